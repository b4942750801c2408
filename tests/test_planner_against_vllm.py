"""The ``"vllm"`` grouping policy against vLLM 0.33 itself, where vLLM is installed.

For every catalogue model (and the synthetic 6 full + 5 sliding and gpt-oss-20b + EAGLE
layouts) the test builds vLLM's own per-layer ``KVCacheSpec`` for each layer, runs vLLM's
planning code (``get_kv_cache_groups`` → ``get_kv_cache_config_from_groups``, with a minimal
stand-in for ``VllmConfig`` as vLLM's own planning tests use, layer-outermost ``LBNHC``
layout), adds the KV-sharing readers as vLLM's worker does (a copy of
``add_kv_sharing_layers_to_kv_cache_groups``, whose module pulls in torch.compile) and asserts
that our ``plan_groups(..., policy="vllm")`` / ``plan_kv_cache`` give exactly vLLM's groups
(layer names in order, spec), ``num_blocks``, and tensor layout. Under 1, 2 and 4 pipeline
stages the catalogue goes through vLLM's engine path too (``get_global_kv_cache_groups`` →
``get_kv_cache_configs``, one worker per stage, layers split by ``get_pp_indices``).

What vLLM decides outside these functions is given to it, not compared:

* Mamba hybrids (Case 4): vLLM raises the attention block size and pads the Mamba page in its
  platform config step (``Platform._align_hybrid_block_size``, which needs a model config and an
  attention backend). vLLM's specs get the block size and padding of our Case 4
  (``rules.raised_block_size``); what vLLM's planning does with them is compared.
* MLA (DeepSeek-V3) is given to vLLM as ``MLAAttentionSpec`` (one 576-element latent); ours is
  the byte-equal ``FullAttentionSpec``: the groups are compared by layer names and page bytes.

Skipped, with the reason, when ``vllm`` cannot be imported (the default, vLLM-less run).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from importlib import import_module
from types import SimpleNamespace
from typing import Any

import pytest

from hybridkv.catalogue import ModelFacts, load_catalogue
from hybridkv.model_layers import decoder_layer_stages, model_layers
from hybridkv.reference.planner import plan_groups, plan_kv_cache
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
with warnings.catch_warnings():
    # vLLM's planning module imports the forward context, hence torch.compile and TorchScript,
    # which warn on import; the project's pytest turns warnings into errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    vllm = pytest.importorskip(
        "vllm",
        reason="vLLM is not installed: the 'vllm' policy is compared with vLLM only where it is",
    )
    if not str(vllm.__version__).startswith("0.33."):
        pytest.skip(
            f"the 'vllm' policy claims vLLM 0.33, found {vllm.__version__}",
            allow_module_level=True,
        )
    torch: Any = import_module("torch")
    planning: Any = import_module("vllm.v1.core.kv_cache_planning")
    iface: Any = import_module("vllm.v1.kv_cache_interface")
    CacheConfig: Any = import_module("vllm.config").CacheConfig
    get_pp_indices: Any = import_module("vllm.distributed.utils").get_pp_indices

BLOCK_SIZE = 16
KV_DTYPE_BYTES = 2
MEMORIES = (40 << 30, (7 << 30) + 12345)
TORCH_DTYPES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


def vllm_config() -> Any:
    """What the planning functions read of ``VllmConfig`` (as vLLM's ``_grouping_config``)."""
    cache_config = CacheConfig()
    cache_config.kv_cache_layout = "LBNHC"
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=cache_config,
    )


def dtype(nbytes: int) -> Any:
    return getattr(torch, TORCH_DTYPES[nbytes])


