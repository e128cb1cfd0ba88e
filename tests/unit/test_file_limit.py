"""``serve`` lifts the soft open-files limit, so thousands of streams (two sockets each) fit."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

CHILD = """
import json, logging, resource, sys
records = []
class Kept(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("sidecar.serve").addHandler(Kept())
from sidecar.server.serve import raise_file_limit
raise_file_limit(int(sys.argv[1]))
print(json.dumps({"limit": resource.getrlimit(resource.RLIMIT_NOFILE), "warnings": records}))
"""


def run_with_limits(soft: int, hard: int, pool_size: int) -> dict[str, object]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(pool_size)],
        preexec_fn=lower,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    answer: dict[str, object] = json.loads(result.stdout)
    return answer


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= 1024, "this machine's hard limit is too low to test raising the soft one"
    answer = run_with_limits(256, hard, pool_size=100)
    assert answer["limit"] == [hard, hard]
    assert answer["warnings"] == []


def test_a_hard_limit_below_what_the_pool_needs_is_said() -> None:
    answer = run_with_limits(256, 1024, pool_size=4096)
    assert answer["limit"] == [1024, 1024]
    assert answer["warnings"] == ["open-files limit below what pool_size streams need (raise ulimit -n)"]
