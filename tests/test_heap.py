"""Large bodies kept in the heap when freed (serve/heap.py): after `keep_large_blocks`, a body
of a late call's size, and a larger one after it is freed, are no new mappings of their own.
Counted by glibc itself (`mallinfo2().hblks`: blocks served by mmap), in a process of its own
so this one's allocator is left as it was."""

from __future__ import annotations

import ctypes.util
import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's (elsewhere keep_large_blocks changes nothing)")

# Prints the count of blocks mmapped since it started while a 21 MB body is held, then a larger one.
PROBE = """
import ctypes, json, sys
from perpetuity_core.serve.heap import keep_large_blocks

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(sys.argv[2])
libc.mallinfo2.restype = Info
kept = keep_large_blocks() if sys.argv[1] == "kept" else None
start = libc.mallinfo2().hblks  # (the interpreter's own)
mapped = []
body = bytes(21 << 20)
mapped.append(libc.mallinfo2().hblks - start)
del body
body = bytes((21 << 20) + 4096)  # the next call's body, a little longer
mapped.append(libc.mallinfo2().hblks - start)
print(json.dumps({"kept": kept, "mapped": mapped}))
"""


def probe(mode: str) -> dict[str, object]:
    libc = ctypes.util.find_library("c") or "libc.so.6"
    out = subprocess.run([sys.executable, "-c", PROBE, mode, libc], check=True,
                         capture_output=True, text=True).stdout
    return dict(json.loads(out))


def test_a_growing_late_body_comes_from_the_heap_not_a_mapping_of_its_own() -> None:
    before = probe("default")
    assert before["mapped"] == [1, 1]  # glibc's default: each body its own mapping
    assert probe("kept") == {"kept": True, "mapped": [0, 0]}
