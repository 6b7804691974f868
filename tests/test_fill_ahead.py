"""GPU slots filled between steps, as a request names its adapter (`vllm_bdlora.adapter_lifecycle.fill_ahead`): which
slot is taken, what is filled, what the engine core asks, and on a GPU the order of the copies against the steps.
The engine tests check the answers against PEFT (`test_more_adapters_than_gpu_slots_still_match_peft`,
`test_gpu_engine.py::test_slots_filled_ahead_on_gpu_match_peft`)."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from tests.test_scheduling import last_token_in_flight
from vllm_bdlora.adapter_lifecycle.calls import RestoreAhead
from vllm_bdlora.adapter_lifecycle.engine import EngineAdmissions
from vllm_bdlora.adapter_lifecycle.fill_ahead import (
    ADAPTERS_PER_STEP,
    WAITING_ADAPTERS,
    AheadFills,
    WaitingAdapters,
    add_spare_slots,
    make_room_for_step,
    name_waiting_adapters,
    scheduler_lora_config,
    slot_to_take,
    waiting_adapters,
)
from vllm_bdlora.adapter_lifecycle.store import AdapterStore
from vllm_bdlora.adapter_lifecycle.worker import (
    WorkerAdapters,
    apply_in_id_order,
    fill_for_waiting_requests,
    note_waiting_requests,
)
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.scheduling import slots_seen


class Recency(OrderedDict):
    """vLLM's LRU cache as the slot choice reads it: `order` least recently used first, `pinned_items`."""

    def __init__(self):
        super().__init__()
        self.pinned_items = set()

    @property
    def order(self):
        return dict.fromkeys(self)

    def touch(self, key):
        self.move_to_end(key)


class Slots:
    """vLLM's LRU LoRA model manager as far as slots go: activation takes the first free slot (evicting the least
    recently used active adapter when there is none), deactivation frees one."""

    def __init__(self, slots: int, registered=(), active=(), settings=None, capacity=None):
        self.lora_index_to_id = [None] * slots
        self.capacity = capacity or max(slots, len(registered))
        self._active_adapters = Recency()
        self._registered_adapters = Recency()
        self._registered_adapters.update(dict.fromkeys(registered))
        self._bdlora_settings = settings or BdLoraSettings(enabled=True)
        self.activated = []
        for adapter_id in active:
            self.activate_adapter(adapter_id)

    def activate_adapter(self, adapter_id):
        if adapter_id in self._active_adapters:
            self._active_adapters.touch(adapter_id)
            return False
        if None not in self.lora_index_to_id:
            self.deactivate_adapter(next(iter(self._active_adapters)))
        slot = self.lora_index_to_id.index(None)
        self.lora_index_to_id[slot] = adapter_id
        self._active_adapters[adapter_id] = None
        self.activated.append((adapter_id, slot))
        return True

    def remove_adapter(self, adapter_id):
        self.deactivate_adapter(adapter_id)
        return self._registered_adapters.pop(adapter_id, False) is None

    def deactivate_adapter(self, adapter_id):
        if adapter_id not in self._active_adapters:
            return False
        del self._active_adapters[adapter_id]
        self.lora_index_to_id[self.lora_index_to_id.index(adapter_id)] = None
        return True


def lora(adapter_id):
    return SimpleNamespace(lora_int_id=adapter_id, adapter_id=adapter_id, lora_name=f"a{adapter_id}")


def worker_of(manager) -> WorkerAdapters:
    adapters = WorkerAdapters(SimpleNamespace(_adapter_manager=manager, device=None))
    adapters.kept = AdapterStore(2**30, threads=1)
    return adapters


def test_the_slot_taken_is_a_free_one_else_the_least_recently_used_one_no_request_needs():
    manager = Slots(3, active=[1, 2])
    assert slot_to_take(manager) == 2  # free
    manager.activate_adapter(3)
    manager._active_adapters.touch(1)  # recency now 2, 3, 1
    assert slot_to_take(manager) == 1  # 2's
    assert slot_to_take(manager, keep={2}) == 2  # 3's
    manager._active_adapters.pinned_items.add(3)
    assert slot_to_take(manager, keep={2}) == 0  # 1's: 3 is pinned
    assert slot_to_take(manager, keep={1, 2}) is None  # every slot is pinned or has requests


