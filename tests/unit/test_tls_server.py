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
