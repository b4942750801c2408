"""config.json → facts → layer specs, one fixture per family, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.catalogue import find_model
from hybridkv.hf_config import ConfigError, facts_from_config, load_config
from hybridkv.model_layers import model_layers
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

CONFIGS = Path(__file__).parent / "fixtures" / "configs"

# fixture → the catalogue model whose facts it must reproduce exactly
SAME_AS_CATALOGUE = {
    "llama": "Llama-3.1-8B",
    "gemma2": "gemma-2-9b",
    "gemma3": "gemma-3-27b-it",
    "gemma3_text_defaults": "gemma-3-4b-it",
    "gemma3n": "gemma-3n-E4B-it",
    "gpt_oss": "gpt-oss-20b",
    "llama4": "Llama-4-Scout-17B-16E",
    "cohere2": "c4ai-command-r7b-12-2024",
    "jamba": "Jamba-v0.1",
    "bamba": "Bamba-9B",
    "granitemoehybrid": "granite-4.0-h-tiny",
    "minimax": "MiniMax-Text-01",
    "qwen3_next": "Qwen3-Next-80B-A3B-Instruct",
    "nemotron_h": "Nemotron-H-8B-Base-8K",
    "falcon_h1": "Falcon-H1-7B-Instruct",
    "deepseek_v3": "DeepSeek-V3",
}


def _specs(fixture: str) -> dict[str, KVCacheSpec]:
    facts = load_config(CONFIGS / f"{fixture}.json")
    return dict(model_layers(facts, block_size=16, kv_dtype_bytes=2).layers)


def _full(heads: int, head: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head, dtype_bytes=2)


def test_there_is_a_fixture_for_every_family() -> None:
    assert {path.stem for path in CONFIGS.glob("*.json")} == {*SAME_AS_CATALOGUE, "mistral"}


@pytest.mark.parametrize(("fixture", "model"), sorted(SAME_AS_CATALOGUE.items()))
def test_config_gives_the_catalogue_layers(fixture: str, model: str) -> None:
    facts = load_config(CONFIGS / f"{fixture}.json")
    expected = find_model(model).facts
    assert facts.layer_kinds == expected.layer_kinds
    assert facts.attention == expected.attention
    assert facts.recurrent == expected.recurrent
    assert dict(facts.kv_sharing) == dict(expected.kv_sharing)
    assert facts.max_position_embeddings == expected.max_position_embeddings


def test_gemma3_nested_text_config() -> None:
    specs = _specs("gemma3")
    assert specs["layers.5"] == _full(16, 128)
    assert specs["layers.0"] == SlidingWindowSpec(
        block_size=16, num_kv_heads=16, head_size=128, dtype_bytes=2, sliding_window=1024
    )


def test_gemma3_text_config_without_heads_uses_transformers_defaults() -> None:
    specs = _specs("gemma3_text_defaults")
    assert specs["layers.5"] == _full(4, 256)
    assert sum(isinstance(spec, SlidingWindowSpec) for spec in specs.values()) == 29


def test_gemma2_alternates_sliding_and_full() -> None:
    specs = _specs("gemma2")
    assert isinstance(specs["layers.0"], SlidingWindowSpec)
    assert specs["layers.1"] == _full(8, 256)


def test_gemma3n_shares_kv() -> None:
    facts = load_config(CONFIGS / "gemma3n.json")
    assert facts.kv_sharing == {i: 19 if (i + 1) % 5 == 0 else 18 for i in range(20, 35)}


def test_llama4_empty_no_rope_layers_means_every_fourth_layer_global() -> None:
    specs = _specs("llama4")
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2, attention_chunk_size=8192
    )
    assert [name for name, spec in specs.items() if spec != chunked] == [
        f"layers.{i}" for i in range(3, 48, 4)
    ]


def test_mistral_format_config_without_layer_types_slides_every_layer() -> None:
    """The catalogue's caveat: HF-format Ministral runs all 36 layers as sliding-32768."""
    facts = load_config(CONFIGS / "mistral.json")
    specs = model_layers(facts, block_size=16, kv_dtype_bytes=2).layers
    assert set(specs.values()) == {
        SlidingWindowSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2, sliding_window=32768
        )
    }
    assert "layer_types" in facts.notes[0]


@pytest.mark.parametrize(
    ("fixture", "num_mamba", "state_bytes"),
    [
        ("jamba", 28, 311_296),
        ("bamba", 29, 2_147_840),
        ("granitemoehybrid", 36, 806_400),
        ("nemotron_h", 24, 4_255_744),
        ("falcon_h1", 44, 1_594_368),
        ("qwen3_next", 36, 1_097_728),
        ("minimax", 70, 2_097_152),
    ],
)
def test_recurrent_layers_become_mamba_specs(
    fixture: str, num_mamba: int, state_bytes: int
) -> None:
    mamba = [spec for spec in _specs(fixture).values() if isinstance(spec, MambaSpec)]
    assert mamba == [MambaSpec(block_size=16, state_bytes=state_bytes)] * num_mamba


def test_deepseek_mla_is_one_head_of_half_the_latent() -> None:
    assert set(_specs("deepseek_v3").values()) == {_full(1, 288)}


# --- Errors -----------------------------------------------------------------------------------


