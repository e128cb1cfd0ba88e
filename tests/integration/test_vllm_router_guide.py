"""docs/vllm-router.md, run as written on the simulators: its ``bash`` blocks are read from the page.

Only what must change is changed. The page's ports become free ones and its
hosts' addresses loopback (P on the same host: the page's allowlist is then
``127.0.0.1``, the one case where loopback belongs in it); each ``vllm serve``
line becomes the simulator of its role with the same flags (the line whose
port is the router's ``--prefill`` runs sim-prefill, real NIXL agents, its
side channel from ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``; the line whose port
is the sidecar's ``--decode-url`` runs sim-decode as vLLM's D); the commands
run from this checkout's environments, and the router's metrics port is a
free one. P, D and the sidecar start in one process group, the router in
another once they answer, as the page says.

Judged from P's own evidence (the simulator's ``/stats``): the request D
serves is read by D; the one D refuses before its handler is freed by the
sidecar's one release; a 503 from D is not retried by the router (one prefill,
one decode attempt) and P frees its blocks exactly once; with D stopped, the
sidecar's 503 passes through the router and, under the page's
``--retried-statuses none``, the sidecar releases P's blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.manifests import ROOT
from tests.e2e.evidence import P_SERIES
from tests.integration.test_readme_by_hand import bash, started, wait_for
from tests.servers import free_port

pytestmark = pytest.mark.nixl

PAGE = ROOT / "docs" / "vllm-router.md"
#: P, the sidecar (D's old port), D, the router, the sidecar's admin port, P's and D's side channels.
PORTS = ("8100", "8200", "8201", "8000", "9100", "5600", "5601")
SIDECAR = ROOT / ".venv" / "bin" / "kv-release-sidecar"
ROUTER = ROOT / ".tools" / "vllm-router" / "bin" / "vllm-router"
HOSTS = re.compile(r"^(P_HOST|D_HOST)=\S+", flags=re.M)
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.S)


def on_free_ports(block: str, mapping: dict[str, str]) -> str:
    return re.sub(r"\b(" + "|".join(PORTS) + r")\b", lambda m: mapping[m.group(1)], block)


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined."""
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _arg(text: str) -> str:
    """``text`` for bash: variables left to expand (``$P_HOST``), anything else quoted."""
    return text if re.fullmatch(r"[\w./:$-]+", text) else shlex.quote(text)


def flag(command: str, name: str) -> str:
    tokens = shlex.split(command)
    return tokens[tokens.index(name) + 1]


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1].split("/")[0]


def simulated(command: str, prefill_port: str, decode_port: str) -> str:
    """A ``vllm serve`` line as the simulator of its role, with its own flags."""
    tokens = shlex.split(command.removesuffix("&").strip())
    env = {}
    while "=" in tokens[0]:
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    assert tokens[:2] == ["vllm", "serve"], command
    model, flags = tokens[2], dict(zip(tokens[3::2], tokens[4::2], strict=True))
    assert json.loads(flags.pop("--kv-transfer-config")) == NIXL
    port, host = flags.pop("--port"), flags.pop("--host", None)
    assert not flags, f"a vllm serve flag the simulators do not take: {flags}"
    args = ["--model", model, "--port", port, *(("--host", host) if host else ())]
    if port == prefill_port:
        args += ["--side-channel-host", env.pop("VLLM_NIXL_SIDE_CHANNEL_HOST")]
        args += ["--side-channel-port", env.pop("VLLM_NIXL_SIDE_CHANNEL_PORT")]
        role = "sim-prefill"
    else:
        assert port == decode_port, f"{command}: neither the router's prefill nor the sidecar's D"
        env.pop("VLLM_NIXL_SIDE_CHANNEL_PORT", None)  # D's own side channel: the simulator has none
        role, args = "sim-decode", ["--vllm-d", "--log-params", *args]
    assert not env, f"an environment variable the simulators do not take: {env}"
    return " ".join([str(SIDECAR), role, *map(_arg, args), "&"])


def runnable(block: str, prefill_port: str, decode_port: str, metrics_port: str) -> str:
    """The block with the page's programs swapped for this machine's (see the module docstring)."""
    lines = []
    for command in commands(block):
        if "vllm serve" in command:
            command = simulated(command, prefill_port, decode_port)
        elif command.startswith("kv-release-sidecar "):
            command = f"{SIDECAR} {command.removeprefix('kv-release-sidecar ')}"
        elif command.startswith("vllm-router "):
            body = command.removeprefix("vllm-router ").removesuffix("&").strip()
            command = f"{ROUTER} {body} --prometheus-port {metrics_port} &"
        lines.append(command)
    return "\n".join(lines) + "\n"


