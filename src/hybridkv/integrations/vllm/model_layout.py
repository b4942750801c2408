"""A real model's KV cache groups for ``hybridkv vllm-check --model``, as vLLM 0.33 makes them.

The model is what ``hybridkv plan`` accepts (a catalogue name or Hub id, a ``config.json``, a
Hugging Face snapshot directory), read by the same ``resolve_model`` and mapped to layer specs by
the same ``model_layers``. Its layers are grouped by the planner's ``"vllm"`` policy, the one
that reproduces vLLM 0.33's grouping, and Mamba groups get the ``"align"`` cache mode an engine
with prefix caching selects. What the check keeps is the whole group list: every group, its spec
(window, chunk, state size, block size) and all its layer names. vLLM's scheduler sees only the
groups, so the pool size comes from the check (``--num-blocks``), not from a memory budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from hybridkv.spec import KVCacheConfig, MambaSpec


class ModelLayoutError(ValueError):
    """A model the check cannot lay out in vLLM 0.33; the message names the model and why."""


@dataclass(frozen=True)
class ModelLayout:
    """A model's groups (``config``; its ``num_blocks`` is a placeholder) and its short name."""

    name: str
    config: KVCacheConfig

    @property
    def block_size(self) -> int:
        """The groups' block size: the planner's, raised for Mamba states as vLLM raises it."""
        return self.config.groups[0].spec.block_size

    @property
    def has_mamba(self) -> bool:
        """Whether a group is Mamba: the engine then runs its Mamba cache in ``"align"`` mode."""
        return any(isinstance(group.spec, MambaSpec) for group in self.config.groups)

    def vllm_config(self, num_blocks: int, *, retention: int | None) -> Any:
        """vLLM's ``KVCacheConfig`` of these groups with a pool of ``num_blocks``."""
        from hybridkv.integrations.vllm.convert import to_vllm_config

        config = dataclasses.replace(
            self.config, num_blocks=num_blocks, prefix_cache_retention_interval=retention
        )
        return to_vllm_config(config)

    def default_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The null block and what one request of ``max_model_len`` holds in every group.

        The tightest pool in which every request still fits alone: the check's concurrent
        requests do not fit together, so it preempts under memory pressure, as the built-in
        layouts' 96 blocks make it do, however many groups the model has.
        """
        return 1 + sum(
            group.spec.max_blocks_per_request(
                max_model_len, max_num_batched_tokens, enable_prefix_caching=True
            )
            for group in self.config.groups
        )


def load_model_layout(model: str, block_size: int) -> ModelLayout:
    """``model``'s groups under vLLM 0.33's grouping; ``ModelLayoutError`` naming the model and
    the layer type or field it cannot lay out (an unknown model included)."""
    import click

    from hybridkv.catalogue import DTYPE_BYTES, ModelError
    from hybridkv.cli.options import resolve_model
    from hybridkv.model_layers import model_layers
    from hybridkv.reference.planner import plan_groups, with_mamba_cache_mode

    try:
        choice = resolve_model(model)
    except click.ClickException as error:
        raise ModelLayoutError(error.format_message()) from None
    try:
        layers = model_layers(
            choice.facts, block_size=block_size, kv_dtype_bytes=DTYPE_BYTES["bf16"]
        )
        groups = plan_groups(layers.layers, kv_sharing=layers.kv_sharing, policy="vllm")
        config = with_mamba_cache_mode(KVCacheConfig(2, groups), enable_caching=True)
        layout = ModelLayout(display_name(choice.name), config)
        layout.vllm_config(2, retention=None)  # what vLLM 0.33 cannot express fails here
    except (ModelError, ValueError) as error:
        raise ModelLayoutError(f"cannot check {choice.name} in vLLM 0.33: {error}") from None
    return layout


def display_name(name: str) -> str:
    """A short run name: ``gemma-3-27b-it`` for ``google/gemma-3-27b-it``; a config file's
    directory (the model of a Hub cache ``models--org--name/snapshots/…``, else its name)."""
    path = PurePath(name)
    if path.suffix != ".json":
        return path.name
    for part in reversed(path.parts):
        if part.startswith("models--"):
            return part.rsplit("--", 1)[-1]
    return path.parent.name or path.stem
