"""vLLM's CPU backend thread binding with a KV connector configured, and the advice to keep it."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def cpu_reserve_advice(vllm_config: Any) -> str | None:
    """What to set so that a CPU engine with this connector computes with the cores it would
    have without one, or None when nothing needs setting.

    vLLM's CPU backend binds each worker's OpenMP threads to the cores of its NUMA node less
    the cores it reserves for its own processes (scheduler, API server): one per local worker,
    plus one more per worker whenever any KV connector is configured, for connectors that run
    threads of their own. When a node has no more cores than that, it reserves none at all,
    and the OpenMP threads then share their cores with the engine's processes: on a 2-core
    machine a batch decoded at a quarter of the speed with a connector configured, even one
    doing nothing (benchmarks/bench_vllm_binding.py). This connector copies at the step
    boundary on the worker's own thread (CPU caches) and needs no reserved core, so the
    reservation an engine without a connector gets is the right one:
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` set to the number of local workers."""
    import os

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None  # the operator binds the threads explicitly
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        return None
    pc = vllm_config.parallel_config
    workers = getattr(pc, "local_world_size", None) or (
        pc.tensor_parallel_size * pc.pipeline_parallel_size
    )
    return f"VLLM_CPU_NUM_OF_RESERVED_CPU={workers}"


def _check_cpu_binding(vllm_config: Any) -> None:
    try:
        advice = cpu_reserve_advice(vllm_config)
    except Exception:  # a config attribute moved: the advice is only advice
        logger.debug("could not check vLLM's CPU thread binding", exc_info=True)
        return
    if advice:
        logger.warning(
            "KVStoreConnector on vLLM's CPU backend: vLLM reserves an extra core per worker for "
            "any KV connector (on a small machine it then reserves none, and the forward pass "
            "runs several times slower); this connector needs none: start the engine with %s "
            "to keep the binding an engine without a connector has",
            advice,
        )
