"""The optional parts of the install (pyproject's extras) and the one-line error when one is missing.

The core install runs ``serve`` with ``--release off``, ``dry-run`` or ``http``.
The rest is optional: ``nixl`` (NIXL, numpy and ZMQ: ``--release nixl`` and
``auto``, the P simulator), ``loadtest`` (aiohttp and matplotlib: ``demo``,
``loadtest``), ``otel`` (OpenTelemetry tracing) and ``llm-d`` (lightkube for the
InferencePool watch, cryptography for a self-signed serving certificate, pyyaml
for llm-d's ``--configuration`` YAML). A command that needs a missing extra stops
with exit code 2 and ``MissingExtra``'s one line, naming the extra and how to
install it, instead of an ``ImportError`` traceback. In the image, where nobody
runs pip, the way to install it is the Dockerfile's ``EXTRAS`` build argument:
the image's build writes the extras it was built with to ``IMAGE_MARKER`` in
its virtual environment, and the line then names the build argument.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

# Each extra: the modules that show it is installed (alternatives separated by "|").
MODULES: dict[str, tuple[str, ...]] = {
    "nixl": ("nixl_cu12|nixl", "numpy", "zmq"),
    "loadtest": ("aiohttp", "matplotlib"),
    "otel": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"),
    "llm-d": ("lightkube", "cryptography", "yaml"),
}
# nixl-cu12 declares torch, so pip would pull it with the extra: point at the recipe without it.
HINTS: dict[str, str] = {
    "nixl": 'install it without torch as "Install" in README.md shows',
    "loadtest": 'pip install "<checkout>[loadtest]"',
    "otel": 'pip install "<checkout>[otel]"',
    "llm-d": 'pip install "<checkout>[llm-d]"',
}
# Written by the Dockerfile's build into the image's virtual environment (sys.prefix): the
# EXTRAS build argument the image was built with, separated by spaces.
IMAGE_MARKER = "kv-release-sidecar-extras"


def image_extras(prefix: str | None = None) -> list[str] | None:
    """The extras this image was built with, or None outside the image (no marker)."""
    try:
        return (Path(prefix or sys.prefix) / IMAGE_MARKER).read_text().split()
    except OSError:
        return None


def hint(extra: str, prefix: str | None = None) -> str:
    """How to get ``extra``: the image's build argument in the image, pip (or README.md) elsewhere."""
    built = image_extras(prefix)
    if built is None:
        return HINTS[extra]
    if extra == "loadtest":
        return "it is in the loadtest image: docker build --target loadtest ."
    if "loadtest" in built:  # the loadtest image: its stage takes no EXTRAS
        return "it is in the sidecar image: docker build ."
    wanted = " ".join(dict.fromkeys([*built, extra]))
    return f'rebuild the image with --build-arg EXTRAS="{wanted}"'


class MissingExtra(Exception):
    """``what`` needs ``extra``, and ``module`` cannot be imported."""

    def __init__(self, what: str, extra: str, module: str) -> None:
        self.what, self.extra, self.module = what, extra, module
        super().__init__(
            f"{what} needs the {extra} extra, which is not installed (no module {module}): {hint(extra)}"
        )


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def missing_module(extra: str) -> str | None:
    """The first module of ``extra`` that cannot be found, or None when it is installed."""
    for alternatives in MODULES[extra]:
        names = alternatives.split("|")
        if not any(_importable(name) for name in names):
            return names[0]
    return None


def require(what: str, extras: Iterable[str]) -> None:
    """Raise ``MissingExtra`` for the first of ``extras`` that is not installed."""
    for extra in extras:
        module = missing_module(extra)
        if module is not None:
            raise MissingExtra(what, extra, module)


def require_module(what: str, extra: str, module: str) -> None:
    """Raise ``MissingExtra`` when ``module``, the part of ``extra`` that ``what`` imports, is missing."""
    if not _importable(module):
        raise MissingExtra(what, extra, module)


def extra_of(module: str | None) -> str | None:
    """The extra that provides ``module`` (a top-level or dotted name), if any."""
    if not module:
        return None
    top = module.split(".")[0]
    for extra, names in MODULES.items():
        if any(top == name.split(".")[0] for alternatives in names for name in alternatives.split("|")):
            return extra
    return None
