"""The process's allocator, set so large buffers go back to the system when freed.

glibc serves a buffer of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB) with its
own ``mmap`` and unmaps it on ``free``, but by default it raises that
threshold to the size of each such buffer freed, up to 32 MiB: after a burst
of requests carrying multi-megabyte bodies or ``kv_transfer_params`` (hundreds
of thousands of block ids), later buffers of that size come from the heap and
the process keeps their pages long after the requests ended. Setting the
threshold explicitly turns that adjustment off (``mallopt(3)``), so the
sidecar's footprint follows the requests in flight, not the largest ones it
has seen. Other C libraries (musl) keep their own policy; nothing is done there.

``settle_heap`` is for once a server has started: what start-up built lives as
long as the process, so it is frozen out of the cyclic collector's sight, and
the collector's youngest generation is collected after ``YOUNG_COLLECTION``
allocations rather than CPython's 700. The request path leaves no cycles
behind, so a young collection finds nothing to free: every one is pure cost,
and at 700 it ran every few requests and moved the objects of the requests
then in flight into the older generations, which are walked again later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger("sidecar.memory")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 128 * 1024
YOUNG_COLLECTION = 20_000  # allocations of container objects between two young collections


def settle_heap() -> None:
    """Start-up's garbage freed, what is left frozen, young collections spaced out (module docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION, *gc.get_threshold()[1:])


def release_large_buffers() -> bool:
    """Fix glibc's mmap threshold at 128 KiB; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: no mallopt to call
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) was refused; the allocator keeps its own policy")
    return done
