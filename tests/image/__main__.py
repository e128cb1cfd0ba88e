"""``python -m tests.image build|check``: the multi-arch images (``make image``, ``make image-check``).

Exit codes: 0 when every image was built or checked; 1 when a build or a
check failed; 2 when this machine cannot (no podman or docker, not root for
the stand-ins or the checks), with one line saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.arm64.lane import Host as LaneHost
from tests.arm64.lane import LaneError, StepFailed, binfmt, host_tools, mirror, run
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BASE = "docker.io/library/python:3.11-slim-bookworm"
STANDIN = "localhost/python-standin:3.11-slim-bookworm-{arch}"
IMAGES = {"kv-release-sidecar": None, "kv-release-loadtest": "loadtest"}  # name -> Dockerfile target
UID = "10001:10001"
# What the Dockerfile's build stage checks, again in the runtime image as it ships.
NO_TORCH = (
    "import importlib.util as u, sys; "
    "sys.exit([m for m in ('torch', 'nixl_ep_cu12', 'matplotlib', 'aiohttp') if u.find_spec(m)] or 0)"
)
AGENT = (
    "from nixl_cu12._api import nixl_agent as a, nixl_agent_config as c; "
    "a('image-check', c(backends=['UCX'])); print('a NIXL agent with UCX started')"
)
READYZ = """
import json, sys, time, urllib.error, urllib.request
deadline = time.monotonic() + 120
while True:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2)
        print("readyz 200"); sys.exit(1)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode()
        if exc.code == 503 and json.loads(body)["checks"].get("decode") is False:
            print("readyz", exc.code, body); sys.exit(0)  # started, and D is away
    except OSError:
        pass
    if time.monotonic() > deadline:
        print("no 503 naming D on", sys.argv[1]); sys.exit(1)
    time.sleep(0.2)
