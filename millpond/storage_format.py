"""The on-disk format of a table's segment storage, as anything reading the files needs it.

The shard's storage (``millpond.service.storage``) writes these files; a learner on the same
host reads them (:mod:`millpond.colocated`). Both take the names and layouts from here, so
the two can never disagree. See the storage module for what each file holds.

A slot's metadata is derived from its segment's record: :class:`SlotColumn` names the
fields a slot decodes to (the storage's ``slot_info`` rows), which tables, exports and the
test helpers read alike.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import urllib.parse
from enum import IntEnum
from pathlib import Path

from millpond.spec import Key

__all__ = [
    "CHAINS_FILE",
    "CHAIN_WIDTH",
    "COLUMNS_DIR",
    "COLUMN_INDEX",
    "RECORD_WIDTH",
    "SEGMENTS_FILE",
    "SLOTS_FILE",
    "SLOT_EMPTY",
    "SLOT_STEP",
    "SLOT_TAIL",
    "TOKEN_FILE",
    "ChainField",
    "RecordField",
    "SlotColumn",
    "column_filename",
    "ensure_token",
    "num_prefix_rows",
    "num_records",
    "read_token",
    "records_in",
    "storage_identity",
]

SLOTS_FILE = "slots.bin"
SEGMENTS_FILE = "segments.bin"
#: Per segment record of a table with frame stacks, where its stacks' older frames are
#: (:class:`ChainField`); tables with frame stacks made before it have none.
CHAINS_FILE = "chains.bin"
#: The directory of the column files, and the index naming each key's file in it.
COLUMNS_DIR = "columns"
COLUMN_INDEX = "index.json"
#: A random id written once into a storage directory: what tells a reader that the files
#: it opened are those of the table a shard reports, not another one at the same path.
TOKEN_FILE = "storage_token"


class RecordField(IntEnum):
    """The int64 fields of a segment's record in ``segments.bin`` (one 64-byte row).

    Their order is :class:`SlotColumn`'s, so that a slot's decoded row is its record's row
    with two fields fixed: the step (``STEP_BASE + slot``) and the kind (in place of the
    tail slot).
    """

    GENERATION = 0  # the commit marker: the segment's publication number, 0 if none
    EPISODE_ID = 1
    STEP_BASE = 2  # first step - START: a slot's step (within its episode) is STEP_BASE + slot
    START = 3  # first slot
    LENGTH = 4  # steps (the segment takes LENGTH + 1 slots)
    TAIL = 5  # the tail's slot, START + LENGTH
    WRITER = 6  # hash of the writer that sent the segment (0: anonymous)
    SEQUENCE = 7  # the segment's number in its writer's stream


RECORD_WIDTH = len(RecordField)


class ChainField(IntEnum):
    """The int64 fields of a segment's row in ``chains.bin`` (tables with frame stacks).

    A segment that continues its predecessor on that one's tail slot (a writer's region)
    stores no older frames of its own: its first stacks reach back into the slots before it,
    to the first segment of its *chain*, whose prefix row holds the older frames of the
    chain's first stack. A chain's first segment has ``START`` equal to its own first slot.
    """

    START = 0  # the first slot of the chain's first segment
    PREFIX = 1  # the row of the prefix files holding the older frames of that segment's first stack


CHAIN_WIDTH = len(ChainField)

#: Values of the :attr:`SlotColumn.KIND` column.
SLOT_EMPTY, SLOT_STEP, SLOT_TAIL = 0, 1, 2


class SlotColumn(IntEnum):
    """The fields of a decoded slot (``slot_info`` rows; derived, not stored per slot)."""

    GENERATION = 0  # the segment's publication number, 0 if none
    EPISODE_ID = 1
    STEP = 2  # index within its episode (a tail slot: one past the segment's last step)
    SEGMENT_START = 3
    SEGMENT_LENGTH = 4
    KIND = 5  # SLOT_STEP or SLOT_TAIL (SLOT_EMPTY: no published segment)
    WRITER = 6  # hash of the writer that sent the segment (0: anonymous)
    SEQUENCE = 7  # the segment's number in its writer's stream


def num_records(capacity: int) -> int:
    """Rows of ``segments.bin`` for a new ring of ``capacity`` slots (record 0 stays zero:
    what pointer 0 reads).

    A segment that continues another on its tail slot (writers' regions) takes as few as
    one slot of its own, so a table has a record per slot. Tables written before regions,
    and tables with frame stacks written before ``chains.bin``, keep a record per two
    slots; readers take the count from the file's size (:func:`records_in`).
    """
    return capacity + 1


def num_prefix_rows(capacity: int) -> int:
    """Rows of each prefix file of a ring of ``capacity`` slots: one per segment that stores
    the older frames of its first stack, which takes two slots of its own at least (row 0
    stays unused where rows are handed out by ``chains.bin``)."""
    return capacity // 2 + 1


def records_in(size: int, capacity: int) -> int:
    """Rows of a ``segments.bin`` of ``size`` bytes, checked to be a layout of ``capacity``."""
    rows = size // (RECORD_WIDTH * 8)
    if size % (RECORD_WIDTH * 8) or rows not in (capacity // 2 + 1, capacity + 1):
        raise ValueError(
            f"{SEGMENTS_FILE} has {size} bytes, which is no record count for capacity {capacity}"
        )
    return rows


def column_filename(key: Key) -> str:
    """The file name of ``key``'s column (and of its prefix file, if frame-stacked)."""
    return ".".join(urllib.parse.quote(p, safe="") for p in key) + ".bin"


def read_token(directory: str | os.PathLike) -> str | None:
    """The storage token of ``directory``, or ``None`` if it has none or cannot be read."""
    try:
        return (Path(directory) / TOKEN_FILE).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def ensure_token(directory: str | os.PathLike) -> str | None:
    """The storage token of ``directory``, written first if it has none; ``None`` where the
    directory cannot take one (read-only, full disk).

    Created by a hard link from a unique temporary file, so two callers racing agree on one
    token and a reader never sees a half-written one.
    """
    token = read_token(directory)
    if token is not None:
        return token
    path = Path(directory) / TOKEN_FILE
    tmp = path.with_name(f".{TOKEN_FILE}.{secrets.token_hex(8)}")
    try:
        tmp.write_text(secrets.token_hex(16) + "\n")
        with contextlib.suppress(FileExistsError):  # another caller's token stands
            os.link(tmp, path)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return read_token(directory)


def storage_identity(directory: str | os.PathLike) -> str | None:
    """What names the files of ``directory`` on its host: its token (:func:`read_token`) and
    the inode numbers of its slot and record files, so that files put in place of others
    (a restored copy, token included) do not pass for the ones a reader mapped. ``None``
    where it has no token or the files cannot be read."""
    token = read_token(directory)
    if token is None:
        return None
    try:
        inodes = [os.stat(Path(directory) / f).st_ino for f in (SLOTS_FILE, SEGMENTS_FILE)]
    except OSError:
        return None
    return "-".join([token, *map(str, inodes)])
