"""The sidecar's one frozen config, and how it is loaded."""

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
