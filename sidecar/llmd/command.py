"""``kv-release-sidecar pd-sidecar``: llm-d's routing sidecar's command line, served by ``serve``.

The image's ``serve`` entry point also lands here when its arguments are
llm-d's (``recognises``), so swapping the image in an llm-d decode pod is
enough. Sources, highest first: llm-d's flags, its ``--configuration`` YAML,
the variables llm-d reads (``INFERENCE_POOL``, ``ENABLE_PREFILLER_SAMPLING``,
``POD_IP``), then this project's ``KVR_*`` variables and ``--config`` TOML file (for
settings llm-d has no flag for), then llm-d's defaults (``PD_DEFAULTS``):
router mode on llm-d's header (any P address but loopback, link-local,
metadata, unspecified and multicast without an allowlist), NIXL releases, TLS
with a self-signed certificate, llm-d's answers and inbound limits (idle
keep-alive 300 s, headers 30 s, header blocks up to 1 MiB as Go's server).
One ``Config`` underneath, as for ``serve``.
"""

from __future__ import annotations

import logging
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sidecar import config as config_mod
from sidecar import extras
from sidecar.config import ConfigError, did_you_mean
from sidecar.llmd.flags import as_list, refuse, settings
from sidecar.llmd.table import FLAGS, MAPPING, MORIIO_PREFIX, NEWEST_TAG

log = logging.getLogger("sidecar.llmd")

# llm-d's defaults as settings; KVR_* variables and the TOML file may change them.
PD_DEFAULTS: dict[str, Any] = {
    "decode_url": "http://localhost:8200",
    "tls": True,
    "release": "nixl",
    "answers": "llm-d",
    "prefill_policy": "first",
    "pool_size": 1024,
    # llm-d connects to any P without --enable-ssrf-protection; this admits any address a P can have.
    "prefill_allow_default": "routable",
    # As llm-d: a client's own kv_transfer_params go to D and are never released, allowlist or not.
    "release_client_params": False,
    # llm-d's inbound server (pkg/sidecar/proxy/proxy_helpers.go): IdleTimeout 300 s, ReadHeaderTimeout 30 s.
    "timeout_keep_alive": 300.0,
    "client_header_timeout": 30.0,
    # Go's net/http server default (DefaultMaxHeaderBytes, 1 MiB), which llm-d's sidecar keeps.
    "max_header_bytes": 1024 * 1024,
}
_NOT_YAML = ("configuration", "configuration-file", "kubeconfig")
YAML_KEYS = frozenset(k for k in FLAGS if k not in _NOT_YAML and not k.startswith(("zap-", MORIIO_PREFIX)))
# Flags serve does not have (serve's are its settings' names): their presence marks an llm-d
# command line. serve's own --data-parallel-size or --pool-group keep serve's meaning.
LLMD_ONLY = frozenset(FLAGS) - {"tracing"} - {name.replace("_", "-") for name in config_mod.FIELDS}
USAGE = "usage: kv-release-sidecar pd-sidecar [llm-d routing-sidecar flags] [--config FILE] (docs/llm-d.md)"


def recognises(argv: Sequence[str]) -> bool:
    """``argv`` (after ``serve``) names a flag only llm-d's sidecar has."""
    names = {a.lstrip("-").partition("=")[0] for a in argv if a.startswith("-")}
    return bool(names & LLMD_ONLY) or any(n.startswith(MORIIO_PREFIX) for n in names)


def parse(argv: Sequence[str]) -> tuple[dict[str, Any], str | None]:
    """llm-d's flags as given (name -> raw value, lists joined), and ``--config``'s file if any.

    Arguments that are not flags are ignored, as pflag leaves them to a program that reads none
    (an empty one is what a manifest's template renders for a flag it leaves out)."""
    given: dict[str, Any] = {}
    toml: str | None = None
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].lstrip("-").partition("=")
        if not argv[i].startswith("-") or argv[i] == "-":
            i += 1
            continue
        if not name:
            raise ConfigError("argument", argv[i], "not a flag")
        kind = FLAGS[name].kind if name in FLAGS else "str"
        if name not in FLAGS and name != "config":
            raise refuse(name, argv[i], unknown_flag(name))
        if not eq and kind != "bool":
            if i + 1 >= len(argv):
                raise refuse(name, "", "needs a value")
            i, value = i + 1, argv[i + 1]
        if name == "config":
            toml = value
        elif kind == "list":
            given[name] = [*given.get(name, []), *as_list(value)]
        else:
            given[name] = value if eq or kind != "bool" else "true"
        i += 1
    return given, toml


