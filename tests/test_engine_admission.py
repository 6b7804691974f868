"""The engine core's side of adapter admission (`adapter_lifecycle.engine`), driven against workers' real adapter
stores (`adapter_lifecycle.store`) whose reads the tests control: answers come later while the engine keeps going,
every rank must read the same files, a read that never returns fails alone at its deadline, requests wait for their
adapter, and an unload waits for the adapter's requests. The engine tests (test_engine_vs_peft.py, test_server*.py)
run the same code inside vLLM."""

import logging
import os
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from vllm_bdlora.adapter_lifecycle.calls import (
    WORKER_METHOD,
    AdmissionReceipt,
    AdmissionStates,
    BeginAdmissions,
    CompleteAdmissions,
    ForgetAdmissions,
    RestoreAhead,
    Unknown,
)
from vllm_bdlora.adapter_lifecycle.engine import ADMISSION_TICK, EngineAdmissions, admit_before_request
from vllm_bdlora.adapter_lifecycle.read_and_cut import AdmittedAdapter
from vllm_bdlora.adapter_lifecycle.store import AdapterStore
from vllm_bdlora.adapters import AdapterLoadFailure, AdapterRejected


def lora(adapter_id, name=None):
    return SimpleNamespace(lora_int_id=adapter_id, lora_name=name or f"ad{adapter_id}", lora_path=f"/a/{adapter_id}",
                           load_inplace=False)  # fmt: skip


class Workers:
    """TP ranks, each with a real store; `reads[(rank, id)]` decides what a rank's admission of an adapter returns
    (an identity string, an exception to raise, or an Event to wait on first)."""

    def __init__(self, ranks=2, threads=2):
        self.stores = [AdapterStore(2**30, threads=threads) for _ in range(ranks)]
        self.reads = {}
        self.add_failures = {}  # (rank, id): the message that rank's add_lora fails with
        self.added, self.removed = [], []
        self.calls = []  # the type of every call the engine made, in order

    def work(self, rank, request):
        def read():
            outcome = self.reads.get((rank, request.lora_int_id), "same-files")
            if isinstance(outcome, threading.Event):
                outcome.wait(30)
                outcome = "same-files"
            if isinstance(outcome, BaseException):
                raise outcome
            return SimpleNamespace(identity=outcome, nbytes=0, template=SimpleNamespace(loras={}))

        return read

    def collective_rpc(self, method, args=()):
        assert method == WORKER_METHOD
        (call,) = args
        self.calls.append(type(call).__name__)
        replies = []
        for rank, store in enumerate(self.stores):
            match call:
                case BeginAdmissions(requests=requests):
                    for request in requests:
                        store.begin(request.lora_int_id, request.lora_name, self.work(rank, request))
                    replies.append(True)
                case AdmissionStates(adapter_ids=ids):
                    replies.append(store.status(list(ids)))
                case ForgetAdmissions(adapter_ids=ids):
                    replies.append([store.forget(i) for i in ids])
                case CompleteAdmissions(requests=requests):
                    replies.append([self.add_lora_on(rank, store, request) for request in requests])
                case RestoreAhead(adapter_ids=ids, begin=begin):
                    replies.append(store.restore_ahead(list(ids)) if begin else store.reading_back(list(ids)))
        if isinstance(call, CompleteAdmissions):
            for index, request in enumerate(call.requests):
                if all(isinstance(reply[index], AdmissionReceipt) for reply in replies):
                    self.added.append(request.lora_int_id)
        return replies

    def add_lora_on(self, rank, store, request):
        """One rank's add_lora as `worker.add_lora_reporting_failures` answers it: a receipt or a failure."""
        admitted = store.take_staged(request.lora_int_id, timeout=5)
        failure = self.add_failures.get((rank, request.lora_int_id))
        if failure is not None:
            return AdapterLoadFailure(failure)
        return AdmissionReceipt(True, admitted.identity)

    def remove_lora(self, adapter_id):
        self.removed.append(adapter_id)
        return True


