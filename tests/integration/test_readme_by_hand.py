"""The README's "Run it by hand" section, run as written: its ``sh`` blocks are read from the
README, so the commands cannot drift from what the section shows.

The first block starts the three processes (real ones, in bash, in their own
process group); the README's fixed ports are swapped for free ones in the
text, readiness is polled on each. The next blocks run in one bash session
(the parameters P answers are carried in ``$PARAMS`` as a reader's shell
does); the last block is run once the release has been counted.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy.manifests import ROOT
from tests.integration.guides import on_free_ports, started
from tests.support.ports import free_port
from tests.support.until import answered

pytestmark = pytest.mark.nixl

README = ROOT / "README.md"
PORTS = ("8100", "8200", "8000", "9100", "5600")  # P, D, the sidecar, its admin port, P's side channel
BINARY = ".venv/bin/kv-release-sidecar"


def bash(script: str, check: bool = True) -> str:
    result = subprocess.run(
        ["bash", "-c", "set -e\n" + script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 or not check, result.stdout + result.stderr
    return result.stdout


def section() -> str:
    return README.read_text().split("\n## Run it by hand\n", 1)[1].split("\n## ", 1)[0]


def section_blocks(language: str = "sh") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section(), flags=re.S)


def test_the_readme_runs_by_hand(tmp_path: Path) -> None:
    if not (ROOT / BINARY).exists():
        pytest.fail(f"{BINARY} is missing: make test creates it")
    blocks = section_blocks()
    commands = [line for line in blocks[0].splitlines() if not line.startswith(" ")]
    assert len(blocks) == 4 and len(commands) == 3 and all(line.startswith(BINARY) for line in commands)
    ports = {port: str(free_port()) for port in PORTS}
    log = tmp_path / "processes.log"
    p, d, admin = (f"http://127.0.0.1:{ports[port]}" for port in ("8100", "8200", "9100"))
    with started(on_free_ports(blocks[0], ports), log):
        for url in (p + "/health", d + "/health", admin + "/readyz"):
            answered(url, timeout=60.0, poll=0.05)
        out = bash(on_free_ports(blocks[1] + blocks[2], ports))
        params_line, rejection = out.strip().splitlines()[0], "\n".join(out.strip().splitlines()[1:])
        params, shown = json.loads(params_line), json.loads(section_blocks("json")[0])
        assert params["do_remote_prefill"] is True and params["remote_port"] == int(ports["5600"])
        assert list(params) == list(shown)  # the README shows what P sends, field for field
        assert '"type":"Bad Request"' in rejection and '"param":"body.max_tokens"' in rejection
        deadline = time.monotonic() + 10  # the release is sent after the client's answer
        while '"freed_by_notification": 1' not in (
            looked := bash(on_free_ports(blocks[3], ports), check=False)
        ):
            assert time.monotonic() < deadline, looked
            time.sleep(0.05)
    assert 'kvr_releases_total{result="sent",strategy="nixl"} 1.0' in looked
    assert 'kvr_released_blocks_total{strategy="nixl"} 1.0' in looked
    assert '"pinned_requests": 0' in looked and '"freed_by_expiry": 0' in looked
    decisions = [line for line in log.read_text().splitlines() if '"msg":"release decision"' in line]
    assert len(decisions) == 1 and '"request_id":"by-hand-1"' in decisions[0]
    assert '"result":"sent"' in decisions[0] and '"cause":"rejected_4xx"' in decisions[0]