def case4(own: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """vLLM's config step for Mamba hybrids, done our way: raised block size, padded state."""
    attention = [s for s in own.values() if not isinstance(s, MambaSpec)]
    mamba = [s for s in own.values() if isinstance(s, MambaSpec)]
    if not (attention and mamba):
        return dict(own)
    hidden = attention[0].kv_hidden_size
    raised = rules.raised_block_size(attention[0].block_size, hidden, mamba[0].state_bytes)
    return {
        name: MambaSpec(
            block_size=raised, state_bytes=s.state_bytes, page_size_padded=raised * hidden
        )
        if isinstance(s, MambaSpec)
        else type(s)(**{**s.__dict__, "block_size": raised})
        for name, s in own.items()
    }


class Model:
    """A layout to compare: our layers, KV sharing, and how to give each layer to vLLM."""

    def __init__(
        self,
        layers: Mapping[str, KVCacheSpec],
        kv_sharing: Mapping[str, str] | None = None,
        facts: ModelFacts | None = None,
    ) -> None:
        self.layers = dict(layers)
        self.kv_sharing = dict(kv_sharing or {})
        self.facts = facts

    def is_mla(self, name: str) -> bool:
        if self.facts is None:
            return False
        index = int(name.split(".")[1])
        return self.facts.layer_kinds[index] == "full_attention_mla"

    def to_vllm(self, name: str, spec: KVCacheSpec) -> Any:
        """vLLM's spec of layer ``name`` with our (Case-4-unified) ``spec``."""
        if isinstance(spec, MambaSpec):
            assert self.facts is not None
            assert self.facts.recurrent is not None
            rec = self.facts.recurrent
            shapes = ((rec.conv_state_elems,), (rec.ssm_state_elems,))
            dtypes = (torch.bfloat16, dtype(rec.ssm_dtype_bytes))
            vspec = iface.MambaSpec(
                block_size=spec.block_size,
                shapes=shapes,
                dtypes=dtypes,
                page_size_padded=spec.page_size_padded,
            )
            assert vspec.real_page_size_bytes == spec.state_bytes
            return vspec
        if self.is_mla(name):
            assert self.facts is not None
            assert self.facts.mla is not None
            vspec = iface.MLAAttentionSpec(
                block_size=spec.block_size,
                num_kv_heads=1,
                head_size=self.facts.mla.latent_elems,
                dtype=dtype(spec.dtype_bytes),
            )
            assert vspec.page_size_bytes == spec.page_size_bytes
            return vspec
        common = {
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "dtype": dtype(spec.dtype_bytes),
        }
        if isinstance(spec, SlidingWindowSpec):
            return iface.SlidingWindowSpec(**common, sliding_window=spec.sliding_window)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return iface.ChunkedLocalAttentionSpec(
                **common, attention_chunk_size=spec.attention_chunk_size
            )
        assert isinstance(spec, FullAttentionSpec)
        return iface.FullAttentionSpec(**common)

    def vllm_specs(self) -> dict[str, Any]:
        """The ``kv_cache_spec`` a vLLM worker reports: readers of shared KV hold none."""
        own = {n: s for n, s in self.layers.items() if n not in self.kv_sharing}
        return {name: self.to_vllm(name, spec) for name, spec in case4(own).items()}


def vllm_plan(model: Model, memory: int) -> tuple[list[Any], Any]:
    """vLLM's groups (readers added as its worker adds them) and its config for ``memory``."""
    config = vllm_config()
    groups = planning.get_kv_cache_groups(config, model.vllm_specs())
    kv_config = planning.get_kv_cache_config_from_groups(config, groups, memory)
    add_kv_sharing_layers(model, kv_config.kv_cache_groups)
    return kv_config.kv_cache_groups, kv_config


def add_kv_sharing_layers(model: Model, groups: list[Any]) -> None:
    """vLLM's ``vllm.v1.worker.utils.add_kv_sharing_layers_to_kv_cache_groups``, copied: that
    module imports the GPU worker (and torch.compile) on import. Its ``shared_kv_cache_layers``
    is filled in model order; each reader is appended to its target's group."""
    group_of = {name: group for group in groups for name in group.layer_names}
    for reader in model.layers:
        if reader in model.kv_sharing:
            group_of[model.kv_sharing[reader]].layer_names.append(reader)


def vllm_tensor_layout(kv_config: Any) -> tuple[list[tuple[str, ...]], int, int]:
    """Layers by the byte address of their region (one region per layer-index across groups,
    groups aliasing from byte 0), the size of one region, and the whole allocation."""
    by_address: dict[int, list[str]] = {}
    region_sizes = set()
    for tensor in kv_config.kv_cache_tensors:
        for index, layer in enumerate(tensor.layers):
            by_address.setdefault(tensor.offset + index * tensor.layer_stride, []).append(layer)
        region_sizes.add(tensor.layer_stride)
    sizes = {t.size for t in kv_config.kv_cache_tensors}
    assert len(region_sizes) == 1
    assert len(sizes) == 1
    layout = [tuple(by_address[address]) for address in sorted(by_address)]
    return layout, region_sizes.pop(), sizes.pop()


def assert_same_as_vllm(model: Model, memory: int) -> None:
    groups, kv_config = vllm_plan(model, memory)
    ours = plan_groups(model.layers, kv_sharing=model.kv_sharing, policy="vllm")
    assert [list(g.layer_names) for g in ours] == [list(g.layer_names) for g in groups]
    for our_group, group in zip(ours, groups, strict=True):
        assert model.to_vllm(our_group.layer_names[0], our_group.spec) == group.kv_cache_spec
        assert our_group.spec.page_size_bytes == group.kv_cache_spec.page_size_bytes

    config: KVCacheConfig = plan_kv_cache(
        model.layers, memory, kv_sharing=model.kv_sharing, policy="vllm", enable_caching=False
    )
    assert config.groups == ours
    assert config.num_blocks == kv_config.num_blocks
    layout, region, total = vllm_tensor_layout(kv_config)
    assert [t.shared_by for t in config.tensors] == layout
    assert {t.size for t in config.tensors} == {region}
    assert sum(t.size for t in config.tensors) == total
    for tensor in kv_config.kv_cache_tensors:
        page = planning._get_per_layer_spec(
            next(g for g in groups if tensor.layers[0] in g.layer_names), tensor.layers[0]
        ).page_size_bytes
        assert tensor.block_stride == page == ours[0].spec.page_size_bytes


CATALOGUE = {entry.model_id: entry for entry in load_catalogue()}


@pytest.mark.parametrize(("block_size", "kv_dtype_bytes"), [(BLOCK_SIZE, KV_DTYPE_BYTES), (64, 1)])
@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("model_id", list(CATALOGUE))
def test_catalogue_model_plans_as_vllm(
    model_id: str, memory: int, block_size: int, kv_dtype_bytes: int
) -> None:
    facts = CATALOGUE[model_id].facts
    found = model_layers(facts, block_size=block_size, kv_dtype_bytes=kv_dtype_bytes)
    assert_same_as_vllm(Model(found.layers, found.kv_sharing, facts), memory)


MAX_MODEL_LEN = 2048
PP_MEMORY = 40 << 30


def engine_config() -> Any:
    """``vllm_config()`` plus what the engine-level ``get_kv_cache_configs`` reads."""
    config = vllm_config()
    config.model_config = SimpleNamespace(
        original_max_model_len=MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN,
        supports_kv_cache_grouping=False,
    )
    config.parallel_config = SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1)
    config.max_in_flight_tokens = 8192
    config.num_prefill_lookahead_tokens = 0
    return config


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("model_id", list(CATALOGUE))
def test_catalogue_model_under_pipeline_stages_plans_as_vllms_engine(
    model_id: str, pp: int
) -> None:
    """The engine's path: each stage's worker reports its layers' specs (decoder layers split
    by vLLM's ``get_pp_indices``); ``get_global_kv_cache_groups`` groups the whole model,
    ``get_kv_cache_configs`` projects the groups onto each worker and gives every worker the
    smallest worker's ``num_blocks``. Our tensors are stage 0's, then stage 1's, …"""
    facts = CATALOGUE[model_id].facts
    found = model_layers(facts, block_size=BLOCK_SIZE, kv_dtype_bytes=KV_DTYPE_BYTES)
    model = Model(found.layers, found.kv_sharing, facts)
    bounds = [get_pp_indices(len(facts.layer_kinds), rank, pp) for rank in range(pp)]
    specs = model.vllm_specs()
    workers = [
        {n: s for n, s in specs.items() if start <= int(n.split(".")[1]) < stop}
        for start, stop in bounds
    ]
    config = engine_config()
    groups = planning.get_global_kv_cache_groups(config, workers)
    if not all(workers):
        # Gemma-3n under 4 stages: the last stage holds only layers that read another
        # layer's KV, so its worker reports no spec; vLLM 0.33 keeps the emptied groups and
        # fails on them (an empty set of "mixed page sizes"). Ours plans it; nothing to compare.
        with pytest.raises(
            ValueError, match=r"cannot express this model's mixed page sizes \(\[\]\)"
        ):
            planning.get_kv_cache_configs(config, workers, [PP_MEMORY] * pp, groups)
        return
    kv_configs = planning.get_kv_cache_configs(config, workers, [PP_MEMORY] * pp, groups)
    add_kv_sharing_layers(model, groups)

    stages = decoder_layer_stages(facts, found, pp)
    assert [sorted(w) for w in workers] == [
        sorted(n for n in specs if stages[n] == stage) for stage in range(pp)
    ]
    ours = plan_kv_cache(
        model.layers,
        PP_MEMORY,
        kv_sharing=model.kv_sharing,
        policy="vllm",
        pipeline_parallel_size=pp,
        layer_stages=stages,
    )
    assert [list(g.layer_names) for g in ours.groups] == [list(g.layer_names) for g in groups]
    for our_group, group in zip(ours.groups, groups, strict=True):
        assert model.to_vllm(our_group.layer_names[0], our_group.spec) == group.kv_cache_spec
    assert {c.num_blocks for c in kv_configs} == {ours.num_blocks}
    layout: list[tuple[str, ...]] = []
    for kv_config in kv_configs:
        worker_layout, region, _ = vllm_tensor_layout(kv_config)
        layout += worker_layout
        assert region == ours.num_blocks * ours.groups[0].spec.page_size_bytes
    assert [t.shared_by for t in ours.tensors] == layout
    assert {t.size for t in ours.tensors} == {ours.num_blocks * ours.groups[0].spec.page_size_bytes}


