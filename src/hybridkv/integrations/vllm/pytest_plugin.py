"""A pytest plugin that runs vLLM's own scheduler tests with a hybridkv manager.

From vLLM 0.33's source tree::

    VLLM_TARGET_DEVICE=cpu python -m pytest -p hybridkv.integrations.vllm.pytest_plugin \\
        --hybridkv-backend reference --confcutdir tests/v1/core \\
        tests/v1/core/test_scheduler.py tests/v1/core/test_async_scheduler.py

``--hybridkv-backend`` is ``reference`` (default), ``optimized``, or ``vllm`` (vLLM's own manager,
for the baseline). Every ``Scheduler`` and ``AsyncScheduler`` the tests build gets the chosen
manager (``install``). ``--hybridkv-offline-models`` serves the ``config.json`` of the models the
tests name (``facebook/opt-125m``) from a local Hugging Face cache, for machines without network
access (the scheduler needs no weights and no tokenizer). ``--confcutdir`` keeps vLLM's top-level
``conftest.py`` (GPU fixtures) out.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

# The published config of facebook/opt-125m (the only model the scheduler tests load for text).
OPT_125M = {
    "_name_or_path": "facebook/opt-125m",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}
_REVISION = "0" * 40

_STACK_KEY = "_hybridkv_install"


def offline_model_cache(root: Path) -> Path:
    """A Hugging Face hub cache under ``root`` that holds ``facebook/opt-125m``'s config."""
    repo = root / "models--facebook--opt-125m"
    snapshot = repo / "snapshots" / _REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M), encoding="utf-8")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_REVISION, encoding="utf-8")
    return root


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("hybridkv")
    group.addoption(
        "--hybridkv-backend",
        choices=("reference", "optimized", "vllm"),
        default="reference",
        help="the KV cache manager of every vLLM scheduler the tests build",
    )
    group.addoption(
        "--hybridkv-offline-models",
        action="store_true",
        help="serve facebook/opt-125m's config.json from a local Hugging Face cache",
    )


def pytest_configure(config: Any) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if config.getoption("--hybridkv-offline-models"):
        root = Path(tempfile.gettempdir()) / "hybridkv-hf-cache"
        os.environ["HF_HUB_CACHE"] = str(offline_model_cache(root))
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
    backend = config.getoption("--hybridkv-backend")
    if backend == "vllm":
        return
    from hybridkv.integrations.vllm.scheduler import install

    stack = contextlib.ExitStack()
    stack.enter_context(install(backend))
    setattr(config, _STACK_KEY, stack)


def pytest_unconfigure(config: Any) -> None:
    stack = getattr(config, _STACK_KEY, None)
    if stack is not None:
        stack.close()


def pytest_report_header(config: Any) -> str:
    return f"hybridkv: KV cache manager = {config.getoption('--hybridkv-backend')}"
