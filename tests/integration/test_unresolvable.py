"""P endpoints that can never work are refused at once, with no retry and no second lookup.

A real sidecar (``nixl``, real NIXL agent) in front of the decode simulator,
which rejects every request here (400 from request validation, before its
handler: the sidecar's to release). The parameters name P hosts that are not
hosts at all, or names that do not exist. The name lookups go to a resolver
with a scripted answer (a real DNS server's NXDOMAIN may take any time on a CI
machine); everything else is the production path.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry

from sidecar.app import Deps, create_admin_app, create_app
from sidecar.config import Config
from sidecar.network.allowlist import Allowlist
from sidecar.network.resolver import Resolver
from sidecar.nixl.handshake import TargetCheck
from sidecar.release.nixl import NixlReleaser
from sidecar.server.host import server_options
from sidecar.server.limits import ServerLimits
from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import serve
from tests.support.runner import Sidecar, kv_params

pytestmark = pytest.mark.nixl

#: What a vLLM 0.33.0 P emits beside the fields ``kv_params`` gives.
V033 = {
    "remote_num_tokens": 32,
    "transfer_mode": "pull",
    "pp_size": 1,
    "dcp_size": 1,
    "remote_registration_generation": 0,
}
HOSTS = {
    "127.0.0.1:5600": "bad_host",  # a port inside the host field
    " 127.0.0.2": "bad_host",
    "127.0.0.1%lo": "bad_host",  # an IPv4 address with a zone
    "p.invalid": "unresolvable",  # NXDOMAIN
    "metadata.google.internal": "unresolvable",
}


class NoSuchName:
    """Every name is NXDOMAIN; counts lookups."""

    def __init__(self) -> None:
        self.lookups: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@contextmanager
def nixl_sidecar(dns: NoSuchName) -> Iterator[Sidecar]:
    d_config = DecodeSimConfig(port=0, version="0.33.0", max_model_len=40)
    with serve(create_decode_app(d_config)) as d:
        config = Config(
            decode_url=d.url,
            release="nixl",
            prefill_allow=("127.0.0.0/8",),  # a CIDR entry: host names are looked up
            vllm_version="0.33.0",
            log_level="warning",
        )
        registry = CollectorRegistry()

        async def no_version() -> str | None:
            return None

        check = TargetCheck(Allowlist(config.prefill_allow), Resolver(lookup=dns))
        releaser = NixlReleaser(config, no_version, registry, check=check)
        app = create_app(config, Deps(releaser=releaser, registry=registry))
        options = server_options(ServerLimits.of(config))
        with serve(app, create_admin_app(app), **options) as server:
            yield Sidecar(server, app, releaser)  # type: ignore[arg-type]


def test_hosts_that_can_never_work_are_refused_at_once_without_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "sidecar.release")
    dns = NoSuchName()
    with nixl_sidecar(dns) as sc:
        answered: dict[str, float] = {}
        for round_ in range(2):  # the second round finds the names in the cache
            for i, host in enumerate(HOSTS):
                rid = f"r{round_}-{i}"
                body = {
                    "model": "sim-model",
                    "prompt": "tok",
                    "max_tokens": "x",
                    "kv_transfer_params": kv_params(rid, remote_host=host, **V033),
                }
                response = httpx.post(sc.url + "/v1/completions", json=body, headers={"x-request-id": rid})
                answered[rid] = time.time()
                assert response.status_code == 400, response.text
        sc.settle()
        decisions = {
            str(r.request_id): r  # type: ignore[attr-defined]
            for r in caplog.records
            if r.getMessage() == "release decision"
        }
        assert len(decisions) == 2 * len(HOSTS)
        for rid, record in decisions.items():
            host = list(HOSTS)[int(rid.split("-")[1])]
            assert (record.result, record.reason) == ("refused", HOSTS[host]), rid  # type: ignore[attr-defined]
            assert record.created - answered[rid] < 0.1, (rid, record.created - answered[rid])
        refused = sum(
            sc.sample("kvr_release_attempts_total", strategy="nixl", reason=r) for r in set(HOSTS.values())
        )
        assert refused == 2 * len(HOSTS)  # one attempt per job: no retry
        assert sc.sample("kvr_releases_total", strategy="nixl", result="refused") == 2 * len(HOSTS)
        # Each missing name was looked up once; the second round was answered from the cache.
        assert sorted(dns.lookups) == ["metadata.google.internal", "p.invalid"]
