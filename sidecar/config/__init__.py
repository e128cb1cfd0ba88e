"""The sidecar's one frozen config and how it is loaded: the struct, its loader and its errors
(``settings``), the checks of each value (``rules``), the ``--help`` lines (``help``) and the
command-line arguments shared by ``serve`` and ``check`` (``args``)."""

from __future__ import annotations

from sidecar.config.help import HELP
from sidecar.config.settings import (
    FIELDS,
    INSPECTED_ROUTES,
    MIN_HEADER_BYTES,
    Config,
    ConfigError,
    FileError,
    KvConnectorSetting,
    ReleaseStrategy,
    build_parser,
    did_you_mean,
    dump,
    env_names,
    help_line,
    load,
    load_with_sources,
    unknown_env,
)

__all__ = [
    "FIELDS",
    "HELP",
    "INSPECTED_ROUTES",
    "MIN_HEADER_BYTES",
    "Config",
    "ConfigError",
    "FileError",
    "KvConnectorSetting",
    "ReleaseStrategy",
    "build_parser",
    "did_you_mean",
    "dump",
    "env_names",
    "help_line",
    "load",
    "load_with_sources",
    "unknown_env",
]
