"""What outbound TLS trusts, read once at start: safely, in bounded time, as Go reads ``SSL_CERT_DIR``.

OpenSSL, under Python's ``ssl``, looks a certificate up in an ``SSL_CERT_DIR``
folder only by its subject-hash name (``5ed36f99.0``). Go's ``crypto/x509``,
and so llm-d's sidecar, reads every file of each folder and trusts every
certificate in it. KServe's LLMInferenceService counts on Go's way: its decode
pods set ``SSL_CERT_DIR=/var/run/kserve/tls:...``, where ``tls.crt`` is the
self-signed certificate P and D serve. ``read_store`` reads folders that way:
each entry of a folder in name order, skipping symlinks to a name in the same
folder (OpenSSL's hash links, as Go skips them); every ``CERTIFICATE`` PEM block
of a regular file. Subfolders, a missing folder, files holding no certificate
and blocks that are no certificate are skipped, as Go skips them.

A setting can name anything, so every file is read the one safe way
(``read_regular``): opened without blocking (a FIFO or a device answers at
once), checked after the open (``fstat``: the file read is the file checked,
wherever a symlink led), refused unless it is a regular file outside ``/proc``
and ``/sys`` (whose files say nothing true of their size, and may block
forever, as ``/proc/kmsg`` does), refused over ``MAX_FILE_BYTES``, and read no
further than the size it declared. A folder is refused on ``/proc`` or
``/sys`` and past ``MAX_FOLDER_ENTRIES`` entries; everything read together is
bounded by ``MAX_TOTAL_BYTES`` and ``READ_SECONDS``. A symlink loop is named as
one. What cannot be used is one line each (``TrustStore.problems``, logged as
warnings once): ``tls_ca_file``, the CA bundle an operator names explicitly,
stops the start instead (``CAFileError``, exit 2), as it did when OpenSSL
could not load it.

OpenSSL's own default file, or the file ``SSL_CERT_FILE`` puts in its place
(as OpenSSL and Go do), is read the same way. OpenSSL's default folder is left
to OpenSSL's lookup by hash name when a certificate is verified, unless
``SSL_CERT_DIR`` puts folders in its place: those are read as ``ssl_cert_dir``
is. OpenSSL itself is never handed a file or folder a setting or a variable
names.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import ssl
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sidecar.exceptions import SidecarError

log = logging.getLogger("sidecar.tls")

# A PEM certificate block; Go trusts only "CERTIFICATE" blocks without headers.
PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n([A-Za-z0-9+/=\r\n]+?)-----END CERTIFICATE-----"
)
#: One file's limit: Debian's whole bundle is 0.2 MB; a file past this is no CA bundle.
MAX_FILE_BYTES = 8 * 1024 * 1024
#: A secret's file (a token, a key): far more than any is.
SECRET_BYTES = 64 * 1024
#: Entries a folder may have to be read (Debian's /etc/ssl/certs: about 290).
MAX_FOLDER_ENTRIES = 10_000
#: Everything read for outbound TLS together.
MAX_TOTAL_BYTES = 64 * 1024 * 1024
#: The whole read's time: past it, what is left is not read (a slow network file system).
READ_SECONDS = 10.0
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


class Unusable(SidecarError):
    """A file or folder that cannot be read as trust material; ``str()`` names it and says why."""

    def __init__(self, path: str, why: str, missing: bool = False) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why, self.missing = path, why, missing


class CAFileError(Unusable):
    """``tls_ca_file`` cannot be used: the start stops (the caller names the setting's source)."""


def _pseudo_devices() -> frozenset[int]:
    """The devices of ``/proc`` and ``/sys``: kernel files, never certificates."""
    found = set()
    for root in ("/proc", "/sys"):
        try:
            found.add(os.stat(root).st_dev)
        except OSError:
            continue
    return frozenset(found)


_PSEUDO = _pseudo_devices()


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symlink loop (too many levels of symbolic links)"
    if exc.errno == errno.ENXIO:
        return "not a regular file (a socket or a device with nothing behind it)"
    if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
        return "reading it would block"
    return exc.strerror or str(exc)


def _refusal(status: os.stat_result, limit: int | None) -> str | None:
    kind = stat.S_IFMT(status.st_mode)
    if kind != stat.S_IFREG:
        return f"not a regular file ({_KINDS.get(kind, 'not a file')})"
    if status.st_dev in _PSEUDO:
        return "a kernel file of /proc or /sys, not certificates"
    if limit is not None and status.st_size > limit:
        return f"{status.st_size} bytes, over the limit of {limit}"
    return None


def read_regular(path: str, limit: int, dir_fd: int | None = None) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (see the module
    docstring); raises ``Unusable``. ``dir_fd``: ``path`` is a name in that open folder."""
    try:
        fd = os.open(path, _FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise Unusable(path, _why(exc), missing=exc.errno == errno.ENOENT) from exc
    try:
        status = os.fstat(fd)
        why = _refusal(status, limit)
        if why is not None:
            raise Unusable(path, why)
        chunks, left = [], status.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise Unusable(path, _why(exc)) from exc
    finally:
        os.close(fd)


def pem_certificates(data: bytes) -> list[str]:
    """Every certificate block of ``data``, each as one PEM text (other blocks and text left out)."""
    return [
        "-----BEGIN CERTIFICATE-----\n" + body.decode("ascii") + "-----END CERTIFICATE-----\n"
        for body in PEM_CERTIFICATE.findall(data)
    ]


@dataclass(frozen=True, slots=True)
class TrustStore:
    """The certificates outbound TLS trusts, OpenSSL's default folder, and what could not be read."""

    pems: tuple[str, ...] = ()
    capath: str | None = None  # OpenSSL's default folder (looked up by hash name when verifying)
    problems: tuple[str, ...] = ()

    def load(self, context: ssl.SSLContext) -> int:
        """Trust every certificate in ``context``; the number added. A block OpenSSL cannot parse
        is skipped, as Go skips a certificate it cannot parse."""
        added = 0
        for pem in self.pems:
            try:
                context.load_verify_locations(cadata=pem)
            except ssl.SSLError:
                continue
            added += 1
        if self.capath:
            context.load_verify_locations(capath=self.capath)
        return added


@dataclass(slots=True)
class _Reading:
    """One read of the trust material: what was found, what was not, and the budget left."""

    pems: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    total: int = 0
    deadline: float = field(default_factory=lambda: time.monotonic() + READ_SECONDS)
    spent: bool = False  # the byte or time budget ran out: nothing more is read

    def budget(self, where: str) -> bool:
        """Whether there is budget left to read ``where``; says once when there is not."""
        if not self.spent and (self.total >= MAX_TOTAL_BYTES or time.monotonic() > self.deadline):
            self.spent = True
            self.problems.append(
                f"{where}: not read, nor anything after it: the trust material read before took "
                f"{self.total} bytes or {READ_SECONDS:g} s, its limits"
            )
        return not self.spent

    def file(self, setting: str, path: str, dir_fd: int | None = None, shown: str | None = None) -> list[str]:
        """The certificates of one file; raises ``Unusable``."""
        data = read_regular(path, MAX_FILE_BYTES, dir_fd)
        if self.total + len(data) > MAX_TOTAL_BYTES:
            self.total = MAX_TOTAL_BYTES
            raise Unusable(shown or path, f"past the {MAX_TOTAL_BYTES} bytes all trust material may take")
        self.total += len(data)
        found = pem_certificates(data)
        if not found:
            log.debug("holds no certificate", extra={"setting": setting, "path": shown or path})
        return found

    def optional(self, setting: str, path: str) -> None:
        """A file Go would skip when it cannot be read: a problem line, and on."""
        if not self.budget(f"{setting} {path}"):
            return
        try:
            self.pems += self.file(setting, path)
        except Unusable as exc:
            if exc.missing:
                log.debug("does not exist", extra={"setting": setting, "path": path})
            else:
                self.problems.append(f"{setting} {exc}: not trusted")

    def folder(self, setting: str, folder: str) -> None:
        """Every file of ``folder`` as Go reads it (module docstring)."""
        try:
            dfd = os.open(folder, _FLAGS | os.O_DIRECTORY)
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # KServe lists folders some images lack
                log.info("folder does not exist", extra={"setting": setting, "path": folder})
            elif exc.errno == errno.ENOTDIR:
                self.problems.append(f"{setting} {folder}: not a folder: not read")
            else:
                self.problems.append(f"{setting} {folder}: {_why(exc)}: not read")
            return
        try:
            if os.fstat(dfd).st_dev in _PSEUDO:
                self.problems.append(
                    f"{setting} {folder}: a folder of /proc or /sys, not certificates: not read"
                )
                return
            names = _names(dfd, MAX_FOLDER_ENTRIES)
            if names is None:
                self.problems.append(
                    f"{setting} {folder}: more than {MAX_FOLDER_ENTRIES} entries, no certificate "
                    "folder: not read"
                )
                return
            for name in names:
                self._entry(setting, folder, dfd, name)
                if self.spent:
                    return
        finally:
            os.close(dfd)

    def _entry(self, setting: str, folder: str, dfd: int, name: str) -> None:
        shown = os.path.join(folder, name)
        try:
            status = os.stat(name, dir_fd=dfd)  # through symlinks: a Secret's files are links
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                log.debug("dangling symlink", extra={"setting": setting, "path": shown})
            else:
                self.problems.append(f"{setting} {shown}: {_why(exc)}: not trusted")
            return
        if stat.S_ISDIR(status.st_mode):
            return  # Go does not descend; a Secret's ..data folder is one
        if _hash_link(name, dfd):
            return  # a link to a name beside it (OpenSSL's hash links): Go reads the target once
        if not self.budget(f"{setting} {shown}"):
            return
        try:
            self.pems += self.file(setting, name, dfd, shown)
        except Unusable as exc:
            self.problems.append(f"{setting} {shown}: {exc.why}: not trusted")


def _hash_link(name: str, dfd: int) -> bool:
    """Whether ``name`` in the open folder ``dfd`` is a symlink to another name in it."""
    try:
        return "/" not in os.readlink(name, dir_fd=dfd)
    except OSError:
        return False  # not a symlink


def _names(dfd: int, limit: int) -> list[str] | None:
    """The names in the open folder ``dfd``, sorted; None past ``limit`` (listing stops there)."""
    names = []
    with os.scandir(dfd) as entries:
        for entry in entries:
            names.append(entry.name)
            if len(names) > limit:
                return None
    return sorted(names)


class TrustSettings(Protocol):
    """The settings of ``sidecar.config.Config`` that name what outbound TLS trusts."""

    @property
    def tls_ca_file(self) -> str: ...
    @property
    def ssl_cert_file(self) -> str: ...
    @property
    def ssl_cert_dir(self) -> Sequence[str]: ...


def read_store(config: TrustSettings, environ: Mapping[str, str] = os.environ) -> TrustStore:
    """Read what outbound TLS trusts (module docstring); raises ``CAFileError`` when
    ``tls_ca_file`` cannot be used."""
    reading = _Reading()
    defaults = ssl.get_default_verify_paths()
    # OpenSSL's default file, or the one SSL_CERT_FILE puts in its place (as OpenSSL would).
    env_file = environ.get(defaults.openssl_cafile_env, "")
    default_file = env_file or defaults.openssl_cafile
    if default_file:
        reading.optional(defaults.openssl_cafile_env if env_file else "OpenSSL's default file", default_file)
    if config.tls_ca_file:
        try:
            found = reading.file("tls_ca_file", config.tls_ca_file)
        except Unusable as exc:
            raise CAFileError(config.tls_ca_file, exc.why) from exc
        if not TrustStore(tuple(found)).load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)):
            raise CAFileError(config.tls_ca_file, "holds no PEM certificate OpenSSL can load")
        reading.pems += found
    if config.ssl_cert_file and config.ssl_cert_file != default_file:
        reading.optional("ssl_cert_file", config.ssl_cert_file)
    # SSL_CERT_DIR's folders replace OpenSSL's default folder: read as Go reads them, never by OpenSSL.
    env_folders = [f for f in environ.get(defaults.openssl_capath_env, "").split(":") if f]
    folders = {f: "ssl_cert_dir" for f in config.ssl_cert_dir if f}
    folders.update({f: defaults.openssl_capath_env for f in env_folders if f not in folders})
    for folder, setting in folders.items():
        if reading.budget(f"{setting} {folder}"):
            reading.folder(setting, folder)
    capath = None
    if not env_folders and defaults.openssl_capath and os.path.isdir(defaults.openssl_capath):
        capath = defaults.openssl_capath  # the system's own folder, looked up by hash name
    return TrustStore(tuple(reading.pems), capath, tuple(reading.problems))


