"""Offline without cached vLLM wheels, the conformance tests skip before any fixture runs, in one line."""

from __future__ import annotations

import re

import pytest

from tests.conformance.wheels import skip_if_offline

RELEASE = re.compile(r"\d+\.\d+\.\d+")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before the module-scoped wheel fixtures: a skip raised in one of those is re-raised per test
    # from the test's own location, and the summary would list each test.
    params = getattr(getattr(item, "callspec", None), "params", {})
    for value in params.values():
        if isinstance(value, str) and RELEASE.fullmatch(value):
            skip_if_offline(value)
