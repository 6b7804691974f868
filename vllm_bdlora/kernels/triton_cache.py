"""Where the plugin's Triton kernels are cached on disk: one directory, whatever vLLM's configuration.

Before the first forward pass, where the layer op's warm-up compiles, vLLM's Inductor adaptor points
TRITON_CACHE_DIR at a directory inside its compile cache, keyed by the engine's configuration (TP size, CUDA
graph sizes, LoRA settings, ...). Our kernels do not depend on any of it, yet every server started with a new
configuration compiled them again: ~35 s of a BD server's start at TP=1 on an H200. The plugin's entry points,
which run in every process before vLLM compiles anything, remember the directory in effect before vLLM changes it
(the user's TRITON_CACHE_DIR, else Triton's default) in BDLORA_TRITON_CACHE_DIR, which child processes inherit; the
warm-up compiles there. (Not a VLLM_ name: vLLM warns about every VLLM_ variable it does not know, and refuses to
start on one when it validates the environment strictly.) No vLLM code is
patched. Deletable once vLLM no longer keys TRITON_CACHE_DIR by configuration (`initialize_cache` of its
Inductor adaptor in vllm/compilation/compiler_interface.py does in 0.32; 0.26's servers behaved the same).
"""

from __future__ import annotations

import contextlib
import os

CACHE_DIR_ENV = "BDLORA_TRITON_CACHE_DIR"


def remember_cache_dir() -> None:
    """Keep the Triton cache directory in effect now, unless a parent process already did."""
    if CACHE_DIR_ENV not in os.environ:
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
        os.environ[CACHE_DIR_ENV] = os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")


@contextlib.contextmanager
def plugin_cache_dir():
    """Triton compiles into (and loads from) the remembered directory inside this block; TRITON_CACHE_DIR
    is restored after it."""
    wanted, previous = os.environ.get(CACHE_DIR_ENV), os.environ.get("TRITON_CACHE_DIR")
    if not wanted or wanted == previous:
        yield
        return
    os.environ["TRITON_CACHE_DIR"] = wanted
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = previous
