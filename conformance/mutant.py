"""A planted bug: one source patch of one module, and the constructors the catalogues use.

The catalogues (``mutants_reference``, ``mutants_optimized``, ``mutants_planner``) are data;
``mutants`` is the runner that loads a patched copy and hunts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Suite = Literal["manager", "planner"]


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``patches`` (old, new) applied to ``module``'s source."""

    name: str
    description: str
    module: str
    patches: tuple[tuple[str, str], ...]
    suite: Suite = "manager"


def manager_mutant(name: str, description: str, module: str, *patches: tuple[str, str]) -> Mutant:
    """A mutant of ``spec/`` or ``reference/``, hunted by the manager checks."""
    return Mutant(name, description, f"hybridkv.{module}", patches)


def optimized_mutant(name: str, description: str, module: str, *patches: tuple[str, str]) -> Mutant:
    """A mutant of the optimized backend (``hybridkv.optimized``): its vectorised and batched
    paths, hunted with the optimized backend in place of the reference."""
    return Mutant(name, description, f"hybridkv.optimized.{module}", patches)


def planner_mutant(name: str, description: str, module: str, *patches: tuple[str, str]) -> Mutant:
    """A mutant of the planner, hunted by the grouping, layout and padding oracles."""
    return Mutant(name, description, f"hybridkv.{module}", patches, "planner")
