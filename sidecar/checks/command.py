"""``kv-release-sidecar check``: will this configuration release, before it is rolled out?

It takes exactly ``serve``'s settings (the same flags, ``KVR_*`` variables and
TOML file, read by ``sidecar.config.args``; a bad value exits 2 with serve's
one line), runs the checks in ``CHECKS`` in order and prints one line each::

    ok    decode: GET http://127.0.0.1:8200/health answered 200
    fail  allowlist: prefill_allow is empty: nothing will be released (...); set prefill_allow to ...

``--json`` prints the same findings as one JSON document instead: a list of
``{"name", "status", "detail", "fix"}``. Exit code 0 when no check fails
(warnings allowed), 1 when one does, 2 for a configuration ``serve`` would
refuse. It never contacts P (no ZMQ, no NIXL agent, nothing sent to a side
channel); of D it asks ``GET /health``, ``GET /version`` and, for ``http`` and
``auto``, the plugin's authenticated ``GET`` health route.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec

from sidecar import checks
from sidecar.checks import Check, Context, Finding
from sidecar.checks.decode import check_control, check_decode, check_kv_connector, check_version
from sidecar.checks.settings import (
    check_allowlist,
    check_environment,
    check_outbound_trust,
    check_release,
    check_retries,
    check_trust,
)
from sidecar.config import Config, ConfigError
from sidecar.config import args as config_args
from sidecar.observability import logs
from sidecar.tls.trust import CAFileError

#: The checks, in the order their lines are printed.
CHECKS: tuple[Check, ...] = (
    check_release,
    check_outbound_trust,
    check_decode,
    check_version,
    check_control,
    check_kv_connector,
    check_allowlist,
    check_retries,
    check_trust,
    check_environment,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_args.add_arguments(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document, a list of {name, status, detail, fix}, instead of lines",
    )


def run(args: argparse.Namespace) -> int:
    try:
        config, sources = config_args.load(args, ignore=("json",))
    except ConfigError as exc:
        print(f"kv-release-sidecar: {exc}", file=sys.stderr)
        return 2
    # The checks report every problem themselves; the strategies' own warnings would repeat them.
    logs.setup("error", config.log_format)
    try:
        findings = asyncio.run(run_checks(config, sources))
    except CAFileError as exc:  # tls_ca_file cannot be used: serve would refuse to start
        error = ConfigError("tls_ca_file", exc.path, exc.why, sources.get("tls_ca_file", ""))
        print(f"kv-release-sidecar: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(msgspec.json.encode(findings).decode())
    else:
        print("\n".join(finding.line() for finding in findings))
    return 1 if any(finding.status == "fail" for finding in findings) else 0


async def run_checks(
    config: Config, sources: dict[str, str] | None = None, selected: tuple[Check, ...] = CHECKS
) -> list[Finding]:
    """Every finding of the ``selected`` checks, in order (one at a time: D is asked little)."""
    async with checks.client(config) as client:
        context = Context(config, sources or {}, client)
        findings: list[Finding] = []
        for check in selected:
            findings += await check(context)
    return findings
