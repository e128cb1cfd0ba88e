"""``make loaded``: the tests whose time bounds a loaded machine broke, 20 times in a row beside a CPU hog.

Each test below once asserted a wall-clock bound (six submits in under 50 ms, a
failure within 100 ms, ...) that a busy two-core machine missed; each now
asserts an order of events, or a bound with its margin stated beside it. This
proves they hold where they failed: one busy loop per CPU runs for the whole
run, at the same priority as the tests, and every test must pass ``COUNT``
times in a row (pytest-repeat, ``-x``: the first failure stops the run and is
reported). Exits with pytest's status.

    python -m tests.loaded [--count N] [--hogs N] [PYTEST_ARGS ...]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

COUNT = 20

TESTS = (
    "tests/unit/test_pipeline.py::test_gives_up_at_deadline",
    "tests/unit/test_pipeline.py::test_full_queue_drops_oldest_and_never_blocks",
    "tests/unit/test_targets.py::test_state_changes_are_logged_at_a_bounded_rate",
    "tests/unit/test_targets.py::test_hurry_brings_an_open_breakers_probe_forward",
    "tests/faults/test_p_restart.py::test_a_restarted_p_gets_nothing_meant_for_the_old_one",
    "tests/integration/test_nixl_release.py::test_p_down_fails_fast_and_retryably",
    "tests/integration/test_nixl_release.py::test_silent_listener_times_out",
    "tests/integration/test_pd_release_e2e.py::test_p_down_retries_then_gives_up_at_deadline",
    "tests/integration/test_hostile_input.py::test_slowloris_is_cut_off",
    "tests/integration/test_hostile_input.py::test_slow_header_blocks_do_not_block_other_clients",
    "tests/integration/test_hostile_input.py::test_over_the_limit_bodies_are_read_up_to_a_cap_then_refused_unread",
    "tests/integration/test_upstream.py::test_each_wait_for_d_keeps_its_own_limit_on_the_shared_timer",
)


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.loaded", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=COUNT, help="runs of each test in a row (default 20)")
    cpus = os.cpu_count() or 1
    parser.add_argument("--hogs", type=int, default=cpus, help="busy loops (default: one per CPU)")
    args, rest = parser.parse_known_args(argv)
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    started = time.monotonic()
    try:
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        command += ["--count", str(args.count), *TESTS, *rest]
        status = subprocess.call(command)
    finally:
        for hog in hogs:
            hog.kill()
    load = os.getloadavg()[0]
    took = time.monotonic() - started
    print(
        f"loaded: {args.count} runs of each test beside {args.hogs} busy loops, {took:.0f} s,"
        f" load average {load:.1f} at the end, pytest exit {status}"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
