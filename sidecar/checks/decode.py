"""The checks that ask D: is it up, which vLLM release it runs, and its control endpoint.

``decode``: ``GET /health`` (vLLM answers 200, or 503 once its engine died).
``version``: ``vllm_version`` or D's ``GET /version`` through the wire tables
(``sidecar.nixl.versions``), judged by what the strategy does with it: ``nixl``
refuses every release to a release it does not know, ``http`` releases anyway.
``control`` (``http`` and ``auto``): the plugin's authenticated health route,
probed by the ``http`` strategy's own probe with the token it would send.
``kv-connector``: D's ``/metrics`` (``sidecar.decode.probes``), unless
``decode_kv_connector`` says.
"""

from __future__ import annotations

import msgspec

from sidecar.checks import CHECK_TIMEOUT, Context, Finding, fail, ok, warn
from sidecar.config.settings import UnknownVllm
from sidecar.decode.notice import effect as newer_effect
from sidecar.decode.probes import probe_kv_connector
from sidecar.nixl.versions import KNOWN, NEWEST, WireProfile, parse_version
from sidecar.release.http import HttpReleaser, Probe, read_token
from sidecar.tls.client import outbound
from sidecar.upstream import Upstream
from sidecar.vllm_plugin.settings import INSECURE_ENV, TOKEN_ENV, TOKEN_FILE_ENV

START_D = "start D, or set decode_url to D's scheme://host:port"


async def check_decode(ctx: Context) -> list[Finding]:
    """D reachable: ``GET /health`` answers 200."""
    url = ctx.config.decode_url.rstrip("/") + "/health"
    answer = await ctx.ask_decode("/health")
    if isinstance(answer, str):
        return [
            fail("decode", f"D is unreachable: {answer}", _unreachable_fix(ctx.config.decode_url, answer))
        ]
    status = answer[0]
    if status == 200:
        return [ok("decode", f"GET {url} answered 200")]
    if status == 503:
        return [fail("decode", f"GET {url} answered 503: D's engine is dead", "read D's log and restart D")]
    return [fail("decode", f"GET {url} answered {status}, not vLLM's 200 or 503", START_D)]


def _unreachable_fix(url: str, answer: str) -> str:
    """The fix for D unreachable: a scheme that does not match D's is named as such."""
    if url.startswith("https://") and any(word in answer for word in ("SSL", "TLS", "certificate")):
        return (
            "D does not complete a TLS handshake: use http:// in decode_url if D serves plain http, "
            "or trust its certificate (tls_ca_file, ssl_cert_dir or SSL_CERT_DIR, decode_tls_insecure)"
        )
    if url.startswith("http://") and (
        "without sending a response" in answer or "RemoteProtocolError" in answer
    ):
        return "D closed the connection without an answer: if D serves https, use https:// in decode_url"
    return START_D


async def decode_version(ctx: Context) -> tuple[str | None, str]:
    """D's ``GET /version`` (``{"version": ...}``), or None and why it could not be read."""
    answer = await ctx.ask_decode("/version")
    if isinstance(answer, str):
        return None, answer
    status, body = answer
    try:
        version = msgspec.json.decode(body, type=dict[str, object]).get("version") if status == 200 else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        version = None
    if isinstance(version, str) and version:
        return version, ""
    return None, f"GET /version answered {status} without a version"


async def check_version(ctx: Context) -> list[Finding]:
    """D's (and P's) vLLM release known to the wire tables, judged by the strategy."""
    configured = ctx.config.vllm_version
    reported, problem = await decode_version(ctx)
    text = configured or reported
    if not text:
        return [_version_unread(ctx.strategy, problem)]
    origin = f"set by {ctx.source('vllm_version')}" if configured else "from D's GET /version"
    profile = WireProfile.for_version(text)
    findings = [
        _known(ctx, text, origin, profile)
        if profile
        else _unknown(ctx.strategy, text, origin, ctx.config.unknown_vllm)
    ]
    if configured and reported and parse_version(configured) != parse_version(reported):
        findings.append(
            warn(
                "version",
                f"vllm_version is {configured} but D reports {reported}",
                "P and D must run one vLLM release: set vllm_version to it, or leave it empty",
            )
        )
    return findings


def _version_unread(strategy: str, problem: str) -> Finding:
    detail = f"D's vLLM release is unknown ({problem})"
    fix = "start D (its GET /version names P's release too) or set vllm_version"
    if strategy in ("nixl", "auto"):
        return fail("version", detail + ": nixl refuses every release until it is known", fix)
    return warn("version", detail, fix)


def _known(ctx: Context, text: str, origin: str, profile: WireProfile) -> Finding:
    own = (
        "D releases its own handler rejections (0.21.0+)" if profile.engine_fix else "D has no fix of its own"
    )
    detail = f"vLLM {text} ({origin}) is known: {own}"
    if profile.safe_unknown_id or ctx.strategy not in ("nixl", "auto"):
        return ok("version", detail)
    detail += "; a notification for a request P already dropped crashes this release's P engine"
    if ctx.config.allow_unsafe_vllm:
        return warn(
            "version", detail + " (allow_unsafe_vllm is on)", "upgrade P and D to vLLM 0.10.1 or later"
        )
    return fail(
        "version",
        detail + ": nixl refuses every release to it",
        "upgrade P and D to vLLM 0.10.1 or later, or accept the risk with allow_unsafe_vllm",
    )


