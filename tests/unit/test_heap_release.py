"""trainer/heap.release_free_heap gives malloc's free pages back to the OS (glibc's malloc_trim), the
per-step call that keeps an actor rank's RSS flat (docs/LOG.md, issue 42 item 7). In a fresh process:
1000 touched 60000-byte blocks (57 MiB), each followed by a small block that stays (so the freed blocks
cannot merge into the heap's top, which free() itself returns: a fragmented heap), every big block
freed: the 57 MiB stay resident until the call, and leave with it (all but the partial pages)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import ctypes, json
    from dapo_megatron.trainer.heap import release_free_heap
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def anon_mib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    blocks, pins = [], []
    for _ in range(1000):  # 60000 B: under the mmap threshold (in the heap) and free()'s 64 KiB trim trigger
        blocks.append(libc.malloc(60000))
        ctypes.memset(blocks[-1], 1, 60000)  # resident
        pins.append(libc.malloc(64))  # kept: the freed block stays a hole
    start = anon_mib()
    for b in blocks:
        libc.free(b)
    freed = anon_mib()
    done = release_free_heap()
    print(json.dumps({"start": start, "freed": freed, "released": anon_mib(), "done": done}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_free_heap_pages_leave_with_the_call():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=60)
    mib = json.loads(out.stdout)
    assert mib["done"] is True
    assert mib["start"] - mib["freed"] < 8  # free() alone keeps them resident (fragmented, not at the top)
    assert mib["freed"] - mib["released"] > 50  # 57.2 MiB freed: 14 of each hole's ~14.6 pages leave
