"""CPU-backend settings the plugin picks when the user set none and vLLM's own would stop the server.

vLLM's CPU backend binds each worker (TP x PP of them) to a NUMA node of its own and reserves 90% of that node's
memory per worker (`--gpu-memory-utilization`); on a machine with fewer NUMA nodes than workers (a laptop, a CI
runner, most VMs) `vllm serve --tensor-parallel-size 2` stops with "Not enough allowed NUMA nodes", and any
server whose NUMA node has less than that fraction of its memory available stops with "Available memory on node 0
... is less than desired" (the node's memory as vLLM measures it, clamped to a container's limit: the machine's
free memory can look ample where the node's is not). For a BD-LoRA engine (`vllm serve` and the Python API alike)
the plugin then splits the allowed cores between the workers (round-robin where there are more workers than cores)
and gives each a KV cache of a quarter of the available memory divided among them, and logs both with the variable
that overrides it. Nothing is changed where the user set the variable or vLLM's own choice would work.
"""

from __future__ import annotations

import glob
import logging
import os

logger = logging.getLogger("vllm.bdlora")

THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
KV_CACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"  # GiB per worker


def numa_nodes() -> int:
    return max(1, len(glob.glob("/sys/devices/system/node/node[0-9]*")))


# What each process of a server (API server, engine core, every worker) holds before the workers measure the node:
# measured here now, the node must have that much to spare besides what vLLM's check wants (1.7 GiB for a worker
# in-process with its engine core, on CPU).
START_UP_GIB_PER_PROCESS = 1.5


def cpu_defaults(workers: int, environ: dict, cpus: list[int], nodes: int, free_gib: float,
                 total: float = 0.0, utilization: float = 0.9) -> dict[str, str]:  # fmt: skip
    """The settings to add to `environ` (empty where vLLM's own work or the user chose). `free_gib` and `total`: the
    available and whole memory in GiB of the NUMA node vLLM checks, of which it wants `utilization` available (total
    0: not checked) when the workers start, after the server's other processes have taken their share."""
    short_of_memory = total > 0 and free_gib < utilization * total + START_UP_GIB_PER_PROCESS * (workers + 2)
    if workers <= nodes and not short_of_memory:
        return {}
    chosen = {}
    if workers > nodes and THREADS_BIND not in environ and cpus:
        per_worker = len(cpus) // workers
        groups = (
            [cpus[i * per_worker : (i + 1) * per_worker] for i in range(workers)]
            if per_worker
            else [[cpus[i % len(cpus)]] for i in range(workers)]  # more workers than cores: shared, slow, working
        )
        chosen[THREADS_BIND] = "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)
    if environ.get(KV_CACHE_SPACE, "0") in ("", "0"):
        chosen[KV_CACHE_SPACE] = str(max(1, int(free_gib / 4 / workers)))
    return chosen


def apply_cpu_defaults(workers: int, utilization: float = 0.9) -> dict[str, str]:
    """`workers`: the engine's worker processes on this machine (TP x PP); `utilization`: its
    --gpu-memory-utilization (on the CPU backend the fraction of memory vLLM reserves)."""
    from vllm_bdlora.compat import cpu_node_memory_gib

    available, total = cpu_node_memory_gib()
    chosen = cpu_defaults(workers, dict(os.environ), sorted(os.sched_getaffinity(0)), numa_nodes(), available, total,
                          utilization)  # fmt: skip
    for name, value in chosen.items():
        os.environ[name] = value
        what = "cores per worker" if name == THREADS_BIND else "GiB of KV cache per worker"
        logger.info(
            "vllm-bdlora: CPU backend with %d workers on %d NUMA node(s): %s=%s (%s; set it to choose).",
            workers, numa_nodes(), name, value, what,
        )  # fmt: skip
    return chosen
