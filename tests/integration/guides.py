"""What the tests of the router pages (docs/vllm-router.md, docs/smg.md) share: reading a page's
``bash`` blocks, running them on free ports, and P's evidence on the simulators.

A page's vLLM commands (``vllm serve``) cannot run here; each page has a "Try it
without GPUs" block that starts the simulators in their place, and
``check_simulators`` holds that block to the ``vllm serve`` lines it stands in
for: the same role per port, the same model, host, port and P's side channel,
the flags each simulator needs and nothing a simulator would ignore.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.deploy.manifests import ROOT
from tests.support.ports import listening
from tests.support.until import until

SIDECAR = ROOT / ".venv" / "bin" / "kv-release-sidecar"
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
HOSTS = re.compile(r"^(P_HOST|D_HOST)=\S+", flags=re.M)


def blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)


def on_free_ports(block: str, mapping: dict[str, str]) -> str:
    return re.sub(r"\b(" + "|".join(mapping) + r")\b", lambda m: mapping[m.group(1)], block)


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined; a here-document stays in its command."""
    lines, found, at = block.replace("\\\n", " ").splitlines(), [], 0
    while at < len(lines):
        line, at = lines[at].strip(), at + 1
        marker = re.search(r"<<\s*'?(\w+)'?", line)
        if marker:
            end = lines.index(marker.group(1), at)
            line, at = "\n".join([line, *lines[at:end], marker.group(1)]), end + 1
        if line:
            found.append(line)
    return found


def flag(command: str, name: str) -> str:
    tokens = shlex.split(command)
    return tokens[tokens.index(name) + 1]


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1].split("/")[0]


def as_simulator(command: str, prefill_port: str, decode_port: str) -> list[str]:
    """A ``vllm serve`` line as the simulator of its role: the tokens its stand-in must have."""
    tokens = shlex.split(command.removesuffix("&").strip())
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    assert tokens[:2] == ["vllm", "serve"], command
    model, flags = tokens[2], dict(zip(tokens[3::2], tokens[4::2], strict=True))
    assert json.loads(flags.pop("--kv-transfer-config")) == NIXL
    port, key = flags.pop("--port"), flags.pop("--api-key", None)
    host = flags.pop("--host", "0.0.0.0")  # vllm serve's default; the simulators' is loopback
    assert not flags, f"a vllm serve flag the simulators do not take: {flags}"
    args = ["--model", model, "--host", host, "--port", port]
    if port == prefill_port:
        role = ["sim-prefill"]
        args += ["--side-channel-host", env.pop("VLLM_NIXL_SIDE_CHANNEL_HOST")]
        args += ["--side-channel-port", env.pop("VLLM_NIXL_SIDE_CHANNEL_PORT")]
    else:
        assert port == decode_port, f"{command}: neither P nor the sidecar's D"
        env.pop("VLLM_NIXL_SIDE_CHANNEL_PORT", None)  # D's own side channel: the simulator has none
        role = ["sim-decode", "--vllm-d"]  # frees P's blocks of what it admits, as vLLM's D
    args += ["--api-key", key] if key else []
    assert not env, f"an environment variable the simulators do not take: {env}"
    return ["kv-release-sidecar", *role, *args, "&"]


def check_simulators(try_block: str, serves: list[str], prefill_port: str, decode_port: str) -> None:
    """The page's simulator block is its ``vllm serve`` lines with the simulators standing in."""
    expected = [as_simulator(line, prefill_port, decode_port) for line in serves]
    found = [shlex.split(line) for line in commands(try_block)]
    assert found == expected


def runnable(block: str, **programs: str) -> str:
    """The block with ``kv-release-sidecar`` run from this checkout's environment, and each
    program named in ``programs`` (``smg="/path/smg"``) from where this machine has it."""
    programs = {"kv-release-sidecar": str(SIDECAR), **programs}
    pattern = r"^(" + "|".join(map(re.escape, programs)) + r") "
    return re.sub(pattern, lambda m: programs[m.group(1)] + " ", block, flags=re.M)


def answers(out: str) -> list[dict[str, Any]]:
    """The JSON answers curl printed one after the other (curl adds no newline)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(out.rstrip()):
        value, at = decoder.raw_decode(out, at)
        found.append(value)
        while at < len(out) and out[at].isspace():
            at += 1
    return found


def d_attempts(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(url + "/sim/log", timeout=5).json())


def sample(metrics: str, line: str) -> float:
    """The value of the series ``line`` names (name and labels, as exposed), 0 when absent."""
    return next(
        (float(m.removeprefix(line + " ")) for m in metrics.splitlines() if m.startswith(line + " ")), 0.0
    )


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
    until(lambda: not listening(port), f"port {port} to close", timeout, 0.05)


@contextlib.contextmanager
def in_own_group(
    command: list[str], log: Path, ready: Callable[[], bool], timeout: float = 60.0
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` in a process group of its own, once ``ready()``; the group stopped on exit."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def started() -> bool:
            assert process.poll() is None, log.read_bytes()[-3000:]
            return ready()

        until(started, f"{command[0]} to be ready", timeout, 0.05, state=lambda: log.read_bytes()[-3000:])
        yield process
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the group this test started
        process.wait(20)


def bash(script: str, cwd: Path) -> str:
    done = subprocess.run(
        ["bash", "-c", "set -e\n" + script], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@contextmanager
def started(block: str, log: Path, cwd: Path = ROOT) -> Iterator[subprocess.Popen[bytes]]:
    """``block`` run by bash in ``cwd``, in a process group of its own, stopped (all of it) on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", block + "\nwait"],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this test started: bash and its three children
        proc.wait(20)
        deadline = time.monotonic() + 20
        while _group_alive(proc.pid):  # the children drain, then exit
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