def test_a_worker_fills_ahead_only_what_vllms_host_cache_holds_and_takes_no_slot_a_request_needs():
    manager = Slots(2, registered=[1, 2, 3, 5, 6], active=[1, 2])
    adapters = worker_of(manager)
    # 3 takes 2's slot (1 has requests); 4 is not in vLLM's host cache (its step loads it); 5 would need 1's or 3's
    filled = adapters.fill_ahead([3, 4, 5], keep=frozenset({1}))
    assert filled == 1 and manager.lora_index_to_id == [1, 3]
    assert adapters.stats.loads["slot_fill_ahead"].count == 1
    assert adapters.fill_ahead([3]) == 0  # in a slot already: nothing to do
    assert adapters.fill_ahead([6]) == 1 and manager.lora_index_to_id == [6, 3]  # 1 no longer needed: LRU


def test_where_every_slot_is_needed_a_waiting_adapter_takes_the_slot_of_the_one_queued_last_behind_it():
    """Slots hold 3 and 4, filled as their requests arrived after 5's (the step limit kept them all waiting): 5's
    fill takes 4's slot, whose request is the last to join, and 4's host entry where the cache has no other to drop."""
    manager = Slots(3, registered=[1, 3, 4, 5], active=[3, 4, 1], capacity=4)
    adapters = worker_of(manager)
    keep = frozenset({1, 3, 4, 5})
    assert adapters.fill_ahead([5, 3, 4], keep) == 0  # without the queue, every slot is needed
    assert adapters.fill_ahead([5, 3, 4], keep, behind=(5, 3, 4)) == 1 and manager.lora_index_to_id == [3, 5, 1]
    assert adapters.ahead_outcome[4] == "no_slot"  # nothing is queued behind 4: its step fills it
    manager = Slots(3, registered=[1, 3, 4], active=[3, 4, 1], capacity=3)
    adapters = worker_of(manager)
    adapters.kept = SimpleNamespace(in_memory=lambda adapter_id: adapter_id == 5)
    adapters.register_kept = lambda adapter_id: manager._registered_adapters.update({adapter_id: None}) or True
    assert adapters.fill_ahead([5], keep, behind=(5, 3, 4)) == 1
    assert manager.lora_index_to_id == [3, 5, 1] and list(manager._registered_adapters) == [1, 3, 5]


def test_an_adapter_kept_in_memory_is_registered_first_dropping_no_host_entry_another_slot_needs():
    """vLLM's own eviction from a full host cache would drop the least recently used entry and its slot with it;
    the entry dropped is the one whose slot is taken, or one in no slot."""
    manager = Slots(2, registered=[1, 2, 3], active=[1, 2], capacity=3)
    adapters = worker_of(manager)
    adapters.kept = SimpleNamespace(in_memory=lambda adapter_id: adapter_id in (4, 5, 6))
    registered = []
    adapters.register_kept = lambda adapter_id: registered.append(adapter_id) or manager._registered_adapters.update(
        {adapter_id: None}) or True  # fmt: skip
    # 4 takes 2's slot (1 has requests); 2's host entry goes (1's has requests, and 2 is the LRU one left)
    assert adapters.fill_ahead([4], keep=frozenset({1})) == 1
    assert manager.lora_index_to_id == [1, 4] and list(manager._registered_adapters) == [1, 3, 4] and registered == [4]
    assert adapters.stats.loads["reread"].count == 1  # registered from what the worker kept, as a step would
    # being read back on this worker: its step fills it (the read-back may not be done on every rank)
    assert adapters.fill_ahead([5], keep=frozenset({1}), reading=[5]) == 0
    # a free slot, but every host entry is in a slot or has requests: nothing is filled
    manager.deactivate_adapter(4)
    assert adapters.fill_ahead([6], keep=frozenset({3, 4})) == 0 and manager.lora_index_to_id == [1, None]
    assert list(manager._registered_adapters) == [1, 3, 4]
    # an adapter the worker cannot register after all (it forgot it meanwhile) is not counted as filled
    adapters.register_kept = lambda adapter_id: False
    assert adapters.fill_ahead([6], keep=frozenset({1})) == 0
    assert adapters.stats.loads["slot_fill_ahead"].count == 1


