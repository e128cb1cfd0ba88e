"""A self-signed serving certificate made at start, when TLS is on and no directory is given.

As llm-d's routing sidecar does: good for testing and for a peer that skips
verification (a gateway with ``insecureSkipVerify``), not for clients that verify.
The key is ECDSA P-256; the names are ``localhost``, the loopback addresses and the
host's name. Needs the ``llm-d`` extra (``cryptography``).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

VALIDITY = datetime.timedelta(days=365)


def make_self_signed(common_name: str = "kv-release-sidecar") -> tuple[bytes, bytes]:
    """A certificate and its private key, both PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    alt_names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname())]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem
