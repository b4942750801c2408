"""vLLM 0.33's own ``KVCacheManager`` through ``hybridkv.conformance.adapters.vllm``.

The golden traces were recorded from this manager, so it replays them; against the reference
it agrees under the differential machine's traffic and its hit is the longest on states built
through its adapter. Skipped where vLLM does not import.
"""

from __future__ import annotations

import warnings

import pytest

from hybridkv.conformance.adapters import EngineOptions
from hybridkv.conformance.golden import check_trace, load_trace, scenario_config, trace_names
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM 0.33 is not installed")

from hybridkv.conformance.adapters import reference_backend
from hybridkv.conformance.adapters.vllm import make_adapter, vllm_config
from hybridkv.conformance.machine import run_differential
from hybridkv.conformance.oracles import run_adapter_hit_oracle
from hybridkv.integrations.vllm.convert import from_vllm_config

# vLLM's modules warn when imported (deprecations in torch and in vLLM itself).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

SAMPLE = trace_names()[::17]


def test_the_sample_spans_both_trace_sets() -> None:
    assert len(SAMPLE) == 20
    assert {name[:4] for name in SAMPLE} == {"eng_", "gen_"}


@pytest.mark.parametrize("name", SAMPLE)
def test_vllm_replays_the_trace_recorded_from_it(name: str) -> None:
    result = check_trace(name, make_adapter)
    assert (result.status, result.detail) == ("pass", "")
    assert result.matched == len(load_trace(name)["observations"])


@pytest.mark.parametrize("name", ["gen_s101_0000", SAMPLE[0]])
def test_the_config_translation_round_trips_through_vllm(name: str) -> None:
    config = scenario_config(load_trace(name)["scenario"])
    assert from_vllm_config(vllm_config(config)) == config


def test_a_mamba_state_and_padding_survive_the_translation() -> None:
    mamba = MambaSpec(block_size=8, state_bytes=48, page_size_padded=64, mamba_cache_mode="align")
    full = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=2, dtype_bytes=4)
    config = KVCacheConfig(
        num_blocks=10, groups=(KVCacheGroup(("a",), full), KVCacheGroup(("m",), mamba))
    )
    assert from_vllm_config(vllm_config(config)) == config


def test_a_dtype_size_vllm_has_no_dtype_for_is_refused_by_name() -> None:
    odd = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=3)
    config = KVCacheConfig(num_blocks=4, groups=(KVCacheGroup(("a",), odd),))
    with pytest.raises(
        ValueError, match=r"^dtype_bytes must be one of \[1, 2, 4\] for vLLM, got 3$"
    ):
        make_adapter(config, 16, True, False, EngineOptions())


def test_vllm_agrees_with_the_reference_under_scheduler_traffic() -> None:
    stats = run_differential(
        [reference_backend(), ("vllm", make_adapter)], max_examples=24, steps=20
    )
    # Hypothesis may end a family early when it runs out of new examples; an example it
    # discards (its draws overran, or no enabled rule applied) has started a layout too.
    assert stats.examples >= 20
    assert stats.skipped["vllm"] == 0
    assert stats.lookups > 0


def test_vllm_returns_the_longest_hit_on_states_built_through_it() -> None:
    stats = run_adapter_hit_oracle("vllm", make_adapter, 40, seed=1)
    assert (stats.states, stats.probes, stats.failures) == (40, 120, [])
    assert stats.hits > 0
