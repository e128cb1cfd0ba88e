"""``kv-release-sidecar check`` as an operator runs it: the real CLI against real servers.

D is the decode simulator, or a vLLM-like FastAPI app with the control-endpoint
plugin mounted as vLLM mounts it, each on an ephemeral loopback port. The
command runs as installed (``python -m sidecar check``) in a clean
environment, so its whole output and exit code are what is checked. A good
configuration passes; each broken one fails on the check that names it, with
the fix.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from sidecar.sim.decode import create_decode_app
from sidecar.sim.decode.config import DecodeSimConfig
from sidecar.sim.servers import ServerThread, serve
from tests.support.fake_engine import TOKEN, NotifyEngine, vllm_like
from tests.support.ports import free_port

CLEAN_ENV = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/")}
LINE_START = ("ok    ", "warn  ", "fail  ")
ROOT = Path(__file__).resolve().parents[2]


class Report:
    """One run of the command: exit code, the findings by name, and the raw output."""

    def __init__(self, done: subprocess.CompletedProcess[str]) -> None:
        self.code, self.stdout, self.stderr = done.returncode, done.stdout, done.stderr
        self.lines = done.stdout.splitlines()

    def statuses(self) -> list[str]:
        return [line.split()[0] for line in self.lines]

    def find(self, name: str) -> list[str]:
        return [line for line in self.lines if line[6:].startswith(f"{name}: ")]

    def one(self, name: str) -> str:
        (line,) = self.find(name)
        return line


def check(*argv: str, env: dict[str, str] | None = None) -> Report:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "check", *argv],
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report = Report(done)
    assert "Traceback" not in done.stderr, done.stderr
    if report.code != 2 and "--json" not in argv:
        assert report.lines and all(line.startswith(LINE_START) for line in report.lines), done.stdout
    return report


def toml(path: Path, **settings: Any) -> str:
    """``settings`` written as the TOML file ``serve --config`` reads; returns its path."""
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()))
    return str(path)


@pytest.fixture(scope="module")
def sim_d() -> Iterator[ServerThread]:
    with serve(create_decode_app(DecodeSimConfig())) as server:
        yield server


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "key"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    return str(path)


def nixl_config(tmp_path: Path, decode_url: str, key_file: str, **changes: Any) -> str:
    """The shipped decode-pod config (deploy/sidecar/sidecar.toml), pointed at a local D."""
    settings = {
        "decode_url": decode_url,
        "release": "nixl",
        "prefill_allow": ["127.0.0.1:5600-5663", "localhost:5600"],
        "trust": "hmac",
        "trust_key_file": key_file,
        **changes,
    }
    return toml(tmp_path / "sidecar.toml", **settings)


# --- a good configuration --------------------------------------------------------------------------


def test_good_nixl_config_passes_with_every_line_ok_or_warn(
    sim_d: ServerThread, tmp_path: Path, key_file: str
) -> None:
    report = check("--config", nixl_config(tmp_path, sim_d.url, key_file))
    assert report.code == 0, report.stdout
    assert set(report.statuses()) <= {"ok", "warn"}
    assert "NIXL is importable" in report.one("release")
    assert report.one("decode") == f"ok    decode: GET {sim_d.url}/health answered 200"
    assert report.one("version").startswith("ok    version: vLLM 0.34.0 (from D's GET /version) is known")
    assert report.find("allowlist") == [
        "ok    allowlist: 1 address entry parses: 127.0.0.1:5600-5663",
        "warn  allowlist: 127.0.0.1:5600-5663 admits loopback addresses; keep it only where P runs on "
        "this machine (a local trial); in a cluster list P's pod network: a P that left "
        "VLLM_NIXL_SIDE_CHANNEL_HOST unset announces localhost, and the sidecar would contact its own pod",
        "ok    allowlist: localhost:5600: localhost resolves to 127.0.0.1",
    ]
    assert report.one("trust").startswith(f"ok    trust: hmac: key read from {key_file} (")
    assert "llm-d's routing sidecar" in report.one("trust-front")  # hmac behind a front that does not sign
    assert report.find("control") == []  # nixl has no control endpoint to check


def shown_in_deploy_readme() -> list[str]:
    """The output deploy/README.md shows for the shipped sidecar.toml (the block after its caption)."""
    text = (ROOT / "deploy" / "README.md").read_text()
    after = text.split("The shipped `sidecar.toml` with the Secret created:", 1)[1]
    block = after.split("```", 2)[1]
    return [line.strip() for line in block.strip().splitlines()]


def test_the_shipped_config_gives_what_the_deploy_readme_shows(sim_d: ServerThread, key_file: str) -> None:
    env = {"KVR_DECODE_URL": sim_d.url, "KVR_TRUST_KEY_FILE": key_file}  # D here, the Secret's key here
    report = check("--config", str(ROOT / "deploy" / "sidecar" / "sidecar.toml"), env=env)
    in_the_pod = (
        "/var/run/kv-release-sidecar/trust/key (/etc/kv-release-sidecar/sidecar.toml, key trust_key_file)"
    )
    expected = [
        line.replace("http://127.0.0.1:8200", sim_d.url).replace(
            in_the_pod, f"{key_file} (KVR_TRUST_KEY_FILE)"
        )
        for line in shown_in_deploy_readme()
    ]
    assert report.code == 0
    assert report.lines == expected


def test_good_http_config_with_the_plugin_passes(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with serve(vllm_like(NotifyEngine())) as d:
        report = check("--decode-url", d.url, "--release", "http", "--control-token-file", str(token_file))
    assert report.code == 0, report.stdout
    assert (
        report.one("control") == f"ok    control: GET {d.url}/kv_release/v1/health answered 200 to the token"
    )
    assert report.one("release").startswith("ok    release: http: D's plugin releases")
    assert report.one("trust").startswith("warn  trust: any: anyone who can reach port 8000")


def test_settings_come_from_flags_env_and_file_as_for_serve(
    sim_d: ServerThread, tmp_path: Path, key_file: str
) -> None:
    config = nixl_config(tmp_path, "http://127.0.0.1:1", key_file)
    env = {"KVR_CONFIG": config, "KVR_DECODE_URL": sim_d.url, "KVR_PREFIL_ALLOW": "10.0.0.0/8"}
    report = check("--prefill-allow", "10.0.0.0/8:5600", env=env)
    assert report.code == 0, report.stdout  # the variable beats the file's unreachable D
    assert report.find("allowlist") == ["ok    allowlist: 1 address entry parses: 10.0.0.0/8:5600"]
    assert report.one("environment") == (
        "warn  environment: KVR_PREFIL_ALLOW is not a setting and is ignored "
        "(did you mean 'KVR_PREFILL_ALLOW'?); rename it to the setting meant, or remove it"
    )


# --- each broken setting, reported with its fix -----------------------------------------------------


def test_d_down_fails_the_decode_and_version_checks(tmp_path: Path, key_file: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    report = check("--config", nixl_config(tmp_path, url, key_file))
    assert report.code == 1
    decode = report.one("decode")
    assert decode.startswith(f"fail  decode: D is unreachable: cannot connect to {url}/health")
    assert decode.endswith("; start D, or set decode_url to D's scheme://host:port")
    assert report.one("version").startswith("fail  version: D's vLLM release is unknown")
    assert "set vllm_version" in report.one("version")


def test_https_against_a_plain_http_d_is_named_a_tls_mismatch(sim_d: ServerThread) -> None:
    report = check("--decode-url", sim_d.url.replace("http://", "https://"), "--vllm-version", "0.33.0")
    assert report.code == 1
    decode = report.one("decode")
    assert decode.startswith("fail  decode: D is unreachable:")
    assert decode.endswith(
        "; D does not complete a TLS handshake: use http:// in decode_url if D serves plain http, "
        "or trust its certificate (tls_ca_file, ssl_cert_dir or SSL_CERT_DIR, decode_tls_insecure)"
    )


def test_engine_dead_fails_the_decode_check() -> None:
    async def health(request: object) -> Response:
        return Response(status_code=503)

    with serve(Starlette(routes=[Route("/health", health)])) as d:
        report = check("--decode-url", d.url, "--vllm-version", "0.33.0")
    assert report.code == 1
    assert report.one("decode") == (
        f"fail  decode: GET {d.url}/health answered 503: D's engine is dead; read D's log and restart D"
    )


def test_a_newer_version_warns_and_fails_for_nixl_only_when_refused(tmp_path: Path, key_file: str) -> None:
    with serve(create_decode_app(DecodeSimConfig(version="0.99.0"))) as d:
        nixl = check("--config", nixl_config(tmp_path, d.url, key_file))
        refuse = check("--config", nixl_config(tmp_path, d.url, key_file), env={"KVR_UNKNOWN_VLLM": "refuse"})
        http = check("--decode-url", d.url, "--release", "http", "--control-url", d.url + "/none")
    assert nixl.one("version") == (
        "warn  version: vLLM 0.99.0 (from D's GET /version) is newer than the releases this sidecar "
        "knows (0.9.0-0.34.0): nixl releases use vLLM 0.34.0's wire and rules while P's handshake "
        "reply decodes under them (refused as unknown_wire when it does not); "
        "upgrade kv-release-sidecar to a release that knows it"
    )
    assert refuse.code == 1
    assert refuse.one("version") == (
        "fail  version: vLLM 0.99.0 (from D's GET /version) is newer than the releases this sidecar "
        "knows (0.9.0-0.34.0): nixl refuses every release (unknown_version; unknown_vllm is refuse); "
        "upgrade kv-release-sidecar to a release that knows it, or set unknown_vllm to newest"
    )
    assert http.one("version").startswith("warn  version: vLLM 0.99.0")
    assert "http releases as for 0.34.0" in http.one("version")


def test_a_release_the_tables_do_not_hold_and_a_mismatch_with_d(sim_d: ServerThread) -> None:
    report = check("--decode-url", sim_d.url, "--release", "auto", "--vllm-version", "0.8.5")
    first, second = report.find("version")
    assert first.startswith("fail  version: vLLM '0.8.5' (set by --vllm-version) is not a release")
    assert first.endswith("; set vllm_version to the release P and D are built from")
    assert second == (
        "warn  version: vllm_version is 0.8.5 but D reports 0.34.0; "
        "P and D must run one vLLM release: set vllm_version to it, or leave it empty"
    )


@pytest.mark.parametrize(
    ("token", "status", "found"),
    [("not-the-plugin-token", "403", "the token is wrong"), ("", "401", "no token was sent")],
)
def test_wrong_or_missing_token_fails_the_control_check(
    tmp_path: Path, token: str, status: str, found: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(token)
    with serve(vllm_like(NotifyEngine())) as d:
        report = check("--decode-url", d.url, "--release", "http", "--control-token-file", str(token_file))
    assert report.code == 1
    assert report.one("control") == (
        f"fail  control: GET {d.url}/kv_release/v1/health answered {status}: {found}; "
        "set control_token_file (or KVR_CONTROL_TOKEN) to the plugin's token "
        "(KVR_CONTROL_TOKEN or KVR_CONTROL_TOKEN_FILE in D's environment)"
    )


def test_unreadable_control_token_file_fails_naming_it(sim_d: ServerThread, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-token")
    report = check("--decode-url", sim_d.url, "--release", "auto", "--control-token-file", missing)
    assert report.code == 1
    line = report.one("control")
    assert line.startswith(
        f"fail  control: control_token_file {missing} (--control-token-file) cannot be read"
    )
    assert line.endswith(
        "; mount the plugin's token (KVR_CONTROL_TOKEN or KVR_CONTROL_TOKEN_FILE in D's environment) "
        f"at {missing}"
    )


@pytest.mark.parametrize(("strategy", "status", "code"), [("http", "fail", 1), ("auto", "warn", 0)])
def test_no_plugin_fails_http_and_warns_auto(
    tmp_path: Path, key_file: str, strategy: str, status: str, code: int
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with serve(vllm_like(NotifyEngine(), plugin=False)) as d:
        config = nixl_config(tmp_path, d.url, key_file, release=strategy, control_token_file=str(token_file))
        report = check("--config", config)
    assert report.code == code, report.stdout
    line = report.one("control")
    assert line.startswith(f"{status:<4}  control: GET {d.url}/kv_release/v1/health found no route (404")
    assert "deploy/vllm-plugin.Dockerfile" in line
    assert (": auto releases through NIXL;" in line) == (strategy == "auto")


def test_plugin_without_engine_fails_the_control_check(tmp_path: Path) -> None:
    with serve(vllm_like(None)) as d:
        report = check("--decode-url", d.url, "--release", "http", "--control-token", TOKEN)
    assert report.one("control") == (
        f"fail  control: GET {d.url}/kv_release/v1/health answered 503: the plugin has no engine; "
        "read D's log and restart D"
    )


def test_allowlist_entry_that_does_not_resolve_fails(
    sim_d: ServerThread, tmp_path: Path, key_file: str
) -> None:
    allow = ["10.0.0.0/8:5600", "p0.kvr-check.invalid:5600", "*.prefill.invalid"]  # RFC 6761: never resolves
    report = check("--config", nixl_config(tmp_path, sim_d.url, key_file, prefill_allow=allow))
    assert report.code == 1
    parsed, unresolved, wildcard = report.find("allowlist")
    assert parsed == "ok    allowlist: 1 address entry parses: 10.0.0.0/8:5600"
    # The resolver's words between the parentheses differ between C libraries.
    assert unresolved.startswith(
        "fail  allowlist: p0.kvr-check.invalid:5600: p0.kvr-check.invalid does not resolve ("
    )
    assert unresolved.endswith("); correct the name, or list your P pods' network instead (a CIDR)")
    assert "Errno" not in unresolved
    assert wildcard == (
        "ok    allowlist: *.prefill.invalid: a wildcard matches P's host names as releases name them; "
        "not resolved"
    )


def test_empty_allowlist_fails_for_nixl(sim_d: ServerThread, tmp_path: Path, key_file: str) -> None:
    report = check("--config", nixl_config(tmp_path, sim_d.url, key_file, prefill_allow=[]))
    assert report.code == 1
    assert report.one("allowlist").startswith(
        "fail  allowlist: prefill_allow is empty: nothing will be released (nixl may contact no P); "
        "set prefill_allow to your P pods' side channels"
    )


def test_missing_key_file_for_hmac_fails_naming_the_file(sim_d: ServerThread, tmp_path: Path) -> None:
    missing = str(tmp_path / "trust" / "key")
    report = check("--config", nixl_config(tmp_path, sim_d.url, missing))
    assert report.code == 1  # a failed check, where serve would exit 2 before listening
    line = report.one("trust")
    assert line.startswith(
        f"fail  trust: hmac: invalid trust_key_file ({tmp_path}/sidecar.toml, key trust_key_file) = "
        f"'{missing}': cannot read: No such file or directory; mount the HMAC key shared with the router"
    )
    assert "kv-release-sidecar-trust" in line


def test_json_is_one_document_matching_the_lines(tmp_path: Path, key_file: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    config = nixl_config(tmp_path, url, key_file, prefill_allow=["p0.kvr-check.invalid"], trust="any")
    text, machine = check("--config", config), check("--config", config, "--json")
    assert (text.code, machine.code) == (1, 1)
    findings = json.loads(machine.stdout)
    assert all(set(f) == {"name", "status", "detail", "fix"} for f in findings)
    rebuilt = [
        f"{f['status']:<4}  {f['name']}: {f['detail']}" + (f"; {f['fix']}" if f["fix"] else "")
        for f in findings
    ]
    assert rebuilt == text.lines
    assert {f["name"] for f in findings if f["status"] == "fail"} == {"decode", "version", "allowlist"}


# --- what check never does, and a configuration serve refuses ---------------------------------------


def test_check_never_contacts_p(sim_d: ServerThread, tmp_path: Path, key_file: str) -> None:
    with socket.socket() as side_channel:  # P's side channel, inside the allowlist
        side_channel.bind(("127.0.0.1", 0))
        side_channel.listen()
        side_channel.setblocking(False)
        port = side_channel.getsockname()[1]
        report = check(
            "--config", nixl_config(tmp_path, sim_d.url, key_file, prefill_allow=[f"127.0.0.1:{port}"])
        )
        assert report.code == 0, report.stdout
        with pytest.raises(BlockingIOError):
            side_channel.accept()  # nobody connected


def test_bad_config_exits_2_with_the_line_serve_prints(tmp_path: Path) -> None:
    config = toml(tmp_path / "bad.toml", decode_url="http://127.0.0.1:8200", relase="nixl")
    report = check("--config", config)
    serve_done = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--config", config],
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (report.code, serve_done.returncode) == (2, 2)
    assert report.stdout == "" and report.stderr == serve_done.stderr
    assert report.stderr == f"kv-release-sidecar: {config}: unknown key 'relase' (did you mean 'release'?)\n"


BLOCK_NIXL = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("nixl", "nixl_cu12", "zmq"):
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, Block())
from sidecar.cli import main
code = main(sys.argv[1:])
assert not [m for m in sys.modules if m.split(".")[0] in ("nixl", "nixl_cu12", "zmq")]
sys.exit(code)
"""


