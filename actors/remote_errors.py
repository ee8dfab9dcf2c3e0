"""Errors of Ray actors' calls as the job's own: what the actor raised, its type (when it is
a millpond error) and its message, without Ray's traceback and terminal colour codes.

Ray hands a driver a failed call as a ``RayTaskError`` whose text is the actor's whole
traceback, coloured for a terminal; the exception the actor raised is its ``cause``.
:func:`from_remote` makes of it the error a user reads; the Ray error stays its
``__cause__`` (``millpond launch --verbose`` prints it).
"""

from __future__ import annotations

import re

from millpond.errors import MillpondError

__all__ = ["first_line", "from_remote", "plain"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", text)


def first_line(e: BaseException) -> str:
    """The first line of an error, uncoloured (Ray's actor errors run to many)."""
    return (plain(str(e)).strip().splitlines() or [type(e).__name__])[0]


def from_remote(error: BaseException, where: str) -> MillpondError:
    """``error``, raised by a Ray call to ``where`` (e.g. ``"learner 0"``), as a
    :class:`~millpond.errors.MillpondError`: the actor's millpond error of the same type,
    or a ``MillpondError`` naming the actor's exception type; its message prefixed with
    ``where``. Its ``__cause__`` is ``error``."""
    cause = error
    # A RayTaskError's cause is what the actor raised (itself a RayTaskError when the actor
    # got it from a call of its own).
    while getattr(cause, "cause", None) is not None and cause is not cause.cause:
        cause = cause.cause
    if cause is error:  # no cause recorded (an actor that died): Ray's own first line
        message, kind = first_line(error), MillpondError
    elif isinstance(cause, MillpondError):
        message, kind = _message(cause), type(cause)
    else:
        message, kind = f"{type(cause).__name__}: {_message(cause)}", MillpondError
    try:
        out = kind(f"{where}: {message}")
    except TypeError:  # an error class with a constructor of its own
        out = MillpondError(f"{where}: {message}")
    out.__cause__ = error
    return out


def _message(e: BaseException) -> str:
    if len(e.args) == 1 and isinstance(e.args[0], str):  # KeyError's str() quotes it
        return plain(e.args[0]).strip()
    return plain(str(e)).strip() or type(e).__name__