_STORES: dict[tuple[object, ...], TrustStore] = {}


def trust_store(config: TrustSettings) -> TrustStore:
    """What ``config`` trusts, read once per process (start-up reads it before the event loop
    runs); the problems are logged, one warning each, when it is read."""
    key = (
        config.tls_ca_file,
        config.ssl_cert_file,
        tuple(config.ssl_cert_dir),
        os.environ.get("SSL_CERT_FILE", ""),
        os.environ.get("SSL_CERT_DIR", ""),
    )
    store = _STORES.get(key)
    if store is None:
        started = time.monotonic()
        store = _STORES[key] = read_store(config)
        for problem in store.problems:
            log.warning("outbound TLS: %s", problem)
        log.debug(
            "outbound TLS trust read",
            extra={"certificates": len(store.pems), "seconds": round(time.monotonic() - started, 3)},
        )
    return store


# --- the parts, as the tests read them ----------------------------------------------------------


def certificates(files: Iterable[str], folders: Sequence[str]) -> list[str]:
    """The PEM certificates of ``files`` and of every file in ``folders``, in that order."""
    reading = _Reading()
    for path in files:
        if path:
            reading.optional("ssl_cert_file", path)
    for folder in folders:
        reading.folder("ssl_cert_dir", folder)
    return reading.pems


def trust(context: ssl.SSLContext, files: Iterable[str], folders: Sequence[str]) -> int:
    """Add the certificates of ``files`` and ``folders`` to ``context``; the number added."""
    return TrustStore(tuple(certificates(files, folders))).load(context)