VLLM_KV = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype_bytes": 4}


@pytest.mark.parametrize("memory", MEMORIES)
def test_six_full_five_sliding_plans_as_vllm(memory: int) -> None:
    full = FullAttentionSpec(**VLLM_KV)
    sliding = SlidingWindowSpec(**VLLM_KV, sliding_window=1)
    specs = [full] * 6 + [sliding] * 5
    layers = {f"layer_{i}": spec for i, spec in enumerate(specs, start=1)}
    assert_same_as_vllm(Model(layers), memory)


@pytest.mark.parametrize("memory", MEMORIES)
def test_gpt_oss_20b_with_an_eagle_layer_plans_as_vllm(memory: int) -> None:
    """12 sliding + 12 full + EAGLE's full-attention draft layer: 13 < 1.5 × 12, groups of 13."""
    facts = CATALOGUE["openai/gpt-oss-20b"].facts
    layers = dict(model_layers(facts, block_size=BLOCK_SIZE, kv_dtype_bytes=KV_DTYPE_BYTES).layers)
    full = next(s for s in layers.values() if isinstance(s, FullAttentionSpec))
    layers["draft.layers.0"] = full
    ours = plan_groups(layers, policy="vllm")
    assert [len(g.layer_names) for g in ours] == [12, 13]  # sliding first: one padding slot
    assert_same_as_vllm(Model(layers), memory)