def unknown_flag(name: str) -> str:
    """Why ``--name`` stops the start: no llm-d tag up to the newest known has it (a newer one may)."""
    return (
        f"unknown flag{did_you_mean(name, sorted(FLAGS))}: not a flag of llm-d's pd-sidecar up to "
        f"{NEWEST_TAG}, the newest release this sidecar knows; a newer release's flag needs a newer "
        "kv-release-sidecar (docs/llm-d.md lists the flags)"
    )


def with_yaml(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` over the settings of ``--configuration`` or ``--configuration-file`` (strict YAML)."""
    inline, path = given.pop("configuration", ""), given.pop("configuration-file", "")
    if inline and path:
        raise refuse(
            "configuration", inline, "--configuration and --configuration-file are mutually exclusive"
        )
    if not inline and not path:
        return given
    flag = "--configuration-file" if path else "--configuration"
    extras.require_module(f"{flag} (llm-d's YAML configuration)", "llm-d", "yaml")
    import yaml  # type: ignore[import-untyped]  # the llm-d extra

    try:
        text = inline or Path(path).read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise refuse("configuration-file" if path else "configuration", path or inline, str(exc)) from exc
    if not isinstance(loaded, dict):
        raise refuse("configuration", loaded, "must be a YAML mapping")
    for key in loaded:
        if key not in YAML_KEYS:
            raise refuse("configuration", key, "unknown key" + did_you_mean(str(key), sorted(YAML_KEYS)))
    return {**{k: v for k, v in loaded.items()}, **given}


def load(
    argv: Sequence[str], environ: Mapping[str, str], notes: list[str] | None = None
) -> tuple[config_mod.Config, dict[str, str]]:
    """The one ``Config`` of an llm-d command line (see the module docstring); raises ``ConfigError``.
    What runs differently from llm-d's sidecar is added to ``notes``."""
    given, toml_path = parse(argv)
    values = settings(with_yaml(given), environ, notes)
    toml_path = toml_path or environ.get("KVR_CONFIG")
    text = None
    if toml_path:
        try:
            with open(toml_path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise config_mod.FileError(toml_path, f"cannot read: {exc.strerror}") from exc
    elsewhere = set(_toml_keys(text)) | {n for n in config_mod.FIELDS if f"KVR_{n.upper()}" in environ}
    defaults = {k: v for k, v in PD_DEFAULTS.items() if k not in elsewhere}
    return config_mod.load_with_sources({**defaults, **values}, environ, text, toml_path or "")


def _toml_keys(text: str | None) -> list[str]:
    try:
        return list(tomllib.loads(text)) if text else []
    except tomllib.TOMLDecodeError:
        return []  # load() names the error


def main(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        for name, flag in MAPPING.items():
            print(f"  --{name} (llm-d {flag.since}): {flag.effect}")
        return 0
    from sidecar.observability import logs
    from sidecar.server import serve

    notes: list[str] = []
    try:
        config, sources = load(argv, os.environ, notes)
    except (ConfigError, extras.MissingExtra) as exc:
        print(f"kv-release-sidecar: {exc}", file=sys.stderr)
        return 2
    logs.setup(config.log_level, config.log_format, config.access_log)
    for note in notes:
        log.warning(note)
    return serve.start(config, sources)


def check(argv: Sequence[str]) -> int:
    """``kv-release-sidecar check`` with llm-d's flags: the checks of ``check`` on their config."""
    import asyncio

    from sidecar.checks.command import run_checks
    from sidecar.observability import logs
    from sidecar.tls.trust import CAFileError

    try:
        config, sources = load(argv, os.environ)
    except (ConfigError, extras.MissingExtra) as exc:
        print(f"kv-release-sidecar: {exc}", file=sys.stderr)
        return 2
    logs.setup("error", config.log_format)
    try:
        findings = asyncio.run(run_checks(config, sources))
    except CAFileError as exc:  # tls_ca_file cannot be used: the drop-in would refuse to start
        error = ConfigError("tls_ca_file", exc.path, exc.why, sources.get("tls_ca_file", ""))
        print(f"kv-release-sidecar: {error}", file=sys.stderr)
        return 2
    print("\n".join(finding.line() for finding in findings))
    return 1 if any(finding.status == "fail" for finding in findings) else 0


def add_arguments(parser: object) -> None:
    """Listed by ``kv-release-sidecar --help``; the flags are read by ``main`` (pflag's forms)."""


def run(args: object) -> int:  # pragma: no cover - sidecar.cli calls main() for this command
    return main(sys.argv[2:])
