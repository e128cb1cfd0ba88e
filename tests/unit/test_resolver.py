"""P host resolution: the host checks before any lookup, and one shared cache of answers."""

from __future__ import annotations

import asyncio
import socket

import pytest

from sidecar.network.allowlist import Allowlist
from sidecar.network.resolver import ResolveFailed, Resolver, Unresolvable
from sidecar.nixl.handshake import resolve_target
from sidecar.release.base import PermanentReleaseError, TargetHealth


class FakeDNS:
    """Answers by name; counts lookups; an optional gate holds them (concurrency)."""

    def __init__(self, answers: dict[str, list[str] | int]) -> None:
        self.answers = answers
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.get(host, socket.EAI_NONAME)
        if isinstance(answer, int):
            raise socket.gaierror(answer, "lookup failed")
        return answer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_answers_are_cached_for_their_ttl_and_shared() -> None:
    dns, clock = FakeDNS({"p.svc": ["10.0.0.7"]}), Clock()
    resolver = Resolver(ttl=30, lookup=dns, clock=clock)
    assert await resolver.resolve("p.svc", 5600) == ["10.0.0.7"]
    clock.now = 29
    assert await resolver.resolve("p.svc", 5600) == ["10.0.0.7"]
    assert dns.calls == ["p.svc"]
    clock.now = 31
    await resolver.resolve("p.svc", 5600)
    assert dns.calls == ["p.svc", "p.svc"]


async def test_a_missing_name_is_permanent_and_cached_briefly() -> None:
    dns, clock = FakeDNS({}), Clock()
    resolver = Resolver(negative_ttl=5, lookup=dns, clock=clock)
    for _ in range(10):
        with pytest.raises(Unresolvable) as caught:
            await resolver.resolve("metadata.google.internal", 5600)
    assert caught.value.reason == "unresolvable" and isinstance(caught.value, PermanentReleaseError)
    assert dns.calls == ["metadata.google.internal"]
    clock.now = 6
    with pytest.raises(Unresolvable):
        await resolver.resolve("metadata.google.internal", 5600)
    assert len(dns.calls) == 2


async def test_a_temporary_failure_is_retryable_counts_against_the_target_and_is_cached_a_second() -> None:
    dns, clock = FakeDNS({"p.svc": socket.EAI_AGAIN}), Clock()
    resolver = Resolver(lookup=dns, clock=clock)
    with pytest.raises(ResolveFailed) as caught:
        await resolver.resolve("p.svc", 5600)
    assert caught.value.health is TargetHealth.DOWN
    with pytest.raises(ResolveFailed):
        await resolver.resolve("p.svc", 5600)
    assert len(dns.calls) == 1
    clock.now = 1.5
    dns.answers["p.svc"] = ["10.0.0.8"]
    assert await resolver.resolve("p.svc", 5600) == ["10.0.0.8"]


async def test_concurrent_lookups_of_one_name_share_one_call() -> None:
    dns = FakeDNS({"p.svc": ["10.0.0.7"]})
    dns.gate = asyncio.Event()
    resolver = Resolver(lookup=dns)
    pending = [asyncio.ensure_future(resolver.resolve("p.svc", 5600)) for _ in range(50)]
    await asyncio.sleep(0.01)
    dns.gate.set()
    assert all(r == ["10.0.0.7"] for r in await asyncio.gather(*pending))
    assert dns.calls == ["p.svc"]


async def test_the_cache_is_bounded() -> None:
    dns = FakeDNS({f"p{i}.svc": ["10.0.0.1"] for i in range(100)})
    resolver = Resolver(size=10, lookup=dns)
    for i in range(100):
        await resolver.resolve(f"p{i}.svc", 5600)
    assert len(resolver._cache) == 10


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("127.0.0.1:5600", "bad_host"),  # a port inside the host
        (" 127.0.0.2", "bad_host"),
        ("127.0.0.1%lo", "bad_host"),  # a zone on an IPv4 address
        ("p.svc/evil", "bad_host"),
        ("metadata.google.internal", "unresolvable"),  # a CIDR entry could admit it: looked up
        ("10.9.9.9", "not_allowed"),
    ],
)
async def test_hosts_that_can_never_work_are_refused_permanently(host: str, reason: str) -> None:
    dns = FakeDNS({})
    with pytest.raises(PermanentReleaseError) as caught:
        await resolve_target(Allowlist(["127.0.0.0/8"]), Resolver(lookup=dns), host, [5600])
    assert caught.value.reason == reason
    assert len(dns.calls) == (1 if reason == "unresolvable" else 0)


async def test_a_name_no_entry_could_admit_is_refused_without_a_lookup() -> None:
    dns = FakeDNS({"evil.example": ["127.0.0.1"]})
    allowlist = Allowlist(["*.prefill.svc", "10.0.0.0/8:5600-5700"])
    with pytest.raises(PermanentReleaseError) as caught:
        await resolve_target(allowlist, Resolver(lookup=dns), "evil.example", [6000])
    assert caught.value.reason == "not_allowed" and dns.calls == []
    target = await resolve_target(
        allowlist, Resolver(lookup=FakeDNS({"p.prefill.svc": ["10.1.2.3"]})), "p.prefill.svc", [6000]
    )
    assert target.address == "10.1.2.3"


async def test_a_port_past_65535_is_refused() -> None:
    with pytest.raises(PermanentReleaseError) as caught:
        await resolve_target(
            Allowlist(["127.0.0.0/8"]), Resolver(lookup=FakeDNS({})), "127.0.0.1", [65535, 65536]
        )
    assert caught.value.reason == "bad_port"
