"""Without the llm-d extra, each path that needs one of its parts stops at start: exit 2, one line.

The parts: pyyaml for llm-d's ``--configuration``/``--configuration-file``,
lightkube for the InferencePool watch, cryptography for a self-signed serving
certificate. Each is blocked in turn (``sys.modules[name] = None``: found by
nothing, importable by nothing) and the command run as the installed CLI runs
it, in process. A path that does not need a part starts without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trustme

from sidecar import cli
from sidecar.config import Config
from sidecar.extras import MissingExtra
from sidecar.server.serve import preflight

# Where a start that went further would listen: nothing here may bind a fixed port.
PORTS = {"KVR_HOST": "127.0.0.1", "KVR_ADMIN_HOST": "127.0.0.1", "KVR_ADMIN_PORT": "0"}
HINT = 'which is not installed (no module {module}): pip install "<checkout>[llm-d]"'


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVR_") or n == "INFERENCE_POOL"]:
        monkeypatch.delenv(name)
    for name, value in PORTS.items():
        monkeypatch.setenv(name, value)


def block(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize(
    ("argv", "module", "what"),
    [
        (
            ["pd-sidecar", "--port=0", "--secure-serving=false", "--configuration={port: 0}"],
            "yaml",
            "--configuration (llm-d's YAML configuration)",
        ),
        (
            ["serve", "--port=0", "--secure-proxy=false", "--configuration-file=sidecar.yaml"],
            "yaml",
            "--configuration-file (llm-d's YAML configuration)",
        ),
        (
            [
                "pd-sidecar",
                "--port=0",
                "--secure-serving=false",
                "--enable-ssrf-protection",
                "--inference-pool=p",
            ],
            "lightkube",
            "the InferencePool watch (inference_pool default/p)",
        ),
        (
            ["pd-sidecar", "--port=0"],  # llm-d's default: TLS on, no --cert-path
            "cryptography",
            "a self-signed serving certificate (TLS without a certificate directory)",
        ),
        (
            ["serve", "--port", "0", "--tls"],
            "cryptography",
            "a self-signed serving certificate (TLS without a certificate directory)",
        ),
    ],
)
def test_each_part_of_the_extra_is_named_in_one_line_at_start(
    argv: list[str],
    module: str,
    what: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sidecar.yaml").write_text("port: 0\n")
    block(monkeypatch, module)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err == f"kv-release-sidecar: {what} needs the llm-d extra, {HINT.format(module=module)}\n"


def test_a_certificate_directory_needs_no_part_of_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cert = trustme.CA().issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    for module in ("yaml", "lightkube", "cryptography"):
        block(monkeypatch, module)
    served = preflight(Config(tls=True, tls_cert_dir=str(tmp_path)))
    assert served.proxy is not None and served.proxy.cert_dir == str(tmp_path) and served.admin is None
    with pytest.raises(MissingExtra, match="no module cryptography"):
        preflight(Config(tls=True))  # the same without the directory: a self-signed certificate
