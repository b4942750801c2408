"""What the subcommands share: memory sizes, dtypes, model resolution and user errors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from hybridkv.catalogue import DTYPE_BYTES, ModelFacts

DEFAULT_MODEL = "google/gemma-3-27b-it"
DEFAULT_MAX_MODEL_LEN = 131072

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class UserError(click.ClickException):
    """A mistake in the command line or its inputs: a message and exit code 2, no traceback."""

    exit_code = 2


class MemorySize(click.ParamType[int]):
    """A byte count: ``40GiB``, ``40 GB``, ``512MiB``, ``1.5GiB`` or a plain number of bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            self.fail(
                f"{value!r} is not a memory size: use a number with B, KiB, MiB, GiB, TiB, "
                "KB, MB, GB or TB (40GiB, 512MiB, 1.5GB) or a plain number of bytes",
                param,
                ctx,
            )
        return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(size: float) -> str:
    """A byte count for people: ``40.00 GiB``, ``8.00 KiB``, ``512 B``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"


@dataclass(frozen=True)
class ModelChoice:
    """The model a command works on, with where its numbers come from."""

    name: str
    source: str
    status: str
    unconfirmed: tuple[str, ...]
    facts: ModelFacts


def resolve_model(name_or_path: str | None) -> ModelChoice:
    """A catalogue name (``gemma-3-27b-it``) or a path to a config.json; ``UserError`` otherwise."""
    from hybridkv.catalogue import ModelError, find_model

    target = name_or_path or DEFAULT_MODEL
    try:
        if target.endswith(".json") or Path(target).is_file():
            from hybridkv.hf_config import load_config

            facts = load_config(target)
            return ModelChoice(target, f"config file {target}", "config.json", (), facts)
        entry = find_model(target)
    except ModelError as error:
        raise UserError(str(error)) from None
    return ModelChoice(entry.model_id, entry.source, entry.status, entry.unconfirmed, entry.facts)


def default_max_model_len(choice: ModelChoice) -> int:
    """The model's own context length, as vLLM defaults it (131072 when the model gives none)."""
    return choice.facts.max_position_embeddings or DEFAULT_MAX_MODEL_LEN


KV_DTYPES = tuple(DTYPE_BYTES)
SSM_DTYPES = ("auto", "bf16", "fp16", "fp32")


def ssm_dtype_bytes(name: str) -> int | None:
    """Bytes of the SSM state dtype; ``None`` for ``auto`` (the model's own, as vLLM decides)."""
    return None if name == "auto" else DTYPE_BYTES[name]
