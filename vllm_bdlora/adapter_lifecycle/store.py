"""What a worker keeps of the adapters it admitted, and how it admits them without holding up an engine step.

vLLM reads an adapter's files whenever it has dropped the adapter from its host-memory cache (`--max-cpu-loras`)
and a request asks for it again, inside the engine step, where every running request waits for the read and any
failure stops the engine; an adapter whose files were re-saved, half-synced or deleted after it was admitted would
take every request down with it, or be served as something other than what was admitted.

So a worker reads an adapter once, when it admits it: its own share of the tensors, checked and cut to this rank
(`read_and_cut.py`), is kept here (`AdapterStore`), in host memory (pinned where the GPU copies from it) up to a
budget in bytes and, past the budget, in a private file that is unlinked as soon as it is made (so it is gone with
the process, however the process ends). Every later load of the adapter is built from what is kept: no file of the
adapter's is read again, so nothing that happens to them afterwards reaches a step, and a re-read costs no more than
the copy into a GPU slot.

Admission runs on threads of its own (`begin`), one adapter per thread, a few at a time: the engine core asks every
rank to begin, polls them between steps (`status`) and completes the load only once every rank has read the same
files (each reports the digest of what it opened, `OpenedAdapter.identity`). A read that never returns (a stalled
network filesystem) is given up by the engine core at its deadline (`forget`), and its thread no longer counts
against the few that run at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_bdlora.access import STORE_FULL
from vllm_bdlora.adapter_lifecycle.calls import AdmissionState, Failed, Reading, Ready, Unknown
from vllm_bdlora.config import BdLoraSettings

logger = logging.getLogger("vllm.bdlora")


class ReadingThreads:
    """How many threads of this process are admitting adapters or reading spilled ones back ahead of their step now,
    every store of the process together. While any is and the engine runs no steps, the process's reader of vLLM's
    message queue waits for a message rather than spinning for one (`worker.wait_for_engine_message`), so that it
    does not take the interpreter lock from them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = 0

    @contextlib.contextmanager
    def reading(self):
        with self._lock:
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1

    def any(self) -> bool:
        return self._count > 0


ADMISSIONS_READING = ReadingThreads()


class ThreadStarter:
    """Starts threads for a caller that must not wait for them to run. `threading.Thread.start` returns only once the
    new thread has taken the interpreter lock and said so, and the caller then takes the lock back: two hand-overs,
    each of which can wait up to Python's switch interval while admission threads read. The caller here is the
    worker's main thread answering the engine core (a begin, a read-back ahead of a step), which the engine loop waits
    for: on one H200 a begin took 9.6-12.8 ms while one thread read. So it hands the thread over to a starter thread
    of the store's, made at the first start, and returns at once. The starter ends after `idle_s` with nothing to
    start (the next start makes another), so that a store that is gone leaves no idle thread behind."""

    def __init__(self, name: str, idle_s: float = 60.0):
        self.name = name
        self.idle_s = idle_s
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._starter: threading.Thread | None = None

    def start(self, target: Callable, args: tuple, name: str) -> None:
        self._pending.put(threading.Thread(target=target, args=args, name=name, daemon=True))
        with self._lock:
            if self._starter is None:
                self._starter = threading.Thread(target=self._start_pending, name=self.name, daemon=True)
                self._starter.start()

    def _start_pending(self) -> None:
        while True:
            try:
                self._pending.get(timeout=self.idle_s).start()
            except queue.Empty:
                with self._lock:  # a thread put before this check is started here; one put after, by a new starter
                    if self._pending.empty():
                        self._starter = None
                        return


class StoreFull(RuntimeError):
    """The host budget is used up and the rest cannot be spilled to disk (no space): the adapter is refused with
    HTTP 507, naming it."""


@dataclass
class _Staging:
    """One admission in progress on its own thread."""

    adapter_id: int
    name: str
    reading_since: float | None = None  # set once it holds a slot (its time queued behind others does not count)
    finished: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None  # an admitted adapter (see `vllm_bdlora.adapter_lifecycle.read_and_cut.AdmittedAdapter`)
    error: BaseException | None = None
    abandoned: bool = False  # forgotten while it ran: its result is dropped when it ends
    counted: bool = True  # holds one of the running slots


@dataclass
class _Spilled:
    """An adapter whose tensors were spilled: a private unlinked file and, per tensor, its place in it."""

    admitted: object  # its tensors set to None until read back
    fd: int
    places: list  # (key, offset, shape, dtype, pinned), keys as the adapter's `host_tensors` names them


