"""What the server process tells its supervisor: an engine that died is a failure, not a clean stop.

vLLM's API server notices a dead engine in its watchdog, stops serving and returns from `vllm serve` normally,
so the process exits with status 0 and a supervisor that restarts failed services leaves it down. The watchdog's
verdict is recorded here and `vllm serve` then exits with `EXIT_ENGINE_DIED`.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("vllm.bdlora")

EXIT_ENGINE_DIED = 1
_engine_died = threading.Event()


def note_engine_death() -> None:
    if not _engine_died.is_set():
        _engine_died.set()
        logger.error(
            "vllm-bdlora: the engine died (see the errors above); the server stops and exits with status %d.",
            EXIT_ENGINE_DIED,
        )


def engine_died() -> bool:
    return _engine_died.is_set()


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


def _is_engine_process(process) -> bool:
    import psutil

    try:
        return " ".join(process.cmdline()).startswith(ENGINE_PROCESS_TITLE)
    except psutil.Error:
        return False
