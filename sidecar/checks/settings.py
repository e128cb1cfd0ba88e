"""The checks that read the config itself, the files it names and DNS; none contacts D or P.

``release``: what the strategy does, and for ``nixl`` and ``auto`` whether
NIXL is importable (``sidecar.extras``, without importing it). ``allowlist``:
every ``prefill_allow`` entry parses and each host name resolves (the
sidecar's own resolver); an empty one with ``nixl`` or ``auto`` releases
nothing. ``retries``: which rejections are left to a gateway's or mesh's retry on
another decode pod, and what to configure there. ``trust``: the key or token
file readable (``sidecar.proxy.trust`` reads it as ``serve`` does), and what the mode
lets through. ``environment``:
``KVR_*`` variables that are no setting (a misspelt one is silently unused).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re

from sidecar import extras, retries
from sidecar.checks import CHECK_TIMEOUT, Context, Finding, fail, ok, warn
from sidecar.config import ConfigError, unknown_env
from sidecar.config.args import NIXL_STRATEGIES
from sidecar.network.allowlist import parse_entry
from sidecar.network.resolver import ResolveFailed, Resolver, Unresolvable
from sidecar.proxy.trust import Trust
from sidecar.tls.trust import trust_store

WHAT = {
    "off": "off: nothing is released; the sidecar forwards every request and counts the decisions",
    "dry-run": "dry-run: records and logs every rejection with no checks and sends nothing; to see what "
    "a live strategy would do, set release to nixl, http or auto with dry_run = true",
    "http": "http: D's plugin releases through D's own NIXL connector; the sidecar needs no NIXL",
    "nixl": "nixl: the sidecar frees P's blocks itself, as a NIXL peer of P",
    "auto": "auto: D's control endpoint while D serves it, NIXL otherwise",
}
ALLOW_EXAMPLE = "e.g. 10.244.0.0/16:5600-5663"


async def check_release(ctx: Context) -> list[Finding]:
    """What the strategy does; NIXL importable for ``nixl`` and ``auto``."""
    what = WHAT[ctx.strategy]
    if ctx.config.dry_run:
        what += " (dry run: each release is decided and checked as live, and none is sent)"
    if ctx.strategy not in NIXL_STRATEGIES:
        return [ok("release", what)]
    module = extras.missing_module("nixl")
    if module is None:
        return [ok("release", f"{what}; NIXL is importable")]
    detail = f"{what}, but the nixl extra is not installed (no module {module})"
    return [fail("release", detail, extras.hint("nixl") + ", or use --release http or dry-run")]


async def check_retries(ctx: Context) -> list[Finding]:
    """What a gateway or mesh retrying answers on another decode pod means for releases."""
    config = ctx.config
    if config.release in ("off", "dry-run") or config.prefill:
        return []  # nothing is freed, or router mode: a retry runs a fresh prefill
    injected = config.inject_statuses if config.inject_rate or config.inject_header else ()
    source = ctx.sources.get("retried_statuses", "the default")
    what, fix = retries.advice(retries.parse(config.retried_statuses), injected, source)
    if config.retried_statuses == (retries.NONE,):
        return [warn("retries", what, fix)]
    return [Finding("retries", "ok", what, fix)]


# --- the allowlist -------------------------------------------------------------------------------


async def check_allowlist(ctx: Context) -> list[Finding]:
    """Every entry parses, each host name resolves; empty with nixl or auto releases nothing."""
    entries = ctx.config.prefill_allow
    if ctx.config.inference_pool:
        shown = f"InferencePool {ctx.config.inference_pool}"
        detail = f"the pods of {shown} (watched), and prefill_allow's {len(entries)} entries"
        return [ok("allowlist", detail)]
    if not entries and ctx.config.prefill_allow_default == "routable":
        return [warn("allowlist", OPEN_DETAIL, OPEN_FIX)]
    if not entries:
        if ctx.strategy in NIXL_STRATEGIES:
            detail = f"prefill_allow is empty: nothing will be released ({ctx.strategy} may contact no P)"
            return [
                fail("allowlist", detail, f"set prefill_allow to your P pods' side channels, {ALLOW_EXAMPLE}")
            ]
        return [ok("allowlist", f"prefill_allow is empty; {ctx.strategy} never contacts P's side channel")]
    findings: list[Finding] = []
    networks: list[str] = []
    resolver = Resolver()
    for text in entries:
        try:
            entry = parse_entry(text)
        except ValueError as exc:
            findings.append(fail("allowlist", f"{text!r} does not parse: {exc}", _ENTRY_FORM))
            continue
        if entry.name is None:
            networks.append(text)
            if _loopback(text):
                findings.append(warn("allowlist", f"{text} admits loopback addresses", LOOPBACK_FIX))
        else:
            findings.append(await _resolves(resolver, text, entry.name, entry.ports[0] or 1))
    if networks:
        parsed = "1 address entry parses" if len(networks) == 1 else f"{len(networks)} address entries parse"
        findings.insert(0, ok("allowlist", f"{parsed}: {', '.join(networks)}"))
    return findings


OPEN_DETAIL = (
    "no allowlist: x-prefiller-host-port and releases may reach any address a P can have (all but "
    "loopback, link-local, cloud metadata, unspecified, multicast), as llm-d's sidecar does "
    "without SSRF protection"
)
OPEN_FIX = (
    "run with --enable-ssrf-protection and --inference-pool (or INFERENCE_POOL) to admit only the pool's "
    "pods (RBAC: deploy/llm-d/ssrf-protection/), or set prefill_allow to P's pod network"
)
_ENTRY_FORM = "write a CIDR, an IP or a host name, each with an optional :port or :lo-hi"
LOOPBACK_FIX = (
    "keep it only where P runs on this machine (a local trial); in a cluster list P's pod network: "
    "a P that left VLLM_NIXL_SIDE_CHANNEL_HOST unset announces localhost, and the sidecar would "
    "contact its own pod"
)


def _loopback(text: str) -> bool:
    """Whether an address entry (an IP or a CIDR, with or without a port) admits a loopback address."""
    address = text.rsplit(":", 1)[0] if text.count(":") == 1 or text.startswith("[") else text
    try:
        network = ipaddress.ip_network(address.strip("[]"), strict=False)
    except ValueError:
        return False
    loopback = ipaddress.ip_network("127.0.0.0/8" if network.version == 4 else "::1/128")
    return network.overlaps(loopback)


async def _resolves(resolver: Resolver, text: str, name: str, port: int) -> Finding:
    if name.startswith("*."):
        return ok(
            "allowlist", f"{text}: a wildcard matches P's host names as releases name them; not resolved"
        )
    shown = name if text.lower().rstrip(".") == name else f"{text}: {name}"
    try:
        addresses = await asyncio.wait_for(resolver.resolve(name, port), CHECK_TIMEOUT)
    except Unresolvable as exc:
        fix = "correct the name, or list your P pods' network instead (a CIDR)"
        return fail("allowlist", f"{shown} does not resolve ({_cause(exc)})", fix)
    except (ResolveFailed, TimeoutError) as exc:
        detail = f"{shown} could not be resolved now ({_cause(exc) or 'no answer'})"
        return warn(
            "allowlist", detail, "check the pod's DNS: the sidecar resolves P's names when it releases"
        )
    return ok("allowlist", f"{shown} resolves to {', '.join(addresses)}")


def _cause(exc: Exception) -> str:
    """The resolver's own words: ``Name or service not known``, without ``[Errno -2]``."""
    return re.sub(r"^\[Errno -?\d+\] ", "", str(exc).rpartition(": ")[2])


