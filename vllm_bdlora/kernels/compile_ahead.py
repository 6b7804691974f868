"""Compile a layer's kernel variants on several threads before launching any of them.

`lora_op.warm_up` launches every variant a layer can use, once, so that serving never compiles; launched one
after another, the first start of a server spends 42 s compiling at LoRA width 128 and 201 s at 512 (Llama-3.1-8B,
TP=1: archived CPU runs). Compiles overlap well on threads (on 2 cores, 23.6 and 106.3 s
instead), and Triton's `AsyncCompileMode` (in 3.6 and 3.9, the versions of vLLM 0.26 and 0.32; a Triton without
it compiles one at a time as before) hands the compiles of `warmup` calls to an executor. So `warm_up` first
runs its launch sequence with every launch made a `warmup` call (`launch`), the compiles on a thread pool, and
then launches as before, finding each variant compiled. The kernels are the same either way: this changes when
they compile, not what runs.

Triton parses a kernel's source (`ast.parse`) when it hashes it, on the launching thread, and when it generates
its code, on the pool's. CPython 3.11 keeps the AST builder's recursion depth in interpreter-wide state, so two
parses at once can fail with "SystemError: AST constructor recursion depth mismatch" (cpython gh-106905; seen as
a Triton CompilationError at a call of a helper kernel) where the collector runs finalizers mid-parse, as in a
long-lived process. While the pool compiles, Triton's parses therefore take turns (`one_parse_at_a_time`): a
parse takes milliseconds (1 ms on average over the plugin's kernels, 17 ms for the largest, on 2 busy cores),
a compile seconds, and the compiles still overlap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

logger = logging.getLogger("vllm.bdlora")

_compiling_only: ContextVar[bool] = ContextVar("vllm_bdlora_compiling_only", default=False)
MAX_THREADS = 8
_parse_lock = threading.Lock()
_windows_lock = threading.Lock()  # guards the two below
_windows_open = 0  # `one_parse_at_a_time` windows open now, on any thread
_unguarded_parse = None  # (class, its own parse) while any window is open


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), or inside `compile_concurrently` its compile alone (nothing runs)."""
    if _compiling_only.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def compile_threads() -> int:
    """Threads for the compiles: this process's CPUs (a TP worker may be pinned to a few), at most MAX_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


@contextlib.contextmanager
def one_parse_at_a_time():
    """Within: Triton's kernel-source parses (`JITFunction.parse`, on any thread) run one at a time (see above).
    Windows may overlap (several threads compiling at once): the first to open installs the guarded parse, the last
    to close restores Triton's own."""
    global _windows_open, _unguarded_parse
    from triton.runtime.jit import JITFunction

    with _windows_lock:
        if _windows_open == 0:
            owner = next((cls for cls in JITFunction.__mro__ if "parse" in vars(cls)), None)
            if owner is not None:  # else a Triton that parses elsewhere: nothing to guard here
                _unguarded_parse = (owner, vars(owner)["parse"])
                owner.parse = _taking_turns(_unguarded_parse[1])
        _windows_open += 1
    try:
        yield
    finally:
        with _windows_lock:
            _windows_open -= 1
            if _windows_open == 0 and _unguarded_parse is not None:
                owner, parse = _unguarded_parse
                owner.parse = parse
                _unguarded_parse = None


def _taking_turns(parse):
    """`parse` under the one lock of every parse (a parse already under way as the windows close still finishes)."""

    def parse_alone(self):
        with _parse_lock:
            return parse(self)

    return parse_alone


def compile_concurrently(launch_all, threads: int | None = None) -> bool:
    """Call `launch_all` (which launches kernels through `launch`) with each launch compiled on a pool of
    `threads` and none run; returns once every compile has finished. False where this Triton has no
    AsyncCompileMode or a compile failed (logged): the caller's own launches then compile what is missing, one
    at a time, as they always did."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton
        return False
    token = _compiling_only.set(True)
    try:
        with (
            one_parse_at_a_time(),
            ThreadPoolExecutor(threads or compile_threads(), thread_name_prefix="bdlora-compile") as pool,
            AsyncCompileMode(pool),
        ):
            launch_all()
        return True
    except Exception as error:  # e.g. a Triton whose internals moved: serve anyway, compiling serially
        # with its traceback: a Triton CompilationError names the kernel line, its cause (chained) what failed
        logger.warning("vllm-bdlora: compiling the LoRA kernels on threads failed (%s: %s); compiling them one at "
                       "a time instead.", type(error).__name__, error, exc_info=error)  # fmt: skip
        return False
    finally:
        _compiling_only.reset(token)
