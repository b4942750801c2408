"""``hybridkv conformance``, ``hybridkv bench`` and ``hybridkv vllm-check``: their modules' own
commands.

They run ``python -m hybridkv.conformance`` / ``python -m hybridkv.bench`` in this process, with
the remaining arguments, once those modules exist.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys

import click

from hybridkv.cli.options import UserError
from hybridkv.extras import EXTRA_OF, VLLM, needs_line

# Every argument, --help included, belongs to the forwarded command.
_FORWARD_ALL = {"ignore_unknown_options": True, "help_option_names": []}


def forward(module: str, args: tuple[str, ...]) -> None:
    """Run ``module`` as ``__main__`` with ``args``; ``UserError`` when it does not exist yet."""
    if not _has_module(module):
        command = _COMMANDS.get(module, module.rsplit(".", 1)[-1])
        raise UserError(
            f"`python -m {module}` does not exist in this version of hybridkv, so "
            f"`hybridkv {command}` cannot run yet"
        )
    saved = sys.argv
    sys.argv = [f"python -m {module}", *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in EXTRA_OF and missing != VLLM:
            raise
        command = _COMMANDS.get(module, module.rsplit(".", 1)[-1])
        raise UserError(needs_line(f"`hybridkv {command}`", missing)) from None
    finally:
        sys.argv = saved


# Commands whose name is not their module's last component.
_COMMANDS = {"hybridkv.integrations.vllm.check": "vllm-check"}


def _has_module(module: str) -> bool:
    """Whether ``module`` can run with ``-m``: a module, or a package with a ``__main__``."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{module}.__main__")
    except ImportError:
        return False
    return spec is not None


@click.command(context_settings=_FORWARD_ALL)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def conformance(args: tuple[str, ...]) -> None:
    """Run the conformance suite (python -m hybridkv.conformance ARGS)."""
    forward("hybridkv.conformance", args)


@click.command(context_settings=_FORWARD_ALL)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Run the benchmarks (python -m hybridkv.bench ARGS)."""
    forward("hybridkv.bench", args)


@click.command("vllm-check", context_settings=_FORWARD_ALL)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def vllm_check(args: tuple[str, ...]) -> None:
    """vLLM's scheduler on vLLM's manager and on hybridkv, step by step
    (python -m hybridkv.integrations.vllm.check ARGS)."""
    forward("hybridkv.integrations.vllm.check", args)
