"""Keep freed message-sized buffers for reuse (glibc's allocator).

Every insert and sample allocates a few buffers the size of its message (megabytes for
image observations). By default glibc serves such blocks with ``mmap`` and gives them back
to the kernel when they are freed, or trims them off the heap, so the next message faults
every 4 KiB page in again: about 2.5 ms per 3.6 MB buffer on a VM, more than copying the
bytes. Raising the two thresholds keeps those blocks in the heap and reuses them; the price
is that a process holds up to :data:`TRIM_THRESHOLD_BYTES` of freed heap.

millpond's own processes call :func:`keep_freed_buffers` when they start (``millpond
serve``, the shards, env actors and the learner of ``millpond launch``); a process of your
own that moves image-sized batches through a :class:`~millpond.ReplayClient` can call it
too. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: Blocks up to this size come from the heap, not from ``mmap`` (glibc's largest).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free heap at its top is returned to the kernel only past this much.
TRIM_THRESHOLD_BYTES = 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_freed_buffers() -> bool:
    """Set glibc's mmap and trim thresholds (once per process); whether they were set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