def answers(out: str) -> list[dict[str, Any]]:
    """The JSON answers curl printed one after the other (curl adds no newline)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(out.rstrip()):
        value, at = decoder.raw_decode(out, at)
        found.append(value)
        while at < len(out) and out[at].isspace():
            at += 1
    return found


def p_stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/stats", timeout=5).json())


def until_p(url: str, check: Any, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not check(stats := p_stats(url)):
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def d_attempts(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(url + "/sim/log", timeout=5).json())


def test_the_page_runs_on_the_simulators(tmp_path: Path) -> None:
    for needed in (SIDECAR, ROUTER):
        if not needed.exists():
            pytest.fail(f"{needed.relative_to(ROOT)} is missing: make test creates it")
    hosts, p, d, router, requests, sidecar_metrics, p_metrics = blocks()
    assert HOSTS.findall(hosts) == ["P_HOST", "D_HOST"]
    ports = {port: str(free_port()) for port in PORTS}
    prefill = port_of(flag(commands(router)[0], "--prefill"))
    decode = port_of(flag(commands(d)[-1], "--decode-url"))
    assert (prefill, decode) == ("8100", "8201")  # P's port; D's new port, behind the sidecar's 8200
    assert port_of(flag(commands(router)[0], "--decode")) == "8200"  # the router's decode URL: the sidecar
    assert flag(commands(d)[-1], "--retried-statuses") == "none"
    loopback = HOSTS.sub(r"\1=127.0.0.1", hosts)
    run = {
        name: runnable(on_free_ports(block, ports), ports[prefill], ports[decode], str(free_port()))
        for name, block in (("p", p), ("d", d), ("router", router))
    }
    p_url, d_url = f"http://127.0.0.1:{ports['8100']}", f"http://127.0.0.1:{ports['8201']}"
    with started(loopback + run["p"] + run["d"], tmp_path / "p-d-sidecar.log"):
        for url in (p_url + "/health", d_url + "/health", f"http://127.0.0.1:{ports['9100']}/readyz"):
            wait_for(url)
        with started(loopback + run["router"], tmp_path / "router.log"):
            wait_for(f"http://127.0.0.1:{ports['8000']}/health")
            served, refused = answers(bash(on_free_ports(requests, ports)))
            assert "error" not in served and served["choices"][0]["text"], served
            error = refused["error"]
            assert (error["code"], error["type"], error["param"]) == (
                400,
                "BadRequestError",
                "stream_options",
            )
            stats = until_p(p_url, lambda s: s["requests_pinned"] == 2 and s["pinned_requests"] == 0)
            assert (stats["freed_by_notification"], stats["freed_by_expiry"], stats["notifs_unknown"]) == (
                2,
                0,
                0,
            )
            counters = bash(on_free_ports(sidecar_metrics, ports))
            assert 'kvr_releases_total{result="sent",strategy="nixl"} 1.0' in counters
            assert 'kvr_not_released_total{cause="admitted",outcome="no_release"} 1.0' in counters
            router_url, admin_url = (f"http://127.0.0.1:{ports[port]}" for port in ("8000", "9100"))
            not_retried(router_url, p_url, d_url)
            d_down_is_released(router_url, p_url, int(ports["8201"]), admin_url)
    # P's own evidence on real vLLM: the series the e2e harness judges P by (tests.e2e.evidence).
    pattern = flag(commands(p_metrics)[0], "-E")
    assert all(re.match(pattern, f"{P_SERIES[name]} 0.0") for name in ("usage", "expired"))
    assert not re.match(pattern, "kvr_sim_prefill_pinned_requests 0.0")


def not_retried(router_url: str, p_url: str, d_url: str) -> None:
    """A 503 from D reaches the client: one prefill, one decode attempt, P's blocks freed once."""
    before, attempts = p_stats(p_url), len(d_attempts(d_url))
    body = {"model": "Qwen/Qwen3-0.6B", "prompt": "busy [[reject:503]]", "max_tokens": 8}
    answer = httpx.post(router_url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 503, answer.text
    after = until_p(p_url, lambda s: s["pinned_requests"] == 0)
    assert after["requests_pinned"] == before["requests_pinned"] + 1  # no second prefill
    assert len(d_attempts(d_url)) == attempts + 1  # no second decode attempt
    assert after["freed_by_notification"] == before["freed_by_notification"] + 1
    assert after["notifs_unknown"] == before["notifs_unknown"]  # freed once: nobody released it twice


def d_down_is_released(router_url: str, p_url: str, d_port: int, admin_url: str) -> None:
    """D stopped: the sidecar's 503 passes through the router, which retries nothing, and under the
    page's ``--retried-statuses none`` the sidecar releases P's blocks (the shipped default leaves
    a 503 to a retry on another decode server, which vllm-router never makes)."""
    os.kill(listener_pid(d_port), signal.SIGTERM)  # the simulated D this test started
    wait_closed(d_port)
    before, sent = p_stats(p_url), sent_releases(admin_url)
    body = {"model": "Qwen/Qwen3-0.6B", "prompt": "D is gone", "max_tokens": 8}
    answer = httpx.post(router_url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 503 and "decode server" in answer.text, answer.text
    after = until_p(p_url, lambda s: s["pinned_requests"] == 0)
    assert after["requests_pinned"] == before["requests_pinned"] + 1
    assert after["freed_by_notification"] == before["freed_by_notification"] + 1
    assert after["notifs_unknown"] == before["notifs_unknown"]
    assert sent_releases(admin_url) == sent + 1


def sent_releases(admin_url: str) -> float:
    line = 'kvr_releases_total{result="sent",strategy="nixl"} '
    metrics = httpx.get(admin_url + "/metrics", timeout=5).text.splitlines()
    return next((float(m.removeprefix(line)) for m in metrics if m.startswith(line)), 0.0)


def listener_pid(port: int) -> int:
    """The process listening on 127.0.0.1:``port`` (from /proc: its socket's inode among its fds)."""
    hexport = f":{port:04X} "
    inodes = {
        fields[9]
        for table in ("/proc/net/tcp", "/proc/net/tcp6")
        for fields in (line.split() for line in Path(table).read_text().splitlines()[1:])
        if hexport in f"{fields[1]} " and fields[3] == "0A"  # 0A: LISTEN
    }
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return int(fd_dir.parent.name)
    raise AssertionError(f"nothing listens on port {port}")


def wait_closed(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        assert time.monotonic() < deadline, f"port {port} still open"
        time.sleep(0.05)
