"""The sidecars under test: ``kv-release-sidecar serve`` processes, one per mode, in front of D.

Each runs exactly what an operator runs (the project's environment, the
``serve`` command, JSON logs to a file) on ephemeral loopback ports, and is
ready when its admin ``/readyz`` answers 200. ``SIDECAR_ARGS`` holds the
settings every e2e sidecar shares, in one place.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from tests.e2e.engines import Child, Processes, wait_healthy
from tests.e2e.scenarios import Mode
from tests.support.ports import free_port

#: Settings every e2e sidecar runs with (and, from the run, ``sidecar_command``'s): releases retry
#: quickly and give up at half P's lease.
SIDECAR_ARGS: tuple[str, ...] = (
    "--host",
    "127.0.0.1",
    "--admin-host",
    "127.0.0.1",
    "--log-format",
    "json",
    "--release-retry-initial",
    "0.05",
    "--release-retry-max",
    "0.5",
    "--decode-health-interval",
    "0.5",
    # Nothing in front of these sidecars retries an answer on another D (no gateway, no mesh), so
    # every status may be released: D down is a 503 the sidecar must release.
    "--retried-statuses",
    "none",
)
MODE_ARGS: dict[Mode, tuple[str, ...]] = {
    "nixl": ("--release", "nixl"),
    "router": ("--release", "nixl"),
    "vllm-router": ("--release", "nixl"),  # as docs/vllm-router.md runs it (and --retried-statuses none)
    "smg": ("--release", "nixl"),  # as docs/smg.md runs it (and --retried-statuses none)
    "http": ("--release", "http"),
    "auto": ("--release", "auto"),
    "off": ("--release", "off"),
}
#: The shipped defaults (``defaults`` mode): the strategy the shipped deploy/sidecar/sidecar.toml
#: sets (the built-in default, dry-run, sends nothing), and what only this machine can say.
DEFAULTS_ARGS = ("--release", "nixl", "--host", "127.0.0.1", "--admin-host", "127.0.0.1")


@dataclass(frozen=True)
class Peers:
    """What a sidecar is put in front of, and may release to."""

    d_url: str
    p_url: str
    prefill_allow: str
    lease: float
    control_token_file: Path | None = None
    body_cap: int = 65536  # small, so a 413 is cheap to provoke


class Proxy(Protocol):
    """What the scenarios send requests to: one sidecar, or a front over several (their counts summed)."""

    @property
    def url(self) -> str: ...

    def metrics(self, client: httpx.Client) -> str:
        """The sidecar's (or sidecars') admin ``/metrics``."""
        ...


@dataclass
class SidecarProcess:
    mode: Mode
    child: Child
    url: str
    admin_url: str

    def metrics(self, client: httpx.Client) -> str:
        return client.get(self.admin_url + "/metrics").text


def sidecar_command(mode: Mode, peers: Peers, port: int, admin_port: int, python: str) -> list[str]:
    """``serve`` for ``mode``: the e2e settings, or in ``defaults`` mode only D's and the ports'
    addresses, the strategy and P's allowlist (every other setting as ``serve`` ships it)."""
    if mode == "defaults":
        return [
            *(python, "-m", "sidecar", "serve", "--decode-url", peers.d_url),
            *("--port", str(port), "--admin-port", str(admin_port), *DEFAULTS_ARGS),
            *("--prefill-allow", peers.prefill_allow),
        ]
    args = [
        python,
        "-m",
        "sidecar",
        "serve",
        "--decode-url",
        peers.d_url,
        "--port",
        str(port),
        "--admin-port",
        str(admin_port),
        *SIDECAR_ARGS,
        *MODE_ARGS[mode],
        "--prefill-allow",
        peers.prefill_allow,
        "--max-body-bytes",
        str(peers.body_cap),
        "--p-hold-seconds",
        f"{peers.lease:g}",
        "--release-deadline",  # a release that never gets through shows as P's expiry
        f"{peers.lease / 2:g}",
    ]
    if mode == "router":
        args += ["--prefill", peers.p_url]
    if mode in ("http", "auto") and peers.control_token_file is not None:
        args += ["--control-token-file", str(peers.control_token_file)]
    return args


def start_sidecar(processes: Processes, mode: Mode, peers: Peers, logs: Path) -> SidecarProcess:
    """Start the ``mode`` sidecar and wait until it is ready."""
    port, admin_port = free_port(), free_port()
    python = sys.executable
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVR_")}
    child = processes.start(
        f"sidecar-{mode}", sidecar_command(mode, peers, port, admin_port, python), env, logs
    )
    sidecar = SidecarProcess(mode, child, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}")
    wait_healthy(child, sidecar.admin_url + "/readyz", timeout=60)
    return sidecar
