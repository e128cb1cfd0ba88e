"""``kv-release-sidecar demo``: what the sidecar saves P, measured on loopback in under a minute."""

from __future__ import annotations
