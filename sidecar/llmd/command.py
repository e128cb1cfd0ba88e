"""``kv-release-sidecar pd-sidecar``: llm-d's routing sidecar's command line, served by ``serve``.

The image's ``serve`` entry point also lands here when its arguments are
llm-d's (``recognises``), so swapping the image in an llm-d decode pod is
enough. Sources, highest first: llm-d's flags, its ``--configuration`` YAML,
the variables llm-d reads (``INFERENCE_POOL``, ``ENABLE_PREFILLER_SAMPLING``,
``POD_IP``), then this project's ``KVR_*`` variables and ``--config`` TOML file (for
settings llm-d has no flag for), then llm-d's defaults (``PD_DEFAULTS``):
router mode on llm-d's header, NIXL releases, TLS with a self-signed
certificate, llm-d's answers. One ``Config`` underneath, as for ``serve``.
"""

from __future__ import annotations

import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sidecar import config as config_mod
from sidecar import extras
from sidecar.config import ConfigError, did_you_mean
from sidecar.llmd.flags import MAPPING, MORIIO_PREFIX, as_list, refuse, settings

# llm-d's defaults as settings; KVR_* variables and the TOML file may change them.
PD_DEFAULTS: dict[str, Any] = {
    "decode_url": "http://localhost:8200",
    "tls": True,
    "release": "nixl",
    "answers": "llm-d",
    "prefill_policy": "first",
    "pool_size": 1024,
}
YAML_KEYS = (
    frozenset(MAPPING)
    - {"configuration", "configuration-file"}
    - {k for k in MAPPING if k.startswith("zap-")}
)
# Flags serve does not have: their presence marks an llm-d command line.
LLMD_ONLY = frozenset(MAPPING) - {"port", "tracing"}
USAGE = "usage: kv-release-sidecar pd-sidecar [llm-d routing-sidecar flags] [--config FILE] (docs/llm-d.md)"


def recognises(argv: Sequence[str]) -> bool:
    """``argv`` (after ``serve``) names a flag only llm-d's sidecar has."""
    names = {a.lstrip("-").partition("=")[0] for a in argv if a.startswith("-")}
    return bool(names & LLMD_ONLY) or any(n.startswith(MORIIO_PREFIX) for n in names)


def parse(argv: Sequence[str]) -> tuple[dict[str, Any], str | None]:
    """llm-d's flags as given (name -> raw value, lists joined), and ``--config``'s file if any."""
    given: dict[str, Any] = {}
    toml: str | None = None
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].lstrip("-").partition("=")
        if not argv[i].startswith("-") or not name:
            raise ConfigError("argument", argv[i], "llm-d's sidecar takes flags only")
        kind = MAPPING[name][0] if name in MAPPING else "str"
        if name.startswith(MORIIO_PREFIX):
            raise refuse(name, value, "MoRI-IO (WRITE mode, Wide-EP) is not supported by this sidecar")
        if name not in MAPPING and name != "config":
            raise refuse(name, argv[i], "unknown flag" + did_you_mean(name, sorted(MAPPING)))
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


def load(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[config_mod.Config, dict[str, str]]:
    """The one ``Config`` of an llm-d command line (see the module docstring); raises ``ConfigError``."""
    given, toml_path = parse(argv)
    values = settings(with_yaml(given), environ)
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
        for name, (_, effect) in MAPPING.items():
            print(f"  --{name}: {effect}")
        return 0
    from sidecar.server import serve

    try:
        config, sources = load(argv, os.environ)
    except (ConfigError, extras.MissingExtra) as exc:
        print(f"kv-release-sidecar: {exc}", file=sys.stderr)
        return 2
    return serve.start(config, sources)


def add_arguments(parser: object) -> None:
    """Listed by ``kv-release-sidecar --help``; the flags are read by ``main`` (pflag's forms)."""


def run(args: object) -> int:  # pragma: no cover - sidecar.cli calls main() for this command
    return main(sys.argv[2:])