# --- vLLM's own log line: "GPU KV cache size: N tokens, Maximum concurrency …" -----------------

kv_cache_utils: Any = import_module("vllm.v1.core.kv_cache_utils")
LOG_MODELS = (
    "google/gemma-3-27b-it",
    "ai21labs/Jamba-v0.1",
    "meta-llama/Llama-4-Scout-17B-16E",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "openai/gpt-oss-20b",
)


def capacity_config(max_model_len: int, max_num_batched_tokens: int) -> Any:
    """What ``update_kv_cache_capacity`` reads and writes of ``VllmConfig``: vLLM 0.33's GPU
    defaults (async scheduling: two batches in flight; prefix caching: Mamba ``align``)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode="align"),
        device_config=SimpleNamespace(device_type="cuda"),
        attention_config=SimpleNamespace(hisparse_config=None),
        max_in_flight_tokens=2 * max_num_batched_tokens,
    )


def vllm_log_line(config: Any, kv_config: Any) -> str:
    """The message vLLM's ``update_kv_cache_capacity`` logs for ``kv_config``."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger = logging.getLogger(kv_cache_utils.__name__)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        kv_cache_utils.update_kv_cache_capacity(config, kv_config)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    [record] = [r for r in records if "KV cache size" in r.getMessage()]
    return record.getMessage()


@pytest.mark.parametrize("model_id", LOG_MODELS)
def test_plan_prints_vllms_kv_cache_size_log_line(model_id: str) -> None:
    from hybridkv.cli.options import resolve_model
    from hybridkv.cli.plan_data import PlanSettings, make_plan

    choice = resolve_model(model_id)
    max_model_len = min(32768, choice.facts.max_position_embeddings or 32768)
    settings = PlanSettings(
        memory_bytes=PP_MEMORY,
        max_model_len=max_model_len,
        max_num_batched_tokens=8192,
        block_size=BLOCK_SIZE,
        kv_dtype="bf16",
        mamba_ssm_dtype="auto",
        policy="vllm",
        async_scheduling=True,
        enable_prefix_caching=True,
    )
    plan = make_plan(choice, settings)
    found = plan.layers
    _, kv_config = vllm_plan(Model(found.layers, found.kv_sharing, choice.facts), PP_MEMORY)
    expected = vllm_log_line(capacity_config(max_model_len, 8192), kv_config)
    assert plan.vllm_log_line == expected