def _unknown(strategy: str, text: str, origin: str, policy: UnknownVllm = "newest") -> Finding:
    parsed = parse_version(text)
    newest = ".".join(map(str, NEWEST))
    if parsed is not None and parsed.release > NEWEST:
        detail = f"vLLM {text} ({origin}) is newer than the releases this sidecar knows ({KNOWN})"
        fix = "upgrade kv-release-sidecar to a release that knows it"
        if policy == "newest":
            nixl = f"nixl {newer_effect(policy)}"
            effects = {
                "nixl": (warn, nixl),
                "auto": (warn, f"the control path releases as for {newest}; the NIXL fallback: {nixl}"),
                "http": (warn, f"http releases as for {newest}"),
            }
            other = f"nixl would release as for {newest}, http too"
        else:
            fix += ", or set unknown_vllm to newest"
            effects = {
                "nixl": (fail, "nixl refuses every release (unknown_version; unknown_vllm is refuse)"),
                "auto": (
                    warn,
                    f"the control path releases as for {newest}; the NIXL fallback refuses every one",
                ),
                "http": (warn, f"http releases as for {newest}"),
            }
            other = f"nixl would refuse every release, http would release as for {newest}"
    else:
        detail = (
            f"vLLM {text!r} ({origin}) is not a release this sidecar knows ({KNOWN}; "
            "pre-releases only where the wire format did not change)"
        )
        fix = "set vllm_version to the release P and D are built from"
        effects = {
            "nixl": (fail, "nixl refuses every release (unknown_version)"),
            "auto": (fail, "the NIXL fallback refuses every release (unknown_version)"),
            "http": (warn, "http releases without knowing whether D's own fix releases too"),
        }
        other = "nixl would refuse every release"
    make, effect = effects.get(strategy, (warn, other))
    return make("version", f"{detail}: {effect}", fix)


# --- the control endpoint ------------------------------------------------------------------------

PLUGIN_TOKEN = f"the plugin's token ({TOKEN_ENV} or {TOKEN_FILE_ENV} in D's environment)"


async def check_control(ctx: Context) -> list[Finding]:
    """For ``http`` and ``auto``: the plugin's health route answers 200 to the sidecar's token."""
    config = ctx.config
    if config.release not in ("http", "auto"):
        return []
    try:
        token = read_token(config)
    except OSError as exc:
        path, source = config.control_token_file, ctx.source("control_token_file")
        return [
            fail(
                "control",
                f"control_token_file {path} ({source}) cannot be read: {exc.strerror}",
                f"mount {PLUGIN_TOKEN} at {path}",
            )
        ]
    releaser = HttpReleaser(config, _unused_version)
    await releaser.start()
    try:
        result = await releaser.probe()
    finally:
        await releaser.close()
    return [_probe_finding(ctx, result, releaser.health_url, bool(token))]


async def _unused_version() -> str | None:
    return None  # the probe never asks for D's release


def _probe_finding(ctx: Context, result: Probe, url: str, token: bool) -> Finding:
    strategy = ctx.config.release
    set_token = f"set control_token_file (or KVR_CONTROL_TOKEN) to {PLUGIN_TOKEN}"
    if result == "present":
        if token:
            return ok("control", f"GET {url} answered 200 to the token")
        return warn(
            "control", f"GET {url} answered 200 without a token", f"D runs with {INSECURE_ENV}=1: {set_token}"
        )
    if result in ("unauthorized", "forbidden"):
        if result == "forbidden":
            return fail("control", f"GET {url} answered 403: the token is wrong", set_token)
        sent = "the token was refused" if token else "no token was sent"
        return fail("control", f"GET {url} answered 401: {sent}", set_token)
    if result == "absent":
        detail = f"GET {url} found no route (404 or 405): no plugin in D, or a plugin without a token"
        fix = f"run D from deploy/vllm-plugin.Dockerfile with {PLUGIN_TOKEN}, or check control_url"
        if strategy == "auto":
            return warn("control", detail + ": auto releases through NIXL", fix)
        return fail("control", detail, fix + ", or use --release nixl")
    if result == "no_engine":
        return fail(
            "control", f"GET {url} answered 503: the plugin has no engine", "read D's log and restart D"
        )
    if result == "unreachable":
        return fail(
            "control",
            f"cannot connect to {url}",
            "check control_url (default: decode_url + /kv_release/v1/release)",
        )
    return fail("control", f"GET {url} gave no usable answer", "check control_url and D's log")


async def check_kv_connector(ctx: Context) -> list[Finding]:
    """D runs a NIXL KV connector: without one D never reads P's blocks, and its own fix (vLLM
    0.21.0+) releases nothing, so the sidecar must release every rejection itself."""
    setting = ctx.config.decode_kv_connector
    if setting != "auto":
        return [ok("kv-connector", f"decode_kv_connector = {setting} ({ctx.source('decode_kv_connector')})")]
    upstream = Upstream(
        ctx.config.decode_url,
        connect_timeout=CHECK_TIMEOUT,
        pool_timeout=CHECK_TIMEOUT,
        header_timeout=CHECK_TIMEOUT,
        read_timeout=CHECK_TIMEOUT,
        pool_size=1,
    ).use_tls(outbound(ctx.config, ctx.config.decode_tls_insecure))
    await upstream.start()
    try:
        found = await probe_kv_connector(upstream)
    finally:
        await upstream.close()
    if found:
        return [ok("kv-connector", "D's /metrics shows a NIXL KV connector")]
    if found is False:
        detail = (
            "D's /metrics shows no NIXL KV connector: D does not read P's blocks, and releases none itself"
        )
        return [warn("kv-connector", detail, "start D with --kv-transfer-config naming the NixlConnector")]
    detail = "D's /metrics cannot tell whether D runs a KV connector (D down, or --disable-log-stats)"
    return [warn("kv-connector", detail, 'set decode_kv_connector = "yes" or "no"')]
