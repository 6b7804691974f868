"""No request waits unboundedly for a LoRA slot.

vLLM's scheduler runs at most `--max-loras` adapters per step and skips a waiting request whose adapter would be
one more; requests of adapters already running keep joining. Under skewed popularity the popular adapters always
have requests running, so a request for a rarely used adapter can wait as long as the popular ones keep coming (vLLM's
own comment: "NOT fair: it can starve LoRAs").

Policy (`lora_wait_limit_s`, default 2 s): while no request has waited longer than the limit, vLLM's order stands
(resident adapters' requests batch first, which is what keeps slot swaps rare). Once the oldest request whose adapter
has no slot has waited longer, the other adapters' waiting requests are held back from joining the batch (base-model
requests, which need no slot, still join); running requests go on and finish, the first slot to empty goes to the
waiting adapter, and then every request joins again. A request therefore waits at most about the limit plus the
time the running requests of one adapter take to finish, and the price is paid only while something has waited that
long.

Where the workers have GPU slots beyond `--max-loras` (`adapter_lifecycle.fill_ahead`), a waiting request whose adapter
is in none of them is held out of one step (`hold_for_fills`, setting `hold_for_slot_fills`) while its adapter is
named for a fill ahead of the next step: the fill then runs beside the step the request sat out, and no running
request's step waits for it. The scheduler does not ask its workers which adapters their slots hold; it follows them
(`SlotsSeen`): the adapters its steps ran and those it named for filling, in vLLM's least-recently-used order. Where
that guess is wrong, a request waits one step it did not need to, or its adapter is filled in its step, as without the
hold; each request is held once at most. A running request whose last token a step in flight already yields (async
scheduling, vLLM's default on GPUs) counts as finished (`runs_again`): vLLM schedules it no more, so its adapter
leaves room under the step limit one step before the request ends, and its slot may take a waiting adapter's fill.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable

HELD_FOR_FILL = "_bdlora_held_for_fill"  # on a vLLM Request held out of a step while its adapter was filled
SLOTS_SEEN = "_bdlora_slots_seen"  # on vLLM's scheduler: what it can tell of its workers' slots
HELD_COUNTS = "_bdlora_held_counts"  # on vLLM's scheduler: `held_counts`
# Why a waiting request was held out of a step: its adapter was being filled into a GPU slot ahead of the next step
# (`hold_for_fills`), or another adapter's request had waited past the limit for a slot (`hold_back`).
HOLD_REASONS = ("slot_fill", "starved_adapter")


def held_counts(scheduler) -> dict[str, int]:
    """How many times the holds took a waiting request out of a step, by reason (`HOLD_REASONS`), since the
    scheduler started: what the holds cost, for /metrics (`vllm_bdlora:requests_held_total`)."""
    counts = getattr(scheduler, HELD_COUNTS, None)
    if counts is None:
        counts = dict.fromkeys(HOLD_REASONS, 0)
        setattr(scheduler, HELD_COUNTS, counts)
    return counts


def waiting_queues(scheduler) -> list:
    """The queues a waiting request may sit in: `waiting` in every release, `skipped_waiting` in those that keep
    skipped requests apart (0.26)."""
    return [q for q in (getattr(scheduler, "waiting", None), getattr(scheduler, "skipped_waiting", None)) if q]


def adapters_of(requests: Iterable) -> set[int]:
    """The adapters `requests` name (base-model requests name none)."""
    return {r.lora_request.lora_int_id for r in requests if getattr(r, "lora_request", None)}


def runs_again(request) -> bool:
    """Whether vLLM's scheduler may still give `request` a step. With async scheduling (vLLM's default on GPUs) a
    step is scheduled while the one before it runs, and a running request whose last token (`max_tokens`) a step in
    flight already yields is not scheduled again: it finishes as that step's output arrives. vLLM's step limit counts
    the adapters of the running requests it schedules, so such a request's adapter no longer counts against it, and
    its slot is needed by no later step. The test is vLLM's own (`Scheduler.schedule`, 0.10 to 0.33); without async
    scheduling no request has output placeholders, and every running request runs again."""
    placeholders = getattr(request, "num_output_placeholders", 0) or 0
    max_tokens = getattr(request, "max_tokens", None)
    if placeholders <= 0 or max_tokens is None:
        return True
    return request.num_computed_tokens + 2 - placeholders < request.num_prompt_tokens + max_tokens


def adapters_needed(requests: Iterable) -> set[int]:
    """The adapters of those of `requests` that a later step may still run (`runs_again`)."""
    return adapters_of(r for r in requests if runs_again(r))


def adapters_of_in_order(requests: Iterable) -> list[int]:
    """The adapters `requests` name, each once, in the order of the requests that first name them."""
    return list(dict.fromkeys(r.lora_request.lora_int_id for r in requests if getattr(r, "lora_request", None)))


def starved_adapter(scheduler, limit_s: float, now: float | None = None) -> int | None:
    """The adapter of the oldest waiting request that needs a slot while every slot is taken, if that request has
    waited longer than `limit_s`; else None."""
    lora_config = getattr(scheduler, "lora_config", None)
    if not limit_s or lora_config is None:
        return None
    running = adapters_needed(scheduler.running)
    if len(running) < lora_config.max_loras:
        return None
    now = time.time() if now is None else now
    oldest = None
    for queue in waiting_queues(scheduler):
        for request in queue:
            lora = request.lora_request
            if lora is None or lora.lora_int_id in running:
                continue
            if now - request.arrival_time > limit_s and (oldest is None or request.arrival_time < oldest.arrival_time):
                oldest = request
    return oldest.lora_request.lora_int_id if oldest is not None else None


def hold_back(scheduler, adapter_id: int) -> list:
    """Take every waiting request of an adapter other than `adapter_id` out of the scheduler's queues (base-model
    requests stay); returns (queue, requests) pairs for `put_back`."""
    held = []
    for queue in waiting_queues(scheduler):
        others = [r for r in queue if r.lora_request is not None and r.lora_request.lora_int_id != adapter_id]
        if others:
            queue.remove_requests(others)
            held.append((queue, others))
            held_counts(scheduler)["starved_adapter"] += len(others)
    return held


def put_back(held: list) -> None:
    """Return held requests to their queues, every queue in arrival order (the order vLLM keeps them in)."""
    for queue, requests in held:
        remaining = list(queue)
        queue.remove_requests(remaining)
        for request in sorted(remaining + requests, key=lambda r: r.arrival_time):
            queue.add_request(request)


def queued_after(behind: Iterable[int], adapter_id: int) -> tuple[int, ...]:
    """The adapters of `behind` (waiting adapters, in the order the scheduler takes them) queued after `adapter_id`;
    none where it is not queued there (an adapter filled as its request arrives is the queue's last)."""
    behind = tuple(behind)
    return behind[behind.index(adapter_id) + 1 :] if adapter_id in behind else ()


def adapter_to_evict(least_recent_first: Iterable[int], keep: frozenset | set, later: Iterable[int] = ()) -> int | None:
    """The adapter whose slot a fill takes where none is free: the least recently used one outside `keep` (adapters
    with requests in the engine); else, of the adapters `later` (waiting requests' adapters queued behind the one
    being filled, in the order the scheduler takes them), the one it takes last: of every slot, its adapter is needed
    last. The worker's rule (`fill_ahead.slot_to_take`) and the scheduler's guess of it (`SlotsSeen`).

    Without the second rule a request's fill ahead finds no slot whenever the slots not running hold adapters of
    requests that arrived after it (filled as they arrived, since the step limit kept them waiting too): its own
    step then fills it, and takes one of theirs anyway."""
    candidates = list(least_recent_first)
    unneeded = next((adapter_id for adapter_id in candidates if adapter_id not in keep), None)
    if unneeded is not None:
        return unneeded
    position = {adapter_id: index for index, adapter_id in enumerate(later)}
    return max((a for a in candidates if a in position), key=position.__getitem__, default=None)


class SlotsSeen:
    """What a scheduler can tell of its workers' GPU slots without asking them: the adapters its steps ran and those
    it named for a fill ahead, least recently used first, as many as there are slots (vLLM's worker evicts in that
    order, and fills ahead take the least recently used slot no request needs, else the slot of the waiting adapter
    queued furthest back). A guess: a worker fills ahead only an adapter it holds in host memory, and a pinned adapter
    keeps its slot."""

    def __init__(self, slots: int):
        self.slots = slots
        self._order: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.held: list = []  # requests held out of the step being scheduled, for the naming of its fills

    def holds(self, adapter_id: int) -> bool:
        return adapter_id in self._order

    def ran(self, adapter_ids: Iterable[int]) -> None:
        """A step made `adapter_ids` resident (each taking the least recently used slot where it was in none)."""
        for adapter_id in adapter_ids:
            self._order[adapter_id] = None
            self._order.move_to_end(adapter_id)
            if len(self._order) > self.slots:
                self._order.popitem(last=False)

    def filled(self, adapter_ids: Iterable[int], keep: frozenset | set, behind: Iterable[int] = ()) -> list[int]:
        """Workers were asked to fill `adapter_ids` ahead, taking no slot of `keep`'s adapters but those of adapters
        queued behind the one filled (`behind`: the waiting adapters in the order the scheduler takes them); as they
        do, the first that finds no slot ends it. Returns the adapters that took a slot."""
        return self._fill(self._order, adapter_ids, keep, behind)

    def would_fill(self, adapter_ids: Iterable[int], keep: frozenset | set, behind: Iterable[int] = ()) -> list[int]:
        """The adapters of `adapter_ids` that `filled` would give a slot, changing nothing."""
        return self._fill(collections.OrderedDict(self._order), adapter_ids, keep, behind)

    def _fill(self, order: collections.OrderedDict, adapter_ids, keep, behind) -> list[int]:
        behind, keep, taken_by = tuple(behind), set(keep), []
        for adapter_id in adapter_ids:
            if adapter_id in order:
                continue
            if len(order) >= self.slots:
                evicted = adapter_to_evict(order, keep, queued_after(behind, adapter_id))
                if evicted is None:
                    break
                del order[evicted]
            order[adapter_id] = None
            keep.add(adapter_id)
            taken_by.append(adapter_id)
        return taken_by

    def forget(self, adapter_id: int) -> None:
        """The adapter was removed: its slots were freed."""
        self._order.pop(adapter_id, None)


def slots_seen(scheduler) -> SlotsSeen | None:
    """The scheduler's `SlotsSeen`, where its workers have slots beyond the adapters one step may run (the
    scheduler's LoRA config is its own copy, limited to `--max-loras`); else None."""
    seen = getattr(scheduler, SLOTS_SEEN, None)
    if seen is not None:
        return seen
    limited = getattr(scheduler, "lora_config", None)
    workers = getattr(getattr(scheduler, "vllm_config", None), "lora_config", None)
    if limited is None or workers is None or workers.max_loras <= limited.max_loras:
        return None
    seen = SlotsSeen(workers.max_loras)
    setattr(scheduler, SLOTS_SEEN, seen)
    return seen


def hold_for_fills(scheduler) -> list:
    """Take out of the scheduler's queues, for the step about to be scheduled, the waiting requests that would join
    it with an adapter that no slot holds as far as the scheduler can tell: in queue order, each adapter that would
    join (it holds a slot, or its request already sat out a step) takes one of the adapters the step may add, and
    each that would join without a slot is held (every waiting request of it), until the step has no room left for
    another adapter; the requests behind wait for that room anyway, and keep their one hold for when it comes. Only
    where a fill ahead would find a slot for one of them (`SlotsSeen.would_fill`: one no request needs, or one of an
    adapter queued behind it that does not join); the others are held too, since slots free as the step's requests
    finish, while one joining now would be filled by the step. Returns (queue, requests) pairs for `put_back`, and
    remembers the requests for naming their adapters for the fills beside the step (`SlotsSeen.held`)."""
    seen = slots_seen(scheduler)
    if seen is None:
        return []
    seen.held = []
    running = adapters_needed(scheduler.running)  # what vLLM counts against its step limit
    room = scheduler.lora_config.max_loras - len(running)
    if room <= 0:
        return []
    queued = [r for queue in waiting_queues(scheduler) for r in queue]
    joining: set[int] = set()
    holding: dict[int, None] = {}  # in queue order
    for request in queued:
        adapter_id = request.lora_request.lora_int_id if request.lora_request is not None else None
        if adapter_id is None or adapter_id in running or adapter_id in joining or adapter_id in holding:
            continue
        if seen.holds(adapter_id) or getattr(request, HELD_FOR_FILL, False):
            joining.add(adapter_id)
            if len(joining) >= room:
                break
        else:
            holding[adapter_id] = None
    if not holding:
        return []
    # the workers' fills ahead beside this step see the queue behind each held adapter without those that join it
    behind = dict.fromkeys(a for a in adapters_of_in_order(queued) if a not in running and a not in joining)
    in_engine = adapters_needed(getattr(scheduler, "requests", {}).values())
    if not seen.would_fill(holding, in_engine, behind):
        return []
    held = []
    for queue in waiting_queues(scheduler):
        hold = [r for r in queue if r.lora_request is not None and r.lora_request.lora_int_id in holding]
        if hold:
            for request in hold:
                setattr(request, HELD_FOR_FILL, True)
            queue.remove_requests(hold)
            held.append((queue, hold))
            seen.held.extend(hold)
            held_counts(scheduler)["slot_fill"] += len(hold)
    return held
