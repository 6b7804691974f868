"""What the server process tells its supervisor: an engine that died is a failure, not a clean stop, and one that
has stopped answering is not healthy.

vLLM's API server notices a dead engine in its watchdog, stops serving and returns from `vllm serve` normally,
so the process exits with status 0 and a supervisor that restarts failed services leaves it down. The watchdog's
verdict is recorded here and `vllm serve` then exits with `EXIT_ENGINE_DIED`, within `EXIT_DEADLINE_S` of it.

A worker that is stopped (SIGSTOP, a debugger) or hung leaves the engine core waiting inside a step, and vLLM's
/health keeps answering 200 until its executor gives up (300 s by default). `/health` here answers 503 at once when
an engine process is stopped, and when the engine core has not answered a ping (`EngineStallWatch`, a utility call it
answers between steps) within `engine_stall_timeout_s`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("vllm.bdlora")

EXIT_ENGINE_DIED = 1
# From the verdict that the engine died to the process's exit, at most. The orderly stop takes about a second
# (the engine's processes are already gone or are killed at once); the deadline covers whatever else waits on the
# dead engine, so that a supervisor never watches a server that neither serves nor exits.
EXIT_DEADLINE_S = 30.0
_engine_died = threading.Event()
# Set when the API server began its own orderly stop (a SIGINT or SIGTERM it received); the engine processes, which
# get the same signal from a terminal or a supervisor's process group, may exit first, and their exit is then part of
# that stop, not a death.
_stop_requested = threading.Event()


def note_engine_death() -> None:
    if not _engine_died.is_set():
        _engine_died.set()
        logger.error(
            "vllm-bdlora: the engine died (see the errors above); the server stops and exits with status %d.",
            EXIT_ENGINE_DIED,
        )
        threading.Thread(target=_exit_by_deadline, args=(EXIT_DEADLINE_S,), name="bdlora-exit-deadline",
                         daemon=True).start()  # fmt: skip


def _exit_by_deadline(seconds: float) -> None:
    time.sleep(seconds)  # the process normally exits before this returns (a daemon thread dies with it)
    # Logging's stream handlers flush each record, so the line is out before os._exit.
    logger.error(
        "vllm-bdlora: the server did not stop within %.0f s of the engine's death; its engine processes are "
        "killed and it exits with status %d now.", seconds, EXIT_ENGINE_DIED,
    )  # fmt: skip
    kill_child_processes()
    os._exit(EXIT_ENGINE_DIED)


def exit_without_teardown(status: int) -> None:
    """Exit after `vllm serve` stopped: the exit handlers run (vLLM's temporary directories, logging's flush), the
    interpreter's module teardown does not. After an orderly stop it only prints noise: Triton's bindings report
    every object they never free ("nanobind: leaked ..."), and vLLM's AsyncLLM finalizer fails on half-removed
    modules ("Exception ignored in AsyncLLM.__del__ ... TypeError")."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def kill_child_processes() -> None:
    import psutil

    for process in psutil.Process().children(recursive=True):
        try:
            process.kill()
        except psutil.Error:
            pass


def fail_pending_engine_calls(pending: dict, make_error) -> int:
    """Answer, with `make_error()`, every call still waiting on the engine core (an adapter load, say).

    vLLM fails the requests that stream from a dead engine but leaves its utility calls waiting for an answer
    that will never come; the HTTP server's shutdown then waits for those requests forever, and the process
    neither serves nor exits. Returns how many calls were answered."""
    failed = 0
    for future in list(pending.values()):
        if not future.done():
            future.set_exception(make_error())
            failed += 1
    if failed:
        logger.error("vllm-bdlora: %d call(s) waiting on the dead engine (adapter loads, say) answered with an "
                     "error.", failed)  # fmt: skip
    return failed


def engine_died() -> bool:
    return _engine_died.is_set()


def note_stop_requested() -> None:
    _stop_requested.set()


def stop_requested() -> bool:
    return _stop_requested.is_set()


ENGINE_PROCESS_TITLE = "VLLM::"  # vLLM titles its engine-core and worker processes "VLLM::EngineCore", ...
_engine_processes: list | None = None


def engine_processes_alive() -> bool:
    """False once an engine-core or worker process started under this API server has died.

    vLLM declares the engine dead only after the engine core gives up on its step, which waits for the dead
    worker (9 s measured on CPU under load); meanwhile /health answered 200. The processes are looked up once,
    at the first health check (the API server serves only once the engine is up); processes on other hosts (Ray)
    are not seen here and are left to vLLM's own check."""
    global _engine_processes
    import psutil

    if _engine_processes is None:
        _engine_processes = [p for p in psutil.Process().children(recursive=True) if _is_engine_process(p)]
    for process in _engine_processes:
        try:
            if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
    return True


def engine_processes_stopped() -> bool:
    """True while an engine-core or worker process of this host is stopped (SIGSTOP, a tracer)."""
    import psutil

    if _engine_processes is None:
        engine_processes_alive()
    for process in _engine_processes or ():
        try:
            if process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                return True
        except psutil.Error:
            continue
    return False


ENGINE_PING = "bdlora_ping"  # the engine core's utility method (vllm_bdlora.patching.engine)
PING_WAIT_S = 1.0  # how long one health check waits for the answer before it looks at the ping's age instead
# While it waits, a health check looks at the engine's processes this often: a check that began just before a worker
# died answers 503 within this, not after the whole wait (the engine core cannot answer a ping once a worker it
# waits on is gone).
LIVENESS_EVERY_S = 0.1


class EngineStallWatch:
    """Whether the engine core comes back to its requests: one ping in flight at a time; the engine is stalled once a
    ping has waited longer than the bound. A health check itself never waits more than `PING_WAIT_S`, and raises
    `dead` as soon as `alive()` says an engine process is gone, during the wait too."""

    def __init__(self, alive: Callable[[], bool] | None = None):
        self._ping = None
        self._sent = 0.0
        self._alive = alive or engine_processes_alive

    async def check(self, engine_client, timeout_s: float, stalled: type[Exception], dead: type[Exception]) -> None:
        import asyncio

        if not self._alive():
            raise dead()
        if engine_processes_stopped():
            raise stalled("an engine process is stopped")
        core = getattr(engine_client, "engine_core", None)
        if not timeout_s or not hasattr(core, "call_utility_async"):
            return
        if self._ping is None or self._ping.done():
            self._ping = asyncio.ensure_future(core.call_utility_async(ENGINE_PING))
            self._sent = time.monotonic()
        wait_until = time.monotonic() + min(PING_WAIT_S, timeout_s)
        while (left := wait_until - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(asyncio.shield(self._ping), min(LIVENESS_EVERY_S, left))
            except asyncio.TimeoutError:
                if not self._alive():
                    raise dead() from None
                continue
            except Exception:  # answered with an error: the dead-engine checks say what it means
                pass
            if not self._alive():
                raise dead()
            return
        waited = time.monotonic() - self._sent
        if waited > timeout_s:
            raise stalled(f"the engine core has not answered for {waited:.0f} s")


def _is_engine_process(process) -> bool:
    import psutil

    try:
        return " ".join(process.cmdline()).startswith(ENGINE_PROCESS_TITLE)
    except psutil.Error:
        return False
