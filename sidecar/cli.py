"""Command line: ``kv-release-sidecar <command>`` (also ``python -m sidecar``).

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this module only dispatches, so importing the CLI pulls
in nothing heavy. Exit codes: 0 ok, 2 bad configuration or usage, 1 failure.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("sidecar.serve", "run the sidecar in front of a vLLM decode server"),
    "sim-decode": ("sidecar.sim.decode", "run the fake vLLM decode server"),
    "sim-prefill": ("sidecar.sim.prefill", "run the fake vLLM prefill server (NIXL)"),
    "demo": ("sidecar.sim.demo", "run the embedded demo and print what is released"),
    "loadtest": ("sidecar.loadtest.command", "open-loop P->D load with a release verdict"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser; only the ``selected`` command's module is imported for its flags."""
    parser = argparse.ArgumentParser(prog="kv-release-sidecar", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module)
        if name == selected:
            importlib.import_module(module).add_arguments(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(selected).parse_args(argv)
    module = importlib.import_module(args._module)
    code: int = module.run(args)
    return code


def entrypoint() -> None:
    sys.exit(main())
