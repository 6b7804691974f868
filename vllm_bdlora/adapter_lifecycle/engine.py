"""The engine core's side of adapter admission: no engine step waits on an adapter's files.

vLLM loads an adapter inside the engine core's loop (a load request's `add_lora`) or inside a step (a request
naming an adapter the engine has not seen), so every running request waits for its disk read, and a read that never
returns stops the whole engine. With BD-LoRA on, the engine core instead:

* `admit` (a load request, `--lora-modules`, Ray Serve's multiplexing): asks every worker to begin admitting the
  adapter on a thread of its own (`calls.BeginAdmissions`, `worker.py`; the loads that arrived since the last tick
  in one call), and answers the call later (a future, which vLLM's engine core supports for its utility calls).
  Between steps it polls the workers; once every rank has read the same files it completes the load with vLLM's own
  `add_lora`, now a copy from what the workers kept (`calls.CompleteAdmissions`: the adapters one poll found ready
  in one call), and answers. The engine loop's calls per burst of loads are so a handful, not two per adapter.
  A refusal on any rank, ranks that read different files, or a rank reading for longer than
  `adapter_load_timeout_s` (time queued behind other admissions does not count) answers with the refusal, and every
  rank forgets the adapter. The engine keeps stepping meanwhile.
* `hold`: a request naming an adapter the engine has not admitted (the Python API's `generate(...,
  lora_request=...)`) is held back while its adapter is admitted the same way, then handed to the scheduler; the
  others run meanwhile. If the adapter is refused the request is aborted and the refusal logged. An engine core in
  the caller's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) has nothing to tick its polls and no channel to abort
  through: there the request's adapter is admitted before vLLM registers the request (`admit_before_request`), and
  a refusal raises from the call that named it.
* `restore_ahead`: a request naming an admitted adapter none of whose requests the scheduler holds asks every worker
  to read it back into memory, off the step, if the worker spilled it to disk (an adapter with requests in the
  scheduler is in a GPU slot or kept in memory for their step), or, where it is in host memory, to copy it into a
  GPU slot no request needs, now (`fill_ahead.py`). Where a rank is reading it back, the
  request is held (with any other request of the adapter that arrives meanwhile) and handed to the scheduler once no
  rank is, or after `read_back_hold_s`: the step that fills the adapter's slot then finds it in memory, where it
  would otherwise have stopped every running request for the read.
* `remove` (an unload): the adapter is removed on every rank (GPU slot, host cache, what its workers kept) once no
  request of it is left; new requests cannot name it any more (the API server forgot the name first).
* `generation`: each admission (an in-place reload included) and each removal gives the adapter a new generation,
  which prefix caching adds to its blocks' keys (`key_blocks_by_admission`). vLLM keys an adapter's cached KV by its
  name and path only, so a fine-tune redeployed to the same path, loaded again or in place, answered from KV its
  previous weights computed. A request takes the generation current when the engine core receives it: one that
  arrives after the load answered reads no block of other weights; one in flight across an in-place reload may
  mix both, as its own computation does. Blocks of earlier generations are not reachable any more and are
  reclaimed as the cache needs room.

Polls are driven by a ticker thread that puts a marker into the engine core's input queue while anything is in
flight, so the engine core's own thread does every call to the workers, in the same order on every rank.

The functions at the end are what the patches of vLLM's engine core and executor call, one each.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_bdlora.adapter_lifecycle.calls import (
    WORKER_METHOD,
    AdmissionCall,
    AdmissionState,
    AdmissionStates,
    BeginAdmissions,
    CompleteAdmissions,
    ForgetAdmissions,
    Ready,
    RestoreAhead,
    Unknown,
    check_admission_replies,
    load_timeout_refusal,
    verdict,
)
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.scheduling import adapters_needed, adapters_of, slots_seen

logger = logging.getLogger("vllm.bdlora")

ADMISSION_TICK = "bdlora-admission-tick"  # an input-queue request type no vLLM request has
TICK_SECONDS = 0.01
# The ticker ends after this long with nothing to tick for (the next admission starts another), so that an engine
# that is gone is not kept alive by it, nor an idle thread per engine a process made.
TICKER_IDLE_S = 30.0
GENERATION_ATTRIBUTE = "_bdlora_adapter_generation"  # set on vLLM's engine-side Request when it is first hashed


@dataclass
class AdmissionTimeline:
    """Where the engine loop's time went while admissions were in flight, from the first begun until none was left:
    the calls it made (begin, the polls, vLLM's add_lora of the ready adapters), each counted; the rest of the wall
    time the loop was free (reads on the workers' threads, model steps, other requests). Logged when the burst ends."""

    started: float | None = None
    admitted: int = 0
    seconds: dict = field(default_factory=lambda: {"begin": 0.0, "poll": 0.0, "add_lora": 0.0})
    calls: dict = field(default_factory=lambda: {"begin": 0, "poll": 0, "add_lora": 0})

    def timed(self, part: str, call: Callable):
        started = time.perf_counter()
        self.calls[part] += 1
        try:
            return call()
        finally:
            self.seconds[part] += time.perf_counter() - started

    def line(self) -> str:
        wall = time.perf_counter() - self.started
        s, n = self.seconds, self.calls
        return (f"admitted {self.admitted} adapter(s) in {wall:.1f} s; the engine loop's own calls took "
                f"{sum(s.values()):.1f} s of it: {n['begin']} begin {s['begin']:.2f} s, {n['poll']} polls "
                f"{s['poll']:.2f} s, {n['add_lora']} of vLLM's add_lora {s['add_lora']:.2f} s "
                f"({1e3 * s['add_lora'] / max(self.admitted, 1):.1f} ms per adapter)")  # fmt: skip


# A burst of at least this many admissions gets its timeline logged at INFO (fewer: DEBUG).
TIMELINE_INFO_ADMISSIONS = 8


@dataclass
class _Pending:
    request: object  # the LoRARequest
    future: Future | None = None
    held: list = field(default_factory=list)  # (engine request, wave) waiting for the adapter
    begun: bool = False  # the workers were asked to read it (the loads of one tick are begun in one call)


@dataclass
class _ReadBack:
    """Requests held while workers read their (admitted) adapter back from spill files."""

    since: float
    held: list = field(default_factory=list)  # (engine request, wave)


class EngineAdmissions:
    """One engine core's admissions in flight, held requests and removals waiting for their requests to end."""

    def __init__(self, core, timeout_s: float, read_back_hold_s: float = BdLoraSettings.read_back_hold_s):
        self.core = core
        self.timeout_s = timeout_s
        self.read_back_hold_s = read_back_hold_s  # `BdLoraSettings.read_back_hold_s`
        self.ready: set[int] = set()
        self.pending: dict[int, _Pending] = {}
        self.removals: set[int] = set()
        self.generations: dict[int, int] = {}
        self._releasing: int | None = None  # the adapter whose held requests go to the scheduler now
        self.reading_back: dict[int, _ReadBack] = {}
        self._generation_counter = itertools.count(1)
        self._wake = threading.Event()
        self._tick_queued = False
        self._thread: threading.Thread | None = None
        self._ticker_lock = threading.Lock()  # the ticker's start against its end
        self.timeline = AdmissionTimeline()

    _creation = threading.Lock()  # the engine core's input thread asks too (`key_blocks_by_admission`)

    @classmethod
    def of(cls, core) -> EngineAdmissions | None:
        """The core's admissions when BD-LoRA is on, else None."""
        admissions = getattr(core, "_bdlora_admissions", None)
        if admissions is None:
            settings = BdLoraSettings.from_vllm_config(getattr(core, "vllm_config", None))
            if not settings.enabled or getattr(core.vllm_config, "lora_config", None) is None:
                return None
            with cls._creation:
                admissions = getattr(core, "_bdlora_admissions", None)
                if admissions is None:
                    admissions = cls(core, settings.adapter_load_timeout_s, settings.read_back_hold_s)
                    core._bdlora_admissions = admissions
        return admissions

    @property
    def defers(self) -> bool:
        """Whether calls can be answered later: only a multiprocess engine core has an input queue to tick through
        (an in-process engine waits for its admissions instead)."""
        return hasattr(self.core, "input_queue")

    def _rpc(self, call: AdmissionCall) -> list:
        return self.core.model_executor.collective_rpc(WORKER_METHOD, args=(call,))

    # -- calls ------------------------------------------------------------------------------------------------------
    def admit(self, lora_request) -> Future | bool:
        pending = self._enqueue(lora_request)
        if pending.future is None:
            pending.future = Future()
        if self.defers:
            self._start_ticking()
            return pending.future
        while not pending.future.done():
            time.sleep(TICK_SECONDS)
            self.poll()
        return pending.future.result()

    def hold(self, request, wave) -> bool:
        """True if `request` waits for its adapter's admission or read-back (it is handed to the scheduler after)."""
        lora = request.lora_request
        if lora is None:
            return False
        if lora.lora_int_id in self.ready:
            return self._held_for_read_back(request, wave)
        if not self.defers:  # in-process: `admit_before_request` admitted it, unless it did not come through vLLM's
            return False  # LLMEngine; then its step reads it, as vLLM does
        pending = self.pending.get(lora.lora_int_id) or self._enqueue(lora)
        pending.held.append((request, wave))
        self._start_ticking()
        return True

    def _held_for_read_back(self, request, wave) -> bool:
        """A request named an admitted adapter: workers that spilled it to disk read it back into memory now, on a
        thread (`restore_ahead`). True if the request is held until they have: the step that fills the adapter's slot
        then does not wait for the read. An in-process engine does not hold (nothing ticks its polls): its request
        waits in the scheduler's queue, usually longer than the read-back takes."""
        adapter_id = request.lora_request.lora_int_id
        waiting = self.reading_back.get(adapter_id)
        if waiting is not None:
            waiting.held.append((request, wave))
            return True
        if adapter_id == self._releasing or self._in_use(adapter_id):
            return False
        if not self.restore_ahead(request.lora_request) or not self.defers:
            return False
        self.reading_back[adapter_id] = _ReadBack(time.monotonic(), [(request, wave)])
        self._start_ticking()
        return True

    def restore_ahead(self, lora_request) -> bool:
        """Ask every worker to read the adapter back if it spilled it, and to keep it in memory until a step takes
        it, or, where it is in host memory, to copy it into a GPU slot that no adapter with requests holds; True if a
        rank is reading it back."""
        adapter_id = lora_request.lora_int_id
        # their requests need their slots first (not one whose last token is in flight: no later step runs it)
        keep = frozenset(adapters_needed(self._requests()) | set(self.reading_back))
        call = RestoreAhead([adapter_id], fill=[lora_request], keep=keep)
        reading = any(adapter_id in ranks_reading for ranks_reading in self._rpc(call))
        seen = slots_seen(getattr(self.core, "scheduler", None))
        if seen is not None and not reading:
            seen.filled([adapter_id], keep)
        return reading

    def _poll_read_backs(self) -> None:
        """Hand the held requests of every adapter no rank is reading back any more (or held for
        `read_back_hold_s`) to the scheduler. An adapter spilled again before its step (a host budget that holds
        fewer adapters than the requests in flight name) is read in that step: reading it back again here would
        spill another, round after round."""
        ids = list(self.reading_back)
        reading = set().union(*self._rpc(RestoreAhead(ids, begin=False)))
        now = time.monotonic()
        for adapter_id in ids:
            waiting = self.reading_back[adapter_id]
            if adapter_id in reading and now - waiting.since < self.read_back_hold_s:
                continue
            self._release_read_back(adapter_id)

    def _release_read_back(self, adapter_id: int) -> None:
        waiting = self.reading_back.pop(adapter_id, None)
        if waiting is None:
            return
        self._releasing = adapter_id  # so that `hold` hands them on without asking again
        try:
            for request, wave in waiting.held:
                self.core.add_request(request, wave)
        finally:
            self._releasing = None

    def drop_held(self, request_ids) -> None:
        ids = set(request_ids)
        for waiting in [*self.pending.values(), *self.reading_back.values()]:
            waiting.held = [(r, w) for r, w in waiting.held if r.request_id not in ids]

    def remove(self, adapter_id: int, remove_now) -> bool:
        """Remove `adapter_id` now (`remove_now`, vLLM's own removal on every rank) or once no request of it is
        left; an admission in flight is given up."""
        self._release_read_back(adapter_id)  # requests that arrived before the unload run first, as with any others
        self._next_generation(adapter_id)
        self.ready.discard(adapter_id)
        pending = self.pending.pop(adapter_id, None)
        if pending is not None:
            self._rpc(ForgetAdmissions([adapter_id]))  # an admission it superseded may be in flight on the workers
            self._settle(pending, RuntimeError(f"LoRA adapter '{pending.request.lora_name}' was unloaded while it "
                                               "was being loaded"))  # fmt: skip
            if not self.pending:
                self._end_timeline()
            return True
        if self._in_use(adapter_id):
            self.removals.add(adapter_id)
            self._start_ticking()
            return True
        return remove_now(adapter_id)

    # -- between steps ----------------------------------------------------------------------------------------------
    def on_tick(self) -> None:
        self._tick_queued = False
        self.poll()

    def poll(self) -> None:
        if self.reading_back:
            self._poll_read_backs()
        self._begin_queued()
        if self.pending:
            ids = [adapter_id for adapter_id, pending in self.pending.items() if pending.begun]
            replies = self.timeline.timed("poll", lambda: self._rpc(AdmissionStates(ids))) if ids else []
            ready = []
            for adapter_id in ids:
                pending = self.pending.get(adapter_id)
                states = [reply.get(adapter_id, Unknown()) for reply in replies]
                if pending is not None and self._advance(adapter_id, pending, states):
                    ready.append((adapter_id, self.pending.pop(adapter_id)))
            if ready:
                self._complete(ready)
            if not self.pending:
                self._end_timeline()
        for adapter_id in list(self.removals):
            if not self._in_use(adapter_id):
                self.removals.discard(adapter_id)
                self.core.model_executor.remove_lora(adapter_id)

    def _advance(self, adapter_id: int, pending: _Pending, states: list[AdmissionState]) -> bool:
        """Settle a refused or timed-out admission; True when every rank is ready for it."""
        name = pending.request.lora_name
        failed, reading = verdict(name, states)
        if failed is None and reading > self.timeout_s:  # time queued behind other admissions does not count
            failed = load_timeout_refusal(name, pending.request.lora_path, self.timeout_s)
        if failed is not None:
            del self.pending[adapter_id]
            self._rpc(ForgetAdmissions([adapter_id]))
            self._settle(pending, RuntimeError(failed))
            return False
        return all(isinstance(state, Ready) for state in states)

    def _complete(self, ready: list[tuple[int, _Pending]]) -> None:
        """vLLM's add_lora of every adapter one poll found ready on every rank, in one call; each adapter's replies are
        judged alone (`check_admission_replies`), so one rank's failure refuses that adapter only."""
        requests = [pending.request for _, pending in ready]
        try:
            replies = self.timeline.timed("add_lora", lambda: self._rpc(CompleteAdmissions(requests)))
        except Exception as e:
            self._rpc(ForgetAdmissions([adapter_id for adapter_id, _ in ready]))
            for _, pending in ready:
                self._settle(pending, e)
            return
        for index, (adapter_id, pending) in enumerate(ready):
            try:
                remove_everywhere = functools.partial(self.core.model_executor.remove_lora, adapter_id)
                replies_of_adapter = [rank_replies[index] for rank_replies in replies]
                loaded = check_admission_replies(replies_of_adapter, pending.request, remove_everywhere)
            except Exception as e:
                self._rpc(ForgetAdmissions([adapter_id]))
                self._settle(pending, e)
                continue
            self.timeline.admitted += 1
            self._next_generation(adapter_id)
            self.ready.add(adapter_id)
            self.removals.discard(adapter_id)
            self._settle(pending, None, loaded)

    def _settle(self, pending: _Pending, error: BaseException | None, result=True) -> None:
        if pending.future is not None and not pending.future.done():
            if error is None:
                pending.future.set_result(result)
            else:
                pending.future.set_exception(error)
        held, pending.held = pending.held, []
        if error is None:
            for request, wave in held:
                self.core.add_request(request, wave)
            return
        if held:
            logger.warning("vllm-bdlora: %d request(s) for adapter '%s' aborted: %s", len(held),
                           pending.request.lora_name, error)  # fmt: skip
        for request, _ in held:
            self.core._send_abort_outputs_to_client([request.request_id], request.client_index)

    def _enqueue(self, lora_request) -> _Pending:
        """An admission to begin at the next poll (with the others that arrived meanwhile)."""
        adapter_id = lora_request.lora_int_id
        previous = self.pending.pop(adapter_id, None)
        if self.timeline.started is None:
            self.timeline.started = time.perf_counter()
        pending = _Pending(lora_request)
        if previous is not None:  # an in-place reload supersedes the admission in flight; its waiters get this one
            pending.future, pending.held = previous.future, previous.held
        self.pending[adapter_id] = pending
        self.removals.discard(adapter_id)
        return pending

    def _begin_queued(self) -> None:
        """Ask every worker to begin reading the admissions not yet begun, in one call (an admission of the same id
        in flight on a worker is replaced, as an in-place reload needs)."""
        queued = [pending for pending in self.pending.values() if not pending.begun]
        if not queued:
            return
        try:
            self.timeline.timed("begin", lambda: self._rpc(BeginAdmissions([p.request for p in queued])))
        except Exception as e:
            for pending in queued:
                del self.pending[pending.request.lora_int_id]
                self._settle(pending, e)
            return
        for pending in queued:
            pending.begun = True

    def _end_timeline(self) -> None:
        timeline, self.timeline = self.timeline, AdmissionTimeline()
        if timeline.started is None or not timeline.admitted:
            return
        level = logging.INFO if timeline.admitted >= TIMELINE_INFO_ADMISSIONS else logging.DEBUG
        logger.log(level, "vllm-bdlora: %s", timeline.line())

    # -- what prefix caching keys an adapter's blocks by ---------------------------------------------------------
    def _next_generation(self, adapter_id: int) -> None:
        """The adapter was admitted or removed: what a slot held of it before serves none of its next requests."""
        self.generations[adapter_id] = next(self._generation_counter)
        seen = slots_seen(getattr(self.core, "scheduler", None))
        if seen is not None:
            seen.forget(adapter_id)

    def key_blocks_by_admission(self) -> None:
        """Make the core's request block hasher give each LoRA request its adapter's generation before its first
        block is hashed (once; on the engine core's input thread, where requests are made; a dict read, no lock)."""
        block_hasher = getattr(self.core, "request_block_hasher", None)
        if block_hasher is None or getattr(block_hasher, "keyed_by_admission", False):
            return

        def hash_blocks(request):
            lora = request.lora_request
            if lora is not None and not hasattr(request, GENERATION_ATTRIBUTE):
                setattr(request, GENERATION_ATTRIBUTE, self.generations.get(lora.lora_int_id, 0))
            return block_hasher(request)

        hash_blocks.keyed_by_admission = True
        self.core.request_block_hasher = hash_blocks

    def _in_use(self, adapter_id: int) -> bool:
        return adapter_id in self._adapters_in_use()

    def _adapters_in_use(self) -> set[int]:
        """The adapters the scheduler holds requests of (running or waiting)."""
        return adapters_of(self._requests())

    def _requests(self) -> list:
        """Every request the scheduler holds."""
        return list((getattr(getattr(self.core, "scheduler", None), "requests", {}) or {}).values())

    # -- the ticker -------------------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self.pending or self.removals or self.reading_back)

    def _start_ticking(self) -> None:
        with self._ticker_lock:
            self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._tick_loop, name="bdlora-admission-ticker", daemon=True)
                self._thread.start()

    def _tick_loop(self) -> None:
        while True:
            if not self._wake.wait(TICKER_IDLE_S):
                with self._ticker_lock:  # a start that set the wake before this takes the lock is seen here
                    if not self._wake.is_set():
                        self._thread = None
                        return
                continue
            self._wake.clear()
            while self._busy():
                if not self._tick_queued:
                    self._tick_queued = True
                    self.core.input_queue.put_nowait((ADMISSION_TICK, None))
                time.sleep(TICK_SECONDS)


def lora_hash_keys_with_generation(keys: list, request) -> list:
    """vLLM's LoRA block-hash keys (`[("lora", name, path)]`; a bare name before 0.32) with the request's adapter
    generation added to each."""
    generation = getattr(request, GENERATION_ATTRIBUTE, None)
    if generation is None:
        return keys
    return [(*key, generation) if isinstance(key, tuple) else (key, generation) for key in keys]


# -- what the patches call ---------------------------------------------------------------------------------------------
# Each takes vLLM's own method (`original`, bound to the core) and falls back on it where BD-LoRA is off.
def add_lora(core, lora_request, original: Callable):
    """A load (API, `--lora-modules`, Ray Serve): answered later, once every rank has admitted the adapter."""
    admissions = EngineAdmissions.of(core)
    return original(lora_request) if admissions is None else admissions.admit(lora_request)


def remove_lora(core, adapter_id: int, original: Callable):
    """An unload: on every rank once no request of the adapter is left."""
    admissions = EngineAdmissions.of(core)
    return original(adapter_id) if admissions is None else admissions.remove(adapter_id, original)


def add_request(core, request, wave, original: Callable):
    """A request: held back while its adapter is admitted, else handed to vLLM."""
    admissions = EngineAdmissions.of(core)
    if admissions is not None and admissions.hold(request, wave):
        return None
    return original(request, wave)


def abort_requests(core, request_ids, original: Callable):
    """Aborts reach the requests held for their adapter too."""
    admissions = EngineAdmissions.of(core)
    if admissions is not None:
        admissions.drop_held(request_ids)
    return original(request_ids)


def handle_client_request(core, request_type, request, original: Callable):
    """The engine core's input queue: the ticker's marker polls the admissions in flight; the rest is vLLM's."""
    if request_type != ADMISSION_TICK:
        return original(request_type, request)
    admissions = EngineAdmissions.of(core)
    if admissions is not None:
        admissions.on_tick()
    return None


def preprocess_add_request(core, request, original: Callable):
    """A request as the engine core receives it: its blocks are keyed by its adapter's generation."""
    admissions = EngineAdmissions.of(core)
    if admissions is not None:
        admissions.key_blocks_by_admission()
    return original(request)


def admit_before_request(client, lora_request) -> None:
    """A request for an engine core in this process (vLLM's in-process client, `client.engine_core`): its adapter is
    admitted first, as a load is, if the engine has not admitted it; a refusal raises here, before vLLM registers
    the request. vLLM reads such an adapter inside the step that runs the request instead: a refusal raised out of
    that step with the request still registered, and every later `generate` of the engine waited for it forever.
    Admitted, the adapter's later requests are read back and filled ahead of their step as any admitted adapter's."""
    core = getattr(client, "engine_core", None)
    if lora_request is None or core is None:
        return
    admissions = EngineAdmissions.of(core)
    if admissions is None or admissions.defers or lora_request.lora_int_id in admissions.ready:
        return
    admissions.admit(lora_request)


def add_lora_on_every_rank(executor, lora_request) -> bool:
    """The executor's add_lora: every rank's reply read before any failure is raised (`check_admission_replies`)."""
    assert lora_request.lora_int_id > 0, "lora_id must be greater than 0."
    replies = executor.collective_rpc("add_lora", args=(lora_request,))
    return check_admission_replies(replies, lora_request, lambda: executor.remove_lora(lora_request.lora_int_id))
