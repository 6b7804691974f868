"""Which waiting requests join a step (`vllm_bdlora.scheduling`), on vLLM's own request queues. No request waits
unboundedly for a LoRA slot: the starved adapter is found once its oldest request has waited past the limit, every
other adapter's waiting request is held back (base-model requests are not), and everything goes back in arrival order.
Where workers have slots beyond the step limit, a request whose adapter is in no slot sits out one step while it is
filled, as far as the scheduler's view of the slots tells."""

from types import SimpleNamespace

import pytest
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

from vllm_bdlora.scheduling import (
    HELD_FOR_FILL,
    SlotsSeen,
    adapter_to_evict,
    held_counts,
    hold_back,
    hold_for_fills,
    put_back,
    runs_again,
    slots_seen,
    starved_adapter,
)


class Request(SimpleNamespace):
    def __lt__(self, other):  # what vLLM's priority queue orders requests by
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)

    __hash__ = object.__hash__


def request(rid, adapter, arrival):
    lora = SimpleNamespace(lora_int_id=adapter) if adapter else None
    return Request(request_id=rid, lora_request=lora, arrival_time=arrival, priority=0)


def scheduler(running_adapters, waiting, max_loras=2, policy=SchedulingPolicy.FCFS):
    queue = create_request_queue(policy)
    for r in waiting:
        queue.add_request(r)
    running = [request(f"run{a}", a, 0.0) for a in running_adapters]
    return SimpleNamespace(lora_config=SimpleNamespace(max_loras=max_loras), running=running, waiting=queue)


def test_nothing_is_starved_while_a_slot_is_free_or_no_one_has_waited_long():
    waiting = [request("r1", 3, 100.0)]
    assert starved_adapter(scheduler([1], waiting), 2.0, now=200.0) is None  # a slot is free: vLLM schedules it
    assert starved_adapter(scheduler([1, 2], waiting), 2.0, now=101.0) is None  # waited 1 s of 2
    assert starved_adapter(scheduler([1, 2], waiting), 0.0, now=200.0) is None  # the policy is off
    assert starved_adapter(scheduler([1, 2], [request("r2", 1, 90.0)]), 2.0, now=200.0) is None  # has a slot


@pytest.mark.parametrize("policy", [SchedulingPolicy.FCFS, SchedulingPolicy.PRIORITY])
def test_the_oldest_starved_adapter_holds_the_others_back_until_the_step_is_scheduled(policy):
    waiting = [request("a1", 1, 100.0), request("base", None, 100.5), request("c1", 3, 101.0),
               request("d1", 4, 102.0), request("a2", 1, 103.0), request("c2", 3, 104.0)]  # fmt: skip
    sched = scheduler([1, 2], waiting, policy=policy)
    starved = starved_adapter(sched, 2.0, now=103.5)
    assert starved == 3  # c1 (101.0) is older than d1 (102.0); a1, a2 have a slot
    held = hold_back(sched, starved)
    left = [r.request_id for r in sched.waiting]
    assert sorted(left) == ["base", "c1", "c2"]  # adapter 1's new requests no longer join: it drains
    assert held_counts(sched) == {"slot_fill": 0, "starved_adapter": 3}  # for /metrics: a1, d1, a2 sat this step out
    sched.waiting.pop_request()  # the scheduler takes one meanwhile
    put_back(held)
    order = [r.request_id for r in sched.waiting]
    assert sorted(order) == sorted(["a1", "c1", "d1", "a2", "c2"]) and len(order) == 5
    if policy == SchedulingPolicy.FCFS:
        assert order == sorted(order, key=lambda rid: next(r.arrival_time for r in waiting if r.request_id == rid))


def test_the_schedulers_view_of_slots_follows_steps_and_fills_in_least_recently_used_order():
    seen = SlotsSeen(3)
    seen.ran([1, 2, 3])
    seen.ran([1, 4])  # 4 takes the least recently used slot: 2's
    assert [seen.holds(a) for a in (1, 2, 3, 4)] == [True, False, True, True]
    # 5 takes 3's slot (no request needs it); nothing is left for 6
    assert seen.filled([5, 6], keep={1, 4, 5, 6}) == [5]
    assert [seen.holds(a) for a in (3, 5, 6)] == [False, True, False]
    assert seen.would_fill([6], {1, 4, 5}) == [] and seen.would_fill([6], {1, 4}) == [6]
    assert seen.holds(4) and not seen.holds(6)  # asking what would be filled changes nothing
    seen.forget(4)  # removed, or admitted again: its slot no longer serves it
    assert not seen.holds(4) and seen.would_fill([6], {1, 4, 5}) == [6]
    seen.filled([6], keep={1, 5})
    assert seen.holds(6)


