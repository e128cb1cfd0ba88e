"""Serving TLS: a pair that cannot be served stops the start; on reload the old certificate stays.

``ServerTLS`` serves a real asyncio TLS listener on loopback and a real TLS
client reads the certificate each new connection is given. At start a
mismatched, unreadable or missing pair is one clear error (``serve`` exits 2
with that line). A bad pair found on reload is logged once and the certificate
already served stays; a good pair written after it is served.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme
from cryptography import x509

from sidecar import cli
from sidecar.tls.server import ServerTLS, TLSFileError

MISMATCH = "KEY_VALUES_MISMATCH"


def write(directory: Path, cert: bytes, key: bytes) -> None:
    """tls.crt and tls.key, each replaced whole (as a Secret's files are)."""
    directory.mkdir(exist_ok=True)
    for name, blob in (("tls.crt", cert), ("tls.key", key)):
        (directory / f".{name}").write_bytes(blob)
        os.replace(directory / f".{name}", directory / name)


def issued(ca: trustme.CA) -> tuple[bytes, bytes, int]:
    """A certificate for 127.0.0.1, its key, and its serial number."""
    cert = ca.issue_cert("127.0.0.1")
    pem = cert.cert_chain_pems[0].bytes()
    return pem, cert.private_key_pem.bytes(), x509.load_pem_x509_certificate(pem).serial_number


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def listener() -> AsyncIterator[list[asyncio.Server]]:
    servers: list[asyncio.Server] = []
    yield servers
    for server in servers:
        server.close()
        await server.wait_closed()


async def serve(tls: ServerTLS, servers: list[asyncio.Server]) -> int:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=tls.context)
    servers.append(server)
    return int(server.sockets[0].getsockname()[1])


async def served_serial(port: int, ca: trustme.CA) -> int:
    """The serial number of the certificate a new connection is given (verified against ``ca``)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="127.0.0.1")
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return x509.load_der_x509_certificate(der).serial_number


@pytest.mark.parametrize("broken", ["mismatched", "not PEM", "no key"])
def test_a_pair_that_cannot_be_served_stops_the_start_in_one_line(
    broken: str,
    ca: trustme.CA,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cert, other_key = issued(ca)[0], issued(ca)[1]
    certs = tmp_path / "certs"
    write(certs, {"mismatched": cert, "not PEM": b"not a certificate\n", "no key": cert}[broken], other_key)
    if broken == "no key":
        (certs / "tls.key").unlink()
    with pytest.raises(TLSFileError) as caught:
        ServerTLS(str(certs))
    assert str(caught.value).startswith(f"cannot serve TLS with {certs}/tls.crt and {certs}/tls.key: ")
    assert (MISMATCH in str(caught.value)) is (broken == "mismatched")
    for name in [n for n in os.environ if n.startswith("KVR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVR_ADMIN_PORT", "0")
    assert cli.main(["pd-sidecar", "--port=0", f"--cert-path={certs}"]) == 2
    assert capsys.readouterr().err == f"kv-release-sidecar: {caught.value}\n"


async def test_a_bad_pair_on_reload_is_logged_once_and_the_old_certificate_stays(
    ca: trustme.CA, tmp_path: Path, caplog: pytest.LogCaptureFixture, listener: list[asyncio.Server]
) -> None:
    first_cert, first_key, first = issued(ca)
    second_cert, second_key, second = issued(ca)
    certs = tmp_path / "certs"
    write(certs, first_cert, first_key)
    tls = ServerTLS(str(certs))
    port = await serve(tls, listener)
    assert await served_serial(port, ca) == first

    write(certs, second_cert, first_key)  # the new certificate with the old key: half a rotation
    with caplog.at_level(logging.WARNING, logger="sidecar.tls"):
        assert tls.reload_if_changed() is False
        assert tls.reload_if_changed() is False  # the same files: not tried nor logged again
    refused = [r for r in caplog.records if r.getMessage().startswith("TLS certificate not reloaded")]
    assert len(refused) == 1 and MISMATCH in refused[0].__dict__["detail"]
    assert await served_serial(port, ca) == first and tls.reloads == 0

    write(certs, second_cert, second_key)  # the rotation completed
    assert tls.reload_if_changed() is True
    assert await served_serial(port, ca) == second and tls.reloads == 1


def client(ca: trustme.CA, version: ssl.TLSVersion, ciphers: str = "") -> ssl.SSLContext:
    """A client that speaks ``version`` only (and, for TLS 1.2, only ``ciphers`` when given)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.minimum_version = context.maximum_version = version
    if ciphers:
        context.set_ciphers(ciphers)
    return context


async def handshake(port: int, context: ssl.SSLContext) -> tuple[str, str]:
    """The version and cipher a new connection agrees on; raises ``ssl.SSLError`` when refused."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="127.0.0.1")
    agreed = writer.get_extra_info("ssl_object")
    writer.close()
    return agreed.version(), agreed.cipher()[0]


async def test_tls_1_3_cipher_names_only_serve_tls_1_3_alone_as_go_does(
    ca: trustme.CA, tmp_path: Path, listener: list[asyncio.Server], caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, *issued(ca)[:2])
    with caplog.at_level(logging.WARNING, logger="sidecar.tls"):
        tls = ServerTLS(str(tmp_path), "1.2", ("TLS_AES_256_GCM_SHA384",))
    assert any("TLS 1.3 suites only" in r.getMessage() for r in caplog.records)
    port = await serve(tls, listener)
    version, cipher = await handshake(port, client(ca, ssl.TLSVersion.TLSv1_3))
    assert version == "TLSv1.3" and cipher.startswith("TLS_")  # any of TLS 1.3's suites
    with pytest.raises((ssl.SSLError, ConnectionResetError)):  # refused in the handshake
        await handshake(port, client(ca, ssl.TLSVersion.TLSv1_2))


async def test_a_tls_1_2_cipher_list_is_honoured_and_tls_1_3_names_in_it_change_nothing(
    ca: trustme.CA, tmp_path: Path, listener: list[asyncio.Server]
) -> None:
    write(tmp_path, *issued(ca)[:2])  # trustme's key is ECDSA
    names = ("TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256")
    port = await serve(ServerTLS(str(tmp_path), "1.2", names), listener)
    tls12 = ssl.TLSVersion.TLSv1_2
    assert await handshake(port, client(ca, tls12)) == ("TLSv1.2", "ECDHE-ECDSA-AES256-GCM-SHA384")
    with pytest.raises((ssl.SSLError, ConnectionResetError)):  # a suite outside the list
        await handshake(port, client(ca, tls12, "ECDHE-ECDSA-AES128-GCM-SHA256"))
    assert (await handshake(port, client(ca, ssl.TLSVersion.TLSv1_3)))[0] == "TLSv1.3"
