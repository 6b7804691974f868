"""How long a server's first start spends compiling the LoRA kernels, measured on any machine, GPU or not.

A BD layer's first call compiles every kernel variant it can launch (`lora_op.warm_up`: routed shrink and
fused expand configurations for 1-65536 tokens, and with a decode state the one-launch decode kernel for each
tile of token rows); Triton caches them on disk, so this is paid once per LoRA width and layer kind on a host
with an empty cache. On an H200 a TP=1 server of BD r'=512 adapters spent ~250 s there before its CUDA-graph
capture (`archived H200 runs/`), against 42 s at r'=128 (`archived H200 runs/logs/`).
Compiling for a GPU needs no
GPU: Triton lowers to PTX and runs the `ptxas` its wheel ships. This benchmark hands Triton a driver that names
a CUDA target (sm_90 by default: H100/H200) and makes every kernel call compile without launching, then
compiles each layer's variants as `warm_up` would, with a fresh Triton cache per LoRA width, and times each
compile by kernel.

    python -m bench.kernels.compile_time --tp 1 --widths 128,512 --out archived H200 runs

Seconds are this machine's (Triton's passes and ptxas run on the CPU; `--threads N` compiles each layer's
variants on N threads as `warm_up` does); a GPU host's CPU compiles faster or slower, but the shares per kernel
and width carry over. Checked with Triton 3.9 (the CPU install) and 3.6 (the GPU hosts':
tests/test_kernels_compile_ahead.py passes with its wheel); the driver stand-in uses Triton's internals
(`JITFunction.run`, `_do_compile`, `runtime.driver`) and may need adjusting for another Triton.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import platform
import tempfile
import time
from unittest import mock

import torch

from bench.kernels.fused_lora import MODEL_SHAPES, layers
from bench.kernels.harness import write_results

# The plans compiled are an H200's (its plan table), the GPU the compile times are quoted for.
H200 = "NVIDIA H200"


@contextlib.contextmanager
def compile_only(arch: int = 90):
    """Within: Triton kernel calls compile for CUDA compute capability `arch` and launch nothing, whatever GPU
    the machine has; yields a dict of compile seconds by kernel name (one entry per variant compiled)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileTarget(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            from triton.backends.nvidia.driver import ty_to_cpp

            return ty_to_cpp(ty)

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def set_current_device(self, device):
            pass

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("compile_only launches nothing")

        def get_device_interface(self):
            raise NotImplementedError("compile_only launches nothing")

        def get_empty_cache_for_benchmark(self):
            raise NotImplementedError("compile_only launches nothing")

        def clear_cache(self, cache):
            pass

    seconds = collections.defaultdict(list)
    run, do_compile = JITFunction.run, JITFunction._do_compile

    def compile_instead(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    def timed_compile(self, *args, **kwargs):
        started = time.perf_counter()
        kernel = do_compile(self, *args, **kwargs)
        seconds[self.fn.__name__].append(time.perf_counter() - started)
        return kernel

    previous = driver._active  # None until something asked for the active driver (on CPU, asking would raise)
    driver.set_active(CompileTarget())
    JITFunction.run, JITFunction._do_compile = compile_instead, timed_compile
    try:
        yield seconds
    finally:
        JITFunction.run, JITFunction._do_compile = run, do_compile
        driver._active = previous
        forget_compiled_kernels()  # compiled for `arch`: never to be launched on this machine's own GPU


def forget_compiled_kernels() -> None:
    """Drop the plugin kernels' in-memory variants, so that the next width compiles all of its own (a server
    start has none in memory)."""
    from triton.runtime.jit import JITFunction

    from vllm_bdlora.kernels import decode_lora, fused_lora

    for module in (fused_lora, decode_lora):
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                value.device_caches.clear()


def compile_layer(k: int, heights: tuple[int, ...], width: int, decode: bool, slots: int = 1) -> int:
    """Compile what `warm_up` compiles for a BD layer of this shape, LoRA width and `slots` LoRA slots (the decode
    kernel's variants too, one per plan it may launch on an H200, with `decode`); returns the variants
    launched."""
    from vllm_bdlora.kernels import decode_lora
    from vllm_bdlora.kernels.lora_op import compile_variants
    from vllm_bdlora.kernels.plans import DEFAULT_MAX_MIXED_WIDTH, layer_plans, state_words, table_for

    table = table_for(H200, 132)

    slices, out_features = len(heights), sum(heights)
    bf16 = dict(dtype=torch.bfloat16)
    x = torch.zeros(16, k, **bf16)
    lora_a = torch.zeros(slots, slices * width, k, **bf16)
    lora_b = torch.zeros(slots, out_features, width, **bf16)
    widths = torch.full((slices, slots), width, dtype=torch.int32)
    bounds = torch.tensor([sum(heights[:j]) for j in range(slices + 1)], dtype=torch.int32)
    launches = compile_variants(table, x, lora_a, lora_b, widths, bounds, slots + 1, None, None, slices > 1, None,
                                DEFAULT_MAX_MIXED_WIDTH)  # fmt: skip
    if not decode:
        return launches
    weight = torch.zeros(out_features, k, **bf16)
    # the plans an H200 would launch, each by its first batch as `warm_up` launches them
    plans = layer_plans(table, out_features, k, slices * width, slots, slices, DEFAULT_MAX_MIXED_WIDTH)
    for tokens, plan in plans.items():
        state = torch.zeros(state_words(slices * width, plan), dtype=torch.int32)
        decode_lora.decode_lora_linear(torch.zeros(tokens, out_features, **bf16), torch.zeros(tokens, k, **bf16),
                                       weight, lora_a, lora_b, widths, bounds, torch.zeros(tokens, dtype=torch.long),
                                       state, plan=plan)  # fmt: skip
        launches += 1
    return launches


def measure(tp: int, shape: str, widths: list[int], arch: int, decode: bool, threads: int = 1,
            slots: int = 1) -> list[dict]:  # fmt: skip
    """Rows of compile seconds per layer and width. threads > 1: as `warm_up` compiles, all of a layer's variants
    at once on a pool of `threads`, then its launches (which find them compiled); the rows then hold each
    layer's wall time, not each kernel's."""
    from vllm_bdlora.kernels.compile_ahead import compile_concurrently

    rows = []
    for width in widths:
        forget_compiled_kernels()
        with (
            tempfile.TemporaryDirectory() as cache,
            mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": cache}),
            compile_only(arch) as seconds,
        ):
            for name, k, heights in layers(tp, shape):  # in a decoder layer's order, one cache as a server has
                before = {kernel: len(times) for kernel, times in seconds.items()}
                started = time.perf_counter()
                layer = functools.partial(compile_layer, k, heights, width, decode, slots)
                if threads > 1 and not compile_concurrently(layer, threads):
                    raise SystemExit("compiling on threads failed (see the warning above)")
                launches = layer()
                row = {"shape": shape, "tp": tp, "layer": name, "width": width, "arch": f"sm_{arch}",
                       "threads": threads, "slots": slots, "variants": launches,
                       "seconds": round(time.perf_counter() - started, 2)}  # fmt: skip
                for kernel, times in seconds.items() if threads == 1 else ():
                    new = times[before.get(kernel, 0) :]
                    row[f"{kernel}_compiled"] = len(new)
                    row[f"{kernel}_seconds"] = round(sum(new), 2)
                    row[f"{kernel}_max_seconds"] = round(max(new, default=0.0), 2)
                rows.append(row)
                print({key: value for key, value in row.items() if not key.endswith("max_seconds")}, flush=True)
    return rows


KERNELS = ("_routed_shrink_kernel", "_fused_expand_kernel", "_decode_lora_linear_kernel")


def report(json_path: str) -> str:
    import json

    with open(json_path) as f:
        results = json.load(f)
    env, rows = results["environment"], results["rows"]
    lines = [
        "# First-start compile time of the LoRA kernels, by layer and LoRA width",
        "",
        f"- compiled for `{rows[0]['arch']}` on {results['cpu']}, torch `{env['torch']}`, triton `{env['triton']}`,"
        f" {env['time']}",
        f"- command: `{env['command']}`",
        "- seconds: Triton's compile of each variant `warm_up` launches (one after another, a fresh cache per width;"
        " variants shared between layers compile once, in the first layer that launches them); no GPU needed",
        "",
        "| TP | layer | width | threads | variants | seconds | "
        + " | ".join(f"{kernel.strip('_')} compiled, s (slowest)" for kernel in KERNELS)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(KERNELS),
    ]
    for row in rows:
        cells = (
            [
                f"{row.get(kernel + '_compiled', 0)}, {row.get(kernel + '_seconds', 0.0)}"
                f" ({row.get(kernel + '_max_seconds', 0.0)})"
                for kernel in KERNELS
            ]
            if row.get("threads", 1) == 1
            else ["— (compiled side by side)"] * len(KERNELS)
        )
        lines.append(f"| {row['tp']} | {row['layer']} | {row['width']} | {row.get('threads', 1)} | {row['variants']} "
                     f"| {row['seconds']} | " + " | ".join(cells) + " |")  # fmt: skip
    totals = collections.defaultdict(float)
    for row in rows:
        totals[(row["tp"], row["width"], row.get("threads", 1))] += row["seconds"]
    lines += ["", "Per server start (the four layer kinds):", ""]
    lines += [f"- TP={tp}, width {width}, {threads} thread(s): {seconds:.1f} s"
              for (tp, width, threads), seconds in totals.items()]  # fmt: skip
    out = os.path.join(os.path.dirname(json_path), "compile_time.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1, help="per-GPU layer shapes at this TP size")
    p.add_argument("--model-shape", default="llama-3.1-8b", choices=MODEL_SHAPES)
    p.add_argument("--widths", default="128,512", help="per-GPU LoRA widths (vLLM's --max-lora-rank, or r'/TP for BD)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: H100/H200)")
    p.add_argument("--no-decode", action="store_true", help="leave out the one-launch decode kernel's variants")
    p.add_argument(
        "--slots",
        type=int,
        default=1,
        help="LoRA slots per layer (vLLM's --max-loras): a layer with"
        " several launches the decode kernel with more plans, sized for the adapters a batch may mix",
    )
    p.add_argument("--threads", default="1", help="comma-separated: 1 = one compile at a time (times each kernel),"
                   " N = a layer's variants on N threads as warm_up compiles them")  # fmt: skip
    args = p.parse_args(argv)
    if args.slots < 1:
        p.error(f"--slots must be at least 1, got {args.slots}")
    widths = [int(w) for w in args.widths.split(",")]
    rows = [row for threads in map(int, args.threads.split(","))
            for row in measure(args.tp, args.model_shape, widths, args.arch, not args.no_decode, threads,
                               args.slots)]  # fmt: skip
    cpu = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
    print(report(write_results(args.out, "compile_time", rows, {"cpu": cpu})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
