"""A certificate shaped like KServe's self-signed one, for the TLS trust tests.

KServe's LLMInferenceService controller (kserve/kserve
pkg/controller/v1alpha2/llmisvc/workload_tls_self_signed.go,
``createSelfSignedTLSCertificate``) makes one certificate per service and
serves it from P and D alike: subject ``O=Kserve Self Signed`` and no common
name, key usage digital signature and key encipherment (no certificate
signing), extended key usage server auth, basic constraints CA false, the
service's DNS names and pod addresses as SANs, an RSA key (4096 bits there,
2048 here: the shape matters, not the size). It is its own issuer and no CA's.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    key_encipherment=True,
    content_commitment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)


def kserve_self_signed(
    names: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",)
) -> tuple[bytes, bytes]:
    """A certificate and its key (both PEM) as KServe's controller makes them."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Kserve Self Signed")])
    now = datetime.datetime.now(datetime.UTC)
    alt: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    alt += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(KEY_USAGE, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def write_secret(directory: Path, cert: bytes, key: bytes) -> Path:
    """``tls.crt`` and ``tls.key`` as a Kubernetes TLS Secret mounts them: each a symlink into
    ``..data``, itself a symlink to the current version's folder."""
    version = directory / "..2026_01_01_00_00_00.000000001"
    version.mkdir(parents=True)
    (version / "tls.crt").write_bytes(cert)
    (version / "tls.key").write_bytes(key)
    (directory / "..data").symlink_to(version.name)
    for name in ("tls.crt", "tls.key"):
        (directory / name).symlink_to(f"..data/{name}")
    return directory


def write_cert(ca: trustme.CA, directory: Path) -> None:
    """tls.crt and tls.key as a Kubernetes TLS Secret mounts them (replaced by a rename)."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    directory.mkdir(exist_ok=True)
    for name, blob in (("tls.crt", cert.cert_chain_pems[0]), ("tls.key", cert.private_key_pem)):
        blob.write_to_path(str(directory / f".{name}"))
        os.replace(directory / f".{name}", directory / name)
