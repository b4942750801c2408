"""The embedded catalogue: names, source lines, and the layer specs its facts give."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from hybridkv.catalogue import (
    MLAFacts,
    ModelError,
    ModelFacts,
    UnknownModelError,
    find_model,
    load_catalogue,
)
from hybridkv.model_layers import model_layers
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

FAMILIES = {
    "gemma2", "gemma3", "gemma3n", "gpt-oss", "llama4", "ministral", "cohere2", "jamba", "bamba",
    "granite-4.0-h", "minimax-01", "qwen3-next", "nemotron-h", "falcon-h1",
}  # fmt: skip


def _records() -> list[dict[str, object]]:
    text = resources.files("hybridkv").joinpath("data/catalogue.json").read_text("utf-8")
    records: list[dict[str, object]] = json.loads(text)["models"]
    return records


def _layers(name: str, **kwargs: int) -> dict[str, object]:
    facts = find_model(name).facts
    return dict(model_layers(facts, block_size=16, kv_dtype_bytes=2, **kwargs).layers)


def test_catalogue_has_every_family_the_issue_names_with_its_source_line() -> None:
    entries = load_catalogue()
    assert len(entries) == 25
    assert {entry.family for entry in entries} >= FAMILIES
    assert "meta-llama/Llama-3.1-8B" in {entry.model_id for entry in entries}
    assert all(entry.source.strip() for entry in entries)
    for record in _records():
        assert len(record["layer_types"]) == record["num_hidden_layers"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    ["google/gemma-3-27b-it", "gemma-3-27b-it", "GEMMA-3-27B-IT", " gemma-3-27b-it "],
)
def test_find_model_accepts_the_id_with_or_without_organisation(name: str) -> None:
    assert find_model(name).model_id == "google/gemma-3-27b-it"


def test_find_model_accepts_other_ids_of_the_same_model() -> None:
    assert find_model("CohereLabs/c4ai-command-r7b-12-2024").family == "cohere2"


def test_unknown_model_lists_close_names() -> None:
    with pytest.raises(UnknownModelError, match="did you mean: google/gemma-3-1b-it"):
        find_model("gemma-3")


def test_unknown_model_without_close_names_points_to_the_list() -> None:
    with pytest.raises(UnknownModelError, match="hybridkv models"):
        find_model("zzzz")


def test_gemma_3_27b_layers_are_sliding_window_with_every_sixth_full() -> None:
    layers = _layers("gemma-3-27b-it")
    full = FullAttentionSpec(block_size=16, num_kv_heads=16, head_size=128, dtype_bytes=2)
    sliding = SlidingWindowSpec(
        block_size=16, num_kv_heads=16, head_size=128, dtype_bytes=2, sliding_window=1024
    )
    assert len(layers) == 62
    assert [name for name, spec in layers.items() if spec == full] == [
        f"layers.{i}" for i in range(5, 62, 6)
    ]
    assert sum(spec == sliding for spec in layers.values()) == 52


def test_llama_4_local_layers_are_chunked() -> None:
    layers = _layers("Llama-4-Scout-17B-16E")
    assert layers["layers.0"] == ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2, attention_chunk_size=8192
    )
    assert isinstance(layers["layers.3"], FullAttentionSpec)


def test_fp8_kv_cache_halves_the_bytes_per_token() -> None:
    facts = find_model("gpt-oss-20b").facts
    spec = model_layers(facts, block_size=16, kv_dtype_bytes=1).layers["layers.1"]
    assert spec == FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype_bytes=1)


@pytest.mark.parametrize("ssm", ["bf16", "fp32"])
def test_recurrent_state_bytes_match_the_catalogue_formulas(ssm: str) -> None:
    """Conv state in bf16 + SSM state in bf16 or fp32, as the catalogue computed them."""
    for record in _records():
        recurrent = record["recurrent"]
        if not isinstance(recurrent, dict):
            continue
        state_bytes = find_model(str(record["model_id"])).facts.recurrent
        assert state_bytes is not None
        ssm_bytes = 2 if ssm == "bf16" else 4
        expected = recurrent[f"state_bytes_vllm_conv_bf16_ssm_{ssm}"]
        assert state_bytes.state_bytes(ssm_bytes) == expected, record["model_id"]


def test_nemotron_h_keeps_its_ssm_state_in_fp32_by_default_and_skips_mlp_layers() -> None:
    layers = _layers("Nemotron-H-8B-Base-8K")
    mamba = [spec for spec in layers.values() if isinstance(spec, MambaSpec)]
    assert len(layers) == 28
    assert len(mamba) == 24
    assert mamba[0].state_bytes == 4_255_744
    assert _layers("Nemotron-H-8B-Base-8K", ssm_dtype_bytes=2)["layers.0"] == MambaSpec(
        block_size=16, state_bytes=2_158_592
    )


def test_falcon_h1_decoder_layers_hold_attention_and_mamba() -> None:
    layers = _layers("Falcon-H1-7B-Instruct")
    assert len(layers) == 88
    assert layers["layers.0.attn"] == FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=128, dtype_bytes=2
    )
    assert layers["layers.43.mamba"] == MambaSpec(block_size=16, state_bytes=1_594_368)


def test_gemma_3n_readers_share_the_last_own_layer_of_their_type() -> None:
    facts = find_model("gemma-3n-E4B-it").facts
    sharing = model_layers(facts, block_size=16, kv_dtype_bytes=2).kv_sharing
    assert len(sharing) == 15
    assert sharing["layers.20"] == "layers.18"
    assert sharing["layers.24"] == "layers.19"
    assert sharing["layers.34"] == "layers.19"


def test_mla_is_full_attention_with_the_latent_split_in_two() -> None:
    """576 latent elements per token: 1 head × 288 × (K + V) = 1,152 bf16 bytes, as catalogued."""
    layers = model_layers(find_model("DeepSeek-V3").facts, block_size=16, kv_dtype_bytes=2)
    spec = layers.layers["layers.0"]
    assert spec == FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=288, dtype_bytes=2)
    assert spec.kv_hidden_size == 1152
    assert any("MLA" in note for note in layers.notes)


def test_an_odd_mla_latent_cannot_be_modelled_exactly() -> None:
    facts = ModelFacts("odd", ("full_attention_mla",), mla=MLAFacts(511, 64))
    with pytest.raises(ModelError, match="cannot be modelled exactly"):
        model_layers(facts, block_size=16, kv_dtype_bytes=2)


def test_a_model_of_mlp_layers_only_has_nothing_to_plan() -> None:
    with pytest.raises(ModelError, match="no layer holds KV"):
        model_layers(ModelFacts("mlp", ("mlp_only",)), block_size=16, kv_dtype_bytes=2)


def test_a_mamba_hybrids_note_says_simulate_caches_its_states_in_align_mode() -> None:
    """``hybridkv simulate`` runs Mamba groups with prefix caching (align) by default, so the
    plan's note must not say it runs them without."""
    layers = model_layers(
        find_model("Qwen/Qwen3-Next-80B-A3B-Instruct").facts, block_size=16, kv_dtype_bytes=2
    )
    (note,) = [n for n in layers.notes if n.startswith("recurrent layers")]
    assert "without prefix caching" not in note
    assert note.endswith(
        "simulate runs them the same way (align with --prefix-caching, the default)"
    )