# --- trust ---------------------------------------------------------------------------------------

SECRET_FIX = {
    "hmac": "mount the HMAC key shared with the router at trust_key_file (in the manifests: the Secret "
    "kv-release-sidecar-trust, key key), or choose the trust mode for the hop in front (docs/security.md)",
    "token": "mount the router token at trust_token_file (in the manifests: the Secret "
    "kv-release-sidecar-trust, key token), or choose the trust mode for the hop in front (docs/security.md)",
    "other": "remove the setting that names the file (this trust mode does not use it), or mount the file",
}
OWN_SECRET = {"hmac": "trust_key", "token": "trust_token"}
UNSIGNED_FRONTS = "llm-d's routing sidecar or vLLM's P/D proxy"


async def check_trust(ctx: Context) -> list[Finding]:
    """The secret files readable (as ``serve`` reads them), and what the mode lets through."""
    config = ctx.config
    try:
        Trust(config)
    except ConfigError as exc:
        named = exc.at(ctx.sources.get(exc.field, exc.source))
        own = exc.field.startswith(OWN_SECRET.get(config.trust, "-"))
        return [fail("trust", f"{config.trust}: {named}", SECRET_FIX[config.trust if own else "other"])]
    if config.release == "off":
        return [ok("trust", f"{config.trust}: releases are off, so no request triggers one")]
    if config.prefill:
        detail = (
            f"{config.trust}: router mode runs every prefill leg itself and drops clients' kv_transfer_params"
        )
        return [ok("trust", detail)]
    if not config.release_client_params:
        detail = (
            f"{config.trust}: clients' own kv_transfer_params are forwarded and never released "
            "(release_client_params off); only the router's own prefill legs release"
        )
        return [ok("trust", detail)]
    if config.trust == "any":
        return [warn("trust", _ANY.format(port=config.port), _ANY_FIX.format(port=config.port))]
    secret = _secret_source(ctx, "trust_key" if config.trust == "hmac" else "trust_token")
    if config.trust == "token":
        detail = f"token: read from {secret}; only requests carrying it in x-kvr-router-token are released"
        return [ok("trust", detail)]
    return [
        ok("trust", f"hmac: key read from {secret}; only parameters signed by the router hop are released"),
        warn(
            "trust-front",
            f"hmac releases nothing behind a hop that does not sign, such as {UNSIGNED_FRONTS} "
            '(each request counts kvr_ineligible_total{reason="untrusted"})',
            "keep hmac only behind this project's router; behind another hop use any (that hop alone "
            "reaching the port) or token (deploy/README.md, the trust table)",
        ),
    ]


_ANY = "any: anyone who can reach port {port} can trigger a release with another tenant's kv_transfer_params"
_ANY_FIX = (
    "let only the hop in front reach port {port} (host 127.0.0.1 in its pod, or a NetworkPolicy), "
    "or use hmac behind this project's router, token behind a gateway (docs/security.md)"
)


def _secret_source(ctx: Context, name: str) -> str:
    path = getattr(ctx.config, name + "_file")
    if path:  # the file wins over the value, as sidecar.proxy.trust reads them
        return f"{path} ({ctx.source(name + '_file')})"
    return f"{name} ({ctx.source(name)})"


async def check_outbound_trust(ctx: Context) -> list[Finding]:
    """What outbound TLS could not trust, one warning each (as ``serve`` logs them); nothing when
    every file and folder named was read."""
    fix = "name a regular file of PEM certificates, or a folder of them, or unset it (docs/security.md)"
    return [warn("tls-trust", problem, fix) for problem in trust_store(ctx.config).problems]


async def check_environment(ctx: Context) -> list[Finding]:
    """``KVR_*`` variables that are no setting: a warning each (serve logs the same)."""
    fix = "rename it to the setting meant, or remove it"
    return [warn("environment", text, fix) for text in unknown_env(os.environ)]