def test_core_install_without_nixl(sim_d: ServerThread) -> None:
    def run(*argv: str) -> Report:
        done = subprocess.run(
            [sys.executable, "-c", BLOCK_NIXL, "check", "--decode-url", sim_d.url, *argv],
            env=CLEAN_ENV,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert "Traceback" not in done.stderr, done.stderr
        return Report(done)

    nixl = run("--release", "nixl", "--prefill-allow", "127.0.0.1")
    dry_run = run("--release", "dry-run")
    assert nixl.code == 1
    assert nixl.one("release") == (
        "fail  release: nixl: the sidecar frees P's blocks itself, as a NIXL peer of P, but the nixl "
        'extra is not installed (no module nixl_cu12); install it without torch as "Install" in '
        "README.md shows, or use --release http or dry-run"
    )
    assert nixl.one("version").startswith("ok    version: vLLM 0.34.0")  # the wire tables need no NIXL
    assert dry_run.code == 0
    assert dry_run.one("release").startswith("ok    release: dry-run: records and logs every rejection")


@pytest.mark.parametrize(
    ("config", "status", "says"),
    [
        (DecodeSimConfig(), "ok", "shows a NIXL KV connector"),
        (DecodeSimConfig(kv_connector=False), "warn", "shows no NIXL KV connector"),
        (DecodeSimConfig(log_stats=False), "warn", "cannot tell"),
    ],
)
def test_the_kv_connector_is_read_from_ds_metrics(
    config: DecodeSimConfig, status: str, says: str, tmp_path: Path, key_file: str
) -> None:
    with serve(create_decode_app(config)) as d:
        report = check("--config", nixl_config(tmp_path, d.url, key_file))
    line = report.one("kv-connector")
    assert line.startswith(status) and says in line, line
    assert report.code == 0  # a warning, not a failure: releases still work, D's own fix does not


def test_llm_d_s_own_args_are_checked_and_the_open_default_is_named(sim_d: ServerThread) -> None:
    """``check`` with the guides' args: no allowlist is a warning that recommends SSRF protection."""
    port = urlsplit(sim_d.url).port
    args = ("--port=8000", "--kv-connector=nixlv2", "--zap-log-level=1", "--secure-proxy=false")
    report = check(*args, f"--model-server-port={port}", env={"KVR_VLLM_VERSION": "0.33.0"})
    line = report.one("allowlist")
    assert line.startswith("warn  allowlist: no allowlist:") and "--enable-ssrf-protection" in line
    assert "loopback" in line and "metadata" in line
