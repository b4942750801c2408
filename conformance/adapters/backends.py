"""The backends the suite runs: the reference (the model every other backend is compared
with), its independent stand-in, the optimized backend (with small size thresholds on half the
layouts, so its vectorised paths run), any manager class (``manager_backend``), a choice by
name (``backends_named``) and an outside adapter named ``MODULE:FACTORY`` (``load_backend``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from hybridkv.conformance.adapters.adapter_protocol import (
    AdapterFactory,
    Backend,
    EngineOptions,
    ManagerAdapter,
)
from hybridkv.conformance.adapters.protocol_adapter import (
    PlanningAdapter,
    ProtocolAdapter,
    RequestMaker,
    hash_block_size_of,
)
from hybridkv.conformance.protocol import KVCacheManagerLike
from hybridkv.spec import KVCacheConfig


def manager_backend(
    name: str,
    manager_class: Callable[..., KVCacheManagerLike],
    *,
    configure: Callable[[Any, KVCacheConfig], None] | None = None,
    plan_report: Callable[..., Any] | None = None,
    request_maker: Callable[[KVCacheConfig], RequestMaker | None] | None = None,
    **kw: Any,
) -> Backend:
    """A backend for any class constructed like ``KVCacheManager(config, max_model_len,
    enable_caching=..., enable_kv_cache_events=..., **engine_keywords, **kw)``; ``configure``
    adjusts each new manager for its layout; with ``plan_report`` (the reference's, or a
    patched copy's) its adapters also plan models (``Planning``); ``request_maker`` may give a
    layout's adapter its own way of making requests (``ProtocolAdapter``'s ``make``)."""

    def factory(
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        events: bool,
        engine: EngineOptions,
    ) -> ManagerAdapter:
        manager = manager_class(
            config,
            max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=events,
            **engine.kwargs(),
            **kw,
        )
        if configure is not None:
            configure(manager, config)
        block_size = hash_block_size_of(config, enable_caching)
        if plan_report is not None:
            return PlanningAdapter(
                name, manager, block_size, engine.num_hash_lookahead_tokens, plan_report
            )
        make = None if request_maker is None else request_maker(config)
        return ProtocolAdapter(name, manager, block_size, engine.num_hash_lookahead_tokens, make)

    return name, factory


def _policy_keywords(eviction_policy: str) -> dict[str, Any]:
    """The manager keyword for an eviction policy; none for the default (a patched copy of a
    backend need not take it)."""
    return {} if eviction_policy == "lru" else {"eviction_policy": eviction_policy}


def reference_backend(eviction_policy: str = "lru") -> Backend:
    """``hybridkv.reference.KVCacheManager``: the model every other backend is compared with
    (its planner too, ``plan_report``), under ``eviction_policy``."""
    from hybridkv.reference import KVCacheManager, plan_report

    return manager_backend(
        "reference", KVCacheManager, plan_report=plan_report, **_policy_keywords(eviction_policy)
    )


def reference_stand_in() -> Backend:
    """An independent second reference: it stands in for a backend that refuses a layout."""
    from hybridkv.reference import KVCacheManager

    return manager_backend("reference-again", KVCacheManager)


SMALL_THRESHOLDS = {
    "batch_min": 1,
    "free_batch_min": 2,
    "busy_batch_min": 2,
    "vector_min": 1,
    "insert_min": 2,
    "pending_min": 2,
    "memcmp_min": 1,
}
"""The optimized backend's size thresholds on half the layouts (an odd pool): every batch, of
one request too, and every lookup, and every touch, take, link or insert of two blocks or more
(and the pending work of two entries or more) takes the vectorised path, and the hash memo
compares prompts' ids by ``memcmp`` however few; a batch with one busy request serves it
alone. Each is a manager attribute that starts at its constant in
``hybridkv.optimized.thresholds``; the constants stay as they are."""


def thresholds_of_pool(num_blocks: int) -> dict[str, int]:
    """The thresholds the differential machine gives a manager of ``num_blocks`` blocks: none
    on an even pool (the production ones), ``SMALL_THRESHOLDS`` on an odd one, where half the
    pools (``num_blocks // 8`` even) vectorise a batch's lone busy request too
    (``busy_batch_min`` 1) and the other half serve it alone. The machine has few live
    requests, so most batches have one busy request: both of its paths run often."""
    if not num_blocks % 2:
        return {}
    if num_blocks // 8 % 2:
        return dict(SMALL_THRESHOLDS)
    return {**SMALL_THRESHOLDS, "busy_batch_min": 1}


def small_thresholds_on_odd_pools(manager: Any, config: KVCacheConfig) -> None:
    """Give ``manager`` the thresholds ``thresholds_of_pool`` draws for ``config``'s pool (a
    ``manager_backend`` ``configure`` hook)."""
    for attribute, value in thresholds_of_pool(config.num_blocks).items():
        setattr(manager, attribute, value)


def optimized_backend(
    device: str = "cpu",
    max_num_reqs: int = 32,
    manager_class: Any = None,
    eviction_policy: str = "lru",
) -> Backend | None:
    """``hybridkv.optimized.TorchKVCacheManager`` (or ``manager_class``, a patched copy) when it
    (and torch) can be imported.

    Its batched calls take the vectorised paths only from ``batch_min`` requests (640; a
    ``free_batch`` from ``free_batch_min``, 16) with ``busy_batch_min`` (64) needing work, and
    its lookups from ``vector_min`` probes: more
    than the differential machine's few live requests. So on layouts with an odd ``num_blocks``
    the thresholds are ``SMALL_THRESHOLDS`` (the vectorised paths), on the others the
    production ones (the single-request paths below them): ``thresholds_of_pool``."""
    try:
        module: Any = importlib.import_module("hybridkv.optimized")
    except ImportError:
        return None
    if manager_class is None:
        manager_class = getattr(module, "TorchKVCacheManager", None)
        if manager_class is None:
            return None

    def step_columns_on_every_other_odd_pool(config: KVCacheConfig) -> RequestMaker | None:
        # Half the layouts whose batches are vectorised (pools of 1 mod 4) make column
        # requests (their counts in one ``StepColumns``), the other half plain ones: both
        # ways of reading a batch's counts run.
        columns_class = getattr(module, "StepColumns", None)
        if config.num_blocks % 4 != 1 or columns_class is None:
            return None
        made: RequestMaker = columns_class().request
        return made

    return manager_backend(
        f"optimized[{device}]",
        manager_class,
        configure=small_thresholds_on_odd_pools,
        request_maker=step_columns_on_every_other_odd_pool,
        device=device,
        max_num_reqs=max_num_reqs,
        **_policy_keywords(eviction_policy),
    )


def backends_named(choice: str, device: str = "cpu", eviction_policy: str = "lru") -> list[Backend]:
    """``reference``, ``optimized`` or ``both`` (the reference first: it is the model), each
    under ``eviction_policy``.

    A lone ``optimized`` is still compared with the reference. ``ValueError`` if the optimized
    backend was asked for and cannot be imported.
    """
    if choice not in ("reference", "optimized", "both"):
        raise ValueError(f"backend must be reference, optimized or both, got {choice!r}")
    chosen = [reference_backend(eviction_policy)]
    if choice != "reference":
        optimized = optimized_backend(device, eviction_policy=eviction_policy)
        if optimized is None:
            raise ValueError("backend optimized: hybridkv.optimized.TorchKVCacheManager is missing")
        chosen.append(optimized)
    return chosen


class AdapterLoadError(ValueError):
    """``--adapter MODULE:FACTORY`` names nothing usable (the message is one line)."""


def load_backend(spec: str) -> Backend:
    """The backend ``MODULE:FACTORY`` names: ``FACTORY`` an ``AdapterFactory`` (called as
    ``factory(config, max_model_len, enable_caching, enable_kv_cache_events, engine)``) in the
    importable module ``MODULE`` (dots allowed in both; the current directory is searched too,
    as ``python -m`` does, also under the ``hybridkv`` script). The backend's name is ``spec``.

    ``AdapterLoadError`` with a one-line message when ``spec`` is not ``MODULE:FACTORY``, the
    module does not import, or the attribute is missing or not callable.
    """
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute or ":" in attribute:
        raise AdapterLoadError(
            f"--adapter must be MODULE:FACTORY (e.g. my_module:make_adapter), got {spec!r}"
        )
    # ``python -m`` puts the current directory on the path; the ``hybridkv`` script does not.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else ""
        raise AdapterLoadError(
            f"--adapter {spec!r}: module {module_name!r} does not import: "
            f"{type(error).__name__}: {reason}"
        ) from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise AdapterLoadError(
                f"--adapter {spec!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise AdapterLoadError(
            f"--adapter {spec!r}: {module_name}.{attribute} is not callable (got "
            f"{type(target).__name__}); it must be an AdapterFactory"
        )
    factory: AdapterFactory = target
    return spec, factory
