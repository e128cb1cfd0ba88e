"""TLS versions and cipher suites as the settings name them, and OpenSSL's names for them.

Cipher suites are named the IANA way (``TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256``), as
llm-d's ``--tls-cipher-suites`` takes them (Go's ``crypto/tls`` names). Only the
suites Go lists as secure are accepted. The list applies to TLS 1.2, as Go's
``CipherSuites`` does: OpenSSL, like Go, always offers all its TLS 1.3 suites,
so TLS 1.3 names in a list have no effect. A list of TLS 1.3 names only leaves
TLS 1.2 no suite: Go then fails every TLS 1.2 handshake (a ``handshake_failure``
alert) and serves TLS 1.3 alone, and so does this sidecar (``minimum_version``).
"""

from __future__ import annotations

import ssl

# IANA (and Go) name -> OpenSSL name, TLS 1.2 and below.
TLS12_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",  # Go's short alias
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
}
TLS13_SUITES = frozenset({"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"})
# What llm-d's routing sidecar serves with when no list is given: ECDHE with an AEAD cipher.
DEFAULT_SUITES = (
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
)
VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def cipher_error(name: str) -> str:
    """Why ``name`` is not a usable cipher suite, or "" when it is."""
    if name in TLS12_SUITES or name in TLS13_SUITES:
        return ""
    return "not a secure TLS cipher suite name; use one of " + ", ".join(sorted(TLS12_SUITES))


def tls13_only(names: tuple[str, ...]) -> bool:
    """``names`` is a list with no TLS 1.2 suite: only TLS 1.3 clients can be served."""
    return bool(names) and not any(n in TLS12_SUITES for n in names)


def minimum_version(version: str, names: tuple[str, ...]) -> ssl.TLSVersion:
    """The oldest version served: ``version``, or TLS 1.3 when ``names`` leave TLS 1.2 no suite."""
    return ssl.TLSVersion.TLSv1_3 if tls13_only(names) else VERSIONS[version]


def openssl_ciphers(names: tuple[str, ...]) -> str:
    """The OpenSSL cipher string for the TLS 1.2 suites of ``names`` (the default list when there
    are none: OpenSSL needs one, and with TLS 1.3 names only it is never used)."""
    chosen = [TLS12_SUITES[n] for n in (names or DEFAULT_SUITES) if n in TLS12_SUITES]
    return ":".join(dict.fromkeys(chosen)) or ":".join(TLS12_SUITES[n] for n in DEFAULT_SUITES)
