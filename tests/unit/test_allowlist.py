"""The allowlist and the host:port parsing behind every connection a request can make the sidecar open."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from sidecar.network.allowlist import Allowlist, is_host_name, split_host_port
from sidecar.router import RouterError, parse_targets

ALLOW = Allowlist(["*.prefill.svc.cluster.local:8000", "10.0.0.0/24", "[fd00::/64]:8100"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("p-0.prefill.svc.cluster.local:8000", ("p-0.prefill.svc.cluster.local", 8000)),
        ("10.0.0.7:8100", ("10.0.0.7", 8100)),
        ("[fd00::7]:8100", ("fd00::7", 8100)),
        ("host.:80", ("host.", 80)),
        # each of these could make a URL or a resolver read another host than the one checked
        ("evil.example#.prefill.svc.cluster.local:8000", None),
        ("user@evil.example?.prefill.svc.cluster.local:8000", None),
        ("evil.example/.prefill.svc.cluster.local:8000", None),
        ("#.prefill.svc.cluster.local:8000", None),
        ("evil .prefill.svc.cluster.local:8000", None),
        ("évil.prefill.svc.cluster.local:8000", None),  # non-ASCII
        ("[evil.example]:8000", None),  # brackets are for IPv6 literals only
        ("[fd00::7]8100", None),
        ("fd00::7:8100", None),  # an unbracketed IPv6 literal is ambiguous
        ("host:0", None),
        ("host:65536", None),
        ("host:٣", None),  # a non-ASCII digit
        ("host:+80", None),
        ("host", None),
        (":80", None),
    ],
)
def test_split_host_port(text: str, expected: tuple[str, int] | None) -> None:
    assert split_host_port(text) == expected


@pytest.mark.parametrize(
    ("host", "valid"),
    [
        ("a", True),
        ("a-b.c", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("", False),
        ("a..b", False),
        ("a_b", False),
    ],
)
def test_is_host_name(host: str, valid: bool) -> None:
    assert is_host_name(host) is valid


@pytest.mark.parametrize(
    ("host", "port", "allowed"),
    [
        ("p-0.prefill.svc.cluster.local", 8000, True),
        ("p-0.prefill.svc.cluster.local", 8001, False),
        ("evil.example#.prefill.svc.cluster.local", 8000, False),
        ("user@evil.example?.prefill.svc.cluster.local", 8000, False),
        ("10.0.0.9", 1234, True),
        ("10.0.1.9", 1234, False),
        ("fd00::9", 8100, True),
        ("fd00::9", 8000, False),
    ],
)
def test_allows_checks_names_strictly(host: str, port: int, allowed: bool) -> None:
    assert ALLOW.allows(host, port) is allowed


def test_prefiller_header_targets_are_the_hosts_checked() -> None:
    urls = parse_targets(b"p-0.prefill.svc.cluster.local:8000, [fd00::7]:8100, 10.0.0.7:9", ALLOW)
    assert [(urlsplit(u).hostname, urlsplit(u).port) for u in urls] == [
        ("p-0.prefill.svc.cluster.local", 8000),
        ("fd00::7", 8100),
        ("10.0.0.7", 9),
    ]


@pytest.mark.parametrize(
    "header",
    [
        b"evil.example#.prefill.svc.cluster.local:8000",
        b"user@evil.example?.prefill.svc.cluster.local:8000",
        b"#.prefill.svc.cluster.local:8000",
        b"p-0.prefill.svc.cluster.local:8000,evil.example#.prefill.svc.cluster.local:8000",
    ],
)
def test_prefiller_header_cannot_smuggle_another_host(header: bytes) -> None:
    with pytest.raises(RouterError) as caught:
        parse_targets(header, ALLOW)
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("entries", "host", "address", "port", "named"),
    [
        (["127.0.0.1"], "127.0.0.1", "127.0.0.1", 5600, True),
        (["127.0.0.1:5600"], "127.0.0.1", "127.0.0.1", 5600, True),
        (["127.0.0.1:5600"], "127.0.0.1", "127.0.0.1", 5601, False),  # another port
        (["127.0.0.0/8"], "localhost", "127.0.0.1", 5600, True),
        (["localhost:5600-5663"], "localhost", "127.0.0.1", 5601, True),
        (["*.localhost"], "localhost", "127.0.0.1", 5600, False),
        (["::1"], "::1", "::1", 5600, True),
        (["127.0.0.2"], "127.0.0.1", "127.0.0.1", 5600, False),
        (["0.0.0.0/0"], "127.0.0.1", "127.0.0.1", 5600, False),  # contains loopback, names nothing
        (["::/0"], "::1", "::1", 5600, False),
        (["10.0.0.0/8"], "10.0.0.1", "10.0.0.1", 5600, False),  # not loopback at all
        (["10.0.0.1"], "p.example", "10.0.0.1", 5600, False),
    ],
)
def test_names_loopback_only_for_an_entry_that_is_loopback_itself(
    entries: list[str], host: str, address: str, port: int, named: bool
) -> None:
    assert Allowlist(entries).names_loopback(host, address, port) is named
