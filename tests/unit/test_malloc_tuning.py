"""mallopt tuning: what glibc then does with a freed buffer, harmless to repeat, a no-op elsewhere.

The effect is read from glibc itself (``mallinfo2``) in a fresh interpreter, so this process's heap
settings are left alone: under glibc's defaults a 1 MiB block is an mmap of its own and freed small
blocks are trimmed off the heap top; once tuned, the 1 MiB block comes from the heap and freed memory
stays in the heap for the next prefill.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from xpyd.worker import malloc_tuning
from xpyd.worker.malloc_tuning import tune_malloc

GLIBC = platform.libc_ver()[0] == "glibc"

# Runs in a child: applies `settings` ("defaults" or "tuned") and reports what glibc did with blocks.
PROBE = r"""
import ctypes, ctypes.util, json, sys
from xpyd.worker.malloc_tuning import GLIBC_DEFAULTS, TUNED, tune_malloc

libc = ctypes.CDLL(ctypes.util.find_library("c"))
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
          "keepcost")

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]

libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)

def info():
    m = libc.mallinfo2()
    return {name: getattr(m, name) for name in FIELDS}

applied = tune_malloc(TUNED if sys.argv[1] == "tuned" else GLIBC_DEFAULTS)
out = {"applied": applied}
# one block of 1 MiB: an mmap of its own (hblkhd), or heap memory (arena)?
before = info()
block = libc.malloc(1 << 20)
during = info()
libc.free(block)
after = info()
out["big"] = {"mmapped": during["hblkhd"] - before["hblkhd"], "unmapped_on_free": during["hblkhd"] - after["hblkhd"]}
# 24 blocks of 96 KiB (below either mmap threshold) from the heap, all freed: is the heap trimmed?
blocks = [libc.malloc(96 << 10) for _ in range(24)]
during = info()
for b in blocks:
    libc.free(b)
after = info()
out["small"] = {"mmapped": during["hblkhd"] - before["hblkhd"], "heap_trimmed": during["arena"] - after["arena"],
                "free_in_heap": after["fordblks"]}
# 256 MiB: above the tuned mmap threshold (32 MiB) and more than the heap top holds: still an mmap
before = info()
block = libc.malloc(256 << 20)
out["huge_mmapped"] = info()["hblkhd"] - before["hblkhd"]
libc.free(block)
print(json.dumps(out))
"""


def probe(settings: str) -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE, settings], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.skipif(not GLIBC, reason="mallopt tuning is glibc-only")
def test_glibc_defaults_mmap_a_1mib_block_and_trim_freed_heap():
    """The control: the probe sees what the tuning changes."""
    got = probe("defaults")
    assert got["applied"] is True
    assert got["big"]["mmapped"] >= 1 << 20 and got["big"]["unmapped_on_free"] >= 1 << 20, got
    assert got["small"]["heap_trimmed"] >= 1 << 20, got  # freed heap top handed back to the OS


@pytest.mark.skipif(not GLIBC, reason="mallopt tuning is glibc-only")
def test_tuned_heap_serves_1mib_blocks_and_keeps_freed_memory():
    got = probe("tuned")
    assert got["applied"] is True
    assert got["big"]["mmapped"] == 0, got  # below the 32 MiB mmap threshold: from the heap
    assert got["small"]["mmapped"] == 0 and got["small"]["heap_trimmed"] == 0, got  # trim threshold 512 MiB
    assert got["small"]["free_in_heap"] >= 24 * (96 << 10), got  # kept, mapped, for the next request
    assert got["huge_mmapped"] >= 256 << 20, got  # the threshold is raised, not off


@pytest.mark.skipif(not GLIBC, reason="mallopt tuning is glibc-only")
def test_tuning_applies_and_repeats():
    assert tune_malloc() is True
    assert tune_malloc() is True  # idempotent


def test_no_libc_means_no_change(monkeypatch):
    monkeypatch.setattr(malloc_tuning, "_mallopt", lambda: None)
    assert tune_malloc() is False
