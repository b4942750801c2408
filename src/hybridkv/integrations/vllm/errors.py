"""The one error the integration raises for a setting it cannot honour."""

from __future__ import annotations


class UnsupportedSetting(ValueError):
    """A vLLM setting hybridkv cannot honour; the message names it and says why."""

    def __init__(self, setting: str, why: str) -> None:
        super().__init__(f"hybridkv does not support {setting}: {why}")
        self.setting = setting
        self.why = why


def refuse(condition: bool, setting: str, why: str) -> None:
    """Raise ``UnsupportedSetting(setting, why)`` when ``condition`` holds."""
    if condition:
        raise UnsupportedSetting(setting, why)


class UnsupportedInternal(UnsupportedSetting, AttributeError):
    """A read of vLLM's manager internals: also an ``AttributeError``, so ``getattr(x, name,
    default)`` and ``hasattr`` keep working."""
