"""What the subcommands share: memory sizes, dtypes, model resolution and user errors."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import click

from hybridkv.catalogue import DTYPE_BYTES, ModelFacts

DEFAULT_MODEL = "google/gemma-3-27b-it"
DEFAULT_MAX_MODEL_LEN = 131072

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*")

BLOCK_SIZE_MULTIPLE = 16
"""vLLM 0.33's GPU attention kernels (FlashAttention, Triton) take blocks of 16k tokens."""


class UserError(click.ClickException):
    """A mistake in the command line or its inputs: a message and exit code 2, no traceback."""

    exit_code = 2


class RunFailed(click.ClickException):
    """A run that did what was asked and achieved nothing (no request fit): exit code 1."""

    exit_code = 1


MIN_PLAIN_BYTES = 2**20
"""A number without a unit is a byte count, and below 1 MiB it is a unit left out."""

MAX_MEMORY_BYTES = 16 * 2**40
"""More than any GPU has (16 TiB per GPU): a bigger size is a typo."""


class MemorySize(click.ParamType[int]):
    """A byte count: ``40GiB``, ``40 GB``, ``512MiB``, ``1.5GiB``, or a plain number of bytes
    of at least 1 MiB (``4.2e10``); at most 16 TiB."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = _SIZE.fullmatch(str(value))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            self.fail(
                f"{value!r} is not a memory size: use a number with B, K, M, G, T (powers of "
                "1000, also KB … TB) or Ki, Mi, Gi, Ti (powers of 1024, also KiB … TiB): "
                "40GiB, 40Gi, 40G, 512M, 4.2e10",
                param,
                ctx,
            )
        size = int(Decimal(match.group(1)) * _UNITS[unit])
        if match.group(2) == "" and size < MIN_PLAIN_BYTES:
            self.fail(
                f"{value!r} has no unit, so it is {size:,} bytes: did you mean "
                f"{match.group(1)}GiB? (a number without a unit is a byte count of at least "
                f"1 MiB = {MIN_PLAIN_BYTES:,})",
                param,
                ctx,
            )
        if size > MAX_MEMORY_BYTES:
            self.fail(
                f"{value!r} is {format_bytes(size)}, more than any GPU has (at most 16 TiB per "
                "GPU): is it a typo?",
                param,
                ctx,
            )
        return size


_TOKENS = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class TokenCount(click.ParamType[int]):
    """A positive token count as vLLM 0.33's ``human_readable_int`` reads it: ``131072``,
    ``128k`` (k, m, g, t: powers of 1000, decimals allowed), ``128K`` (K, M, G, T: powers of
    1024, whole numbers only)."""

    name = "tokens"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value).strip()
        count = value if isinstance(value, int) else self._parse(text, param, ctx)
        if count < 1:
            self.fail(f"{value!r} must be at least 1 token", param, ctx)
        return count

    def _parse(self, text: str, param: click.Parameter | None, ctx: click.Context | None) -> int:
        match = _TOKENS.fullmatch(text)
        if match is not None:
            number, suffix = match.groups()
            if suffix in _DECIMAL:
                return int(float(number) * _DECIMAL[suffix])
            if "." in number:
                self.fail(
                    f"decimals are not allowed with binary suffixes like {suffix}: did you mean "
                    f"{number}{suffix.lower()}?",
                    param,
                    ctx,
                )
            return int(number) * _BINARY[suffix]
        try:
            return int(text)
        except ValueError:
            self.fail(
                f"{text!r} is not a token count: a whole number, or one with k, m, g, t "
                "(powers of 1000: 128k, 25.6k) or K, M, G, T (powers of 1024: 128K), as vLLM "
                "reads it",
                param,
                ctx,
            )


def check_block_size(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """``--block-size``: what vLLM's paged-attention layout on GPUs accepts."""
    if value % BLOCK_SIZE_MULTIPLE:
        raise click.BadParameter(
            f"must be a multiple of {BLOCK_SIZE_MULTIPLE} (16, 32, 48, …): vLLM's GPU attention "
            f"kernels page the KV cache in blocks of 16 tokens, got {value}",
            ctx,
            param,
        )
    return value


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
    notes: tuple[str, ...] = ()


