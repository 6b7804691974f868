"""A GPU slot filled between steps, as soon as a request names its adapter, so that the step that runs it does not.

vLLM fills a slot inside the step that first needs the adapter: the host work of the activation (about a millisecond
at Llama-3.1-8B's depth, `bench/results/slot-fill`) and the copy come before that step's kernels, and every running
request of the step waits for both. When a request names an adapter that is in host memory but in no slot (the
engine core asks as the request arrives, `calls.RestoreAhead`), the worker activates it at once instead:

* the slot (`slot_to_take`): the first free one, else the least recently used slot (vLLM's own order) whose adapter
  is not pinned and has no request in the engine (the engine core names those: `RestoreAhead.keep`, so a burst of
  requests for new adapters never takes a slot from one whose request waits), else, for a waiting request's adapter,
  the slot of the waiting adapter queued last behind it (`scheduling.adapter_to_evict`). Where there is none (every
  slot holds a pinned adapter, a running one, or one queued before), the step fills it, as before.
* the order on a GPU (`AheadFills`): the copies run on a stream of their own. A slot the latest step did not run (the
  least recently used one, wherever a step leaves one idle) is copied after every step before the latest (an event
  recorded as the latest step began), beside the latest step; a slot it ran, after everything enqueued so far. The
  next step's kernels wait for the copies either way. On the CPU backend every copy is done when it returns.
* the adapter: one vLLM's host cache holds, or one the worker keeps in memory (registered in vLLM's host cache from
  there first, as the step would: `worker.WorkerAdapters.register_kept`; where the cache is full, the entry it drops
  is chosen so that no slot but the one taken goes with it, `host_entry_to_drop`). A spilled adapter is read back
  first (`store.AdapterStore.restore_ahead`) and filled by its step. Registering one costs no collective: DoRA's
  scales, the one stage that sums over the ranks, are computed once, at admission.

A request that arrives while every slot holds an adapter with requests (a full engine, under skewed traffic) would
find no slot to take, and its adapter would be filled by the step that first runs it, right after the last request of
another adapter finished. So the workers get slots beyond the adapters one step may run (`fill_ahead_slots`, 1 by
default: `add_spare_slots`, the scheduler keeping `--max-loras` as its limit through `scheduler_lora_config`), and each
step names the adapters its waiting requests need (`WaitingAdapters`, computed by the engine core's scheduler as it
schedules the step, carried to every rank with the step): each worker fills them, as slots allow, right after it has
launched that step, so the copies run beside it. Where that step could have taken such a request, the request sits it
out (`scheduling.hold_for_fills`): it joins the next step, which then finds its adapter filled.

Every rank receives the same calls in the same order and decides on its own state, which is the same on every rank
but for a moment after a read-back finishes on its thread (it may spill another adapter on one rank before it does on
the next): one rank may then fill an adapter ahead while another fills it in the step. Each rank's slots serve only
its own share of every layer, through its own slot mapping, and no fill involves a collective, so the answers do not
depend on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterable, Iterator

import torch

from vllm_bdlora.scheduling import (
    adapter_to_evict,
    adapters_needed,
    adapters_of,
    adapters_of_in_order,
    slots_seen,
    waiting_queues,
)

ADAPTERS_PER_STEP = "_bdlora_adapters_per_step"  # on vLLM's LoRAConfig where slots were added for fills ahead
WAITING_ADAPTERS = "_bdlora_waiting_adapters"  # on vLLM's SchedulerOutput: what its workers may fill after launching it


def add_spare_slots(lora_config, spare: int) -> None:
    """Give the workers `spare` GPU slots beyond the adapters one step may run. vLLM sizes the slots and limits the
    scheduler with one number, `max_loras`: the config's is raised (the workers size everything by it), its host cache
    with it (it must hold every slot's adapter), and the step limit is kept beside it for the scheduler."""
    if spare <= 0 or hasattr(lora_config, ADAPTERS_PER_STEP):
        return
    per_step = lora_config.max_loras
    lora_config.max_loras = per_step + spare
    lora_config.max_cpu_loras = max(lora_config.max_cpu_loras or 0, lora_config.max_loras)
    object.__setattr__(lora_config, ADAPTERS_PER_STEP, per_step)


def adapters_per_step(lora_config) -> int:
    """How many distinct adapters one step may run (`--max-loras`), whatever slots the workers have."""
    return getattr(lora_config, ADAPTERS_PER_STEP, lora_config.max_loras)


def scheduler_lora_config(lora_config):
    """The LoRA config vLLM's scheduler limits its steps by: its `max_loras` is the adapters one step may run."""
    per_step = adapters_per_step(lora_config)
    return lora_config if per_step == lora_config.max_loras else dataclasses.replace(lora_config, max_loras=per_step)


@dataclasses.dataclass(frozen=True)
class WaitingAdapters:
    """What the workers may fill after launching a step: the adapters of waiting requests that no running request
    names, in the order the scheduler takes them (`behind`), the first of them as many as there are slots (`fill`),
    and every adapter with requests in the engine (`keep`: no fill takes their slots but for those of adapters queued
    behind the one filled, the one queued last first: `scheduling.adapter_to_evict`)."""

    fill: tuple[int, ...]
    keep: frozenset[int]
    behind: tuple[int, ...] = ()


def waiting_adapters(running: Iterable, waiting: Iterable, in_engine: Iterable, at_most: int) -> WaitingAdapters | None:
    """The adapters the requests `waiting` (in the scheduler's order) need that no `running` request holds, at most
    `at_most` of them (the slots) to fill, and all of them in order (`behind`); `in_engine`: every request the
    scheduler holds, of which those that no later step runs (`scheduling.runs_again`: their last token is in flight)
    keep no slot. None where there is none."""
    running_ids = adapters_of(running)
    behind = tuple(a for a in adapters_of_in_order(waiting) if a not in running_ids)
    if not behind:
        return None
    return WaitingAdapters(behind[:at_most], frozenset(adapters_needed(in_engine)), behind)


def _least_recent_first(cache) -> list[int]:
    """The keys of one of vLLM's LRU caches (the slots' or the host cache's), least recently used first."""
    return list(cache.order if hasattr(cache, "order") else cache)


def slot_to_take(manager, keep=frozenset(), later=()) -> int | None:
    """The slot an adapter filled ahead of its step may take in vLLM's LoRA model manager `manager`: the first free
    slot (vLLM's activation takes that one), else the least recently used one whose adapter is neither pinned nor in
    `keep` (adapters with requests in the engine), else that of the adapter of `later` (waiting adapters queued behind
    this one) queued last. None where that leaves nothing."""
    slots = manager.lora_index_to_id
    if None in slots:
        return slots.index(None)
    active = manager._active_adapters
    pinned = getattr(active, "pinned_items", ())
    candidates = (a for a in _least_recent_first(active) if a not in pinned and a in slots)
    evicted = adapter_to_evict(candidates, keep, later)
    return None if evicted is None else slots.index(evicted)


def host_entry_to_drop(manager, evicted: int | None, keep=frozenset()) -> int | None | bool:
    """Registering an adapter in vLLM's host cache (to fill its slot) when the cache is full drops an entry, and vLLM's
    own eviction drops the least recently used one, taking its GPU slot with it, which may be a slot a step runs. So
    the entry dropped is chosen here: None where the cache has room; else the least recently used entry that is
    neither pinned, nor in `keep`, nor in a GPU slot other than `evicted`'s (the slot being taken); else `evicted`'s
    own (an adapter of `keep` whose slot goes to one queued before it: its fill registers it again from the worker's
    memory); False where there is no such entry."""
    registered = manager._registered_adapters
    if len(registered) < manager.capacity:
        return None
    active, pinned = manager._active_adapters, getattr(registered, "pinned_items", ())
    for adapter_id in _least_recent_first(registered):
        if adapter_id in pinned or adapter_id in keep:
            continue
        if adapter_id == evicted or adapter_id not in active:
            return adapter_id
    if evicted is not None and evicted in registered and evicted not in pinned:
        return evicted
    return False


@dataclasses.dataclass(frozen=True)
class Room:
    """Where an adapter that no GPU slot holds goes in vLLM's LoRA model manager: `slot`, once its adapter `evicted`
    (None: the slot is free) is deactivated, and the host cache, once entry `dropped` (None: nothing to drop) is
    removed."""

    slot: int
    evicted: int | None
    dropped: int | None


def room_for(manager, adapter_id: int, keep=frozenset(), later=()) -> Room | None:
    """The room `adapter_id` would take sparing `keep`'s adapters but those of `later` (`slot_to_take`, and
    `host_entry_to_drop` unless the host cache holds it); None where either is lacking. The one rule of a fill ahead
    and of a step's own fills."""
    slot = slot_to_take(manager, keep, later)
    if slot is None:
        return None
    evicted = manager.lora_index_to_id[slot]
    registered = adapter_id in manager._registered_adapters
    dropped = None if registered else host_entry_to_drop(manager, evicted, keep)
    if dropped is False:
        return None
    return Room(slot, evicted, dropped)


def clear(manager, room: Room) -> None:
    """Free `room`'s slot and host entry."""
    if room.evicted is not None:
        manager.deactivate_adapter(room.evicted)
    if room.dropped is not None:
        manager.remove_adapter(room.dropped)


def make_room_for_step(manager, adapter_ids, keep=frozenset(), behind=()) -> None:
    """A step about to fill slots for those of `adapter_ids` that no slot holds: vLLM's activation would take the least
    recently used slot, and registering an adapter in a full host cache would drop the least recently used entry with
    its slot. Least recently used is what an adapter filled ahead for a waiting request is after a step or two, or an
    adapter of this very step that its loop has not reached yet: its own step would fill it again, and that fill would
    take the next one. So the slots (and entries) are freed here first: none of the step's adapters', and none of
    `keep`'s (adapters with requests in the engine) where another can go, else that of the waiting adapter queued
    last (`behind`: waiting adapters in the order the scheduler takes them); where all are the step's, or `keep`'s
    and none is queued, vLLM's order decides."""
    step = frozenset(adapter_ids)
    later = tuple(adapter_id for adapter_id in behind if adapter_id not in step)
    for adapter_id in adapter_ids:
        if adapter_id in manager._active_adapters:
            continue
        room = room_for(manager, adapter_id, step | keep, later) or room_for(manager, adapter_id, step)
        if room is None:
            return
        clear(manager, room)


def name_waiting_adapters(scheduler, output) -> None:
    """Put on a step's scheduler output (`output`) the adapters of `scheduler`'s waiting requests that its workers may
    fill after launching the step: only where the workers have slots beyond the step limit (`add_spare_slots`). The
    scheduler's view of its workers' slots (`scheduling.SlotsSeen`) follows what the step runs and fills."""
    seen = slots_seen(scheduler)
    if seen is None:
        return
    seen.ran(adapters_of(scheduled_requests(scheduler, output)))
    # with the requests held out of this step, in the order the scheduler takes them once they are back in its
    # queues (scheduling.put_back: arrival order); the queue as it is where none was held (most steps)
    waiting = (request for queue in waiting_queues(scheduler) for request in queue)
    if seen.held:
        waiting = sorted(itertools.chain(seen.held, waiting), key=lambda request: request.arrival_time)
    named = waiting_adapters(scheduler.running, waiting, scheduler.requests.values(), seen.slots)
    if named is not None:
        setattr(output, WAITING_ADAPTERS, named)
        seen.filled(named.fill, named.keep, named.behind)


def scheduled_requests(scheduler, output) -> list:
    """The requests a step's scheduler output runs: its workers' slots serve their adapters, which become the most
    recently used. Not every running request: one whose last token is in flight is not scheduled again."""
    scheduled = getattr(output, "num_scheduled_tokens", None)
    if scheduled is None:
        return list(scheduler.running)
    requests = scheduler.requests
    return [requests[request_id] for request_id in scheduled if request_id in requests]


class AheadFills:
    """The stream order of one worker's fills ahead of the step (a GPU's; elsewhere every copy is done when it
    returns and this does nothing but remember the latest step's slots)."""

    def __init__(self, device):
        device = torch.device(device) if device is not None else None
        self.on_gpu = device is not None and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.on_gpu else None
        self.busy_slots: frozenset[int] = frozenset()  # the slots the latest step runs (on a GPU)
        self._step_began = None  # an event on the step stream: every step before the latest is done
        self._filled: dict[int, torch.cuda.Event] = {}  # slot -> an event on the fill stream: its fill ahead is done

    def step_begins(self, manager, adapter_ids, fills_in_step: bool) -> None:
        """A step is about to make `adapter_ids` resident in `manager`'s slots and run them: its kernels wait for the
        fills made ahead into the slots it runs (into any slot where it fills one itself: it may take one just filled
        ahead), and the next fills ahead wait for it to begin. A slot filled ahead for a request still waiting is
        not waited for by the steps before its own."""
        if not self.on_gpu or torch.cuda.is_current_stream_capturing():
            return
        step_stream = torch.cuda.current_stream()
        if fills_in_step:
            waited = list(self._filled)
        else:
            slots = manager.lora_index_to_id
            waited = [slot for slot in (slots.index(i) for i in adapter_ids if i in slots) if slot in self._filled]
        for slot in waited:
            step_stream.wait_event(self._filled.pop(slot))
        began = torch.cuda.Event()
        began.record(step_stream)
        self._step_began = began

    def step_runs(self, manager, adapter_ids) -> None:
        """The step that just began runs `adapter_ids` (resident now in `manager`'s slots)."""
        if self.on_gpu:
            slots = manager.lora_index_to_id
            self.busy_slots = frozenset(slots.index(i) for i in adapter_ids if i in slots)

    @contextlib.contextmanager
    def filling(self, slot: int) -> Iterator[None]:
        """Copies made inside (into `slot`) run on the fill stream: after every step before the latest, or where the
        latest step runs `slot`, after everything enqueued so far."""
        if not self.on_gpu:
            yield
            return
        after = self._step_began
        if after is None or slot in self.busy_slots:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream())
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            yield
        filled = torch.cuda.Event()
        filled.record(self.stream)
        self._filled[slot] = filled
