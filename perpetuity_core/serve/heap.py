"""Large bodies kept in the process's heap when freed, not handed back to the system. A session
that never ends sends its whole history on every call, 21 MB by 1.2M tokens, and mitmproxy
holds several copies of each (its reads, its buffer, the joined body). glibc serves a block
that large with a fresh `mmap` and unmaps it when freed, unless a block as large was freed
before (its threshold follows the largest freed), and a history's bodies only grow: every copy
of every late call was new memory, faulted in page by page, then unmapped.

So blocks up to MMAP_BELOW come from the heap and a freed one stays there for the next body
(TRIM_ABOVE bytes free at the heap's top before it is trimmed). Six copies of a growing 21 MB
body, made and freed: 47 ms of CPU before, 6 after. The proxy then holds its largest call's
copies, freed or not: what it held at that call's peak.

How it fails: where the C library is not glibc (macOS, musl), nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("perpetuity")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_BELOW = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_ABOVE = 128 << 20  # four bodies that size


class LargeBlocks:
    def running(self) -> None:
        """Once, as the proxy starts."""
        keep_large_blocks()


def keep_large_blocks() -> bool:
    """Set glibc's thresholds; False where there is no glibc to set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl has no mallopt
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_BELOW)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE))
    if not done:
        log.info("perpetuity: the C library kept its own thresholds for large blocks")
    return done
