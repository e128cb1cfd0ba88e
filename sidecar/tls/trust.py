"""The certificates outbound TLS trusts from ``ssl_cert_file`` and ``ssl_cert_dir``, read as Go reads them.

OpenSSL, under Python's ``ssl``, looks a certificate up in an ``SSL_CERT_DIR``
folder only by its subject-hash name (``5ed36f99.0``). Go's ``crypto/x509``,
and so llm-d's sidecar, reads every file of each folder and trusts every
certificate in it. KServe's LLMInferenceService counts on Go's way: its decode
pods set ``SSL_CERT_DIR=/var/run/kserve/tls:...``, where ``tls.crt`` is the
self-signed certificate P and D serve. ``certificates`` reads folders that way:
each entry of a folder in name order, skipping symlinks to a name in the same
folder (OpenSSL's hash links, as Go skips them); every ``CERTIFICATE`` PEM block
of a regular file. A missing folder, a subfolder, an unreadable or non-PEM
file, and a block that is not a certificate are skipped, as Go skips them.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

log = logging.getLogger("sidecar.tls")

# A PEM certificate block; Go trusts only "CERTIFICATE" blocks without headers.
PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n([A-Za-z0-9+/=\r\n]+?)-----END CERTIFICATE-----"
)


def pem_certificates(data: bytes) -> list[str]:
    """Every certificate block of ``data``, each as one PEM text (other blocks and text left out)."""
    return [
        "-----BEGIN CERTIFICATE-----\n" + body.decode("ascii") + "-----END CERTIFICATE-----\n"
        for body in PEM_CERTIFICATE.findall(data)
    ]


def folder_files(folder: str) -> list[Path]:
    """The regular files of ``folder`` Go reads, in name order ([] when it cannot be listed)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    files = []
    for name in names:
        path = Path(folder) / name
        try:
            if path.is_symlink() and "/" not in os.readlink(path):
                continue  # a hash link beside its target: Go reads the target once
            if stat.S_ISREG(path.stat().st_mode):  # follows links: a Secret's files are links
                files.append(path)
        except OSError:
            continue
    return files


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def certificates(files: Iterable[str], folders: Sequence[str]) -> list[str]:
    """The PEM certificates of ``files`` and of every file in ``folders``, in that order."""
    paths = [Path(f) for f in files if f] + [p for folder in folders for p in folder_files(folder)]
    return [pem for path in paths for pem in pem_certificates(_read(path))]


def trust(context: ssl.SSLContext, files: Iterable[str], folders: Sequence[str]) -> int:
    """Add the certificates of ``files`` and ``folders`` to ``context``; the number added.

    A block OpenSSL cannot parse is skipped, as Go skips a certificate it cannot parse."""
    added = 0
    for pem in certificates(files, folders):
        try:
            context.load_verify_locations(cadata=pem)
        except ssl.SSLError:
            continue
        added += 1
    if folders:
        log.debug(
            "outbound TLS trusts certificates from folders", extra={"folders": list(folders), "added": added}
        )
    return added
