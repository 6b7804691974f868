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
"""

from __future__ import annotations

import time
from collections.abc import Iterable


def waiting_queues(scheduler) -> list:
    """The queues a waiting request may sit in: `waiting` in every release, `skipped_waiting` in those that keep
    skipped requests apart (0.26)."""
    return [q for q in (getattr(scheduler, "waiting", None), getattr(scheduler, "skipped_waiting", None)) if q]


def adapters_of(requests: Iterable) -> set[int]:
    """The adapters `requests` name (base-model requests name none)."""
    return {r.lora_request.lora_int_id for r in requests if getattr(r, "lora_request", None)}


def starved_adapter(scheduler, limit_s: float, now: float | None = None) -> int | None:
    """The adapter of the oldest waiting request that needs a slot while every slot is taken, if that request has
    waited longer than `limit_s`; else None."""
    lora_config = getattr(scheduler, "lora_config", None)
    if not limit_s or lora_config is None:
        return None
    running = adapters_of(scheduler.running)
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
    return held


def put_back(held: list) -> None:
    """Return held requests to their queues, every queue in arrival order (the order vLLM keeps them in)."""
    for queue, requests in held:
        remaining = list(queue)
        queue.remove_requests(remaining)
        for request in sorted(remaining + requests, key=lambda r: r.arrival_time):
            queue.add_request(request)
