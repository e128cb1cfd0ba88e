"""Whether the tests run under CPU emulation (``make arm64``: aarch64 under qemu-user on x86_64).

Emulated code runs five to ten times slower than native, unevenly, so a time
measured there means nothing: a test that bounds a duration asserts it only
on a real CPU (``quick``), and asserts everything else everywhere. The arm64
lane sets ``KVR_EMULATED=1``.
"""

from __future__ import annotations

import os

EMULATED = os.environ.get("KVR_EMULATED") == "1"


def quick(took: float, bound: float) -> bool:
    """``took`` within ``bound`` seconds; always true under emulation (nothing timed there)."""
    return EMULATED or took < bound
