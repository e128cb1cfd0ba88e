"""The allowlist of llm-d's default: any P address, but those where no prefill server can be.

llm-d's routing sidecar without ``--enable-ssrf-protection`` connects to
whatever ``x-prefiller-host-port`` names. ``pd-sidecar`` keeps that drop-in
behaviour (``prefill_allow_default = "routable"``) but refuses the addresses
no P pod can have, where a forged header would reach the node or the cloud
instead: loopback (``127.0.0.0/8``, ``::1``), link-local (``169.254.0.0/16``,
``fe80::/10``), the cloud metadata services (``169.254.169.254``,
``fd00:ec2::254``, ``100.100.100.200``, ``168.63.129.16``), unspecified
(``0.0.0.0/8``, ``::``), multicast (``224.0.0.0/4``, ``ff00::/8``) and
reserved (``240.0.0.0/4``, broadcast included). An IPv6 address that embeds
an IPv4 one (mapped ``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``, 6to4
``2002::/16``) is judged by the IPv4 address. A host name passes when every
address it resolves to passes; the caller resolves, checks, then connects to
a checked address.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from sidecar.network.allowlist import Allowlist, ip_or_none

Refusal = Literal["loopback", "link_local", "metadata", "unspecified", "multicast", "reserved"]
REFUSALS: tuple[Refusal, ...] = ("loopback", "link_local", "metadata", "unspecified", "multicast", "reserved")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16", "169.254.170.2")
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def embedded(address: Address) -> Address:
    """The IPv4 address an IPv6 one stands for (mapped, NAT64, 6to4), else ``address`` itself."""
    if isinstance(address, ipaddress.IPv4Address):
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour or address


def refusal(address: Address) -> Refusal | None:
    """Why no P can be at ``address``, or None when one can."""
    plain = embedded(address)
    if address in METADATA or plain in METADATA:
        return "metadata"
    if plain.is_loopback:
        return "loopback"
    if plain.is_link_local:
        return "link_local"
    if plain.is_unspecified or plain in _THIS_NETWORK:
        return "unspecified"
    if plain.is_multicast:
        return "multicast"
    if isinstance(plain, ipaddress.IPv4Address) and plain.is_reserved:
        return "reserved"
    return None


class RoutableAllowlist(Allowlist):
    """Every address ``refusal`` finds nothing against, on any port; names by their addresses."""

    def __init__(self) -> None:
        super().__init__(())

    def __bool__(self) -> bool:
        return True  # it admits P: the release strategies have somewhere to go

    def allows_name(self, host: str, port: int) -> bool:
        return False  # a name is judged by what it resolves to (``allows`` with ``resolved``)

    def allows_ip(self, host: str, port: int) -> bool:
        address = ip_or_none(host)
        return address is not None and 0 < port <= 65535 and refusal(address) is None

    def may_admit_address(self, port: int) -> bool:
        return 0 < port <= 65535

    def why_not(self, host: str) -> Refusal | None:
        """The refusal of an IP literal (None for a name or an admitted address)."""
        address = ip_or_none(host)
        return refusal(address) if address is not None else None
