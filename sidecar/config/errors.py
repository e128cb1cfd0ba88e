"""The config's errors: each names the setting, where its value came from, the value and why.

``ConfigError`` is what ``sidecar.config`` raises for a value it cannot use; the
CLI prints its one line and exits 2 before any socket opens. A credential's
value (``SECRETS``) is never echoed.
"""

from __future__ import annotations

from sidecar.exceptions import SidecarError


def flag_of(field: str) -> str:
    """The ``serve`` flag of setting ``field``."""
    return "--" + field.replace("_", "-")


class ConfigError(SidecarError):
    """A setting that cannot be used; ``str()`` names the field, its source, the value and the reason."""

    def __init__(self, field: str, value: object, reason: str, source: str = "") -> None:
        self.field, self.value, self.reason = field, value, reason
        self.source = source or flag_of(field)
        shown = REDACTED if field in SECRETS and value else value
        super().__init__(f"invalid {field} ({self.source}) = {shown!r}: {reason}")

    def at(self, source: str) -> ConfigError:
        """The same error, naming where the value came from."""
        return ConfigError(self.field, self.value, self.reason, source)


class FileError(ConfigError):
    """The TOML file itself is wrong (unreadable, not TOML, an unknown key); names the file first."""

    def __init__(self, file_name: str, reason: str, key: str = "config", value: object = None) -> None:
        super().__init__(key, file_name if value is None else value, reason, file_name)
        self.args = (f"{file_name}: {reason}",)


# Settings whose values are credentials: never logged, never echoed in an error.
SECRETS = frozenset({"control_token", "trust_token", "trust_key"})
REDACTED = "<redacted>"
