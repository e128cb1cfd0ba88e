"""The settings of ``serve`` and ``check`` from one command line: flags, ``KVR_*`` variables, the TOML file.

Both commands take exactly the same settings, so both add them with
``add_arguments`` and read them with ``load``: the file named by ``--config``
(or ``KVR_CONFIG``) is read here, then ``sidecar.config`` merges flags >
environment > file > defaults. Nothing here opens a socket.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Mapping

from sidecar import config as config_mod

#: The strategies that run a NIXL agent (auto falls back to it whenever D is unreachable).
NIXL_STRATEGIES = ("nixl", "auto")
# Namespace entries that are not settings: the file itself and the chosen command.
_NOT_SETTINGS = ("config", "command")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and one flag per setting (``kv-release-sidecar serve --help`` lists them)."""
    parser.usage = "%(prog)s [--config FILE] [options]"  # the full list is below, one line each
    config_mod.build_parser(parser)


def load(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    ignore: Collection[str] = (),
) -> tuple[config_mod.Config, dict[str, str]]:
    """The config, and where each value that is not a default came from; raises ``ConfigError``.

    ``ignore``: the command's own flags (``check --json``), which are not settings.
    """
    environ = os.environ if environ is None else environ
    text = None
    path = args.config or environ.get("KVR_CONFIG")
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            source = "--config" if args.config else "KVR_CONFIG"
            raise config_mod.FileError(path, f"cannot read ({source}): {exc.strerror}") from exc
    skipped = (*_NOT_SETTINGS, *ignore)
    fields = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skipped}
    return config_mod.load_with_sources(fields, environ, text, path or "")
