"""Command line: ``kv-release-sidecar <command>`` (also ``python -m sidecar``).

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this module only dispatches, so importing the CLI pulls
in nothing heavy. Exit codes: 0 ok, 2 bad configuration or usage (one line on
stderr, no traceback), 1 failure. A command whose optional extra is not
installed exits 2 naming the extra (``sidecar.extras``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

from sidecar.extras import MissingExtra, extra_of, require

PROG = "kv-release-sidecar"


class Command(NamedTuple):
    module: str
    help: str
    extras: tuple[str, ...] = ()  # checked before the module is imported


COMMANDS: dict[str, Command] = {
    "serve": Command("sidecar.server.serve", "run the sidecar in front of a vLLM decode server"),
    "check": Command(
        "sidecar.checks.command",
        "check serve's configuration against D, DNS and the files it names; sends nothing to P",
    ),
    "pd-sidecar": Command(
        "sidecar.llmd.command", "serve with llm-d's routing-sidecar flags, a drop-in for it (docs/llm-d.md)"
    ),
    "sim-decode": Command("sidecar.sim.decode.command", "run the fake vLLM decode server"),
    "sim-prefill": Command("sidecar.sim.prefill.app", "run the fake vLLM prefill server (NIXL)", ("nixl",)),
    "demo": Command(
        "sidecar.sim.demo.command", "run the embedded demo and print what is released", ("loadtest", "nixl")
    ),
    "loadtest": Command(
        "sidecar.loadtest.command", "open-loop P->D load with a release verdict", ("loadtest",)
    ),
}


class Parser(argparse.ArgumentParser):
    """Usage errors in one line (the full usage of ``serve`` is 60 lines): message and a pointer to --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser; only the ``selected`` command's module is imported for its flags."""
    parser = Parser(
        prog=PROG,
        description="Releases a vLLM prefill node's pinned KV blocks when the decode node rejects "
        "a P/D request before admission.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.help)
        child.set_defaults(_module=command.module)
        if name == selected:
            require(f"{PROG} {name}", command.extras)
            importlib.import_module(command.module).add_arguments(child)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    try:
        llmd = _llm_d_argv(argv)
        if llmd is not None:  # llm-d's flags are pflag's, parsed by the command itself
            from sidecar.llmd import command as pd_sidecar

            return pd_sidecar.check(llmd) if argv[0] == "check" else pd_sidecar.main(llmd)
        args = build_parser(selected).parse_args(argv)
        module = importlib.import_module(args._module)
        code: int = module.run(args)
    except MissingExtra as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # an optional module imported on the way (e.g. sim-decode --vllm-d)
        extra = extra_of(exc.name)
        if extra is None:
            raise
        print(f"{PROG}: {MissingExtra(f'{PROG} {selected}', extra, exc.name or extra)}", file=sys.stderr)
        return 2
    return code


def _llm_d_argv(argv: list[str]) -> list[str] | None:
    """The flags of ``pd-sidecar``, or of ``serve`` or ``check`` given llm-d's flags (the image's
    entry point is ``serve``: an llm-d decode pod's args then run ``pd-sidecar``); None otherwise."""
    if argv and argv[0] == "pd-sidecar":
        return argv[1:]
    if argv and argv[0] in ("serve", "check"):
        from sidecar.llmd.command import recognises

        return argv[1:] if recognises(argv[1:]) else None
    return None


def entrypoint() -> None:
    sys.exit(main())


def pd_sidecar_entrypoint() -> None:
    """``pd-sidecar FLAGS``: llm-d's binary name (KServe runs ``/app/pd-sidecar`` as the command)."""
    sys.exit(main(["pd-sidecar", *sys.argv[1:]]))
