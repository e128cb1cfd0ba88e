"""The pod's service account, checked before start: the InferencePool watch authenticates with it."""

from __future__ import annotations

import os
from pathlib import Path

from sidecar.config import Config, ConfigError


def check_service_account(config: Config) -> None:
    """Raise ``ConfigError`` when the in-cluster API address or the mounted token is missing."""
    if not os.environ.get("KUBERNETES_SERVICE_HOST") or not os.environ.get("KUBERNETES_SERVICE_PORT"):
        raise ConfigError(
            "inference_pool",
            config.inference_pool,
            "watching it needs the in-cluster API (KUBERNETES_SERVICE_HOST and _PORT are not set)",
        )
    token = Path(config.kube_service_account) / "token"
    if not os.access(token, os.R_OK):
        raise ConfigError(
            "kube_service_account",
            config.kube_service_account,
            f"no readable {token}: mount the pod's service-account token (automountServiceAccountToken)",
        )
