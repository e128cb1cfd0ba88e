"""Hypothesis settings for the property suite: deterministic in CI, wider on demand.

The ``ci`` profile (the default) derandomizes generation, so every run tries the
same examples and a failure reproduces exactly; it keeps no example database and
no deadline (a loaded CI machine must not turn a slow example into a failure).
``HYPOTHESIS_PROFILE=dev`` explores: random seeds and ten times the examples.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", parent=settings.get_profile("ci"), derandomize=False, max_examples=1500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
