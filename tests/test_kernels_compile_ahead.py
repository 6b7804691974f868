"""Compiling a layer's kernel variants on threads before `warm_up` launches them (kernels/compile_ahead.py)."""

import contextlib
import gc
import logging
import os
import sys
import threading
import time

import pytest

from vllm_bdlora.kernels.compile_ahead import compile_concurrently, compile_threads, launch, one_parse_at_a_time


class RecordingKernel:
    """Stands in for a Triton kernel: records whether it was launched or only compiled."""

    def __init__(self):
        self.calls = []

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("compiled", grid, args))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launched", grid, args))


def test_launches_inside_compile_concurrently_only_compile_and_launch_again_after():
    kernel = RecordingKernel()
    launch(kernel, (1,), "x")
    assert compile_concurrently(lambda: launch(kernel, (2,), "y"), threads=2)
    launch(kernel, (3,), "z")
    assert kernel.calls == [("launched", (1,), ("x",)), ("compiled", (2,), ("y",)), ("launched", (3,), ("z",))]
    assert 1 <= compile_threads() <= 8


def test_a_failure_on_threads_is_logged_with_its_cause_and_leaves_launches_to_compile_as_before(caplog):
    kernel = RecordingKernel()

    def fails():
        launch(kernel, (1,), "x")
        raise RuntimeError("internals moved") from KeyError("the cause")

    with caplog.at_level(logging.WARNING, logger="vllm.bdlora"):
        assert compile_concurrently(fails, threads=2) is False
    assert "RuntimeError: internals moved" in caplog.text and "one at a time" in caplog.text
    assert "KeyError: 'the cause'" in caplog.text  # the chained cause (Triton wraps a kernel's in CompilationError)
    launch(kernel, (2,), "y")
    assert kernel.calls[-1] == ("launched", (2,), ("y",))


def test_a_layers_variants_compile_on_threads_and_its_launches_then_compile_nothing(tmp_path, monkeypatch):
    """The real kernels, compiled for sm_90 on this machine (bench/kernels/compile_time.py's stand-in target):
    every variant `warm_up` launches compiles on the pool, and the launches after it find each one compiled."""
    from bench.kernels.compile_time import compile_layer, compile_only, forget_compiled_kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    forget_compiled_kernels()
    with compile_only(90) as seconds:
        layer = lambda: compile_layer(512, (512, 128, 128), 16, decode=True)  # noqa: E731
        assert compile_concurrently(layer, threads=2)
        cubins = sum(name.endswith(".cubin") for _, _, files in os.walk(tmp_path) for name in files)
        compiled_before = sum(map(len, seconds.values()))
        launches = layer()
        assert sum(map(len, seconds.values())) == compiled_before  # no compile left for the launches
    assert cubins == launches  # one binary per variant, all compiled on the pool


class YieldsWhenCollected:
    """Cyclic garbage whose finalizer hands the interpreter lock to another thread, as a long-lived process's
    garbage can when the collector runs in the middle of a parse."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        time.sleep(0)


def parse_on_two_threads(guard) -> list[SystemError]:
    from vllm_bdlora.kernels.fused_lora import _routed_shrink_kernel

    errors = []

    def parse_repeatedly():
        for _ in range(300):
            YieldsWhenCollected()
            try:
                _routed_shrink_kernel.parse()
            except SystemError as error:  # "AST constructor recursion depth mismatch"
                errors.append(error)
                return

    threshold = gc.get_threshold()
    gc.set_threshold(50)  # collect often: many finalizers run mid-parse
    try:
        with guard:
            threads = [threading.Thread(target=parse_repeatedly) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        gc.set_threshold(*threshold)
    return errors


@pytest.mark.parametrize("repeat", range(3))
def test_kernel_source_parses_take_turns_while_the_pool_compiles(repeat):
    """Two threads parsing kernel sources at once, the collector running finalizers between them: without
    `one_parse_at_a_time` CPython 3.11 fails some parse with SystemError (what failed a threaded compile in a
    long test process); with it, none fails."""
    assert parse_on_two_threads(one_parse_at_a_time()) == []


def test_windows_of_turns_may_overlap_and_the_last_to_close_restores_tritons_parse():
    from triton.runtime.jit import JITFunction

    own = JITFunction.parse
    first, second = one_parse_at_a_time(), one_parse_at_a_time()
    first.__enter__()
    guarded = JITFunction.parse
    assert guarded is not own
    second.__enter__()  # another thread's warm-up, say
    assert JITFunction.parse is guarded
    first.__exit__(None, None, None)
    assert JITFunction.parse is guarded  # the second still compiles
    second.__exit__(None, None, None)
    assert JITFunction.parse is own


def test_without_turns_two_threads_parsing_at_once_can_fail_on_this_python():
    """The test above can fail: here the same two threads parse unguarded (CPython 3.11 keeps the AST builder's
    recursion depth interpreter-wide)."""
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the shared AST recursion depth is CPython 3.11's; other Pythons are not claimed either way")
    errors = [error for _ in range(5) for error in parse_on_two_threads(contextlib.nullcontext())]
    assert errors and "recursion depth mismatch" in str(errors[0])
