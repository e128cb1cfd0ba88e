"""Outbound TLS trusts ``SSL_CERT_DIR`` folders as Go reads them, and ``SSL_CERT_FILE`` (sidecar.tls.trust).

The folders are KServe's: a mounted TLS Secret holding its self-signed
``tls.crt`` (symlinks into ``..data``) and ``tls.key``, a service-account
folder with a token that is no PEM at all, a folder that does not exist.
Each test reads real files; the last ones make real TLS handshakes with a
context ``outbound`` builds.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from sidecar.config import Config, load
from sidecar.sim.servers import serve
from sidecar.tls.client import outbound
from sidecar.tls.trust import (
    MAX_FILE_BYTES,
    CAFileError,
    Unusable,
    certificates,
    pem_certificates,
    read_regular,
    read_store,
    trust,
)
from tests.support.certs import kserve_self_signed, write_secret


def subject_of(pem: str) -> str:
    return x509.load_pem_x509_certificate(pem.encode()).subject.rfc4514_string()


@pytest.fixture
def kserve_tls(tmp_path: Path) -> tuple[Path, bytes, bytes]:
    cert, key = kserve_self_signed()
    return write_secret(tmp_path / "kserve-tls", cert, key), cert, key


def test_a_secret_folder_gives_its_certificate_and_not_its_key(kserve_tls: tuple[Path, bytes, bytes]) -> None:
    folder, cert, _ = kserve_tls
    [found] = certificates([], [str(folder)])  # ..data (a folder) not descended, the links read once
    assert found.encode() == cert and subject_of(found) == "O=Kserve Self Signed"


def test_non_pem_files_subfolders_fifos_and_missing_folders_are_skipped(
    tmp_path: Path, kserve_tls: tuple[Path, bytes, bytes]
) -> None:
    folder, cert, _ = kserve_tls
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("eyJhbGciOiJSUzI1NiJ9.not-a-certificate")
    (account / "namespace").write_bytes(b"\x00\xff binary")
    nested = account / "nested"
    nested.mkdir()
    (nested / "inner.crt").write_bytes(kserve_self_signed()[0])  # Go does not descend: neither do we
    os.mkfifo(account / "pipe")  # read, it would block: not a regular file
    missing = tmp_path / "etc-pki-tls-certs"
    found = certificates([], [str(folder), str(account), str(missing)])
    assert [pem.encode() for pem in found] == [cert]


def test_every_certificate_of_a_bundle_counts_and_a_hash_link_only_once(tmp_path: Path) -> None:
    first, second = kserve_self_signed()[0], kserve_self_signed(("p.example",))[0]
    folder = tmp_path / "certs"
    folder.mkdir()
    (folder / "bundle.pem").write_bytes(b"# a comment line\n" + first + b"\nsome text\n" + second)
    (folder / "5ed36f99.0").symlink_to("bundle.pem")  # OpenSSL's hash link beside its target: read once
    assert [pem.encode() for pem in certificates([], [str(folder)])] == [first, second]


def test_other_pem_blocks_and_a_broken_certificate_are_not_trusted(tmp_path: Path) -> None:
    good, key = kserve_self_signed()
    broken = b"-----BEGIN CERTIFICATE-----\nTUlJQm9vbQ==\n-----END CERTIFICATE-----\n"
    assert pem_certificates(key) == [] and len(pem_certificates(broken + good)) == 2
    folder = tmp_path / "certs"
    folder.mkdir()
    (folder / "mixed.pem").write_bytes(broken + key + good)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    assert trust(context, [], [str(folder)]) == 1  # the broken block is skipped, not an error
    assert context.cert_store_stats()["x509"] == 1


def test_ssl_cert_file_and_a_missing_one(tmp_path: Path) -> None:
    cert = kserve_self_signed()[0]
    (tmp_path / "ca.pem").write_bytes(cert)
    found = certificates([str(tmp_path / "ca.pem"), str(tmp_path / "absent.pem")], [])
    assert [pem.encode() for pem in found] == [cert]


def test_the_variables_load_into_the_config_and_kvr_ones_win() -> None:
    kserve = "/var/run/kserve/tls:/var/run/secrets/kubernetes.io/serviceaccount:/etc/pki/tls/certs"
    config = load({}, {"SSL_CERT_DIR": kserve, "SSL_CERT_FILE": "/etc/ca.pem"})
    assert config.ssl_cert_dir == tuple(kserve.split(":")) and config.ssl_cert_file == "/etc/ca.pem"
    mine = load({}, {"SSL_CERT_DIR": kserve, "KVR_SSL_CERT_DIR": "/a,b:/c"})
    assert mine.ssl_cert_dir == ("/a,b", "/c")  # colon-separated: a path may hold a comma
    flag = load({"ssl_cert_dir": "/d"}, {"SSL_CERT_DIR": kserve})
    assert flag.ssl_cert_dir == ("/d",)
    assert load({}, {"SSL_CERT_DIR": ""}).ssl_cert_dir == ()


async def hello(scope: dict[str, object], receive: object, send: object) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"hello"})  # type: ignore[operator]


def test_outbound_verifies_a_kserve_certificate_only_from_the_folder(
    kserve_tls: tuple[Path, bytes, bytes],
) -> None:
    # The handshake the colleague's run failed: D serves KServe's certificate, the sidecar trusts
    # SSL_CERT_DIR. Python's own reading of SSL_CERT_DIR (OpenSSL: hashed names only) finds nothing.
    folder, _, _ = kserve_tls
    files = {"ssl_certfile": str(folder / "tls.crt"), "ssl_keyfile": str(folder / "tls.key")}
    with serve(hello, lifespan="off", **files) as server:
        for host in ("localhost", "127.0.0.1"):
            url = f"https://{host}:{server.port}/"
            trusted = outbound(Config(ssl_cert_dir=(str(folder), "/nonexistent")), insecure=False)
            assert httpx.get(url, verify=trusted).text == "hello"
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url, verify=outbound(Config(), insecure=False))
        openssl_way = ssl.create_default_context(capath=str(folder))  # what Python alone does
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url, verify=openssl_way)


def test_tls_ca_file_and_the_system_store_stay_trusted(kserve_tls: tuple[Path, bytes, bytes]) -> None:
    folder, _, _ = kserve_tls
    system = ssl.create_default_context().cert_store_stats()["x509"]
    assert system > 0  # the test needs a system store to see it kept
    context = outbound(Config(tls_ca_file=str(folder / "tls.crt")), insecure=False)
    assert context.cert_store_stats()["x509"] == system + 1  # the system's store kept beside it
    both = outbound(Config(tls_ca_file=str(folder / "tls.crt"), ssl_cert_file=str(folder / "tls.crt")), False)
    assert both.cert_store_stats()["x509"] == system + 1  # the same certificate twice: one entry


# --- what a setting may name: read safely, each problem in one line --------------------------------


@pytest.mark.timeout(10)
def test_a_fifo_proc_a_symlink_loop_and_an_oversized_file_are_refused_without_reading(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # a blocking open or read would hang past the timeout
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with (tmp_path / "huge.pem").open("wb") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)  # sparse
    cases = {
        str(tmp_path / "fifo"): "not a regular file (a FIFO)",
        "/proc/self/status": "a kernel file of /proc or /sys",
        "/dev/null": "not a regular file (a character device)",
        str(tmp_path / "loop"): "a symlink loop",
        str(tmp_path / "huge.pem"): f"{MAX_FILE_BYTES + 1} bytes, over the limit of {MAX_FILE_BYTES}",
        str(tmp_path / "absent"): "No such file or directory",
        str(tmp_path): "not a regular file (a folder)",
    }
    for path, why in cases.items():
        with pytest.raises(Unusable) as caught:
            read_regular(path, MAX_FILE_BYTES)
        assert caught.value.path == path and why in caught.value.why


def test_a_file_is_read_no_further_than_the_size_it_declares(tmp_path: Path) -> None:
    cert = kserve_self_signed()[0]
    (tmp_path / "ca.pem").write_bytes(cert)
    assert read_regular(str(tmp_path / "ca.pem"), MAX_FILE_BYTES) == cert
    with pytest.raises(Unusable, match="over the limit of 10"):
        read_regular(str(tmp_path / "ca.pem"), 10)


@pytest.mark.timeout(30)
def test_each_folder_problem_is_one_line_and_the_rest_is_read(
    tmp_path: Path, kserve_tls: tuple[Path, bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sidecar.tls.trust.MAX_FOLDER_ENTRIES", 20)
    folder, cert, _ = kserve_tls
    os.mkfifo(folder / "pipe")
    (folder / "a").symlink_to("b")
    (folder / "b").symlink_to("a")
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for i in range(21):
        (crowded / str(i)).touch()
    config = Config(ssl_cert_dir=(str(folder), "/proc", "/sys/kernel", str(crowded), str(tmp_path / "none")))
    store = read_store(config, environ={})
    assert [pem.encode() for pem in store.pems if pem.encode() == cert] == [cert]
    assert sorted(store.problems) == sorted(
        [
            f"ssl_cert_dir {folder}/a: a symlink loop (too many levels of symbolic links): not trusted",
            f"ssl_cert_dir {folder}/b: a symlink loop (too many levels of symbolic links): not trusted",
            f"ssl_cert_dir {folder}/pipe: not a regular file (a FIFO): not trusted",
            "ssl_cert_dir /proc: a folder of /proc or /sys, not certificates: not read",
            "ssl_cert_dir /sys/kernel: a folder of /proc or /sys, not certificates: not read",
            f"ssl_cert_dir {crowded}: more than 20 entries, no certificate folder: not read",
        ]
    )  # the folder that does not exist is no problem: KServe names folders some images lack


def test_the_whole_read_is_bounded_in_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sidecar.tls.trust.MAX_TOTAL_BYTES", 3000)
    folder = tmp_path / "certs"
    folder.mkdir()
    for name in ("1.pem", "2.pem", "3.pem", "4.pem"):
        (folder / name).write_bytes(kserve_self_signed()[0])  # about 1.2 kB each
    no_default = {"SSL_CERT_FILE": str(tmp_path / "absent")}  # OpenSSL's own bundle is larger
    store = read_store(Config(ssl_cert_dir=(str(folder),)), environ=no_default)
    assert len(store.pems) == 2 and len(store.problems) == 2
    assert "3.pem: past the 3000 bytes all trust material may take" in store.problems[0]
    assert "4.pem: not read, nor anything after it" in store.problems[1]


def test_ssl_cert_file_and_dir_in_the_environment_replace_openssls_defaults(
    tmp_path: Path, kserve_tls: tuple[Path, bytes, bytes]
) -> None:
    folder, cert, _ = kserve_tls
    os.mkfifo(tmp_path / "fifo")
    environ = {"SSL_CERT_FILE": str(tmp_path / "fifo"), "SSL_CERT_DIR": str(folder)}
    store = read_store(Config(), environ=environ)
    assert [pem.encode() for pem in store.pems] == [cert]  # the folder, read as Go reads it
    assert store.capath is None  # OpenSSL looks nothing up in a folder a variable names
    assert store.problems == (f"SSL_CERT_FILE {tmp_path / 'fifo'}: not a regular file (a FIFO): not trusted",)


def test_an_unusable_tls_ca_file_stops_with_the_setting_named(tmp_path: Path) -> None:
    (tmp_path / "key.pem").write_bytes(kserve_self_signed()[1])  # a key, no certificate
    for path, why in (
        (tmp_path / "key.pem", "holds no PEM certificate"),
        (Path("/proc/self/status"), "/proc"),
    ):
        with pytest.raises(CAFileError) as caught:
            read_store(Config(tls_ca_file=str(path)), environ={})
        assert caught.value.path == str(path) and why in caught.value.why
