"""Which prefill endpoints the sidecar may open connections to.

Anything in a request that makes the sidecar connect somewhere (P's
``remote_host`` and ``remote_port``) is checked here first. Entries are a
CIDR or IP (``10.0.0.0/8``, ``fd00::/8``), or a host name with an optional
leading wildcard (``*.prefill.svc.cluster.local``), each optionally followed
by ``:port`` or ``:lo-hi``. An IP literal target matches CIDR/IP entries; a
host-name target matches name entries, or CIDR entries once every address it
resolves to is inside them (the caller resolves, then connects to the checked
address, so a DNS answer cannot change between check and use).
The empty allowlist allows nothing.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_LOOPBACK_V4 = ipaddress.IPv4Network("127.0.0.0/8")
_LOOPBACK_V6 = ipaddress.IPv6Network("::1/128")


@dataclass(frozen=True, slots=True)
class Entry:
    """One parsed allowlist entry."""

    network: IPNetwork | None
    name: str | None  # lower-case; "*.x" matches any sub-domain of x
    ports: tuple[int, int]  # inclusive range; (0, 65535) when no port was given

    def port_ok(self, port: int) -> bool:
        return self.ports[0] <= port <= self.ports[1]


def _parse_ports(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    if not lo.isdigit() or (hi and not hi.isdigit()):
        raise ValueError(f"port {text!r} is not a number or lo-hi range")
    low, high = int(lo), int(hi or lo)
    if not (0 < low <= 65535 and 0 < high <= 65535):
        raise ValueError(f"port range {text!r} is outside 1-65535")
    if low > high:
        raise ValueError(f"port range {text!r} is reversed: write {high}-{low}")
    return low, high


def _split(entry: str) -> tuple[str, str | None]:
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, port
    return entry, None  # a bare IPv6 address or CIDR, or a name without port


def parse_entry(entry: str) -> Entry:
    """Parse one allowlist entry; raises ValueError with the reason."""
    text = entry.strip()
    if not text:
        raise ValueError("empty entry")
    host, port = _split(text)
    ports = _parse_ports(port) if port is not None else (0, 65535)
    try:
        return Entry(ipaddress.ip_network(host, strict=False), None, ports)
    except ValueError:
        pass
    name = host.lower().rstrip(".")
    label = name[2:] if name.startswith("*.") else name
    if not label or not all(part and _is_label(part) for part in label.split(".")):
        raise ValueError(f"{host!r} is neither an IP, a CIDR nor a host name")
    return Entry(None, name, ports)


def _within_loopback(network: IPNetwork) -> bool:
    if isinstance(network, ipaddress.IPv4Network):
        return network.subnet_of(_LOOPBACK_V4)
    return network.subnet_of(_LOOPBACK_V6)


def _is_label(part: str) -> bool:
    return len(part) <= 63 and part.isascii() and all(c.isalnum() or c == "-" for c in part)


def is_host_name(host: str) -> bool:
    """A DNS host name: ASCII letters, digits and hyphens in dot-separated labels (a trailing
    dot allowed). Anything else (``#``, ``@``, ``/``, ``?``, spaces...) could make a URL or a
    resolver read another host than the one checked."""
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(part and _is_label(part) for part in name.split("."))


def split_host_port(text: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` with a valid host (IP literal or host name), else None."""
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[1:end], text[end + 1 :]
        if end < 0 or not rest.startswith(":") or not isinstance(ip_or_none(host), ipaddress.IPv6Address):
            return None
        port = rest[1:]
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host or (ip_or_none(host) is None and not is_host_name(host)):
            return None
    if not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 < int(port) <= 65535:
        return None
    return host, int(port)


def ip_or_none(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


class Allowlist:
    """A parsed allowlist. ``allows`` is pure: no DNS."""

    def __init__(self, entries: tuple[str, ...] | list[str]) -> None:
        self.entries = tuple(parse_entry(e) for e in entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def allows_name(self, host: str, port: int) -> bool:
        """A host-name target matched against name entries."""
        name = host.lower().rstrip(".")
        for entry in self.entries:
            if entry.name is None or not entry.port_ok(port):
                continue
            if entry.name == name:
                return True
            if entry.name.startswith("*.") and name.endswith(entry.name[1:]):
                return True
        return False

    def allows_ip(self, host: str, port: int) -> bool:
        """An IP literal matched against CIDR/IP entries."""
        address = ip_or_none(host)
        if address is None:
            return False
        return any(e.network is not None and address in e.network and e.port_ok(port) for e in self.entries)

    def may_admit_address(self, port: int) -> bool:
        """Some CIDR/IP entry covers ``port``: a host name's addresses could pass on it."""
        return any(entry.network is not None and entry.port_ok(port) for entry in self.entries)

    def names_loopback(self, host: str, address: str, port: int) -> bool:
        """Whether an entry names this loopback target itself: a loopback IP or CIDR entry (inside
        127.0.0.0/8 or ``::1``) holding ``address``, or a ``localhost`` entry for that name, on
        ``port``. A wider entry that merely contains loopback (``0.0.0.0/0``) names nothing."""
        ip = ip_or_none(address)
        if ip is None or not ip.is_loopback:
            return False
        name = host.lower().rstrip(".")
        for entry in self.entries:
            if not entry.port_ok(port):
                continue
            if entry.network is not None and ip in entry.network and _within_loopback(entry.network):
                return True
            if entry.name == "localhost" and name == "localhost":
                return True
        return False

    def allows(self, host: str, port: int, resolved: list[str] | None = None) -> bool:
        """Whether ``host:port`` may be contacted.

        For a host name, ``resolved`` holds its addresses: the name passes when
        a name entry matches, or when every resolved address passes ``allows_ip``.
        """
        if not 0 < port <= 65535:
            return False
        if ip_or_none(host) is not None:
            return self.allows_ip(host, port)
        if not is_host_name(host):
            return False  # not a name a resolver or a URL would read as this one
        if self.allows_name(host, port):
            return True
        return bool(resolved) and all(self.allows_ip(a, port) for a in resolved or ())
