"""Keep freed host memory in the process, so that each forward's large activations land on pages already mapped.

Why: on these VMs the first write to a fresh page costs 5-7 us. glibc hands big blocks to the OS and back: those
above M_MMAP_THRESHOLD are mmap'd and unmapped on free, and a heap top above M_TRIM_THRESHOLD is trimmed. Its
dynamic threshold adapts to one size but not to a forward's mix (a 512-token chunk's 6 MB gate/up output, 3 MB
activations, 1 MB hidden states), so a 1.5k-token prefill took about 9,000 page faults (37 MB), every time. With
the thresholds raised it takes none; the process keeps its peak activation memory (tens of MB) instead.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for it on 64-bit (HEAP_MAX_SIZE / 2)
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and
                    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    except (OSError, AttributeError):  # musl or another libc without mallopt
        done = False
    if not done:
        log.info("host allocator left as it is: no glibc mallopt here")
    return done
