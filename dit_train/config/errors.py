"""The one error type of the config layer."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; the message is the whole story (printed without a traceback)."""


def invalid(key: str, value, valid: str) -> ConfigError:
    """`key=value is not valid: what is valid` — the one shape every config error has."""
    return ConfigError(f"{key}={value!r} is not valid: {valid}")