"""
# Like the python:3.11-slim image: the interpreter in /usr/local/bin, pip allowed system-wide, the
# machine's CA bundle (package downloads may go through a proxy with its own CA).
STANDIN_PACKAGES = "python3.11,python3.11-venv,python3-pip,ca-certificates"
STANDIN_ENV = (
    "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
    "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
    "ENV UV_NATIVE_TLS=1",
    "ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
)


def podman(*args: str, limit: float = 1800, what: str = "") -> str:
    return run(["podman", *args], limit, what or f"podman {args[0]}").stdout


def quiet(*args: str) -> bool:
    """A podman command whose failure is an answer (exists, rm)."""
    return subprocess.run(["podman", *args], capture_output=True, timeout=120, check=False).returncode == 0


def arch_of(platform: str) -> str:
    return platform.split("/")[1]


def pullable(platforms: list[str]) -> bool:
    """Whether the base image comes from its registry here (each platform)."""
    for platform in platforms:
        done = subprocess.run(
            ["podman", "pull", "--quiet", "--platform", platform, BASE],
            capture_output=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            return False
    return True


def standin(arch: str) -> str:
    """The stand-in base for ``arch``, made once from Debian's packages."""
    tag = STANDIN.format(arch=arch)
    if quiet("image", "exists", tag):
        return tag
    print(f"image: no registry for {BASE}; a stand-in for linux/{arch} from Debian's packages", flush=True)
    with tempfile.TemporaryDirectory(prefix="standin-") as scratch:
        root = Path(scratch) / "root"
        command = ["mmdebstrap", "--mode=root", "--variant=minbase", f"--arch={arch}", "--quiet"]
        command += [f"--include={STANDIN_PACKAGES}", "bookworm", str(root), mirror()]
        run(command, 1800, f"mmdebstrap ({arch})")
        (root / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
        for name in ("python3.11", "python3", "python"):
            link = root / "usr/local/bin" / name
            link.unlink(missing_ok=True)
            link.symlink_to("/usr/bin/python3.11")
        shutil.copyfile("/etc/ssl/certs/ca-certificates.crt", root / "etc/ssl/certs/ca-certificates.crt")
        changes = [option for line in STANDIN_ENV for option in ("--change", line)]
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            done = subprocess.run(
                ["podman", "import", "--arch", arch, "--os", "linux", *changes, "-", tag],
                stdin=tar.stdout,
                capture_output=True,
                timeout=600,
                check=False,
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait(600)
        if done.returncode != 0:
            raise LaneError(f"podman import ({arch}) failed: {done.stderr.decode()[-1500:]}")
    return tag


def bases(platforms: list[str]) -> None:
    """The base under its own name for every platform: pulled, or the stand-ins as a manifest list."""
    if pullable(platforms):
        return
    host = LaneHost.here()  # root, and on x86_64: qemu-user for the arm64 stand-in and build
    host_tools(host, {"arch-test": "arch-test"})  # mmdebstrap configures a foreign root with it
    binfmt(host)
    tags = [standin(arch_of(p)) for p in platforms]
    if not quiet("manifest", "rm", BASE):
        quiet("rmi", BASE)
    podman("manifest", "create", BASE)
    for tag in tags:
        podman("manifest", "add", BASE, f"containers-storage:{tag}")


def build_podman(platforms: list[str], tag: str) -> None:
    bases(platforms)
    for name, target in IMAGES.items():
        ref = f"localhost/{name}:{tag}"
        if not quiet("manifest", "rm", ref):
            quiet("rmi", ref)
        command = ["build", "--isolation", "chroot", "--network", "host", "--platform", ",".join(platforms)]
        command += ["--manifest", ref, *(["--target", target] if target else []), str(ROOT)]
        print(f"image: {ref} for {', '.join(platforms)}", flush=True)
        done = subprocess.run(["podman", *command], timeout=5400, check=False)
        if done.returncode != 0:
            raise StepFailed(f"podman build of {ref} failed (exit {done.returncode})")
    plugin(["podman", "build", "--isolation", "chroot", "--network", "host"], tag)


def build_docker(platforms: list[str], tag: str) -> None:
    repo, push = os.environ.get("IMAGE_REPO", ""), os.environ.get("IMAGE_PUSH") == "1"
    for name, target in IMAGES.items():
        ref = f"{repo.rstrip('/') + '/' if repo else ''}{name}:{tag}"
        command = ["docker", "buildx", "build", "--platform", ",".join(platforms), "-t", ref]
        command += [*(["--target", target] if target else []), *(["--push"] if push else []), str(ROOT)]
        print(f"image: {ref} for {', '.join(platforms)}{' (pushed)' if push else ''}", flush=True)
        if subprocess.run(command, timeout=5400, check=False).returncode != 0:
            raise StepFailed(f"docker buildx build of {ref} failed")
    plugin(["docker", "build"], tag)


def plugin(builder: list[str], tag: str) -> None:
    """The vLLM plugin image, for this machine's platform, on the deployment's vLLM image."""
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    uv = shutil.which("uv", path=str(ROOT / ".tools" / "bin")) or "uv"
    run([uv, "build", "--quiet", "--wheel", "--out-dir", str(dist), str(ROOT)], 600, "uv build")
    dockerfile = ROOT / "deploy" / "vllm-plugin.Dockerfile"
    ref = f"kv-release-vllm:{tag}"
    done = subprocess.run([*builder, "-f", str(dockerfile), "-t", ref, str(ROOT)], timeout=3600, check=False)
    if done.returncode != 0:
        base = next(
            line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("FROM ")
        )
        print(f"image: {ref} not built: its base, vLLM's image ({base}), is not to be had here", flush=True)


def instances(ref: str) -> dict[str, str]:
    """The manifest list's image per platform: linux/<arch> -> digest reference."""
    listed = json.loads(podman("manifest", "inspect", ref))
    name = ref.rsplit(":", 1)[0]
    return {
        f"{m['platform']['os']}/{m['platform']['architecture']}": f"{name}@{m['digest']}"
        for m in listed["manifests"]
    }


def check(platforms: list[str], tag: str) -> list[str]:
    """Each platform's sidecar image checked as it runs; lines for the report."""
    ref = f"localhost/kv-release-sidecar:{tag}"
    found, report = instances(ref), []
    for platform in platforms:
        image = found.get(platform)
        if image is None:
            raise StepFailed(f"{ref} holds no {platform} image")
        user = podman("image", "inspect", "--format", "{{.Config.User}}", image).strip()
        if user != UID:
            raise StepFailed(f"{platform}: the image's user is {user!r}, not {UID}")
        env = json.loads(podman("image", "inspect", "--format", "{{json .Config.Env}}", image))
        mount = podman("image", "mount", image).strip()
        try:
            checked = in_image(mount, platform, env)
            venv = run(["du", "-sm", f"{mount}/opt/venv"], 120, "du").stdout.split()[0]
        finally:
            quiet("image", "unmount", image)
        size = int(podman("image", "inspect", "--format", "{{.Size}}", image)) // 1_000_000
        report.append(f"{platform}: {size} MB (virtual environment {venv} MB); {checked}")
    return report


def in_image(mount: str, platform: str, env: list[str]) -> str:
    """The checks, run as the image's user with its environment (``env``, and the home its
    passwd entry names, as a container runtime sets it) in a chroot of its file system (a mount
    and PID namespace of their own: /proc, /sys, /dev and /dev/shm bound in, gone when they end)."""
    port, admin = free_port(), free_port()
    environment = " ".join(shlex.quote(v) for v in [*env, "HOME=/nonexistent"])
    chroot = f"chroot --userspec={UID} {shlex.quote(mount)} /usr/bin/env -i {environment}"
    serve = (
        f"{chroot} /opt/venv/bin/kv-release-sidecar serve --release nixl --decode-url http://127.0.0.1:9 "
        f"--host 127.0.0.1 --port {port} --admin-host 127.0.0.1 --admin-port {admin} --log-format json"
    )
    script = "\n".join(
        [
            "set -eu",
            f"m={shlex.quote(mount)}",
            'mount -t proc proc "$m/proc"',
            'mount --rbind /sys "$m/sys"',
            'mount --rbind /dev "$m/dev"',
            'mount -t tmpfs -o mode=1777 shm "$m/dev/shm"',
            f"{chroot} /usr/bin/id -u",
            f"{chroot} /opt/venv/bin/python -c {shlex.quote(NO_TORCH)} && echo 'no torch'",
            f'help=$({chroot} /app/pd-sidecar --help) && printf "%s\\n" "$help" | head -1',
            f"{chroot} /opt/venv/bin/python -c {shlex.quote(AGENT)}",
            f"{serve} > /tmp/kvr-image-serve.log 2>&1 &",
            f"{chroot} /opt/venv/bin/python -c {shlex.quote(READYZ)} http://127.0.0.1:{admin}/readyz",
            'kill "$!"',
        ]
    )
    argv = ["unshare", "--mount", "--pid", "--fork", "--kill-child=SIGKILL", "--propagation", "private"]
    out = run([*argv, "sh", "-c", script], 900, f"the {platform} image's checks").stdout
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines or lines[0] != UID.split(":")[0]:
        raise StepFailed(f"{platform}: runs as {lines[:1]}, not uid {UID.split(':')[0]}")
    if not any(line.startswith("readyz 503") for line in lines):
        raise StepFailed(f"{platform}: /readyz did not answer 503 with D away: {lines[-3:]}")
    print(f"image: {platform}:", *lines, sep="\n  ", flush=True)
    return "uid 10001, no torch, /app/pd-sidecar --help, NIXL agent, /readyz 503 while D is away"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.image", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build", "check"])
    parser.add_argument("--platforms", default="linux/amd64,linux/arm64")
    parser.add_argument("--tag", default="dev")
    args = parser.parse_args(argv)
    platforms = [p for p in args.platforms.split(",") if p]
    try:
        if args.command == "build":
            if shutil.which("podman"):
                build_podman(platforms, args.tag)
            elif shutil.which("docker"):
                build_docker(platforms, args.tag)
            else:
                raise LaneError("make image needs podman or docker (with buildx)")
        else:
            if not shutil.which("podman") or os.geteuid() != 0:
                raise LaneError("make image-check runs as root with podman (it mounts the images)")
            for line in check(platforms, args.tag):
                print(f"image: {line}", flush=True)
    except LaneError as exc:
        print(f"image: {exc}", file=sys.stderr, flush=True)
        return 1 if isinstance(exc, StepFailed) else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
