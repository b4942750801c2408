"""The one error the integration raises for a setting it cannot honour, and the settings
refused when the manager is built."""

from __future__ import annotations

from typing import Any


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


def refuse_unsupported(
    kv_cache_config: Any,
    hash_block_size: int,
    enable_caching: bool,
    parallel: tuple[int, int],
    watermark: float,
) -> None:
    """The manager's settings checked before anything is built: decode and prefill context
    parallelism (``parallel``: their world sizes) and, with caching on, Mamba ``"align"``
    blocks larger than ``hash_block_size`` (partial hash hits) are ``UnsupportedSetting``; a
    ``watermark`` outside ``[0, 1)`` is a ``ValueError``."""
    from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled

    for name, size in zip(("dcp_world_size", "pcp_world_size"), parallel, strict=True):
        refuse(size != 1, f"{name}={size}", "no context parallelism")
    if not 0.0 <= watermark < 1.0:
        raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
    refuse(
        enable_caching
        and partial_hash_hits_enabled(kv_cache_config.kv_cache_groups, hash_block_size),
        "Mamba 'align' blocks larger than hash_block_size (partial hash hits)",
        "sub-block Mamba hits with copy-on-write are not modelled",
    )


class UnsupportedInternal(UnsupportedSetting, AttributeError):
    """A read of vLLM's manager internals: also an ``AttributeError``, so ``getattr(x, name,
    default)`` and ``hasattr`` keep working."""