def test_the_engine_cores_read_back_call_fills_ahead_unless_the_setting_is_off():
    for on in (True, False):
        manager = Slots(2, registered=[1, 2, 3], active=[1, 2],
                        settings=BdLoraSettings(enabled=True, fill_slots_ahead=on))  # fmt: skip
        adapters = worker_of(manager)
        assert adapters.answer(RestoreAhead([3], fill=[lora(3)], keep=frozenset({2}))) == []
        assert manager.lora_index_to_id == ([3, 2] if on else [1, 2])


def test_the_engine_core_asks_for_a_fill_naming_the_adapters_whose_requests_need_their_slots():
    calls = []
    running = SimpleNamespace(lora_request=lora(7))
    ending = last_token_in_flight(SimpleNamespace(lora_request=lora(8)))  # no later step runs it: 8 keeps no slot
    scheduler = SimpleNamespace(requests={"r0": running, "r1": SimpleNamespace(lora_request=None), "r4": ending},
                                lora_config=SimpleNamespace(max_loras=1),
                                vllm_config=SimpleNamespace(lora_config=SimpleNamespace(max_loras=2)))  # fmt: skip
    core = SimpleNamespace(
        scheduler=scheduler,
        model_executor=SimpleNamespace(collective_rpc=lambda method, args: calls.append(args[0]) or [[], []]),
    )
    admissions = EngineAdmissions(core, timeout_s=5)
    admissions.ready |= {3, 7}
    admissions.reading_back[9] = SimpleNamespace(held=[])
    request = SimpleNamespace(request_id="r2", lora_request=lora(3))
    assert not admissions.hold(request, 0)  # in memory on every rank: straight to the scheduler
    (call,) = calls
    assert call == RestoreAhead([3], fill=[request.lora_request], keep=frozenset({7, 9}))
    assert slots_seen(scheduler).holds(3)  # the scheduler counts it filled: its request joins the next step
    assert not admissions.hold(SimpleNamespace(request_id="r3", lora_request=lora(7)), 0) and len(calls) == 1


def test_a_step_after_a_fill_ahead_counts_its_adapter_as_a_gpu_hit_and_fills_nothing():
    manager = Slots(2, registered=[1, 2, 3], active=[1, 2])
    manager.list_adapters = lambda: dict(manager._registered_adapters)
    adapters = worker_of(manager)
    adapters.fill_ahead([3])
    apply_in_id_order(SimpleNamespace(_adapter_manager=manager, _bdlora_adapters=adapters), [lora(3)],
                      lambda ordered: [manager.activate_adapter(r.lora_int_id) for r in ordered])  # fmt: skip
    assert adapters.stats.hits["gpu"] == adapters.stats.lookups["gpu"] == 1
    assert adapters.stats.loads["slot_fill"].count == 0 and adapters.stats.loads["slot_fill_ahead"].count == 1
    assert adapters.stats.lookups["cpu"] == adapters.stats.hits["cpu"] == 1  # the fill found it in host memory