class AdapterStore:
    """One worker's admitted adapters (keyed by vLLM's adapter id), the admissions it runs, and its spill files.

    `host_budget`: bytes of adapter tensors kept in host memory; the least recently used beyond it are spilled to
    `spill_dir` (None: the system's temporary directory) and read back when a load asks for them. `threads`: how many
    admissions read at once. `named_kept_s`: how long an adapter a request named (`restore_ahead`: read back, or
    found in memory) is kept from spilling before a step takes it (`get`), while another can go instead
    (`BdLoraSettings.named_kept_s`)."""

    def __init__(self, host_budget: int, spill_dir: str | None = None, threads: int = 4,
                 named_kept_s: float = BdLoraSettings.named_kept_s):  # fmt: skip
        self.host_budget = host_budget
        self.named_kept_s = named_kept_s
        self.spill_dir = spill_dir or tempfile.gettempdir()
        self._lock = threading.Lock()
        self._admitted: OrderedDict[int, object] = OrderedDict()  # least recently used first
        self._spilled: dict[int, _Spilled] = {}
        self._staging: dict[int, _Staging] = {}
        self._restoring: dict[int, threading.Event] = {}  # spilled adapters being read back
        self._awaiting_step: dict[int, float] = {}  # named by a request, not yet taken by a step: kept until when
        self._slots = threading.Semaphore(max(1, threads))
        self._threads = ThreadStarter("bdlora-admission-starter")
        self.resident_bytes = 0

    # -- admissions ---------------------------------------------------------------------------------------------
    def begin(self, adapter_id: int, name: str, work: Callable[[], object]) -> None:
        """Start admitting `adapter_id` on a thread of its own (`work` reads, checks and cuts it); an admission of
        the same id already running is abandoned (an in-place reload supersedes it)."""
        with self._lock:
            previous = self._staging.pop(adapter_id, None)
        if previous is not None:
            self._abandon(previous)
        staging = _Staging(adapter_id, name)
        with self._lock:
            self._staging[adapter_id] = staging
        self._threads.start(self._run, (staging, work), f"bdlora-admit-{adapter_id}")

    def _run(self, staging: _Staging, work: Callable[[], object]) -> None:
        self._slots.acquire()
        staging.reading_since = time.monotonic()
        try:
            if not staging.abandoned:
                with ADMISSIONS_READING.reading():
                    staging.result = work()
        except BaseException as e:  # reported through status(); the engine core turns it into the client's answer
            staging.error = e
        finally:
            staging.finished = time.monotonic()
            with self._lock:
                release = staging.counted
                staging.counted = False
            if release:
                self._slots.release()
            staging.done.set()

    def status(self, ids: list[int]) -> dict[int, AdmissionState]:
        """Each id's state of admission (`vllm_bdlora.adapter_lifecycle.calls`)."""
        found = {}
        with self._lock:
            for adapter_id in ids:
                staging = self._staging.get(adapter_id)
                kept = self._admitted.get(adapter_id) or getattr(self._spilled.get(adapter_id), "admitted", None)
                if staging is None:
                    found[adapter_id] = Ready(kept.identity) if kept is not None else Unknown()
                elif not staging.done.is_set():
                    since = staging.reading_since
                    found[adapter_id] = Reading(0.0 if since is None else time.monotonic() - since)
                elif staging.error is not None:
                    found[adapter_id] = Failed(str(staging.error) or type(staging.error).__name__)
                else:
                    found[adapter_id] = Ready(staging.result.identity)
        return found

    def take_staged(self, adapter_id: int, timeout: float | None = None):
        """The result of `adapter_id`'s admission (waiting for it, at most `timeout` seconds), kept from now on; None
        where none was begun. Raises what the admission raised."""
        with self._lock:
            staging = self._staging.get(adapter_id)
        if staging is None:
            return None
        if not staging.done.wait(timeout):
            raise TimeoutError(f"adapter '{staging.name}' is still being read")
        with self._lock:
            if self._staging.get(adapter_id) is staging:
                del self._staging[adapter_id]
        if staging.error is not None:
            raise staging.error
        self.keep(adapter_id, staging.result)
        return staging.result

    def _abandon(self, staging: _Staging) -> None:
        staging.abandoned = True
        with self._lock:
            release = staging.counted and not staging.done.is_set()
            staging.counted = False if release else staging.counted
        if release:  # a read stuck past its deadline no longer holds up the admissions behind it
            self._slots.release()

    # -- what is kept ---------------------------------------------------------------------------------------------
    def keep(self, adapter_id: int, admitted) -> None:
        """`admitted` is what `adapter_id` is served from from now on (replacing an earlier one)."""
        self._drop(adapter_id)
        with self._lock:
            self._admitted[adapter_id] = admitted
            self.resident_bytes += admitted.nbytes
        try:
            self._enforce_budget(keep=adapter_id)
        except StoreFull as e:
            self._drop(adapter_id)
            raise StoreFull(f"LoRA adapter '{getattr(admitted, 'name', adapter_id)}' not admitted: {e}") from e

    def get(self, adapter_id: int):
        """The admitted adapter (read back from its spill file if it was spilled, or once a read-back ahead of the
        step has finished), or None."""
        with self._lock:
            admitted = self._admitted.get(adapter_id)
            if admitted is not None:
                self._admitted.move_to_end(adapter_id)
                self._awaiting_step.pop(adapter_id, None)
                return admitted
            spilled = adapter_id in self._spilled
            restoring = self._restoring.get(adapter_id)
        if restoring is not None:
            restoring.wait()
            return self.get(adapter_id)
        if not spilled:
            return None
        admitted = self._restore(adapter_id)
        self._enforce_budget(keep=adapter_id)
        return admitted

    def needs_restore(self, adapter_id: int) -> bool:
        """Whether a load of `adapter_id` now would wait for a read from its spill file."""
        with self._lock:
            return adapter_id in self._spilled or adapter_id in self._restoring

    def restore_ahead(self, adapter_ids, record: Callable[[float], None] | None = None) -> list[int]:
        """Read each spilled adapter of `adapter_ids` back into memory on a thread of its own, so that the step that
        needs it finds it there (a load meanwhile waits for it, `get`); `record(seconds)` hears each one's time.
        Each is kept in memory until a step takes it (`named_kept_s`). Returns the ids not in memory yet: those
        whose read-back began now or was already under way (the engine core holds their requests back until no rank
        reports them, `engine.EngineAdmissions.hold`)."""
        reading = []
        for adapter_id in adapter_ids:
            with self._lock:
                if adapter_id in self._admitted:
                    self._admitted.move_to_end(adapter_id)
                    self._awaiting_step[adapter_id] = time.monotonic() + self.named_kept_s
                    continue
                if adapter_id in self._restoring:
                    reading.append(adapter_id)
                    continue
                if adapter_id not in self._spilled:
                    continue
                done = self._restoring[adapter_id] = threading.Event()
            reading.append(adapter_id)
            self._threads.start(self._restore_in_background, (adapter_id, done, record), f"bdlora-restore-{adapter_id}")
        return reading

    def reading_back(self, adapter_ids) -> list[int]:
        """The ids of `adapter_ids` whose read-back ahead of the step is under way."""
        with self._lock:
            return [adapter_id for adapter_id in adapter_ids if adapter_id in self._restoring]

    def _restore_in_background(self, adapter_id: int, done: threading.Event, record) -> None:
        started = time.perf_counter()
        try:
            with ADMISSIONS_READING.reading():  # a thread of adapter reads, as an admission's (worker's queue reader)
                restored = self._restore(adapter_id, wait_for_others=False)
            if restored is not None:
                with self._lock:
                    self._awaiting_step[adapter_id] = time.monotonic() + self.named_kept_s
                self._enforce_budget(keep=adapter_id)
                if record is not None:
                    record(time.perf_counter() - started)
        except Exception as e:  # StoreFull, OSError: a load that needs it reads it again (or fails), as in a step
            logger.warning("vllm-bdlora: reading adapter %d back from its spill file ahead of its step failed: %s",
                           adapter_id, e)  # fmt: skip
        finally:
            with self._lock:
                self._restoring.pop(adapter_id, None)
            done.set()

    def forget(self, adapter_id: int) -> str | None:
        """Drop everything of `adapter_id`: its admission in progress, its tensors, its spill file. Returns its name,
        None if the store held nothing of it."""
        with self._lock:
            staging = self._staging.pop(adapter_id, None)
        if staging is not None:
            self._abandon(staging)
        dropped = self._drop(adapter_id)
        return dropped or (staging.name if staging is not None else None)

    def ids(self) -> set[int]:
        with self._lock:
            return set(self._admitted) | set(self._spilled)

    def in_memory(self, adapter_id: int) -> bool:
        with self._lock:
            return adapter_id in self._admitted

    def resident_ids(self) -> set[int]:
        with self._lock:
            return set(self._admitted)

    def spilled_ids(self) -> set[int]:
        with self._lock:
            return set(self._spilled)

    def names(self) -> dict[int, str]:
        """Adapter id -> name of everything kept or being admitted."""
        with self._lock:
            kept = [*self._admitted.items(), *((i, s.admitted) for i, s in self._spilled.items())]
            names = {i: getattr(a, "name", str(i)) for i, a in kept}
            names.update({i: s.name for i, s in self._staging.items()})
        return names

    def reading_seconds(self, adapter_id: int) -> float | None:
        """How long a finished admission of `adapter_id` spent reading (None if there is none)."""
        with self._lock:
            staging = self._staging.get(adapter_id)
        if staging is None or staging.reading_since is None or staging.finished is None:
            return None
        return staging.finished - staging.reading_since

    def remove_all(self) -> None:
        with self._lock:
            ids = list(self._admitted) + list(self._spilled) + list(self._staging)
        for adapter_id in ids:
            self.forget(adapter_id)

    def _drop(self, adapter_id: int) -> str | None:
        with self._lock:
            restoring = self._restoring.get(adapter_id)
        if restoring is not None:  # a read-back ahead of the step ends by putting it in memory: drop it after that
            restoring.wait()
        with self._lock:
            admitted = self._admitted.pop(adapter_id, None)
            if admitted is not None:
                self.resident_bytes -= admitted.nbytes
            self._awaiting_step.pop(adapter_id, None)
            spilled = self._spilled.pop(adapter_id, None)
        if spilled is not None:
            os.close(spilled.fd)
            admitted = spilled.admitted
        return getattr(admitted, "name", str(adapter_id)) if admitted is not None else None

    # -- spilling -------------------------------------------------------------------------------------------------
    def _enforce_budget(self, keep: int) -> None:
        while True:
            with self._lock:
                if self.resident_bytes <= self.host_budget:
                    return
                victim = self._spill_victim(keep)
                if victim is None:
                    return  # one adapter larger than the budget stays resident
                admitted = self._admitted.pop(victim)
                self.resident_bytes -= admitted.nbytes
            try:
                self._spill(victim, admitted)
            except OSError as e:
                with self._lock:  # keep it resident: over budget beats losing an admitted adapter
                    self._admitted[victim] = admitted
                    self._admitted.move_to_end(victim, last=False)
                    self.resident_bytes += admitted.nbytes
                raise StoreFull(
                    f"{STORE_FULL}: the host memory for adapters ({self.host_budget} bytes per worker) is used up and "
                    f"spilling to {self.spill_dir} failed ({e.strerror or e}); unload adapters, or give the server "
                    'more "adapter_host_memory" or spill space'
                ) from e

    def _spill_victim(self, keep: int) -> int | None:
        """The least recently used adapter other than `keep`, passing over those requests named that no step has
        taken yet where another can go (under the lock)."""
        now, fallback = time.monotonic(), None
        for adapter_id in self._admitted:
            if adapter_id == keep:
                continue
            if self._awaiting_step.get(adapter_id, now) <= now:
                self._awaiting_step.pop(adapter_id, None)
                return adapter_id
            fallback = adapter_id if fallback is None else fallback
        self._awaiting_step.pop(fallback, None)
        return fallback

    def _spill(self, adapter_id: int, admitted) -> None:
        import torch

        fd, path = tempfile.mkstemp(prefix="vllm-bdlora-spill-", dir=self.spill_dir)
        os.unlink(path)  # the file lives as long as this descriptor: gone with the process, however it ends
        places, offset = [], 0
        try:  # ENOSPC included: the caller keeps the adapter resident and says so
            for key, tensor in admitted.host_tensors():
                data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
                written = 0
                while written < data.nbytes:
                    written += os.pwrite(fd, memoryview(data)[written:], offset + written)
                places.append((key, offset, tuple(tensor.shape), tensor.dtype, tensor.is_pinned()))
                offset += data.nbytes
        except OSError:
            os.close(fd)
            raise
        admitted.release_host_tensors()
        with self._lock:
            self._spilled[adapter_id] = _Spilled(admitted, fd, places)

    def _restore(self, adapter_id: int, wait_for_others: bool = True):
        import torch

        with self._lock:
            spilled = self._spilled.pop(adapter_id, None)
        if spilled is None:  # read back by another thread meanwhile (a read-back ahead does not wait on itself)
            return self.get(adapter_id) if wait_for_others else None
        admitted = spilled.admitted
        restored = {}
        try:
            for key, offset, shape, dtype, pinned in spilled.places:
                count = 1
                for n in shape:
                    count *= n
                raw = admitted.empty_host_tensor(key, count * torch.empty((), dtype=dtype).element_size(), pinned)
                view = memoryview(raw.numpy())
                done = 0
                while done < len(view):
                    done += os.preadv(spilled.fd, [view[done:]], offset + done)
                restored[key] = raw.view(dtype).reshape(shape)
        finally:
            os.close(spilled.fd)
        admitted.restore_host_tensors(restored)
        with self._lock:
            self._admitted[adapter_id] = admitted
            self.resident_bytes += admitted.nbytes
        return admitted


def host_budget_bytes(configured: int | None, local_workers: int) -> int:
    """The host-memory budget for one worker's adapters: the configured bytes, or a fifth of the machine's memory
    shared by its workers."""
    if configured is not None:
        return configured
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 * 2**30
    return max(2**30, total // 5 // max(1, local_workers))
