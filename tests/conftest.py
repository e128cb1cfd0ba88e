"""What the whole suite shares: under emulation (``make arm64``) Hypothesis times nothing.

Hypothesis fails an example that runs longer than its deadline (200 ms), and
a run whose examples are slow to generate; under qemu-user both take five to
ten times as long, unevenly, and a duration means nothing there
(``tests/support/emulation.py``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from tests.support.emulation import EMULATED

if EMULATED:
    settings.register_profile("emulated", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("emulated")