def test_a_steps_own_fills_are_counted_by_why_none_was_made_ahead():
    """A fill a step makes itself is counted by its cause: its adapter was never named for a fill ahead, or was named
    when no slot was left that no request needed, or while it was not in host memory, or was filled ahead and lost
    that slot before its step."""
    manager = Slots(2, registered=[1, 2, 3, 4, 5], active=[1, 2])
    manager.list_adapters = lambda: dict(manager._registered_adapters)
    adapters = worker_of(manager)
    adapters.kept = SimpleNamespace(in_memory=lambda adapter_id: adapter_id != 6)
    worker_manager = SimpleNamespace(_adapter_manager=manager, _bdlora_adapters=adapters)

    def step(*adapter_ids):
        apply_in_id_order(worker_manager, [lora(i) for i in adapter_ids],
                          lambda ordered: [manager.activate_adapter(r.lora_int_id) for r in ordered])  # fmt: skip

    assert adapters.fill_ahead([3, 4, 6], keep=frozenset({1, 2, 3, 4, 6})) == 0  # 1 and 2 have requests; 6 spilled
    assert adapters.fill_ahead([5]) == 1 and manager.lora_index_to_id == [5, 2]  # 5 takes 1's slot
    step(2, 3)  # 3: named, no slot
    step(3, 6)  # 6: named while spilled
    step(1, 3)  # 1: never named
    step(5, 1)  # 5: filled ahead, then its slot went to 3 in the first step
    step(4, 1)  # 4: named, no slot (its history outlived the steps between)
    assert adapters.stats.in_step_causes == {"not_named": 1, "no_slot": 2, "not_in_memory": 1, "evicted": 1}
    assert adapters.stats.loads["slot_fill"].count == 5
    step(3, 4)  # ran before: its history ended with that step; 3 never named since
    assert adapters.stats.in_step_causes["not_named"] == 2


def request(request_id, adapter_id=None, arrival_time=0.0):
    lora_request = None if adapter_id is None else lora(adapter_id)
    return SimpleNamespace(request_id=request_id, lora_request=lora_request, arrival_time=arrival_time)


def test_workers_get_spare_slots_and_the_scheduler_keeps_max_loras_as_its_step_limit():
    import pickle

    from vllm.config import LoRAConfig

    config = LoRAConfig(max_loras=3, max_lora_rank=8)
    add_spare_slots(config, 1)
    add_spare_slots(config, 1)  # once only: a config is given its spare slots when it is made
    assert (config.max_loras, config.max_cpu_loras) == (4, 4)  # every slot's adapter has a host entry
    config = pickle.loads(pickle.dumps(config))  # as workers and the engine core receive it
    limited = scheduler_lora_config(config)
    assert (limited.max_loras, config.max_loras) == (3, 4) and not hasattr(limited, ADAPTERS_PER_STEP)
    plain = LoRAConfig(max_loras=3, max_lora_rank=8)
    add_spare_slots(plain, 0)
    assert scheduler_lora_config(plain) is plain and plain.max_loras == 3


def test_a_step_names_the_adapters_of_waiting_requests_no_running_request_holds_in_queue_order():
    running = [request("r0", 1), request("r1", 2)]
    waiting = [request("w0", 2), request("w1", 5), request("w2"), request("w3", 4), request("w4", 5), request("w5", 6)]
    named = waiting_adapters(running, waiting, running + waiting, at_most=2)
    assert named == WaitingAdapters((5, 4), frozenset({1, 2, 4, 5, 6}), behind=(5, 4, 6))
    assert waiting_adapters(running, waiting[:1] + waiting[2:3], running, at_most=2) is None  # all running or base


def test_an_adapter_whose_requests_all_end_in_flight_keeps_no_slot_and_is_not_counted_as_run():
    running = [request("r0", 1), last_token_in_flight(request("r1", 2))]
    waiting = [request("w0", 5)]
    named = waiting_adapters(running, waiting, running + waiting, at_most=2)
    assert named == WaitingAdapters((5,), frozenset({1, 5}), behind=(5,))  # 2's slot may take 5's fill
    both = running + [request("w1", 2)]  # a waiting request of 2 keeps it
    assert waiting_adapters(running, waiting, both + waiting, at_most=2).keep == {1, 2, 5}
    # the scheduler's view of the slots: the step ran what its output schedules, not every running request
    from vllm.config import LoRAConfig

    workers = LoRAConfig(max_loras=2, max_lora_rank=8)
    add_spare_slots(workers, 1)
    in_engine = {r.request_id: r for r in running + waiting}
    scheduler = SimpleNamespace(vllm_config=SimpleNamespace(lora_config=workers), running=running, waiting=waiting,
                                lora_config=scheduler_lora_config(workers), requests=in_engine)  # fmt: skip
    slots_seen(scheduler).ran([2, 1, 3])  # least recently used first
    name_waiting_adapters(scheduler, SimpleNamespace(num_scheduled_tokens={"r0": 1}))
    seen = slots_seen(scheduler)
    assert seen.holds(5) and seen.holds(3) and not seen.holds(2)  # 5 took 2's slot: the step did not run 2


