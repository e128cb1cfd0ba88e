"""The serving TLS context of a port, and its certificate reloaded when the files change.

``ServerTLS`` owns one ``ssl.SSLContext`` that uvicorn serves with. Its
certificate comes from ``tls.crt`` and ``tls.key`` in a directory (a mounted
Kubernetes Secret), or from ``selfsigned`` when there is none. ``watch`` polls
the two files every ``interval`` seconds (their resolved paths, sizes and
modification times: a Secret is rotated by swapping a symlink); on a change
it loads them into a new context, and only if that succeeds does a new
connection's handshake switch to it (the context's SNI callback, which OpenSSL
runs for every ClientHello, with or without a server name). A half-written or
mismatched pair is logged and the previous certificate stays: connections
already open keep theirs either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
from pathlib import Path

from sidecar.exceptions import SidecarError
from sidecar.tls.names import minimum_version, openssl_ciphers, tls13_only
from sidecar.tls.selfsigned import make_self_signed

log = logging.getLogger("sidecar.tls")

CERT, KEY = "tls.crt", "tls.key"
RELOAD_INTERVAL = 1.0


class TLSFileError(SidecarError):
    """A certificate directory that cannot be served (missing files, a key that does not match)."""


class ServerTLS:
    """One port's serving context; ``context`` is what uvicorn serves with."""

    def __init__(self, cert_dir: str, min_version: str = "1.2", ciphers: tuple[str, ...] = ()) -> None:
        self.cert_dir = cert_dir
        self._min_version, self._ciphers = min_version, ciphers
        self._stamp: tuple[object, ...] | None = None
        self._failed: tuple[object, ...] | None = None  # a pair already refused (logged once)
        self.reloads = 0
        if cert_dir:  # loaded first: a missing file is the same one-line error as a bad one
            self.context = self._load(Path(cert_dir) / CERT, Path(cert_dir) / KEY)
            self._stamp = self._files_stamp()
        else:
            self.context = self._self_signed()
        self._current = self.context
        self.context.sni_callback = self._pick
        if tls13_only(ciphers):
            log.warning(
                "tls_ciphers names TLS 1.3 suites only: TLS 1.2 clients are refused and TLS 1.3 is "
                "served with all its suites, as llm-d's sidecar (Go) does",
                extra={"tls_ciphers": list(ciphers)},
            )

    def _new_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = minimum_version(self._min_version, self._ciphers)
        context.set_ciphers(openssl_ciphers(self._ciphers))
        context.set_alpn_protocols(["http/1.1"])
        return context

    def _load(self, cert: Path, key: Path) -> ssl.SSLContext:
        context = self._new_context()
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise TLSFileError(f"cannot serve TLS with {cert} and {key}: {exc}") from exc
        return context

    def _self_signed(self) -> ssl.SSLContext:
        cert, key = make_self_signed()
        # load_cert_chain reads files only: write the pair where only this process can read it.
        with tempfile.TemporaryDirectory(prefix="kvr-tls-") as scratch:
            paths = Path(scratch) / CERT, Path(scratch) / KEY
            for path, data in zip(paths, (cert, key), strict=True):
                path.write_bytes(data)
                path.chmod(0o600)
            return self._load(*paths)

    def _pick(self, ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        if self._current is not self.context:
            ssl_object.context = self._current

    def _files_stamp(self) -> tuple[object, ...]:
        stamp: list[object] = []
        for name in (CERT, KEY):
            path = os.path.realpath(Path(self.cert_dir) / name)
            info = os.stat(path)
            stamp += [path, info.st_size, info.st_mtime_ns, info.st_ino]
        return tuple(stamp)

    def reload_if_changed(self) -> bool:
        """Load the files if they changed since the last load; True when a new certificate is served."""
        if not self.cert_dir:
            return False
        stamp: tuple[object, ...] | None = None
        try:
            stamp = self._files_stamp()
            if stamp in (self._stamp, self._failed):
                return False
            context = self._load(Path(self.cert_dir) / CERT, Path(self.cert_dir) / KEY)
        except (OSError, TLSFileError) as exc:
            if stamp is not None:
                self._failed = stamp
                log.warning(
                    "TLS certificate not reloaded, the previous one stays", extra={"detail": str(exc)}
                )
            return False
        self._stamp, self._current = stamp, context
        self.reloads += 1
        log.info("TLS certificate reloaded", extra={"directory": self.cert_dir})
        return True

    async def watch(self, interval: float = RELOAD_INTERVAL) -> None:
        """Poll the files until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()


def serving(cert_dir: str, on: bool, min_version: str, ciphers: tuple[str, ...]) -> ServerTLS | None:
    """A port's ``ServerTLS`` when ``on``; raises ``TLSFileError`` for files it cannot serve."""
    return ServerTLS(cert_dir, min_version, ciphers) if on else None