def _config(fixture: str, **changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((CONFIGS / f"{fixture}.json").read_text())
    target = config.get("text_config", config)
    for key, value in changes.items():
        if value is None:
            del target[key]
        else:
            target[key] = value
    return config


@pytest.mark.parametrize(
    ("fixture", "changes", "message"),
    [
        ("llama", {"num_hidden_layers": None}, "field 'num_hidden_layers' is missing"),
        ("llama", {"num_key_value_heads": "8"}, "field 'num_key_value_heads' must be a positive"),
        ("gemma3", {"head_dim": 0}, "field 'text_config.head_dim' must be a positive integer"),
        ("gpt_oss", {"layer_types": ["sliding_attention", "local"] * 12}, r"'layer_types\[1\]'"),
        ("gpt_oss", {"layer_types": ["full_attention"] * 23}, "gives 23 layers"),
        ("nemotron_h", {"hybrid_override_pattern": "MX"}, "'hybrid_override_pattern' must be"),
        ("jamba", {"mamba_d_state": None}, "field 'mamba_d_state' is missing"),
        ("jamba", {"attn_layer_offset": 9}, r"'attn_layer_offset' must be an integer in \[0, 8\)"),
        ("minimax", {"attn_type_list": [2] * 80}, r"'attn_type_list\[0\]' must be 0 or 1"),
        ("gemma3", {"global_head_dim": 512}, "'text_config.global_head_dim' gives global layers"),
        ("llama", {"model_type": "mystery"}, "field 'model_type' is 'mystery', which hybridkv"),
        ("gemma3n", {"num_kv_shared_layers": 35}, "leaves no layer that stores KV"),
    ],
)
def test_a_field_that_cannot_be_read_is_named(
    fixture: str, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        facts_from_config(_config(fixture, **changes), name="config.json")


def test_invalid_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",\n')
    with pytest.raises(ConfigError, match=r"not valid JSON \(line 2"):
        load_config(path)


def test_a_json_list_is_not_a_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_config(path)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.json")


# --- Refuse or say it: unknown model types, MiniMax-M1, defaults --------------------------------


def test_an_unknown_model_type_is_refused_naming_it_what_is_read_and_the_two_ways_out() -> None:
    config = {"model_type": "weird_new_arch", "num_hidden_layers": 26, "num_attention_heads": 8}
    with pytest.raises(ConfigError) as raised:
        facts_from_config(config, name="config.json")
    message = str(raised.value)
    assert message.startswith(
        "config.json: field 'model_type' is 'weird_new_arch', which hybridkv does not know: it "
        "reads the layer kinds of model_type bamba, cohere2, "
    )
    assert "minimax_m1, minimax_text_01, " in message
    assert message.endswith(
        "and of any model from a 'layer_types' list (attention, chunked_attention, "
        "full_attention, mamba2, mlp, sliding_attention, one per layer); add layer_types to the "
        "config, or pass --assume-full-attention (assume_full_attention=True) if every layer is "
        "full attention"
    )


def test_an_unknown_model_type_asserted_full_attention_is_planned_so_with_a_note() -> None:
    config = {
        "model_type": "weird_new_arch",
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
    }
    facts = facts_from_config(config, name="config.json", assume_full_attention=True)
    assert facts.layer_kinds == ("full_attention",) * 26
    assert facts.notes == (
        "model_type 'weird_new_arch' is not one hybridkv reads: every layer is planned as full "
        "attention, as --assume-full-attention asserts",
    )


def test_an_unknown_model_type_with_layer_types_is_read_from_them() -> None:
    config = {
        "model_type": "weird_new_arch",
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "sliding_window": 512,
    }
    facts = facts_from_config(config, name="config.json")
    assert facts.layer_kinds == ("sliding_attention", "full_attention")
    assert facts.notes == ()


def test_minimax_m1_reads_attn_type_list_as_70_lightning_and_10_full_layers() -> None:
    config = _config("minimax", model_type="minimax_m1")
    facts = facts_from_config(config, name="config.json")
    assert facts.layer_kinds == find_model("MiniMax-Text-01").facts.layer_kinds
    assert facts.layer_kinds.count("linear_attention_lightning") == 70
    assert [i for i, kind in enumerate(facts.layer_kinds) if kind == "full_attention"] == list(
        range(7, 80, 8)
    )


def test_a_config_of_only_model_type_and_layers_lists_every_default_it_was_planned_on() -> None:
    facts = facts_from_config({"model_type": "gemma3_text", "num_hidden_layers": 26}, name="c.json")
    assert facts.notes == (
        "c.json leaves out fields the plan needs; filled with defaults: "
        "sliding_window_pattern = 6, num_attention_heads = 8, head_dim = 256, "
        "num_key_value_heads = 4, sliding_window = 4096, max_position_embeddings = 131072",
    )


def test_a_head_dim_derived_from_hidden_size_is_listed_as_a_default() -> None:
    config = _config("llama", head_dim=None, num_key_value_heads=None)
    facts = facts_from_config(config, name="c.json")
    assert facts.notes == (
        "c.json leaves out fields the plan needs; filled with defaults: head_dim = 128, "
        "num_key_value_heads = 32",
    )


def test_a_complete_config_has_no_default_note() -> None:
    assert load_config(CONFIGS / "llama.json").notes == ()