def test_the_scheduler_puts_the_waiting_adapters_on_its_output_only_where_workers_have_spare_slots():
    from vllm.config import LoRAConfig

    running, waiting, held = [request("r0", 1)], [request("w0", 3, 2.0)], [request("h0", 6, 3.0)]
    for spare in (0, 1):
        workers = LoRAConfig(max_loras=1, max_lora_rank=8)
        add_spare_slots(workers, spare)
        in_engine = {r.request_id: r for r in running + waiting + held}
        scheduler = SimpleNamespace(vllm_config=SimpleNamespace(lora_config=workers), running=running, waiting=waiting,
                                    lora_config=scheduler_lora_config(workers), requests=in_engine)  # fmt: skip
        seen = slots_seen(scheduler)
        if seen is not None:
            seen.held = held  # held out of this step while its adapter is filled (scheduling.hold_for_fills)
        output = SimpleNamespace()
        name_waiting_adapters(scheduler, output)
        # in the order the scheduler takes them: the held request goes back into the queue in arrival order
        named = WaitingAdapters((3, 6), frozenset({1, 3, 6}), behind=(3, 6)) if spare else None
        assert getattr(output, WAITING_ADAPTERS, None) == named
    # the scheduler follows what its workers' slots now hold: the step's adapter, and the first named, which the
    # spare slot takes
    assert seen.holds(1) and seen.holds(3) and not seen.holds(6)


def test_a_worker_fills_the_waiting_adapters_into_its_spare_slot_after_launching_the_step():
    manager = Slots(3, registered=[1, 2, 3, 4], active=[1, 2, 4])  # 4: no request left
    adapters = worker_of(manager)
    worker_manager = SimpleNamespace(_adapter_manager=manager, _bdlora_adapters=adapters)
    output = SimpleNamespace(**{WAITING_ADAPTERS: WaitingAdapters((3, 5), frozenset({1, 2, 3, 5}), behind=(3, 5))})
    # 3 takes 4's slot; 5 would need a slot an adapter with requests holds
    assert fill_for_waiting_requests(worker_manager, output) == 1 and manager.lora_index_to_id == [1, 2, 3]
    assert adapters.stats.loads["slot_fill_ahead"].count == 1
    assert fill_for_waiting_requests(worker_manager, SimpleNamespace()) == 0  # a step naming none
    note_waiting_requests(worker_manager, output)  # before a step: what its own fills leave alone
    assert adapters.waiting_keep == {1, 2, 3, 5} and adapters.waiting_behind == (3, 5)
    note_waiting_requests(worker_manager, SimpleNamespace())
    assert adapters.waiting_keep == frozenset() and adapters.waiting_behind == ()
    assert fill_for_waiting_requests(None, output) == 0  # a worker without LoRA