def resolve_model(name_or_path: str | None, *, assume_full_attention: bool = False) -> ModelChoice:
    """A catalogue name or Hub id (``gemma-3-27b-it``, also ``google/gemma-3-27b``: a variant
    suffix finds its catalogue entry), a config.json, or a Hugging Face snapshot directory
    holding one; ``UserError`` otherwise. ``assume_full_attention`` plans a config.json of a
    ``model_type`` hybridkv does not know as all full attention."""
    from hybridkv.catalogue import ModelError, UnknownModelError, find_model, find_variant

    target = DEFAULT_MODEL if name_or_path is None else name_or_path
    if not target.strip():
        raise UserError(
            f"MODEL is {target!r}: give a catalogue name (`hybridkv models` lists them), a "
            f"config.json or a snapshot directory, or leave it out for {DEFAULT_MODEL}"
        )
    try:
        path = Path(target)
        if path.is_dir():
            return _from_config(_snapshot_config(path), assume_full_attention)
        if target.endswith(".json") or path.is_file():
            return _from_config(target, assume_full_attention)
        try:
            entry = find_model(target)
            notes: tuple[str, ...] = ()
        except UnknownModelError:
            variant = find_variant(target)
            if variant is None:
                raise
            entry = variant
            notes = (
                f"{target!r} is planned as the catalogue's {entry.model_id}: the -it, "
                "-Instruct, -Thinking and -Base variants of a model share its layers",
            )
    except ModelError as error:
        raise UserError(str(error)) from None
    return ModelChoice(
        entry.model_id, entry.source, entry.status, entry.unconfirmed, entry.facts, notes
    )


def _snapshot_config(directory: Path) -> str:
    """A Hugging Face snapshot directory's ``config.json``; ``UserError`` without one."""
    config = directory / "config.json"
    if not config.is_file():
        raise UserError(
            f"{directory} is a directory without a config.json: give a Hugging Face snapshot "
            "directory (it holds config.json), a config.json file or a catalogue name"
        )
    return str(config)


def _from_config(path: str, assume_full_attention: bool) -> ModelChoice:
    """The model a config.json describes."""
    from hybridkv.hf_config import load_config

    facts = load_config(path, assume_full_attention=assume_full_attention)
    return ModelChoice(path, f"config file {path}", "config.json", (), facts)


def default_max_model_len(choice: ModelChoice) -> int:
    """The model's own context length, as vLLM defaults it (131072 when the model gives none)."""
    return choice.facts.max_position_embeddings or DEFAULT_MAX_MODEL_LEN


def with_max_model_len_note(choice: ModelChoice, max_model_len: int | None) -> ModelChoice:
    """``choice`` with a note when the plan's max_model_len is the library's fallback (the
    model gives no max_position_embeddings and the user no --max-model-len)."""
    if max_model_len is not None or choice.facts.max_position_embeddings is not None:
        return choice
    note = (
        f"{choice.name} gives no max_position_embeddings: max_model_len defaults to "
        f"{DEFAULT_MAX_MODEL_LEN:,} (give --max-model-len)"
    )
    return dataclasses.replace(choice, notes=(*choice.notes, note))


ASSUME_FULL_ATTENTION_HELP = (
    "Plan a config.json whose model_type hybridkv does not know as all full attention "
    "(without it such a config is refused; a layer_types list in the config needs no flag)."
)


KV_DTYPES = tuple(DTYPE_BYTES)
SSM_DTYPES = ("auto", "bf16", "fp16", "fp32")


def ssm_dtype_bytes(name: str) -> int | None:
    """Bytes of the SSM state dtype; ``None`` for ``auto`` (the model's own, as vLLM decides)."""
    return None if name == "auto" else DTYPE_BYTES[name]
