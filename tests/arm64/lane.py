"""The pieces of the arm64 lane: what the host needs, the cached root file system, a step inside it.

Plain Python, standard library only: the lane runs before any environment of
the project exists. See ``tests/arm64/__init__.py`` for what it does.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"  # Debian 12: Python 3.11, the project's oldest, as the image's base
# What the chroot needs beside the project's wheels: a shell and make for the Makefile, Python
# with venv for its bootstrap, libstdc++ for the manylinux wheels that use the system's (pyzmq,
# NIXL's UCX), ps for the tests; and the test tools make installs from Debian (nginx, haproxy,
# wrk), to show they exist for arm64 and start.
PACKAGES = (
    "bash", "ca-certificates", "coreutils", "dash", "findutils", "grep", "haproxy", "libstdc++6",
    "make", "nginx-light", "procps", "python3", "python3-venv", "sed", "wrk",
)  # fmt: skip
# Bumped whenever what the lane does to the extracted packages changes (a new cache key).
RECIPE = "extract-1"
HOST_PACKAGES = {"mmdebstrap": "mmdebstrap", "unshare": "util-linux", "chroot": "coreutils"}
QEMU = "qemu-aarch64-static"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
BINFMT_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Environment variables the host's package clients need inside too (index, proxy, certificates).
PASSED = ("PIP_", "UV_", "SSL_CERT_", "REQUESTS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
UNIX_FILES = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n",
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nservices: files\n",
}  # what the maintainer scripts an extracted root never ran would have written
KEPT = (".tools", ".venv")  # what a run keeps of the one before it
# Seconds each kind of step may take before the lane stops it.
LIMITS = {"apt": 900, "mount": 30, "build": 900, "probe": 120}


class LaneError(Exception):
    """Why the lane cannot run on this host, in one line for the user (exit 2)."""


class StepFailed(LaneError):
    """A step inside the root failed or ran past its time limit (exit 1)."""


@dataclass(frozen=True)
class Host:
    machine: str  # x86_64 or aarch64
    emulated: bool  # aarch64 code runs through qemu-user

    @classmethod
    def here(cls) -> Host:
        if not sys.platform.startswith("linux"):
            raise LaneError("the arm64 lane runs on Linux only")
        machine = platform.machine()
        if machine not in ("x86_64", "aarch64"):
            raise LaneError(f"the arm64 lane runs on x86_64 (emulated) or aarch64 hosts, not {machine}")
        if os.geteuid() != 0:
            raise LaneError(
                "the arm64 lane needs root (it mounts, chroots and installs Debian packages): "
                "run it as root, e.g. sudo make arm64"
            )
        return cls(machine, machine != "aarch64")


def run(
    command: Sequence[str], limit: float, what: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``command`` in a session of its own, killed whole past ``limit`` seconds; LaneError when
    it fails (its output's tail in the message)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    try:
        out, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise LaneError(f"{what}: no end after {limit:.0f} s; stopped") from None
    if process.returncode != 0:
        raise LaneError(f"{what} failed (exit {process.returncode}): {out.strip()[-1500:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, "")


def host_tools(host: Host, also: dict[str, str] | None = None) -> None:
    """mmdebstrap, unshare, chroot, (emulated) qemu-user-static and ``also`` (tool -> Debian
    package); installed from Debian when missing and apt-get is there, else LaneError naming them."""
    needed = {**HOST_PACKAGES, **(also or {})}
    if host.emulated:
        needed[QEMU] = "qemu-user-static"
    missing = sorted({package for tool, package in needed.items() if not shutil.which(tool)})
    if not missing:
        return
    if not shutil.which("apt-get"):
        raise LaneError(f"install {' '.join(missing)} (Debian package names); no apt-get here")
    print(f"arm64: installing Debian packages: {' '.join(missing)}", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], LIMITS["apt"], "apt-get update", env=env)
    run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        LIMITS["apt"],
        "apt-get install",
        env=env,
    )


def binfmt(host: Host) -> Path | None:
    """The kernel runs aarch64 binaries through qemu: binfmt_misc mounted and qemu-aarch64
    registered (from the package's own entry) and enabled. The interpreter's path, to copy into
    the root (needed where the entry was registered without the F flag); None on aarch64."""
    if not host.emulated:
        return None
    if not (BINFMT / "status").exists():
        try:
            run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], LIMITS["mount"], "mount")
        except LaneError as exc:
            raise LaneError(
                f"binfmt_misc is not mounted and cannot be ({exc}): run the lane on a host, or in a "
                "container allowed to mount it (privileged)"
            ) from None
    entry = BINFMT / "qemu-aarch64"
    if not entry.exists():
        if not BINFMT_CONF.exists():
            raise LaneError(f"no qemu-aarch64 entry to register: {BINFMT_CONF} is missing (qemu-user-static)")
        try:
            (BINFMT / "register").write_text(BINFMT_CONF.read_text().strip())
        except OSError as exc:
            raise LaneError(f"cannot register qemu-aarch64 with binfmt_misc: {exc}") from None
    if (BINFMT / "status").read_text().strip() != "enabled":
        raise LaneError("binfmt_misc is disabled on this host (echo 1 > /proc/sys/fs/binfmt_misc/status)")
    lines = entry.read_text().splitlines()
    if not lines or lines[0] != "enabled":
        raise LaneError(f"the qemu-aarch64 binfmt entry is disabled ({entry})")
    interpreter = next((line.split(" ", 1)[1] for line in lines if line.startswith("interpreter ")), "")
    return Path(interpreter) if interpreter else None


def cache_dir() -> Path:
    return Path(os.environ.get("KVR_ARM64_CACHE", "/var/cache/kv-release-sidecar/arm64"))


def root_key() -> str:
    """The cached root's name: what it is made of."""
    return hashlib.sha256("\n".join([SUITE, RECIPE, *sorted(PACKAGES)]).encode()).hexdigest()[:16]


def mirror() -> str:
    """The host's Debian mirror (its apt sources), else Debian's own."""
    for sources in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    listed = Path("/etc/apt/sources.list")
    if listed.exists():
        for line in listed.read_text().splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "deb" and "security" not in words[1]:
                return words[1] if not words[1].startswith("[") else words[2]
    return DEFAULT_MIRROR


def root_fs(cache: Path) -> tuple[Path, bool]:
    """The arm64 root file system, built once per package list; (its path, whether it was built now)."""
    root = cache / f"root-{root_key()}"
    if (root / "usr/bin/python3").exists():
        return root, False
    cache.mkdir(parents=True, exist_ok=True)
    building = cache / f".building-{root_key()}"
    shutil.rmtree(building, ignore_errors=True)
    print(f"arm64: extracting Debian {SUITE} arm64 packages into {root}", flush=True)
    command = ["mmdebstrap", "--mode=root", "--variant=extract", "--arch=arm64", "--quiet"]
    command += [f"--include={','.join(PACKAGES)}", SUITE, str(building), mirror()]
    run(command, LIMITS["build"], "mmdebstrap")
    for name, text in UNIX_FILES.items():
        (building / name).write_text(text)
    for stale in cache.glob("root-*"):  # another package list's: not used again
        shutil.rmtree(stale, ignore_errors=True)
    building.rename(root)
    return root, True


def probe(root: Path) -> str:
    """Python runs in the root (through qemu when emulated): its version and machine."""
    check = "import platform, ssl, venv; print(platform.python_version(), platform.machine())"
    try:
        done = run(
            ["chroot", str(root), "/usr/bin/python3", "-c", check], LIMITS["probe"], "python3 in the root"
        )
    except LaneError as exc:
        raise LaneError(f"aarch64 code does not run here ({exc}); is qemu-aarch64 registered?") from None
    return done.stdout.strip()


def sources() -> list[str]:
    """The checkout's files as git sees them (tracked, and new files it does not ignore)."""
    names: list[str] = []
    for extra in ((), ("--others", "--exclude-standard")):
        done = subprocess.run(
            ["git", "ls-files", "-z", *extra], cwd=ROOT, capture_output=True, check=False, timeout=60
        )
        if done.returncode != 0:
            raise LaneError(f"the lane copies a git checkout's files: git ls-files failed in {ROOT}")
        names += [n for n in done.stdout.decode().split("\0") if n and (ROOT / n).is_file()]
    return names


@dataclass(frozen=True)
class Run:
    """One lane run's writable layer over the cached root, and where the mounts go."""

    root: Path
    directory: Path
    emulated: bool
    interpreter: Path | None

    @property
    def upper(self) -> Path:
        return self.directory / "upper"

    @property
    def merged(self) -> Path:
        return self.directory / "merged"

    def prepare(self, cache: Path) -> None:
        """A fresh layer holding the checkout in /src and the host's package-client settings. The
        environments a former run made (``.tools``, ``.venv``) stay, as in a checkout: ``make``
        syncs ``.venv`` again when uv.lock or pyproject.toml changed (``ARM64_FRESH=1``: not kept)."""
        kept = self.directory / "kept"
        shutil.rmtree(kept, ignore_errors=True)
        if os.environ.get("ARM64_FRESH") != "1" and (self.upper / "src").is_dir():
            kept.mkdir(parents=True)
            for name in KEPT:
                if (self.upper / "src" / name).is_dir():
                    (self.upper / "src" / name).rename(kept / name)
        for sub in ("upper", "work", "merged"):
            shutil.rmtree(self.directory / sub, ignore_errors=True)
            (self.directory / sub).mkdir(parents=True)
        with tarfile.open(self.directory / "src.tar", "w") as archive:
            for name in sources():
                archive.add(ROOT / name, arcname=name, recursive=False)
        with tarfile.open(self.directory / "src.tar") as archive:
            archive.extractall(self.upper / "src", filter="tar")
        (self.directory / "src.tar").unlink()
        if kept.is_dir():
            for name in KEPT:
                if (kept / name).is_dir():
                    (kept / name).rename(self.upper / "src" / name)
            kept.rmdir()
        for name in ("uv", "pip"):
            (cache / name).mkdir(parents=True, exist_ok=True)
            (self.upper / "root/.cache" / name).mkdir(parents=True, exist_ok=True)
        for path in host_files():
            target = self.upper / path.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        if self.interpreter is not None and self.interpreter.exists():
            target = self.upper / self.interpreter.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.interpreter.resolve(), target)
            target.chmod(0o755)

    def step(self, name: str, command: str, limit: float, cache: Path) -> float:
        """``command`` (a shell line, in /src) inside the root; its output streamed; seconds taken.
        StepFailed when it fails or runs past ``limit``."""
        merged = shlex.quote(str(self.merged))
        layers = f"lowerdir={self.root},upperdir={self.upper},workdir={self.directory / 'work'}"
        mounts = [
            "set -eu",
            f"mount -t overlay overlay -o {shlex.quote(layers)} {merged}",
            f"mount -t proc proc {merged}/proc",
            f"mount --rbind /sys {merged}/sys",
            f"mount --rbind /dev {merged}/dev",
            f"mount -t tmpfs -o mode=1777 shm {merged}/dev/shm",
            f"mount --bind {shlex.quote(str(cache / 'uv'))} {merged}/root/.cache/uv",
            f"mount --bind {shlex.quote(str(cache / 'pip'))} {merged}/root/.cache/pip",
            f"exec chroot {merged} /usr/bin/env -i {' '.join(map(shlex.quote, self.environment()))} "
            f"/bin/sh -c {shlex.quote('cd /src && ' + command)}",
        ]
        # A mount and PID namespace of the step's own: its mounts and processes end with it.
        argv = ["unshare", "--mount", "--pid", "--fork", "--kill-child=SIGKILL", "--propagation", "private"]
        argv += ["sh", "-c", "\n".join(mounts)]
        print(f"arm64: {name}: {command}", flush=True)
        started = time.monotonic()
        process = subprocess.Popen(argv, start_new_session=True)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise StepFailed(f"{name}: no end after {limit:.0f} s; stopped") from None
        took = time.monotonic() - started
        if code != 0:
            raise StepFailed(f"{name} failed (exit {code}) after {took:.0f} s")
        return took

    def environment(self) -> list[str]:
        passed = [f"{k}={v}" for k, v in os.environ.items() if k.upper().startswith(PASSED)]
        passed = [p for p in passed if not p.startswith(("UV_PROJECT_ENVIRONMENT=", "UV_CACHE_DIR="))]
        emulated = ["KVR_EMULATED=1"] if self.emulated else []
        return [
            "PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME=/root",
            "LANG=C.UTF-8",
            *emulated,
            *passed,
        ]


def host_files() -> list[Path]:
    """The host's settings the package clients read (the reference of this machine: pip's
    configuration and the certificate files its variables name), and its resolver."""
    found = [Path("/etc/resolv.conf"), Path("/etc/pip.conf"), Path.home() / ".config/pip/pip.conf"]
    found.append(Path("/etc/ssl/certs/ca-certificates.crt"))
    for name in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE"):
        if value := os.environ.get(name):
            found.append(Path(value))
    unique = dict.fromkeys(p for p in found if p.is_absolute() and p.is_file())
    return list(unique)