@pytest.mark.gpu
def test_on_a_gpu_fills_ahead_wait_for_the_steps_before_and_the_next_step_waits_for_them():
    """A slot the latest step does not run is copied once every earlier step is done, whatever the latest step still
    does; a slot it runs, once the latest step is done too; the next step reads what was copied."""
    ahead = AheadFills("cuda")
    slots = torch.zeros(3, 1 << 20, device="cuda")
    image = torch.full((1 << 20,), 7.0).pin_memory()
    # an earlier step writes slot 0 late (the stream is busy first); then the latest step begins, running slot 1
    torch.cuda._sleep(200_000_000)
    slots[0].fill_(1.0)
    manager = SimpleNamespace(lora_index_to_id=[None, 5, None])
    ahead.step_begins(manager, [5], fills_in_step=False)
    ahead.step_runs(manager, [5])
    torch.cuda._sleep(200_000_000)
    slots[1].fill_(2.0)
    with ahead.filling(0):  # idle in the latest step: after the earlier step's write
        slots[0].copy_(image, non_blocking=True)
    with ahead.filling(1):  # run by the latest step: after its write
        slots[1].copy_(image, non_blocking=True)
    with ahead.filling(2):
        torch.cuda._sleep(200_000_000)  # the fill stream is busy: the next step must wait for it
        slots[2].copy_(image, non_blocking=True)
    ahead.step_begins(manager, [], fills_in_step=True)  # it fills a slot itself: it waits for every fill ahead
    seen = slots[:, :8].clone()  # the next step's read
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), torch.full((3, 8), 7.0))


@pytest.mark.gpu
def test_on_a_gpu_a_step_waits_only_for_the_fills_ahead_into_the_slots_it_runs():
    """A slot filled ahead for a request still waiting is not waited for by a step that does not run it; the step
    that runs it waits."""
    ahead = AheadFills("cuda")
    slots = torch.zeros(2, 1 << 20, device="cuda")
    image = torch.full((1 << 20,), 7.0).pin_memory()
    manager = SimpleNamespace(lora_index_to_id=[5, 6])
    ahead.step_begins(manager, [5], fills_in_step=False)
    ahead.step_runs(manager, [5])
    with ahead.filling(1):
        torch.cuda._sleep(1_000_000_000)  # a long copy into slot 1 (adapter 6's)
        slots[1].copy_(image, non_blocking=True)
    fill_done = ahead._filled[1]
    ahead.step_begins(manager, [5], fills_in_step=False)  # a step of adapter 5 alone
    step_done = torch.cuda.Event()
    step_done.record()
    step_done.synchronize()
    assert not fill_done.query()  # it ran beside the copy, not after it
    ahead.step_begins(manager, [5, 6], fills_in_step=False)  # the step that runs slot 1
    seen = slots[1, :8].clone()
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), torch.full((8,), 7.0))


def test_a_steps_own_fills_take_no_slot_a_waiting_request_or_the_step_itself_needs_where_another_can_go():
    # least recently used first: 1 (filled ahead for a waiting request), 2 (this step's, not yet reached), 3
    manager = Slots(3, registered=[1, 2, 3], active=[1, 2, 3], capacity=3)
    make_room_for_step(manager, [2, 5], keep=frozenset({1, 2, 5}))
    manager.activate_adapter(2)
    manager.activate_adapter(5)  # as vLLM's step does next: into the slot made free, 3's, with 3's host entry
    assert manager.lora_index_to_id == [1, 2, 5] and 3 not in manager._registered_adapters
    # every other slot's adapter has requests: the step still takes none of its own, the least recent other one
    manager = Slots(3, registered=[1, 2, 3], active=[1, 2, 3], capacity=4)
    make_room_for_step(manager, [2, 5], keep=frozenset({1, 2, 3, 5}))
    assert manager.lora_index_to_id == [None, 2, 3] and list(manager._registered_adapters) == [1, 2, 3]
    # every other slot's adapter waits: the step takes the slot of the one queued last (3), not the least recent (1)
    manager = Slots(3, registered=[1, 2, 3], active=[1, 2, 3], capacity=3)
    make_room_for_step(manager, [2, 5], keep=frozenset({1, 2, 3, 5}), behind=(1, 3))
    assert manager.lora_index_to_id == [1, 2, None] and list(manager._registered_adapters) == [1, 2]
    # every slot is the step's own: vLLM's order decides
    manager = Slots(2, registered=[1, 2], active=[1, 2])
    make_room_for_step(manager, [1, 2, 5])
    assert manager.lora_index_to_id == [1, 2]
