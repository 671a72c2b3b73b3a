"""The C heap's free pages given back to the OS after every step (glibc's malloc_trim).

Why (docs/LOG.md, 2026-11-27 session 2, issue 42 item 7): an actor rank's RSS rose in steps over a long
run while what it had allocated stayed flat. glibc's mallinfo2 in a 160-step tiny run, global rank 0:
bytes in use 153 -> 161.5 MiB in the first 40 steps, then flat; free bytes malloc kept in its arenas
4 -> 62 MiB and still rising (fragmentation: a freed block is reused only by a request it fits, in the
arena of the thread that freed it). MALLOC_ARENA_MAX=2 did not change that. malloc_trim(0) returns the
whole free pages of every arena (madvise), so the RSS follows what is in use: ~40 MiB less per rank, and
its growth down from 0.04-0.06 to 0.006-0.03 MiB a step (the table in docs/LOG.md). The cost was not
measurable beside ~4 s steps. Elsewhere (no glibc: macOS, musl) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # no C library by that name, or one without malloc_trim (not glibc)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give malloc's free pages back to the OS; True where glibc did (returned memory or not)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
