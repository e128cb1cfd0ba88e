"""The prefill pool reads the outbound trust store only for an https P, and at start.

Building a TLS context reads the system's store, ``tls_ca_file``, ``SSL_CERT_FILE`` and every file
of each ``SSL_CERT_DIR`` folder (on a Debian host with both variables set: 290 files and a bundle
of 146 certificates, 0.3 s of CPU). Read on a plain-http P's first prefill leg, it held the event
loop and so every stream that arrived meanwhile. Here ``tls_ca_file`` names a file that is not
there: any read of the trust store raises, so a test that passes read none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config import Config
from sidecar.router.pool import PrefillPool
from sidecar.tls.trust import CAFileError


def missing_ca(tmp_path: Path) -> str:
    return str(tmp_path / "absent-ca.pem")


async def test_an_http_p_client_reads_no_trust_store(tmp_path: Path) -> None:
    pool = PrefillPool(Config(prefill=("http://127.0.0.1:1",), tls_ca_file=missing_ca(tmp_path)))
    try:
        client = await pool.client("http://127.0.0.1:1")
        assert await pool.client("http://127.0.0.1:1") is client  # pooled, built once
    finally:
        await pool.close()


async def test_header_named_http_ps_read_no_trust_store(tmp_path: Path) -> None:
    config = Config(prefill_allow=("127.0.0.1",), tls_ca_file=missing_ca(tmp_path))
    pool = PrefillPool(config)
    try:
        [url] = await pool.candidates(b"127.0.0.1:8000")
        assert url == "http://127.0.0.1:8000"
        await pool.client(url)
    finally:
        await pool.close()


@pytest.mark.parametrize(
    "settings",
    [
        {"prefill": ("https://127.0.0.1:1",)},  # a static https P
        {"prefill_allow": ("127.0.0.1",), "prefill_tls": True},  # header-named Ps, over TLS
    ],
)
def test_the_trust_store_of_https_ps_is_read_when_the_pool_is_built(
    tmp_path: Path, settings: dict[str, object]
) -> None:
    with pytest.raises(CAFileError, match="absent-ca"):  # at start, not in the first prefill leg
        PrefillPool(Config(tls_ca_file=missing_ca(tmp_path), **settings))  # type: ignore[arg-type]