def test_where_every_slot_is_needed_a_fill_takes_the_slot_of_the_adapter_queued_last_behind_it():
    assert adapter_to_evict([1, 2, 3], keep={1, 3}) == 2  # one no request needs goes first
    assert adapter_to_evict([1, 2, 3], keep={1, 2, 3}) is None  # none queued behind: none is taken
    assert adapter_to_evict([1, 2, 3], keep={1, 2, 3}, later=[3, 9, 2]) == 2  # of those in slots, queued last
    assert adapter_to_evict([1, 2, 3], keep={1, 2, 3}, later=[9]) is None
    # 3 and 4 were filled as their requests arrived, after 5's: 5 takes 4's slot, and nothing is left for 4
    seen = SlotsSeen(3)
    seen.ran([3, 4, 1])
    assert seen.filled([5, 3, 4], keep={1, 3, 4, 5}, behind=[5, 3, 4]) == [5]
    assert [seen.holds(a) for a in (1, 3, 4, 5)] == [True, True, False, True]


def spare_slot_scheduler(running_adapters, waiting, step_limit=2, slots=3):
    sched = scheduler(running_adapters, waiting, max_loras=step_limit)
    sched.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_loras=slots))
    sched.requests = {r.request_id: r for r in [*sched.running, *waiting]}
    return sched


def test_a_request_whose_adapter_is_in_no_slot_sits_out_one_step_and_is_named_first():
    waiting = [request("a", 2, 1.0), request("base", None, 2.0), request("b", 1, 3.0), request("c", 3, 4.0),
               request("a2", 2, 5.0)]  # fmt: skip
    sched = spare_slot_scheduler([1], waiting)
    slots_seen(sched).ran([1, 3])  # 1 runs; 3 was filled ahead
    held = hold_for_fills(sched)
    assert [r.request_id for r in sched.waiting] == ["base", "b", "c"]  # 2 in no slot: both its requests sit out
    assert [r.request_id for r in slots_seen(sched).held] == ["a", "a2"]
    assert held_counts(sched)["slot_fill"] == 2
    put_back(held)
    assert [r.request_id for r in sched.waiting] == ["a", "base", "b", "c", "a2"]
    assert getattr(waiting[0], HELD_FOR_FILL)
    # once only: where its fill ahead did not happen, the step fills it, as without the hold
    assert hold_for_fills(sched) == [] and slots_seen(sched).held == []
    assert held_counts(sched)["slot_fill"] == 2


def test_no_request_sits_out_where_no_adapter_could_join_or_no_slot_could_be_filled_or_none_is_spare():
    waiting = [request("a", 2, 1.0)]
    full = spare_slot_scheduler([1, 3], waiting)  # two adapters run: the step limit keeps 2 out anyway
    assert hold_for_fills(full) == [] and not hasattr(waiting[0], HELD_FOR_FILL)
    kept = spare_slot_scheduler([1], waiting)
    slots_seen(kept).ran([1, 3, 4])
    kept.requests |= {"w3": request("w3", 3, 0.5), "w4": request("w4", 4, 0.5)}  # every slot's adapter has requests
    assert hold_for_fills(kept) == []
    no_spare = spare_slot_scheduler([1], waiting, slots=2)  # the workers' slots are the step limit, as in vLLM
    assert slots_seen(no_spare) is None and hold_for_fills(no_spare) == []
    assert [r.request_id for r in no_spare.waiting] == ["a"]


def test_a_request_sits_out_where_its_fill_can_take_the_slot_of_an_adapter_queued_behind_it():
    # 1 runs; one more adapter may join; the other slots hold 3 and 4, whose requests came after 5's
    waiting = [request("a", 5, 1.0), request("c", 3, 2.0), request("d", 4, 3.0)]
    sched = spare_slot_scheduler([1], waiting)
    slots_seen(sched).ran([3, 4, 1])
    held = hold_for_fills(sched)
    assert [r.request_id for r in slots_seen(sched).held] == ["a"]  # takes 4's slot: 3 joins the step, 4 waits
    assert all(slots_seen(sched).holds(a) for a in (1, 3, 4))  # the fill is named with the step, not here
    put_back(held)
    # where the one behind it joins the step too, there is no slot to take: it joins, and its step fills it
    waiting = [request("a2", 5, 1.0), request("c2", 3, 2.0), request("d2", 4, 3.0)]
    sched = spare_slot_scheduler([6], waiting, step_limit=3, slots=4)
    sched.requests["e"] = request("e", 7, 0.5)  # 7's request is in the engine, though not queued
    slots_seen(sched).ran([3, 4, 7, 6])
    assert hold_for_fills(sched) == []


