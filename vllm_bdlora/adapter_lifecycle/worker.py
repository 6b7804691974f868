"""The worker's entry points into the adapter lifecycle (every worker process), each called by one patch of vLLM's
worker-side LoRA machinery, and `WorkerAdapters`, the one object per worker that owns what the worker keeps of its
adapters (`store.py`) and its counts (`vllm_bdlora.metrics`).

* `answer_admission_call`: the engine core's admission calls (`calls.py`): begin reading on admission threads,
  report states, complete the ready ones (vLLM's add_lora of each), forget, report figures, read spilled adapters
  back ahead of the steps that need them.
* `add_lora_reporting_failures`: vLLM's add_lora on one rank, answering a receipt or a failure instead of raising.
* `fill_ahead` (`WorkerAdapters.fill_ahead`, on the engine core's `calls.RestoreAhead`): an adapter a request just
  named, in host memory but in no GPU slot, copied into a slot between steps (`fill_ahead.py`).
* `fill_for_waiting_requests`: after a step is launched, the adapters its waiting requests need, copied into slots
  beside it (`fill_ahead.WaitingAdapters`, named by the engine core's scheduler).
* `load_adapter`: vLLM's `_load_adapter`, which fills a GPU slot: the adapter comes from the store (the result of its
  admission, kept in host memory or read back from a spill file), never from its files again.
* `apply_in_id_order`: the adapters a step needs, in the same order on every rank, counted as lookups; the step waits
  for the fills made ahead of it.
* `remove_adapter`: an unload: GPU slot and host cache (vLLM's), and everything the store kept.
* `admission_leaves_engine_caches`: whether an adapter being admitted stops at the store (no room in vLLM's host
  cache or GPU slots: its first request's step takes room).
* `register_kept_before_pin`: a pin of an adapter the store keeps but vLLM's host cache does not hold registers it
  first, as vLLM's pin requires.
* `wait_for_engine_message`: while the worker admits adapters and the engine runs no steps, its main thread waits for
  the engine core's next message without spinning for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable

from vllm_bdlora.adapter_lifecycle.calls import (
    AdapterFigures,
    AdmissionCall,
    AdmissionReceipt,
    AdmissionStates,
    BeginAdmissions,
    CompleteAdmissions,
    ForgetAdmissions,
    RestoreAhead,
)
from vllm_bdlora.adapter_lifecycle.fill_ahead import (
    WAITING_ADAPTERS,
    AheadFills,
    clear,
    make_room_for_step,
    room_for,
)
from vllm_bdlora.adapter_lifecycle.finish import finish_admission
from vllm_bdlora.adapter_lifecycle.read_and_cut import AdmittedAdapter, read_adapter, read_on
from vllm_bdlora.adapter_lifecycle.store import ADMISSIONS_READING, AdapterStore, host_budget_bytes
from vllm_bdlora.adapter_lifecycle.targets import tensor_parallel_size
from vllm_bdlora.adapters import (
    AdapterFormat,
    AdapterLoadFailure,
    AdapterRejected,
    read_adapter_format,
    refuse_unserved_kinds,
)
from vllm_bdlora.compat import adapter_absolute_path, lora_warm_up, without_load_inplace
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.manager import is_first_tp_rank
from vllm_bdlora.metrics import WorkerAdapterStats
from vllm_bdlora.scheduling import queued_after

logger = logging.getLogger("vllm.bdlora")

# How long a worker's main thread waits for the engine core's next message, at most, before it re-reads the queue
# while the worker admits adapters (`wait_for_engine_message`).
IDLE_RECHECK_MS = 1


class StepClock:
    """When this process last ran an engine step (`apply_in_id_order`, which every step with LoRA enabled calls)."""

    def __init__(self):
        self.last = float("-inf")

    def mark(self) -> None:
        self.last = time.monotonic()

    def since(self) -> float:
        return time.monotonic() - self.last


STEPS = StepClock()

# True while a worker loads an adapter for an add_lora call (admission), as opposed to a step's request.
_admitting = contextvars.ContextVar("bdlora_admitting", default=False)


@contextlib.contextmanager
def admitting():
    token = _admitting.set(True)
    try:
        yield
    finally:
        _admitting.reset(token)


class WorkerAdapters:
    """One worker's adapters: its store (made on first use, BD-LoRA on only) and its counts. `of` is the one way to
    reach it from vLLM's worker LoRA manager."""

    ATTRIBUTE = "_bdlora_adapters"  # the one attribute vllm-bdlora sets on vLLM's WorkerLoRAManager

    def __init__(self, worker_manager):
        self.worker_manager = worker_manager
        self.stats = WorkerAdapterStats()
        self.kept: AdapterStore | None = None  # None until BD-LoRA first admits an adapter here
        self.ahead = AheadFills(getattr(worker_manager, "device", None))
        self.waiting_keep: frozenset[int] = frozenset()  # the latest step's adapters with requests in the engine
        self.waiting_behind: tuple[int, ...] = ()  # its waiting adapters, in the order the scheduler takes them
        # adapter id -> why a step would still fill it, from the latest fill ahead that named it (`IN_STEP_CAUSES`);
        # dropped when a step runs it
        self.ahead_outcome: dict[int, str] = {}

    @classmethod
    def of(cls, worker_manager) -> WorkerAdapters:
        adapters = getattr(worker_manager, cls.ATTRIBUTE, None)
        if adapters is None:
            adapters = cls(worker_manager)
            setattr(worker_manager, cls.ATTRIBUTE, adapters)
        return adapters

    @property
    def manager(self):
        """vLLM's LoRA model manager (GPU slots, its host cache)."""
        return self.worker_manager._adapter_manager

    @property
    def settings(self) -> BdLoraSettings:
        return getattr(self.manager, "_bdlora_settings", None) or BdLoraSettings()

    @property
    def store(self) -> AdapterStore:
        if self.kept is None:
            from vllm.platforms import current_platform

            settings = self.settings
            threads = settings.admission_threads or (1 if current_platform.is_cpu() else 2)
            budget = host_budget_bytes(settings.adapter_host_memory, tensor_parallel_size(self.manager))
            self.kept = AdapterStore(budget, settings.adapter_spill_dir, threads, settings.named_kept_s)
        return self.kept

    # -- the engine core's calls ----------------------------------------------------------------------------------
    def answer(self, call: AdmissionCall, add_lora: Callable | None = None):
        """`add_lora`: the worker's own add_lora (vLLM's, through `add_lora_reporting_failures`)."""
        match call:
            case CompleteAdmissions(requests=requests):
                return [add_lora(request) for request in requests]
            case BeginAdmissions(requests=requests):
                device = getattr(self.worker_manager, "device", None)
                for request in requests:
                    read = functools.partial(read_on, device, self.worker_manager, request, self.settings,
                                             self.stats.record_stages)  # fmt: skip
                    self.store.begin(request.lora_int_id, request.lora_name, read)
                return True
            case AdmissionStates(adapter_ids=ids):
                return self.store.status(list(ids))
            case ForgetAdmissions(adapter_ids=ids):
                return [self.store.forget(adapter_id) for adapter_id in ids]
            case AdapterFigures():
                return self.stats.snapshot(self.worker_manager, self.kept)
            case RestoreAhead(adapter_ids=ids, begin=begin, fill=fill, keep=keep):
                if self.kept is None:
                    return []
                if not begin:
                    return self.kept.reading_back(list(ids))
                # an adapter vLLM's host cache holds fills its slot from there: the store's copy is not needed
                registered = self.manager._registered_adapters
                reading = self.kept.restore_ahead(
                    [i for i in ids if i not in registered],
                    lambda seconds: self.stats.record_load("restore_ahead", seconds),
                )
                if self.settings.fill_slots_ahead:
                    self.fill_ahead([request.lora_int_id for request in fill], keep, reading)
                return reading
        raise TypeError(f"vllm-bdlora: not an admission call: {type(call).__name__}")

    def receipt(self, lora_request, loaded: bool) -> AdmissionReceipt:
        admitted = self.kept.get(lora_request.lora_int_id) if self.kept is not None else None
        return AdmissionReceipt(bool(loaded), admitted.identity if admitted else None)

    # -- a slot fill ------------------------------------------------------------------------------------------------
    def fill_ahead(self, adapter_ids, keep=frozenset(), reading=(), behind=()) -> int:
        """Copy each adapter of `adapter_ids` that no GPU slot holds, but vLLM's host cache or this worker's memory
        does (not `reading`: being read back), into a slot no adapter of `keep` holds, or else one whose adapter waits
        behind it (`behind`: waiting adapters in the order the scheduler takes them), now rather than in the step
        that runs it (`fill_ahead.py`); stops at the first for which no such slot is left. Returns how many it
        filled."""
        manager, filled, full, outcome = self.manager, 0, False, self.ahead_outcome
        for adapter_id in adapter_ids:
            if adapter_id in manager._active_adapters:
                continue
            registered = adapter_id in manager._registered_adapters
            in_memory = registered or (self.kept is not None and self.kept.in_memory(adapter_id))
            if adapter_id in reading or not in_memory:
                outcome[adapter_id] = "not_in_memory"
                continue
            room = None if full else room_for(manager, adapter_id, keep, queued_after(behind, adapter_id))
            if room is None:  # none left for this one, nor for those after it
                full = True
                outcome[adapter_id] = "no_slot"
                continue
            started = time.perf_counter()
            with self.ahead.filling(room.slot):
                clear(manager, room)
                if not registered:  # from what this worker kept: a reread, as a step's load from the store is
                    registered = self.register_kept(adapter_id)
                    self.stats.record_load("reread", time.perf_counter() - started)
                if registered:
                    manager.activate_adapter(adapter_id)
            if not registered:
                outcome[adapter_id] = "not_in_memory"
                continue
            outcome[adapter_id] = "evicted"  # should a step still fill it, it lost this slot before
            self.stats.record_fill_ahead(time.perf_counter() - started)
            keep = keep | {adapter_id}  # its request is on its way to the scheduler
            filled += 1
        return filled

    def load(self, lora_request, read: Callable):
        """vLLM's `_load_adapter` with vllm-bdlora's rules: `read(request)` is vLLM's own reader, used only with BD-LoRA
        off. With it on, the adapter comes from the store: the result of its admission (begun by the engine core
        before this call), or what was kept when it was admitted. Only an adapter this worker never admitted is read
        here, inside the call (vLLM's own behaviour for a request naming an adapter the engine has not seen, which the
        engine core holds back until its admission is done where it can)."""
        settings = self.settings
        if not settings.enabled:
            return self._load_unadmitted(lora_request, read, settings)
        store, stats = self.store, self.stats
        adapter_id = lora_request.lora_int_id
        started = time.perf_counter()
        read_for = store.reading_seconds(adapter_id)
        admitted = store.take_staged(adapter_id, timeout=settings.adapter_load_timeout_s)
        if admitted is not None:
            stats.record_load("admission", read_for or 0.0)
        if admitted is None and getattr(lora_request, "load_inplace", False) and _admitting.get():
            store.forget(adapter_id)  # an in-place reload that was not begun ahead: read it again now
        if admitted is None:
            spilled = store.needs_restore(adapter_id)
            admitted = store.get(adapter_id)
            if admitted is not None:
                stats.record_load("restore" if spilled else "reread", time.perf_counter() - started)
        if admitted is None:
            admitted = read_adapter(self.worker_manager, lora_request, settings)
            store.keep(adapter_id, admitted)
            stats.record_load("in_step", time.perf_counter() - started)
        try:
            finish_admission(admitted, adapter_id)
        except BaseException:
            store.forget(adapter_id)
            raise
        if not admitted.logged:
            admitted.logged = True
            if is_first_tp_rank(self.manager):
                log_admission(admitted)
        return admitted.fresh_model()

    def _load_unadmitted(self, lora_request, read: Callable, settings: BdLoraSettings):
        """BD-LoRA off: vLLM's own load, after refusing the adapter kinds this server does not serve; timed for
        /metrics as it runs (in add_lora, or in a step)."""
        name = lora_request.lora_name
        try:
            fmt = read_adapter_format(adapter_absolute_path(lora_request.lora_path), name)
        except AdapterRejected:
            raise
        except (OSError, ValueError):
            fmt = AdapterFormat(None, dora=False)  # vLLM's own reader reports missing or unreadable adapters
        refuse_unserved_kinds(fmt, settings, name)
        started = time.perf_counter()
        lora_model = read(lora_request)
        self.stats.record_load("admission" if _admitting.get() else "in_step", time.perf_counter() - started)
        return lora_model

    def register_kept(self, adapter_id: int) -> bool:
        """Register an admitted adapter that vLLM's host cache does not hold (an admission left it out, or the cache
        dropped it since) from what the store kept, as a step's load would (the least recently used cache entry
        makes room). False where there is nothing to do: BD-LoRA off, registered already, or not kept here."""
        manager = self.manager
        if not self.settings.enabled or self.kept is None or adapter_id in manager._registered_adapters:
            return False
        admitted = self.kept.get(adapter_id)
        if admitted is None:
            return False
        finish_admission(admitted, adapter_id)
        if len(manager._registered_adapters) + 1 > manager.capacity:
            manager.remove_oldest_adapter()
        return bool(manager.add_adapter(admitted.fresh_model()))

    # -- an unload --------------------------------------------------------------------------------------------------
    def forget_removed(self, adapter_id: int, removed: bool) -> bool:
        """After vLLM removed `adapter_id` (`removed`: whether it held it): drop what the store kept of it too."""
        name = self.kept.forget(adapter_id) if self.kept is not None else None
        self.ahead_outcome.pop(adapter_id, None)
        if name is not None and is_first_tp_rank(self.manager):
            logger.info("vllm-bdlora: adapter '%s' removed from the engine (GPU slot, host cache, what each worker "
                        "kept of it)", name)  # fmt: skip
        return bool(removed or name)


