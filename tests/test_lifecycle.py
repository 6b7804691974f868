"""What the server process does once its engine has died: calls still waiting on the engine are answered with an
error, and the process exits with status 1 by a deadline whatever else still waits (the end-to-end case, a worker
killed under traffic, is tests/test_server_guards.py::test_dead_engine_turns_health_to_503_and_exits_non_zero)."""

import asyncio
import subprocess
import sys
import textwrap
import time

import psutil
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_bdlora.compat import pending_engine_calls
from vllm_bdlora.serve.lifecycle import EXIT_ENGINE_DIED, EngineStallWatch, fail_pending_engine_calls


def test_calls_waiting_on_a_dead_engine_are_answered_with_engine_dead_error():
    class Client:  # the shape of vLLM's AsyncLLM: its multiprocess client keeps the waiting calls
        class engine_core:
            utility_results = {}

    async def scenario():
        loop = asyncio.get_running_loop()
        waiting, answered = loop.create_future(), loop.create_future()
        answered.set_result("adapter loaded")
        Client.engine_core.utility_results.update({1: waiting, 2: answered})
        load = asyncio.ensure_future(waiting)  # an adapter load awaiting the engine core's answer
        assert fail_pending_engine_calls(pending_engine_calls(Client()), EngineDeadError) == 1
        done, _ = await asyncio.wait([load], timeout=1)
        return done, load, answered

    done, load, answered = asyncio.run(scenario())
    assert done == {load} and isinstance(load.exception(), EngineDeadError)
    assert answered.result() == "adapter loaded"
    assert pending_engine_calls(object()) == {}


class _Stalled(Exception):
    pass


class _Dead(Exception):
    pass


def _health_check(alive, answers_ping: bool, timeout_s: float = 60.0):
    """One health check of an engine core whose ping is answered at once or never; the outcome's class, or None."""

    class Client:
        class engine_core:
            @staticmethod
            async def call_utility_async(method):
                if not answers_ping:
                    await asyncio.Event().wait()
                return None

    async def scenario():
        try:
            await EngineStallWatch(alive).check(Client(), timeout_s, _Stalled, _Dead)
        except (_Stalled, _Dead) as outcome:
            return type(outcome)
        return None

    return asyncio.run(scenario())


def test_health_check_that_began_before_a_worker_died_answers_dead_not_healthy():
    # The engine core cannot answer a ping once a worker it waits on is gone; a check that began while every process
    # was alive must not wait out the ping and answer healthy.
    calls = iter([True, True, True])
    assert _health_check(lambda: next(calls, False), answers_ping=False) is _Dead
    assert _health_check(lambda: True, answers_ping=False) is None  # alive, not yet past the stall bound
    assert _health_check(lambda: True, answers_ping=False, timeout_s=0.5) is _Stalled
    assert _health_check(lambda: True, answers_ping=True) is None
    assert _health_check(lambda: False, answers_ping=True) is _Dead


def test_server_exits_with_status_1_by_the_deadline_and_kills_its_engine_processes(tmp_path):
    child_pid = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import subprocess, sys, threading
        from vllm_bdlora.serve import lifecycle
        lifecycle.EXIT_DEADLINE_S = 1.0
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(child_pid)!r}, "w").write(str(engine.pid))
        lifecycle.note_engine_death()
        threading.Event().wait()  # a shutdown that waits forever
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_ENGINE_DIED, proc.stderr
    assert time.monotonic() - started < 30
    assert "did not stop within 1 s of the engine's death" in proc.stderr
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.1)