def test_every_adapter_in_no_slot_sits_out_where_a_fill_ahead_finds_a_slot_for_one():
    # 1 and 2 just finished; 3 holds a slot and joins; 4 and 5 take 1's and 2's slots ahead of their steps, and 6,
    # for which none is left now, sits out as well: joining now, its own step would fill it (as slots free when the
    # next requests finish, its fill ahead can come then)
    waiting = [request("c", 3, 1.0), request("d", 4, 2.0), request("e", 5, 3.0), request("f", 6, 4.0)]
    sched = spare_slot_scheduler([], waiting)
    slots_seen(sched).ran([1, 2, 3])
    held = hold_for_fills(sched)
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert [r.request_id for r in slots_seen(sched).held] == ["d", "e", "f"]
    put_back(held)


def test_requests_behind_the_adapters_a_step_can_add_keep_their_hold_for_when_they_could_join():
    # one adapter a step, none running: vLLM would take the queue's first adapter
    waiting = [request("c", 3, 1.0), request("b", 2, 2.0), request("d", 4, 3.0)]
    sched = spare_slot_scheduler([], waiting, step_limit=1, slots=2)
    slots_seen(sched).ran([2])  # 2 was filled ahead; 3 and 4 are in no slot
    held = hold_for_fills(sched)
    assert [r.request_id for r in slots_seen(sched).held] == ["c"]  # 2 joins instead; 4 waits behind it anyway
    put_back(held)
    assert not hasattr(waiting[2], HELD_FOR_FILL)
    # a queue whose first adapter holds a slot: it joins, and no one sits out (the pipeline of one adapter at a time)
    sched = spare_slot_scheduler([], [request("b", 2, 1.0), request("e", 5, 2.0)], step_limit=1, slots=2)
    slots_seen(sched).ran([2])
    assert hold_for_fills(sched) == []


def last_token_in_flight(r, prompt=4, max_tokens=4):
    """`r` as vLLM's async scheduling leaves a running request whose step in flight yields its last token."""
    r.num_prompt_tokens, r.max_tokens = prompt, max_tokens
    r.num_computed_tokens, r.num_output_placeholders = prompt + max_tokens - 1, 1
    return r


def test_a_running_request_runs_again_unless_a_step_in_flight_yields_its_last_token():
    r = request("r", 1, 0.0)
    assert runs_again(r)  # no async scheduling: no placeholders
    last_token_in_flight(r)
    assert not runs_again(r)
    r.num_computed_tokens -= 1  # two tokens to go, one in flight
    assert runs_again(r)
    r.num_computed_tokens, r.num_output_placeholders = 7, 0  # its output arrived: vLLM decides, as without async
    assert runs_again(r)


def test_an_adapter_whose_last_request_ends_in_flight_leaves_room_and_its_slot_to_a_waiting_fill():
    # 1 and 3 run, the step limit is 2; 3's only request has its last token in flight, so vLLM schedules it no more
    # and may add an adapter: 2 is first in the queue and in no slot, 4 was filled ahead behind it
    for in_flight in (False, True):
        waiting = [request("a", 2, 1.0), request("d", 4, 2.0)]
        sched = spare_slot_scheduler([1, 3], waiting)
        if in_flight:
            last_token_in_flight(sched.running[1])
        slots_seen(sched).ran([1, 3, 4])
        held = hold_for_fills(sched)
        if not in_flight:  # two adapters run: the step limit keeps 2 out anyway
            assert held == []
            continue
        # 2 sits out while its fill takes 3's slot (no later step runs 3), and 4 joins
        assert [r.request_id for r in slots_seen(sched).held] == ["a"]
        assert [r.request_id for r in sched.waiting] == ["d"]
        assert slots_seen(sched).would_fill([2], {1, 2, 4}) == [2]
        put_back(held)
    sched = spare_slot_scheduler([1, 3], [request("a", 2, 1.0)])
    last_token_in_flight(sched.running[1])
    sched.running[1].arrival_time = 0.0
    assert starved_adapter(sched, 2.0, now=100.0) is None  # vLLM has room for 2: nothing to hold back for it