# -- what the patches call ---------------------------------------------------------------------------------------------
def answer_admission_call(worker_manager, call: AdmissionCall, add_lora: Callable | None = None):
    """The worker method the engine core's admission calls name (`calls.WORKER_METHOD`); `add_lora` is the worker's."""
    return WorkerAdapters.of(worker_manager).answer(call, add_lora)


def add_lora_reporting_failures(runner, lora_request, add: Callable):
    """vLLM's add_lora on this rank (`add`): a failure is returned, not raised (`AdapterLoadFailure`), a load
    answers a receipt naming the files it was admitted from and is timed (kind "add_lora": what the engine loop
    waits for per adapter; with BD-LoRA on, `calls.CompleteAdmissions` makes these calls for a poll's ready adapters
    one after another)."""
    started = time.perf_counter()
    try:
        with admitting():
            loaded = add(lora_request)
    except Exception as e:
        return AdapterLoadFailure(str(e))
    adapters = WorkerAdapters.of(runner.lora_manager)
    adapters.stats.record_load("add_lora", time.perf_counter() - started)
    return adapters.receipt(lora_request, loaded)


def admission_leaves_engine_caches(worker_manager, lora_request) -> bool:
    """Whether an admission's add_lora should stop after loading `lora_request` (checked, finished, kept by the store)
    rather than also register it in vLLM's host cache and copy it into a GPU slot. vLLM does both for every adapter
    it loads, evicting the least recently used adapter from each when full: loading a thousand adapters through a
    dozen slots would evict the adapters being served and spend the engine loop's time on slot fills that the next
    loads undo. On a BD server an admission takes room only where both have it; otherwise the step of the adapter's
    first request registers it from the store and fills its slot, as vLLM does for any adapter not resident. An
    adapter vLLM already holds (an in-place reload among them) takes vLLM's own path."""
    adapters = WorkerAdapters.of(worker_manager)
    if not _admitting.get() or not adapters.settings.enabled:
        return False
    manager = adapters.manager
    registered = manager._registered_adapters
    if lora_request.lora_int_id in registered:
        return False
    return len(registered) >= manager.capacity or len(manager._active_adapters) >= manager.lora_slots


