"""The servers of ``python -m bench``'s paths: D, the sidecar and the reference hops, as child processes.

D (``sim-decode``) and the sidecar (``serve``) run as ``python -m sidecar``
children of this process (``bench.harness.procs``), D on the load core and
the hops on the other. Beside the sidecar, on its core, run the reference
hops: the relay (``python -m bench.servers.relay``, the cheapest hop Python can run)
and, when an ``nginx`` binary is available, nginx (one worker, upstream
keep-alive, no buffering; configured in a temporary directory). Readiness is
polled against a deadline (D's ``GET /health``, the sidecar's ``GET /readyz``
on the admin port, D's ``GET /health`` through the relay and through nginx).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bench.harness.procs import (
    HOST,
    BenchError,
    Child,
    CorePlan,
    serve_args,
    sidecar_argv,
    starting,
    wait_all_ready,
)
from bench.servers.nginx import nginx_config
from tests.support.ports import free_port

# The measured paths: straight to D, through the sidecar, through the reference hops.
PathName = Literal["direct", "sidecar", "baseline", "relay", "nginx"]


@dataclass(frozen=True, slots=True)
class Servers:
    """D, the sidecar and the reference hops as started (``wait_ready`` tells when all answer)."""

    decode: Child
    sidecar: Child
    relay: Child
    nginx: Child | None  # only when an nginx binary was given or found
    decode_url: str
    sidecar_url: str
    admin_url: str
    relay_url: str
    nginx_url: str | None
    baseline: Child | None = None  # another checkout's sidecar (``--baseline``)
    baseline_url: str | None = None

    def paths(self) -> tuple[PathName, ...]:
        """The paths to measure, in their base order."""
        every: tuple[PathName, ...] = ("direct", "sidecar", "baseline", "relay", "nginx")
        return tuple(path for path in every if path == "direct" or self.proxy(path) is not None)

    def url(self, path: PathName) -> str:
        """The base URL the load generator sends ``path``'s requests to."""
        urls = {
            "direct": self.decode_url,
            "sidecar": self.sidecar_url,
            "baseline": self.baseline_url,
            "relay": self.relay_url,
            "nginx": self.nginx_url,
        }
        url = urls[path]
        if url is None:
            raise BenchError(f"no {path} server was started")
        return url

    def proxy(self, path: PathName) -> Child | None:
        """The process between the load generator and D on ``path`` (none on the direct path)."""
        hops = {"direct": None, "sidecar": self.sidecar, "baseline": self.baseline}
        return {**hops, "relay": self.relay, "nginx": self.nginx}[path]

    def proxies(self) -> list[Child]:
        """Every process on the sidecar's core."""
        hops = (self.sidecar, self.baseline, self.relay, self.nginx)
        return [child for child in hops if child is not None]


@contextlib.contextmanager
def launched(
    plan: CorePlan, stream_events: int, nginx: str | None = None, baseline: Path | None = None
) -> Iterator[Servers]:
    """Start D, the sidecar, the relay, (given its binary) nginx and (given a checkout) another
    revision's sidecar, not yet known ready; stop all on exit."""
    d_port, s_port, a_port, r_port, n_port = (free_port() for _ in range(5))
    decode_url, sidecar_url = f"http://{HOST}:{d_port}", f"http://{HOST}:{s_port}"
    relay_url, nginx_url = f"http://{HOST}:{r_port}", f"http://{HOST}:{n_port}"
    with starting("kvr-bench-") as (log_dir, start):
        decode = start(
            "sim-decode",
            sidecar_argv(
                "sim-decode", "--host", HOST, "--port", str(d_port), "--stream-events", str(stream_events)
            ),
            plan.load,
        )
        sidecar = start("sidecar", sidecar_argv(*serve_args(decode_url, s_port, a_port)), plan.sidecar)
        relay = start(
            "relay",
            [sys.executable, "-m", "bench.servers.relay", "--host", HOST, "--port", str(r_port),
             "--target", f"{HOST}:{d_port}"],
            plan.sidecar,
        )  # fmt: skip
        before = None
        if baseline is not None:
            b_port, b_admin = free_port(), free_port()
            argv = sidecar_argv(*serve_args(decode_url, b_port, b_admin), checkout=baseline)
            before = start("baseline", argv, plan.sidecar)
        proxy = None
        if nginx is not None:
            conf = nginx_config(nginx, log_dir, {n_port: f"{HOST}:{d_port}"})
            proxy = start("nginx", [nginx, "-p", f"{log_dir}/", "-c", str(conf)], plan.sidecar)
        yield Servers(
            decode,
            sidecar,
            relay,
            proxy,
            decode_url,
            sidecar_url,
            f"http://{HOST}:{a_port}",
            relay_url,
            nginx_url if proxy else None,
            before,
            f"http://{HOST}:{b_port}" if before else None,
        )


async def wait_ready(servers: Servers, deadline: float) -> None:
    """Poll D's ``/health``, the sidecar's ``/readyz``, and D's ``/health`` through each reference hop,
    until 200 or ``deadline`` (monotonic)."""
    ready = {servers.decode: servers.decode_url + "/health", servers.sidecar: servers.admin_url + "/readyz"}
    ready[servers.relay] = servers.relay_url + "/health"
    if servers.nginx is not None and servers.nginx_url is not None:
        ready[servers.nginx] = servers.nginx_url + "/health"
    if servers.baseline is not None and servers.baseline_url is not None:
        ready[servers.baseline] = servers.baseline_url + "/health"  # D's, through it
    await wait_all_ready(ready, deadline)
