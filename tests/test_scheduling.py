"""No request waits unboundedly for a LoRA slot (`vllm_bdlora.scheduling`), on vLLM's own request queues: the
starved adapter is found once its oldest request has waited past the limit, every other adapter's waiting request is
held back (base-model requests are not), and everything goes back in arrival order."""

from types import SimpleNamespace

import pytest
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

from vllm_bdlora.scheduling import hold_back, put_back, starved_adapter


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
    sched.waiting.pop_request()  # the scheduler takes one meanwhile
    put_back(held)
    order = [r.request_id for r in sched.waiting]
    assert sorted(order) == sorted(["a1", "c1", "d1", "a2", "c2"]) and len(order) == 5
    if policy == SchedulingPolicy.FCFS:
        assert order == sorted(order, key=lambda rid: next(r.arrival_time for r in waiting if r.request_id == rid))