def register_kept_before_pin(worker_manager, adapter_id: int) -> None:
    """Before vLLM's pin of `adapter_id` (which fails for an adapter its host cache does not hold): register it from
    what this worker kept. Stock vLLM registers every adapter it loads, so a pin after a load finds it there; a BD
    server leaves adapters admitted while its caches are full to the store (`admission_leaves_engine_caches`)."""
    WorkerAdapters.of(worker_manager).register_kept(adapter_id)


def wait_for_engine_message(condition, timeout_ms, wait: Callable):
    """vLLM's message-queue reader spins for a second after every message it reads: check the queue, yield the CPU,
    check again, holding the interpreter lock for each check. On a worker's main thread the engine core's admission
    polls (every `engine.TICK_SECONDS`) kept it spinning for as long as adapters were read, and the admission threads
    then waited for the lock after every tensor operation that released it: each stage of an admission cost 2-3x what
    it costs alone (`bench/admission_stages.py`). While this process admits adapters (or reads spilled ones back),
    the busy-loop window counts from the last engine step instead of the last message: a serving engine's steps keep
    the reader spinning, as vLLM means it to (each step's message would otherwise wait for the reader to wake), and
    an engine that only polls admissions lets it take vLLM's own idle path: wait on the queue's notification socket,
    without the lock."""
    if not ADMISSIONS_READING.any() or STEPS.since() <= condition.busy_loop_s:
        return wait(condition, timeout_ms)
    condition.last_read = float("-inf")
    # vLLM's idle path may miss a notification (its own recheck interval bounds that at 5 s): re-read the queue's
    # flag every millisecond instead, a thousand wake-ups a second against the spin's millions
    return wait(condition, IDLE_RECHECK_MS if timeout_ms is None else min(timeout_ms, IDLE_RECHECK_MS))