class Core:
    """What EngineAdmissions uses of vLLM's engine core: its executor, scheduler, input queue and request entry."""

    def __init__(self, workers, multiprocess=True):
        self.model_executor = workers
        self.scheduler = SimpleNamespace(requests={})
        self.scheduled, self.aborted = [], []
        if multiprocess:
            self.input_queue = queue.Queue()

    def add_request(self, request, wave=0):
        admissions = self._bdlora_admissions
        if admissions.hold(request, wave):
            return
        self.scheduled.append(request.request_id)
        self.scheduler.requests[request.request_id] = request

    def _send_abort_outputs_to_client(self, ids, client_index):
        self.aborted += ids


def engine(ranks=2, timeout_s=5.0, multiprocess=True, threads=2):
    workers = Workers(ranks, threads)
    core = Core(workers, multiprocess)
    core._bdlora_admissions = EngineAdmissions(core, timeout_s)
    return core, workers, core._bdlora_admissions


def poll_until(admissions, done, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        admissions.poll()
        time.sleep(0.01)
    assert done()


def test_a_load_is_answered_later_while_the_engine_goes_on():
    core, workers, admissions = engine()
    gate = threading.Event()
    workers.reads[(1, 7)] = gate  # rank 1 is still reading
    answer = admissions.admit(lora(7))
    assert not answer.done() and workers.added == []
    admissions.poll()  # between steps: not yet
    assert not answer.done()
    assert core.input_queue.get(timeout=2) == (ADMISSION_TICK, None)  # the ticker wakes the engine core's loop
    gate.set()
    poll_until(admissions, answer.done)
    assert answer.result() is True and workers.added == [7] and 7 in admissions.ready


def test_the_ticker_and_the_stores_starters_end_when_idle_and_start_again(monkeypatch):
    """Neither the engine's admission ticker nor a store's thread starter outlives its work by long: idle, each ends
    (so an engine or store that is gone leaves no thread holding it), and the next admission starts them again."""
    from vllm_bdlora.adapter_lifecycle import engine as engine_module

    monkeypatch.setattr(engine_module, "TICKER_IDLE_S", 1.0)
    core, workers, admissions = engine()
    for store in workers.stores:
        store._threads.idle_s = 1.0
    for adapter_id in (7, 8):  # the second admission after both had ended
        answer = admissions.admit(lora(adapter_id))
        admissions.poll()  # begun on every rank: each store's starter starts the read
        threads = [admissions._thread, *(store._threads._starter for store in workers.stores)]
        assert all(thread is not None for thread in threads)
        poll_until(admissions, answer.done)
        assert answer.result() is True and adapter_id in admissions.ready
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive()
        assert admissions._thread is None and all(store._threads._starter is None for store in workers.stores)
    assert workers.added == [7, 8]


def test_one_ranks_refusal_refuses_the_adapter_on_every_rank():
    _, workers, admissions = engine()
    workers.reads[(0, 3)] = AdapterRejected("ad3", ["model.layers.0.mlp.up_proj: lora_B holds NaN or Inf"])
    answer = admissions.admit(lora(3))
    poll_until(admissions, answer.done)
    with pytest.raises(RuntimeError, match="LoRA adapter rejected: 'ad3'"):
        answer.result()
    assert workers.added == [] and all(3 not in store.ids() for store in workers.stores)
    assert all(store.status([3]) == {3: Unknown()} for store in workers.stores)


def test_ranks_that_read_different_files_refuse_the_adapter():
    _, workers, admissions = engine()
    workers.reads[(1, 4)] = "the-file-after-a-rewrite"
    answer = admissions.admit(lora(4))
    poll_until(admissions, answer.done)
    with pytest.raises(RuntimeError, match="changed while the tensor-parallel ranks were reading them"):
        answer.result()
    assert workers.added == []


def test_a_read_that_never_returns_fails_alone_at_its_deadline():
    _, workers, admissions = engine(timeout_s=0.3, threads=1)
    stuck = threading.Event()
    workers.reads[(0, 5)] = stuck
    slow = admissions.admit(lora(5, "stuck"))
    fine = admissions.admit(lora(6, "fine"))  # queued behind the stuck read on rank 0's only thread
    poll_until(admissions, lambda: slow.done() and fine.done())
    with pytest.raises(RuntimeError, match=r"(?s)'stuck'.*not read on every worker within 0.3 s"):
        slow.result()
    assert fine.result() is True and workers.added == [6]
    stuck.set()


def test_a_request_waits_for_its_adapter_and_is_scheduled_once_it_is_admitted():
    core, workers, admissions = engine()
    gate = threading.Event()
    workers.reads[(0, 8)] = gate
    request = SimpleNamespace(request_id="r1", lora_request=lora(8), client_index=0)
    core.add_request(request)
    other = SimpleNamespace(request_id="r2", lora_request=None, client_index=0)
    core.add_request(other)
    assert core.scheduled == ["r2"]  # the others run meanwhile
    gate.set()
    poll_until(admissions, lambda: "r1" in core.scheduled)
    assert workers.added == [8]
    core.add_request(SimpleNamespace(request_id="r3", lora_request=lora(8), client_index=0))
    assert core.scheduled[-1] == "r3"  # admitted: no more waiting


def test_requests_for_a_refused_adapter_are_aborted_and_the_refusal_logged(caplog):
    core, workers, admissions = engine()
    workers.reads[(1, 9)] = AdapterRejected("ad9", ["adapter_config.json: lora_alpha 1e+308 ..."])
    with caplog.at_level(logging.WARNING, logger="vllm.bdlora"):
        core.add_request(SimpleNamespace(request_id="r1", lora_request=lora(9), client_index=0))
        core.add_request(SimpleNamespace(request_id="r2", lora_request=lora(9), client_index=0))
        poll_until(admissions, lambda: core.aborted)
    assert core.aborted == ["r1", "r2"] and core.scheduled == []
    assert "2 request(s) for adapter 'ad9' aborted" in caplog.text


def test_a_held_request_the_client_gave_up_is_not_scheduled():
    core, workers, admissions = engine()
    gate = threading.Event()
    workers.reads[(0, 10)] = gate
    core.add_request(SimpleNamespace(request_id="r1", lora_request=lora(10), client_index=0))
    admissions.drop_held(["r1"])
    gate.set()
    poll_until(admissions, lambda: 10 in admissions.ready)
    assert core.scheduled == []


def test_an_unload_waits_for_the_adapters_requests():
    core, workers, admissions = engine()
    answer = admissions.admit(lora(11))
    poll_until(admissions, answer.done)
    core.add_request(SimpleNamespace(request_id="r1", lora_request=lora(11), client_index=0))
    removed_now = []
    assert admissions.remove(11, removed_now.append)
    assert removed_now == [] and 11 not in admissions.ready
    admissions.poll()
    assert workers.removed == []  # r1 still runs
    del core.scheduler.requests["r1"]
    admissions.poll()
    assert workers.removed == [11]
    assert admissions.remove(12, removed_now.append) is None and removed_now == [12]  # nothing running: at once


def test_an_unload_during_the_load_gives_the_load_up():
    _, workers, admissions = engine()
    gate = threading.Event()
    workers.reads[(0, 13)] = gate
    answer = admissions.admit(lora(13))
    admissions.remove(13, lambda i: None)
    with pytest.raises(RuntimeError, match="unloaded while it was being loaded"):
        answer.result(timeout=1)
    gate.set()


def test_an_in_process_engine_waits_for_its_admissions():
    _, workers, admissions = engine(multiprocess=False)
    assert admissions.admit(lora(14)) is True and workers.added == [14]
    workers.reads[(1, 15)] = AdapterRejected("ad15", ["x: bad"])
    with pytest.raises(RuntimeError, match="'ad15'"):
        admissions.admit(lora(15))


def test_an_in_process_request_admits_its_adapter_before_it_is_registered():
    """vLLM's in-process client (`client.engine_core`): a request naming an adapter the engine has not admitted
    admits it first; once admitted, its requests admit nothing more; a refusal raises, naming the adapter, before the
    request exists anywhere. A multiprocess engine core holds such requests itself instead."""
    core, workers, admissions = engine(multiprocess=False)
    client = SimpleNamespace(engine_core=core)
    admit_before_request(client, lora(16))
    assert workers.added == [16] and 16 in admissions.ready
    calls = len(workers.calls)
    admit_before_request(client, lora(16))
    admit_before_request(client, None)
    assert len(workers.calls) == calls
    core.add_request(SimpleNamespace(request_id="r1", lora_request=lora(16), client_index=0))
    assert core.scheduled == ["r1"]
    workers.reads[(1, 17)] = AdapterRejected("ad17", ["adapter_model.safetensors: lora_A of q_proj is 64 wide"])
    with pytest.raises(RuntimeError, match=r"(?s)'ad17'.*adapter_model.safetensors"):
        admit_before_request(client, lora(17))
    assert 17 not in admissions.ready and all(17 not in store.ids() for store in workers.stores)
    mp_core, mp_workers, _ = engine()
    admit_before_request(SimpleNamespace(engine_core=mp_core), lora(18))
    assert mp_workers.calls == []


def test_a_burst_of_admissions_logs_where_the_engine_loops_time_went(caplog):
    """Eight loads in flight at once: when the last is answered one line says how many were admitted and how long the
    engine loop's own calls (begin, polls, vLLM's add_lora one adapter at a time) took of the burst's time."""
    _, workers, admissions = engine()
    answers = [admissions.admit(lora(i)) for i in range(1, 9)]
    with caplog.at_level(logging.INFO, logger="vllm.bdlora"):
        poll_until(admissions, lambda: all(a.done() for a in answers))
    lines = [r.getMessage() for r in caplog.records if "admitted 8 adapter(s) in" in r.getMessage()]
    assert len(lines) == 1 and "polls" in lines[0] and "vLLM's add_lora" in lines[0], caplog.text
    assert sorted(workers.added) == list(range(1, 9))
    assert admissions.timeline.started is None  # the next burst starts a timeline of its own


def test_a_burst_of_loads_is_begun_and_completed_in_one_call_each():
    """Loads that arrive between two ticks are begun in one call, and the adapters one poll finds ready are completed
    (vLLM's add_lora of each) in one call: the engine loop's calls per burst do not grow with its size."""
    _, workers, admissions = engine()
    ids, gate = list(range(1, 13)), threading.Event()
    workers.reads.update({(0, i): gate for i in ids})
    answers = [admissions.admit(lora(i)) for i in ids]
    assert workers.calls == []  # nothing is sent before the engine loop's next tick
    admissions.poll()
    assert workers.calls == ["BeginAdmissions", "AdmissionStates"]
    gate.set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(  # every rank's reads done: the next poll finds all twelve ready
        all(type(state).__name__ == "Ready" for state in store.status(ids).values()) for store in workers.stores
    ):
        time.sleep(0.01)
    admissions.poll()
    assert workers.calls == ["BeginAdmissions", "AdmissionStates", "AdmissionStates", "CompleteAdmissions"]
    assert sorted(workers.added) == ids and all(a.result(timeout=0) is True for a in answers)


def test_one_adapters_failed_add_lora_refuses_it_alone():
    _, workers, admissions = engine()
    workers.add_failures[(1, 2)] = "LoRA rank 64 is greater than max_lora_rank 32"
    answers = {i: admissions.admit(lora(i)) for i in (1, 2, 3)}
    poll_until(admissions, lambda: all(a.done() for a in answers.values()))
    with pytest.raises(RuntimeError, match="greater than max_lora_rank"):
        answers[2].result()
    assert answers[1].result() is True and answers[3].result() is True
    assert sorted(workers.added) == [1, 3] and admissions.ready == {1, 3}
    assert all(2 not in store.ids() for store in workers.stores)  # forgotten on every rank


def spilling_engine(tmp_path, ranks=2):
    """An engine whose workers' stores hold one adapter in memory: of adapters 1 and 2, kept in that order, 1 is
    spilled on every rank. Both are admitted."""
    core, workers, admissions = engine(ranks)
    for rank, store in enumerate(workers.stores):
        store.host_budget, store.spill_dir = 4 * 256 * 4, str(tmp_path)
        for adapter_id in (1, 2):
            weights = SimpleNamespace(lora_a=torch.full((4, 256), float(adapter_id)), lora_b=None)
            store.keep(adapter_id, AdmittedAdapter(f"ad{adapter_id}", SimpleNamespace(loras={"m": weights}),
                                                   "same-files", "", [], None))  # fmt: skip
        assert store.spilled_ids() == {1}, rank
    admissions.ready |= {1, 2}
    return core, workers, admissions


def gate_read_backs(monkeypatch):
    """Spill-file reads wait for the returned event."""
    gate, preadv = threading.Event(), os.preadv
    monkeypatch.setattr(os, "preadv", lambda *args: gate.wait(10) and preadv(*args))
    return gate


def test_a_request_waits_for_its_adapters_read_back_while_the_others_run(tmp_path, monkeypatch):
    """A request naming a spilled adapter is held until no rank is reading it back, with the requests of that adapter
    that arrive meanwhile (one of them given up by its client), so that the step filling its slot does not wait for
    the read; requests of other adapters go to the scheduler meanwhile, and once the adapter is in memory its next
    requests go straight there."""
    core, workers, admissions = spilling_engine(tmp_path)
    gate = gate_read_backs(monkeypatch)
    core.add_request(SimpleNamespace(request_id="r1", lora_request=lora(1), client_index=0))
    core.add_request(SimpleNamespace(request_id="r2", lora_request=lora(2), client_index=0))
    core.add_request(SimpleNamespace(request_id="r3", lora_request=lora(1), client_index=0))
    core.add_request(SimpleNamespace(request_id="r4", lora_request=lora(1), client_index=0))
    admissions.drop_held(["r4"])
    assert core.scheduled == ["r2"] and workers.calls.count("RestoreAhead") == 2  # one per adapter
    admissions.poll()
    assert core.scheduled == ["r2"] and all(store.needs_restore(1) for store in workers.stores)
    gate.set()
    poll_until(admissions, lambda: "r1" in core.scheduled)
    assert core.scheduled == ["r2", "r1", "r3"] and not admissions.reading_back
    assert all(1 in store.resident_ids() for store in workers.stores)
    calls = len(workers.calls)
    core.add_request(SimpleNamespace(request_id="r5", lora_request=lora(1), client_index=0))
    assert core.scheduled[-1] == "r5" and len(workers.calls) == calls  # its requests run: in a slot, or kept
    core.scheduler.requests.clear()  # they finished: the next request asks again (it may have been spilled since)
    core.add_request(SimpleNamespace(request_id="r6", lora_request=lora(1), client_index=0))
    assert core.scheduled[-1] == "r6" and workers.calls[calls:] == ["RestoreAhead"]


def test_a_worker_reads_back_no_adapter_vllms_host_cache_holds(tmp_path, monkeypatch):
    """vLLM fills the slot of an adapter its host cache holds from there, so the worker neither reads it back nor
    keeps it for a step that will not take it. (The read-back of 1 is held until the answer is checked: finished, it
    would spill 2 from this one-adapter budget, and a quick one did so before the worker looked at 2.)"""
    from vllm_bdlora.adapter_lifecycle.worker import WorkerAdapters

    _, workers, _ = spilling_engine(tmp_path, ranks=1)
    (store,) = workers.stores
    manager = SimpleNamespace(_registered_adapters={1: object()})
    adapters = WorkerAdapters(SimpleNamespace(_adapter_manager=manager))
    adapters.kept = store
    assert adapters.answer(RestoreAhead([1, 2])) == [] and store.needs_restore(1)  # spilled, and left there
    assert set(store._awaiting_step) == {2}  # in memory, not in vLLM's cache: kept for its step
    del manager._registered_adapters[1]
    gate = gate_read_backs(monkeypatch)
    try:
        assert adapters.answer(RestoreAhead([1, 2])) == [1]
    finally:
        gate.set()


def test_a_read_back_that_takes_too_long_holds_its_requests_no_longer(tmp_path, monkeypatch):
    core, workers, admissions = spilling_engine(tmp_path)
    gate = gate_read_backs(monkeypatch)
    admissions.read_back_hold_s = 0.2
    core.add_request(SimpleNamespace(request_id="r1", lora_request=lora(1), client_index=0))
    assert core.scheduled == []
    poll_until(admissions, lambda: core.scheduled == ["r1"], seconds=5)
    assert all(store.needs_restore(1) for store in workers.stores)  # its step will wait for the read, as without
    gate.set()


def test_an_unload_hands_requests_held_for_a_read_back_on_and_waits_for_them(tmp_path, monkeypatch):
    core, workers, admissions = spilling_engine(tmp_path)
    gate = gate_read_backs(monkeypatch)
    core.add_request(SimpleNamespace(request_id="r1", lora_request=lora(1), client_index=0))
    assert admissions.remove(1, lambda i: pytest.fail("removed under a running request"))
    assert core.scheduled == ["r1"] and not admissions.reading_back
    gate.set()
    del core.scheduler.requests["r1"]
    poll_until(admissions, lambda: workers.removed == [1])
