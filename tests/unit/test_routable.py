"""pd-sidecar's default without an allowlist: any P address but those no P pod can have.

A table of addresses (each family, each refusal, the IPv6 forms that embed an
IPv4 address), property checks over whole ranges, then the router's use of it:
llm-d's header forms (several lines, comma lists, an ``http://`` prefix), host
names judged by every address they resolve to and reached at the checked one.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config import Config
from sidecar.network.allowlist import Allowlist
from sidecar.network.resolver import Resolver
from sidecar.network.routable import REFUSALS, RoutableAllowlist, refusal
from sidecar.nixl.handshake import resolve_target
from sidecar.router import PrefillPool, RouterError, parse_targets

OPEN = RoutableAllowlist()


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("10.0.0.7", None),
        ("192.168.1.20", None),
        ("100.64.3.4", None),  # carrier-grade NAT: some pod networks use it
        ("8.8.8.8", None),
        ("fd00::7", None),  # unique local: IPv6 pod networks
        ("2001:db8::1", None),
        ("127.0.0.1", "loopback"),
        ("127.200.0.9", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:7f00:1", "loopback"),
        ("64:ff9b::7f00:1", "loopback"),  # NAT64 of 127.0.0.1
        ("169.254.1.1", "link_local"),
        ("fe80::1", "link_local"),
        ("fe80::1%eth0", "link_local"),
        ("169.254.169.254", "metadata"),
        ("::ffff:169.254.169.254", "metadata"),
        ("64:ff9b::a9fe:a9fe", "metadata"),
        ("2002:a9fe:a9fe::1", "metadata"),  # 6to4 of 169.254.169.254
        ("fd00:ec2::254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("168.63.129.16", "metadata"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("::", "unspecified"),
        ("::ffff:0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("ff02::1", "multicast"),
        ("255.255.255.255", "reserved"),
        ("240.0.0.1", "reserved"),
    ],
)
def test_the_addresses_no_p_can_have(address: str, why: str | None) -> None:
    assert refusal(ipaddress.ip_address(address)) == why
    assert OPEN.allows(address, 8000) is (why is None)
    assert OPEN.why_not(address) == why


def test_every_refusal_is_a_metric_label() -> None:
    assert set(REFUSALS) == {"loopback", "link_local", "metadata", "unspecified", "multicast", "reserved"}


@given(st.integers(0, 2**24 - 1))
def test_no_loopback_address_passes_in_any_form(offset: int) -> None:
    v4 = ipaddress.IPv4Address(int(ipaddress.IPv4Address("127.0.0.0")) + offset)
    for form in (
        v4,
        ipaddress.IPv6Address(f"::ffff:{v4}"),
        ipaddress.IPv6Address(int(v4) | (0x64FF9B << 96)),
    ):
        assert refusal(form) == "loopback"


@given(st.integers(0, 2**16 - 1))
def test_no_link_local_address_passes(offset: int) -> None:
    v4 = ipaddress.IPv4Address(int(ipaddress.IPv4Address("169.254.0.0")) + offset)
    assert refusal(v4) in ("link_local", "metadata")
    assert not OPEN.allows(f"::ffff:{v4}", 5600)


@given(st.integers(int(ipaddress.IPv4Address("10.0.0.0")), int(ipaddress.IPv4Address("10.255.255.255"))))
def test_private_pod_networks_pass_on_every_port(value: int) -> None:
    address = str(ipaddress.IPv4Address(value))
    assert OPEN.allows(address, 1) and OPEN.allows(address, 65535) and not OPEN.allows(address, 0)


def test_names_pass_only_by_every_address_they_resolve_to() -> None:
    assert not OPEN.allows("p-0.prefill", 8000)  # unresolved: nothing to judge
    assert OPEN.allows("p-0.prefill", 8000, ["10.0.0.7", "fd00::7"])
    assert not OPEN.allows("p-0.prefill", 8000, ["10.0.0.7", "169.254.169.254"])
    assert not OPEN.allows("evil.example#.x", 8000, ["10.0.0.7"])


@pytest.mark.parametrize(
    ("header", "hosts"),
    [
        (b"10.0.0.7:8000", [("10.0.0.7", 8000)]),
        (b"http://10.0.0.7:8000", [("10.0.0.7", 8000)]),
        (b"http://10.0.0.7:8000, http://[fd00::7]:8100", [("10.0.0.7", 8000), ("fd00::7", 8100)]),
        (b"10.0.0.7:8000,10.0.0.8:8000", [("10.0.0.7", 8000), ("10.0.0.8", 8000)]),
    ],
)
def test_llm_d_s_header_forms(header: bytes, hosts: list[tuple[str, int]]) -> None:
    urls = parse_targets(header, OPEN)
    assert [(urlsplit(u).hostname, urlsplit(u).port) for u in urls] == hosts


@pytest.mark.parametrize(
    "header", [b"https://10.0.0.7:8000", b"http://http://10.0.0.7:8000", b"ftp://10.0.0.7:1"]
)
def test_other_prefixes_are_not_host_port(header: bytes) -> None:
    with pytest.raises(RouterError) as caught:
        parse_targets(header, OPEN)
    assert caught.value.status == 400  # llm-d trims http:// only


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (b"127.0.0.1:8200", "loopback"),
        (b"http://169.254.169.254:80", "metadata"),
        (b"[::ffff:127.0.0.1]:8000", "loopback"),
        (b"10.0.0.7:8000,0.0.0.0:8000", "unspecified"),
    ],
)
def test_a_refused_target_is_a_403_with_its_reason(header: bytes, why: str) -> None:
    with pytest.raises(RouterError) as caught:
        parse_targets(header, OPEN)
    assert (caught.value.status, caught.value.refused) == (403, why)
    assert why in str(caught.value)


def test_outside_a_configured_allowlist_the_reason_is_not_allowed() -> None:
    with pytest.raises(RouterError) as caught:
        parse_targets(b"10.0.0.9:8000", Allowlist(["10.1.0.0/16"]))
    assert caught.value.refused == "not_allowed"


def _pool(answers: dict[str, list[str]], **settings: object) -> PrefillPool:
    async def lookup(host: str, port: int) -> list[str]:
        return answers[host]

    config = Config(answers="llm-d", prefill_policy="first", **settings)  # type: ignore[arg-type]
    return PrefillPool(config, allowlist=OPEN, resolver=Resolver(lookup=lookup))


async def test_a_named_p_is_reached_at_the_address_checked() -> None:
    pool = _pool({"p-0.prefill": ["10.0.0.7"]})
    assert await pool.candidates(b"p-0.prefill:8000") == ["http://10.0.0.7:8000"]
    tls = _pool({"p-0.prefill": ["10.0.0.7"]}, prefill_tls=True)
    assert await tls.candidates(b"p-0.prefill:8000") == [
        "https://p-0.prefill:8000"
    ]  # its certificate names it


async def test_a_name_resolving_to_the_node_or_the_cloud_is_refused() -> None:
    pool = _pool({"meta.evil": ["10.0.0.7", "169.254.169.254"], "gone": []})
    with pytest.raises(RouterError) as caught:
        await pool.candidates(b"meta.evil:80")
    assert (caught.value.status, caught.value.refused) == (403, "metadata")
    with pytest.raises(RouterError) as caught:
        await pool.candidates(b"gone:80")
    assert caught.value.status == 502 and not caught.value.refused


async def test_releases_go_to_p_s_side_channel_by_the_same_rule() -> None:
    resolver = Resolver(lookup=lambda host, port: _addresses(["10.0.0.7"]))
    target = await resolve_target(OPEN, resolver, "p-0.prefill", [5600, 5601])
    assert (target.address, target.base_port) == ("10.0.0.7", 5600)
    with pytest.raises(Exception, match="not in"):
        await resolve_target(OPEN, resolver, "127.0.0.1", [5600])


async def _addresses(found: list[str]) -> list[str]:
    return found


def test_every_line_of_the_header_is_read_as_llm_d_reads_it() -> None:
    from sidecar.proxy.context import RequestContext

    headers = [
        (b"x-prefiller-host-port", b"http://10.0.0.7:8000"),
        (b"x-prefiller-host-port", b"10.0.0.8:8000"),
    ]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    ctx = RequestContext.of(scope, None, None)  # type: ignore[arg-type]
    assert ctx.prefiller == b"http://10.0.0.7:8000,10.0.0.8:8000"
    assert parse_targets(ctx.prefiller, OPEN) == ["http://10.0.0.7:8000", "http://10.0.0.8:8000"]


@pytest.mark.parametrize(
    ("settings", "trusted"),
    [
        ({"prefill_allow_default": "routable"}, False),
        ({"prefill_allow_default": "routable", "prefill_allow": ("10.0.0.0/8",)}, True),
        ({"prefill_allow_default": "routable", "inference_pool": "ns/pool"}, True),
        ({}, True),
    ],
)
def test_a_client_s_own_parameters_are_not_released_while_nothing_vets_their_p(
    settings: dict[str, object], trusted: bool
) -> None:
    from sidecar.proxy.trust import Trust

    config = Config(**settings)  # type: ignore[arg-type]
    assert Trust(config).trusted({}, "r-1", b'{"remote_host":"10.9.9.9"}') is trusted