def load_adapter(worker_manager, lora_request, read: Callable):
    return WorkerAdapters.of(worker_manager).load(lora_request, read)


def apply_in_id_order(worker_manager, requests, apply: Callable):
    """vLLM's per-step `_apply_adapters` (`apply`) over the step's LoRA requests in adapter-id order, as every rank
    must load them (see `patch_adapter_load_order`), counted as GPU and host-cache lookups for /metrics, and where it
    fills GPU slots, timed as the step's slot fills. The step's kernels wait for the fills made ahead of it, and the
    next fills ahead for what it runs (`fill_ahead.AheadFills`). vLLM's own steps over dummy adapters (warm-up and
    CUDA graph capture, before any request) count nothing: on a GPU they fill slots a dozen times or more."""
    STEPS.mark()
    ordered = sorted((without_load_inplace(r) for r in requests if r), key=lambda r: r.adapter_id)
    adapters = WorkerAdapters.of(worker_manager)
    manager = adapters.manager
    kept = adapters.kept.in_memory if adapters.kept is not None else None
    adapter_ids = [r.adapter_id for r in ordered]
    missing = [adapter_id for adapter_id in adapter_ids if adapter_id not in manager._active_adapters]
    fills = len(missing)
    counted = not lora_warm_up(worker_manager)
    if counted:
        adapters.stats.record_lookups(manager, adapter_ids, kept)
        # each adapter runs: its fill-ahead history ends here, and those the step fills give theirs as the cause
        outcomes = {adapter_id: adapters.ahead_outcome.pop(adapter_id, "not_named") for adapter_id in adapter_ids}
        adapters.stats.record_in_step_causes(outcomes[adapter_id] for adapter_id in missing)
    adapters.ahead.step_begins(manager, adapter_ids, fills_in_step=fills > 0)
    if fills:
        make_room_for_step(manager, adapter_ids, adapters.waiting_keep, adapters.waiting_behind)
    started = time.perf_counter()
    applied = apply(ordered)
    if fills and counted:
        adapters.stats.record_fills(fills, time.perf_counter() - started)
    adapters.ahead.step_runs(manager, adapter_ids)
    return applied


