"""What operators and routers see of adapters on the server's `/metrics`.

vLLM exports one LoRA gauge, `vllm:lora_requests_info`, which counts requests per adapter in flight, not where
adapters are resident. A BD-LoRA server also exports, from what its workers see (the engine core asks them between
steps; the API server polls the engine core every `METRICS_POLL_S`):

* residency, under the names of vLLM's open proposals (#54830, #45820) so that routers written for them work
  unchanged: `vllm:lora_adapter_loaded{adapter_name,level="gpu"|"cpu",pinned}` (1 while the adapter holds a GPU
  slot, or is kept in host memory), `vllm:num_gpu_loaded_lora_adapters`, `vllm:num_cpu_loaded_lora_adapters`,
  `vllm:lora_cache_lookups_total{level}` / `vllm:lora_cache_hits_total{level}` (one lookup per adapter per engine step
  at the GPU level, one per slot fill (in a step or ahead of it) at the CPU level, a hit where the adapter is in host
  memory: vLLM's host cache or what the worker kept of it, not a spill file). A name vLLM registers itself is left to
  vLLM.
* `vllm_bdlora:lora_slots{state="used"|"total"}`, `vllm_bdlora:adapters_kept{where="memory"|"spilled"}`,
  `vllm_bdlora:adapter_host_bytes`, `vllm_bdlora:adapter_loads_total{kind}` and `vllm_bdlora:adapter_load_seconds{kind}`
  (kind "admission": files read, checked and cut, off the engine's step; "reread": a load from what a worker kept;
  "restore": read back from a spill file inside a step; "restore_ahead": read back from a spill file off the step,
  when a request named it; "in_step": an adapter the engine had not admitted, read inside a step; "slot_fill": one
  per adapter a step copied into a GPU slot, the host time that step spent making its adapters resident shared evenly
  among them, including any reread, restore or in_step load within it: what the step's requests waited for fills;
  "slot_fill_ahead": one per adapter copied into a GPU slot between steps, as a request named it, the host time it
  took (no step waits for it; that adapter's first step then finds it in its slot, a GPU hit);
  "add_lora": vLLM's add_lora on a worker for a load request, which the engine loop waits for (with BD-LoRA the
  adapters one poll found ready, one after another in one call; without, one call per load): with BD-LoRA taking
  what the admission thread read, keeping it in vLLM's host cache and copying it into a GPU slot; without, reading
  the files too (also counted as "admission") before the same),
  `vllm_bdlora:engine_step_seconds`, `vllm_bdlora:adapter_refusals_total{reason}`;
* `vllm_bdlora:requests_held_total{reason}`: each time the scheduler took a waiting request out of one step
  (`vllm_bdlora.scheduling.HOLD_REASONS`: "slot_fill", it sat out the step while its adapter was filled into a GPU
  slot beside it, once per request at most; "starved_adapter", another adapter's request had waited past
  `lora_wait_limit_s` for a slot, once per request and step): what the holds cost in steps waited;
* `vllm_bdlora:slot_fills_in_step_total{cause}`: each "slot_fill" load again, by why no fill ahead of the step made it
  (`IN_STEP_CAUSES`: "not_named", no fill ahead named the adapter; "no_slot", one did, but every slot held an adapter
  with requests in the engine; "not_in_memory", one did while the adapter was spilled or being read back; "evicted",
  it was filled ahead and lost that slot before its step);
* `vllm_bdlora:admission_stage_seconds_total{stage,clock}`: where the admission threads' time went, per stage of an
  admission (`ADMISSION_STAGES`), by the wall clock and by the thread's own CPU clock (`StageClock`), summed over the
  admissions that succeeded (divide by `adapter_loads_total{kind="admission"}` for one adapter's): wall minus CPU is
  time the thread waited, for the interpreter lock above all while other threads of its worker run Python;
* per adapter, from the API server's own requests: `vllm_bdlora:adapter_requests_total`,
  `vllm_bdlora:adapter_prompt_tokens_total`, `vllm_bdlora:adapter_generation_tokens_total`,
  `vllm_bdlora:adapter_ttft_seconds` and `vllm_bdlora:adapter_tpot_seconds` (histograms), `{adapter_name}`.

Cardinality is bounded: the first `metrics_max_adapters` adapter names (100 by default) get a label value of their
own, every later one shares `adapter_name="other"`; 0 exports no adapter name at all (only the totals, under
"other"). `/metrics` needs `--api-key` where one is set (`vllm_bdlora.access`). Counters never go backwards: the
workers' counts only grow, and the API server adds their growth.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from vllm_bdlora.access import METRICS_OVERFLOW_LABEL
from vllm_bdlora.adapter_lifecycle.calls import WORKER_METHOD, AdapterFigures

logger = logging.getLogger("vllm.bdlora")

METRICS_POLL_S = 2.0
OTHER = METRICS_OVERFLOW_LABEL
# Loads of 8B-sized adapters take milliseconds from memory and seconds from slow disks.
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
# Bounds at most 1.5x apart from 50 ms to 30 s (1.25x from 4 s to 10 s), where queueing for a slot puts first tokens:
# a quantile read from the buckets (`vllm-bdlora top`, PromQL's histogram_quantile) lies within its bucket.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.5,
                10.0, 15.0, 20.0, 30.0, 60.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
LOAD_KINDS = ("admission", "add_lora", "reread", "restore", "restore_ahead", "in_step", "slot_fill", "slot_fill_ahead")
# An admission's stages (`adapter_lifecycle.read_and_cut.read_adapter`): its files opened, mapped and their header and
# config checked; every module checked and cut to the rank's share; a region of host memory taken for its slot image
# (pinned, where no freed one is left, on a GPU); the shares copied into the image; vLLM's LoRAModel built over them;
# their values checked; the rest (magnitudes, scaling, packing ahead).
ADMISSION_STAGES = ("open", "cut", "region", "image", "vllm_model", "check", "finish")
# Why a step filled a slot itself rather than finding its adapter filled ahead (`adapter_lifecycle.fill_ahead`): no
# fill ahead named it; one did but no slot was left that no request needed; one did while the adapter was spilled or
# being read back; or it was filled ahead and lost that slot before its step.
IN_STEP_CAUSES = ("not_named", "no_slot", "not_in_memory", "evicted")
CLOCKS = ("wall", "cpu")


class StageClock:
    """Wall and thread-CPU seconds between laps, summed per stage: `lap(stage)` charges the time since the previous
    lap (or the clock's start) to `stage`. CPU time is the calling thread's own (`time.thread_time`): a thread waiting
    for the interpreter lock, a page or a file accrues wall time only."""

    def __init__(self):
        self.laps: dict[str, tuple[float, float]] = {}
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def lap(self, stage: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        spent_wall, spent_cpu = self.laps.get(stage, (0.0, 0.0))
        self.laps[stage] = (spent_wall + wall - self._wall, spent_cpu + cpu - self._cpu)
        self._wall, self._cpu = wall, cpu


class Histogram:
    """Cumulative bucket counts and a sum, as worker and engine processes keep them until they are polled."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        self.counts[index] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> dict:
        return {"counts": list(self.counts), "sum": self.total}


class WorkerAdapterStats:
    """One worker's counts: lookups and hits per level, and loads by kind with their durations."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lookups = defaultdict(int)
        self.hits = defaultdict(int)
        self.loads = {kind: Histogram(LOAD_BUCKETS) for kind in LOAD_KINDS}
        self.stage_seconds = {stage: [0.0, 0.0] for stage in ADMISSION_STAGES}  # [wall, cpu]
        self.in_step_causes = dict.fromkeys(IN_STEP_CAUSES, 0)

    def record_lookups(self, manager, adapter_ids, kept_in_memory: Callable[[int], bool] | None = None) -> int:
        """Per step, per adapter the step needs: in a GPU slot already (a GPU hit), else in host memory (a CPU hit):
        vLLM's host cache or, with BD-LoRA, what the worker kept at admission (`kept_in_memory(id)`, asked only on a
        GPU miss; a spilled adapter is read back from disk, a miss as stock's read from the adapter's files is). So the
        CPU hit rate means the same with BD-LoRA, whose host tier is its store and not vLLM's cache, as without.
        Returns the GPU misses: the slots the step is about to fill."""
        active = getattr(manager, "_active_adapters", {})
        registered = manager.list_adapters()
        misses = 0
        with self.lock:
            for adapter_id in adapter_ids:
                self.lookups["gpu"] += 1
                if adapter_id in active:
                    self.hits["gpu"] += 1
                    continue
                misses += 1
                self.lookups["cpu"] += 1
                self.hits["cpu"] += adapter_id in registered or bool(kept_in_memory and kept_in_memory(adapter_id))
        return misses

    def record_fills(self, fills: int, seconds: float) -> None:
        """A step that copied `fills` adapters into GPU slots and spent `seconds` making its adapters resident: one
        "slot_fill" load per adapter, each its even share (the step's total, which is what its requests waited, is
        exact; vLLM copies a step's adapters in one call, so no finer split is measured)."""
        with self.lock:
            for _ in range(fills):
                self.loads["slot_fill"].observe(seconds / fills)

    def record_in_step_causes(self, causes) -> None:
        """Each of a step's own slot fills, by its cause (`IN_STEP_CAUSES`)."""
        with self.lock:
            for cause in causes:
                self.in_step_causes[cause] += 1

    def record_fill_ahead(self, seconds: float) -> None:
        """An adapter copied into a GPU slot between steps, from host memory (`fill_ahead.py`): a "slot_fill_ahead"
        load, and a host-memory lookup that hit, as the fill in a step would have counted (so the CPU level counts
        every fill, wherever it ran; the step that runs the adapter then counts a GPU hit)."""
        with self.lock:
            self.loads["slot_fill_ahead"].observe(seconds)
            self.lookups["cpu"] += 1
            self.hits["cpu"] += 1

    def record_load(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.loads[kind].observe(seconds)

    def record_stages(self, laps: dict[str, tuple[float, float]]) -> None:
        """One admission's `StageClock.laps`."""
        with self.lock:
            for stage, (wall, cpu) in laps.items():
                spent = self.stage_seconds[stage]
                spent[0] += wall
                spent[1] += cpu

    def snapshot(self, worker_manager, store) -> dict:
        manager = worker_manager._adapter_manager
        names = store.names() if store is not None else {}
        with self.lock:
            counts = {"lookups": dict(self.lookups), "hits": dict(self.hits),
                      "loads": {kind: h.snapshot() for kind, h in self.loads.items()},
                      "admission_stages": {stage: list(spent) for stage, spent in self.stage_seconds.items()},
                      "in_step_causes": dict(self.in_step_causes)}  # fmt: skip
        return {
            **counts,
            "gpu": [i for i in manager.lora_index_to_id if i is not None],
            "cpu": sorted(set(manager.list_adapters()) | (store.resident_ids() if store is not None else set())),
            "pinned": sorted(getattr(getattr(manager, "_registered_adapters", None), "pinned", ()) or ()),
            "spilled": sorted(store.spilled_ids()) if store is not None else [],
            "slots": manager.lora_slots,
            "host_bytes": store.resident_bytes if store is not None else 0,
            "names": names,
        }


class EngineStepStats:
    """The engine core's step durations (steps that ran the model)."""

    def __init__(self):
        self.steps = Histogram(STEP_BUCKETS)

    def timed(self, step):
        started = time.perf_counter()
        result = step()
        if result:
            self.steps.observe(time.perf_counter() - started)
        return result


def engine_step_stats(core) -> EngineStepStats:
    stats = getattr(core, "_bdlora_step_stats", None)
    if stats is None:
        stats = core._bdlora_step_stats = EngineStepStats()
    return stats


class WorkerFigures:
    """The workers' adapter figures as the engine core last asked for them, asked again only once something else has
    reached the workers since (a model step, an adapter load, an admission's progress, an unload): a worker that is
    asked wakes and spins on vLLM's shared-memory queue for a second before it sleeps again, so asking at every
    poll would keep the workers of an idle server at half a core each."""

    def __init__(self, executor):
        self.calls = 0  # the executor's calls to its workers, other than these figures'
        self.refreshed_at: tuple[int, int] | None = None
        self.figures: dict = {}
        self._ask = executor.collective_rpc

        def counted(*args, **kwargs):
            self.calls += 1
            return self._ask(*args, **kwargs)

        executor.collective_rpc = counted

    def current(self, steps: int) -> dict:
        """`steps`: the engine's model steps so far (an executor may run them without a call counted here)."""
        if self.refreshed_at != (self.calls, steps):
            self.figures = merge_worker_snapshots(self._ask(WORKER_METHOD, args=(AdapterFigures(),)))
            self.refreshed_at = (self.calls, steps)
        return self.figures


def worker_figures(executor) -> WorkerFigures:
    figures = getattr(executor, "_bdlora_worker_figures", None)
    if figures is None:
        figures = executor._bdlora_worker_figures = WorkerFigures(executor)
    return figures


def merge_worker_snapshots(snapshots: list) -> dict:
    """One view of the ranks: an adapter is in GPU slots or host memory only where every rank has it there (ranks
    move together; a rank that differs is mid-move); counts are the first rank's (every rank counts the same
    steps)."""
    if not snapshots:
        return {}
    first = snapshots[0]
    merged = dict(first)
    for level in ("gpu", "cpu", "spilled"):
        common = set(first[level])
        for other in snapshots[1:]:
            common &= set(other[level])
        merged[level] = sorted(common)
    merged["names"] = {int(k): v for s in snapshots for k, v in s["names"].items()}
    return merged


class AdapterMetrics:
    """The API server's adapter metrics (see the module's docstring): per-adapter request metrics it observes itself,
    and a collector that exports the engine's latest polled figures as they are (cumulative counts included)."""

    def __init__(self, max_adapters: int, registry=None):
        from prometheus_client import REGISTRY

        self.registry = registry or REGISTRY
        self.max_adapters = max_adapters
        self.latest: dict = {}
        self._labelled: set[str] = set()
        self._lock = threading.Lock()
        self.refusals = self._counter("vllm_bdlora:adapter_refusals", "Refused adapter loads by reason.", ["reason"])
        self.requests = self._counter("vllm_bdlora:adapter_requests", "Finished requests per adapter.",
                                      ["adapter_name"])  # fmt: skip
        self.prompt_tokens = self._counter("vllm_bdlora:adapter_prompt_tokens", "Prompt tokens per adapter.",
                                           ["adapter_name"])  # fmt: skip
        self.generation_tokens = self._counter("vllm_bdlora:adapter_generation_tokens",
                                               "Generated tokens per adapter.", ["adapter_name"])  # fmt: skip
        self.ttft = self._histogram("vllm_bdlora:adapter_ttft_seconds", "Time to first token per adapter.",
                                    ["adapter_name"], TTFT_BUCKETS)  # fmt: skip
        self.tpot = self._histogram("vllm_bdlora:adapter_tpot_seconds", "Time per output token per adapter.",
                                    ["adapter_name"], TPOT_BUCKETS)  # fmt: skip
        self.registry.register(EngineAdapterCollector(self))

    # -- registration that leaves vLLM's own metrics alone ------------------------------------------------------------
    def taken(self, name: str) -> bool:
        names = getattr(self.registry, "_names_to_collectors", {})
        return any(n in names for n in (name, f"{name}_total", f"{name}_bucket"))

    def _counter(self, name, documentation, labels=()):
        from prometheus_client import Counter

        return None if self.taken(name) else Counter(name, documentation, list(labels), registry=self.registry)

    def _histogram(self, name, documentation, labels, buckets):
        from prometheus_client import Histogram as PromHistogram

        return None if self.taken(name) else PromHistogram(name, documentation, list(labels), buckets=buckets,
                                                            registry=self.registry)  # fmt: skip

    # -- adapter names under the cap ----------------------------------------------------------------------------------
    def label(self, name: str | None) -> str:
        if not name:
            return OTHER
        with self._lock:
            if name in self._labelled:
                return name
            if len(self._labelled) < self.max_adapters:
                self._labelled.add(name)
                return name
        return OTHER

    def forget(self, name: str) -> None:
        """An unloaded adapter: its series go (a later load of the name starts them again) and its label's place
        under the cap is free."""
        with self._lock:
            if name not in self._labelled:
                return
            self._labelled.discard(name)
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot):
            if metric is not None:
                try:
                    metric.remove(name)
                except KeyError:
                    pass  # no request of it finished

    # -- the API server's own requests -----------------------------------------------------------------------------
    def on_output(self, req_stats, lora_name: str | None, first_token_latency: float | None) -> None:
        """A request's output: its first (`first_token_latency` given) or a later one. The adapter's name rides on
        vLLM's per-request statistics object, which the request's end hands back to `on_finished`."""
        if lora_name is None:
            return
        req_stats.bdlora_adapter = lora_name
        if first_token_latency is not None and self.ttft is not None:
            self.ttft.labels(self.label(lora_name)).observe(first_token_latency)

    def on_finished(self, req_stats, prompt_tokens: int, generation_tokens: int, tpot: float) -> None:
        lora_name = getattr(req_stats, "bdlora_adapter", None)
        if lora_name is None:
            return
        label = self.label(lora_name)
        for metric, amount in ((self.requests, 1), (self.prompt_tokens, prompt_tokens),
                               (self.generation_tokens, generation_tokens)):  # fmt: skip
            if metric is not None and amount:
                metric.labels(label).inc(amount)
        if self.tpot is not None and generation_tokens > 1:
            self.tpot.labels(label).observe(tpot)

    def on_refusal(self, reason: str) -> None:
        if self.refusals is not None:
            self.refusals.labels(reason).inc()

    async def poll(self, engine_client, interval_s: float = METRICS_POLL_S) -> None:
        while True:
            try:
                self.latest = await engine_client.engine_core.call_utility_async("bdlora_adapter_stats")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # an engine that is gone or busy: keep the last figures
                logger.debug("vllm-bdlora: adapter metrics not refreshed: %s", e)
            await asyncio.sleep(interval_s)


class EngineAdapterCollector:
    """Exports the engine's latest polled figures at each scrape: residency gauges, and the workers' and engine
    core's cumulative counts and histograms as they are."""

    def __init__(self, metrics: AdapterMetrics):
        self.metrics = metrics

    def describe(self):
        return []  # names are only known to be free at scrape time (vLLM may register some later)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        metrics, stats = self.metrics, self.metrics.latest
        workers = stats.get("workers") or {}
        families = []

        def add(family):
            if not metrics.taken(family.name):
                families.append(family)

        if workers:
            names = {int(k): v for k, v in workers["names"].items()}
            gpu, cpu, pinned = set(workers["gpu"]), set(workers["cpu"]), set(workers["pinned"])
            loaded = GaugeMetricFamily("vllm:lora_adapter_loaded", "1 while the adapter is resident at that level.",
                                       labels=["adapter_name", "level", "pinned"])  # fmt: skip
            for level, members in (("gpu", gpu), ("cpu", cpu)):
                for adapter_id in sorted(members):
                    loaded.add_metric([metrics.label(names.get(adapter_id)), level, str(adapter_id in pinned).lower()],
                                      1)  # fmt: skip
            add(loaded)
            add(GaugeMetricFamily("vllm:num_gpu_loaded_lora_adapters", "Adapters holding a GPU LoRA slot.", len(gpu)))
            add(GaugeMetricFamily("vllm:num_cpu_loaded_lora_adapters", "Adapters kept in host memory.", len(cpu)))
            slots = GaugeMetricFamily("vllm_bdlora:lora_slots", "GPU LoRA slots, used and in total.",
                                      labels=["state"])  # fmt: skip
            slots.add_metric(["used"], len(gpu))
            slots.add_metric(["total"], workers["slots"])
            add(slots)
            kept = GaugeMetricFamily("vllm_bdlora:adapters_kept", "Admitted adapters kept, in memory or spilled.",
                                     labels=["where"])  # fmt: skip
            kept.add_metric(["memory"], len(cpu))
            kept.add_metric(["spilled"], len(workers["spilled"]))
            add(kept)
            host = "Bytes of adapters kept in host memory, per worker."
            add(GaugeMetricFamily("vllm_bdlora:adapter_host_bytes", host, workers["host_bytes"]))
            caches = (("vllm:lora_cache_lookups", "lookups", "Adapter lookups per level."),
                      ("vllm:lora_cache_hits", "hits", "Lookups that found it at that level."))  # fmt: skip
            for name, key, documentation in caches:
                family = CounterMetricFamily(name, documentation, labels=["level"])
                for level in ("gpu", "cpu"):
                    family.add_metric([level], workers[key].get(level, 0))
                add(family)
            loads = CounterMetricFamily("vllm_bdlora:adapter_loads", "Adapter loads by kind.", labels=["kind"])
            seconds = HistogramMetricFamily("vllm_bdlora:adapter_load_seconds", "Adapter load durations by kind.",
                                            labels=["kind"])  # fmt: skip
            for kind, snapshot in workers["loads"].items():
                loads.add_metric([kind], sum(snapshot["counts"]))
                seconds.add_metric([kind], cumulative_buckets(LOAD_BUCKETS, snapshot["counts"]), snapshot["sum"])
            add(loads)
            add(seconds)
            stages = CounterMetricFamily("vllm_bdlora:admission_stage_seconds",
                                         "Admission threads' seconds per stage, wall and thread CPU.",
                                         labels=["stage", "clock"])  # fmt: skip
            for stage, spent in (workers.get("admission_stages") or {}).items():
                for clock, value in zip(CLOCKS, spent, strict=True):
                    stages.add_metric([stage, clock], value)
            add(stages)
            causes = CounterMetricFamily("vllm_bdlora:slot_fills_in_step",
                                         "Slot fills a step made itself, by why none was made ahead of it.",
                                         labels=["cause"])  # fmt: skip
            for cause, count in (workers.get("in_step_causes") or {}).items():
                causes.add_metric([cause], count)
            add(causes)
        if "steps" in stats:
            steps = HistogramMetricFamily("vllm_bdlora:engine_step_seconds", "Engine steps that ran the model.")
            steps.add_metric([], cumulative_buckets(STEP_BUCKETS, stats["steps"]["counts"]), stats["steps"]["sum"])
            add(steps)
        if "held" in stats:
            held = CounterMetricFamily("vllm_bdlora:requests_held", "Waiting requests held out of a step, by reason.",
                                       labels=["reason"])  # fmt: skip
            for reason, count in stats["held"].items():
                held.add_metric([reason], count)
            add(held)
        return families


def latest_engine_figures() -> list:
    """The engine's adapter figures as this process last polled them (none before its first poll), for registries
    built apart from the process's own: vLLM's merged multiprocess registry."""
    metrics = current_metrics()
    return [] if metrics is None else EngineAdapterCollector(metrics).collect()


def cumulative_buckets(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    total, buckets = 0, []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return buckets


_metrics: AdapterMetrics | None = None


def adapter_metrics(max_adapters: int) -> AdapterMetrics:
    global _metrics
    if _metrics is None:
        _metrics = AdapterMetrics(max_adapters)
    return _metrics


def current_metrics() -> AdapterMetrics | None:
    return _metrics


REFUSAL_REASONS = (
    ("is not allowed: a name is", "name"),
    ("without control characters", "path"),
    ("allowed adapter directories", "outside_roots"),
    ("no room for it on this server", "no_room"),
    ("were not read on every worker within", "timeout"),
    ("changed while", "files_changed"),
    ("holds NaN or Inf", "values"),
    ("over the limit", "values"),
    ("needs LoRA width", "width"),
    ("adapter_config.json", "files"),
    ("adapter_model.safetensors", "files"),
)


def refusal_reason(message: str, status: int) -> str:
    """The `reason` label of a refused load, from its answer."""
    if status == 404:
        return "not_found"
    return next((reason for phrase, reason in REFUSAL_REASONS if phrase in message), "invalid")