def note_waiting_requests(worker_manager, scheduler_output) -> None:
    """Before a step runs: the adapters with requests in the engine (`fill_ahead.WaitingAdapters.keep`, which the
    engine core's scheduler put on the step where requests wait for adapters), whose slots the step's own fills do not
    take where others can go, and the waiting ones in queue order, whose slots go last first where none can
    (`fill_ahead.make_room_for_step`)."""
    if worker_manager is None:
        return
    waiting = getattr(scheduler_output, WAITING_ADAPTERS, None)
    adapters = WorkerAdapters.of(worker_manager)
    adapters.waiting_keep = waiting.keep if waiting is not None else frozenset()
    adapters.waiting_behind = waiting.behind if waiting is not None else ()


def fill_for_waiting_requests(worker_manager, scheduler_output) -> int:
    """After a step is launched: fill the slots its waiting requests' adapters need, as slots allow
    (`fill_ahead.WaitingAdapters`, which the engine core's scheduler put on the step); the copies run beside the step.
    Returns how many it filled."""
    waiting = getattr(scheduler_output, WAITING_ADAPTERS, None)
    if waiting is None or worker_manager is None:
        return 0
    return WorkerAdapters.of(worker_manager).fill_ahead(waiting.fill, waiting.keep, behind=waiting.behind)


def remove_adapter(worker_manager, adapter_id: int, remove: Callable) -> bool:
    """An unload (the executor's remove_lora): vLLM's removal (`remove`), then what the store kept. vLLM's per-step
    eviction from GPU slots does not come here: it goes through the model manager and keeps what was admitted."""
    removed = remove(adapter_id)
    return WorkerAdapters.of(worker_manager).forget_removed(adapter_id, removed)


def log_admission(admitted: AdmittedAdapter) -> None:
    """One line when an adapter is admitted (later loads of it are routine), and what --lora-target-modules drops."""
    logger.info("vllm-bdlora: %s", admitted.summary)
    if admitted.not_served:
        logger.warning(
            "vllm-bdlora: adapter '%s' is served without its LoRA on %d module(s) that --lora-target-modules %s "
            "leaves out (%s): its outputs differ from the adapter's as trained. Add their names to "
            "--lora-target-modules to serve it whole.",
            admitted.name, len(admitted.not_served), " ".join(admitted.deployment_targets or ()),
            _module_kinds(admitted.not_served),
        )  # fmt: skip


def _module_kinds(modules: list[str]) -> str:
    """'lm_head, 2 x up_proj' rather than every layer's full name."""
    kinds = Counter(module.rsplit(".", 1)[-1] for module in modules)
    return ", ".join(kind if count == 1 else f"{count} x {kind}" for kind, count in sorted(kinds.items()))
