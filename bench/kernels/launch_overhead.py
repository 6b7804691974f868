"""Host time per call of the LoRA layer's pieces: what prefill pays outside CUDA graphs (vLLM replays
graphs for decode-sized batches only; larger batches launch every kernel from Python on every layer).

    python -m bench.kernels.launch_overhead --out bench/results/kernels/launch-overhead-h200 [--tokens 1 16 1024]

Each piece is timed alone: the GPU is synchronised before each call and the wall clock measures the call
itself (its launches queue and return), median over many calls, µs. Pieces: op dispatch alone (torch.ops
with vLLM's no-LoRA flag set, so it returns at once; as registered now, and as torch.library.custom_op would
register it), our shrink and expand launches, the whole layer op with and without the base GEMM (three
kernels) and, for decode-sized batches, with the one-launch kernel (as serving runs it: no-LoRA flag clear,
base weight and decode state given) and that kernel's Python launcher alone; vLLM's shrink and expand ops
(when vLLM is installed) beside a bare cuBLAS GEMM. `--profile` adds `launch_overhead_profile.txt`: cProfile's
view of the layer op's calls (first layer, each token count), to show where the host time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import statistics
import time

import torch

from bench.kernels.fused_lora import LAYERS, WIDTH, make_layer, vllm_lora_inputs
from bench.kernels.harness import write_results

CALLS = 2000


def host_us(fn, calls: int = CALLS) -> float:
    """Median µs of host time per call, each call made with the GPU idle (its launches only queue)."""
    for _ in range(50):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


@functools.cache
def custom_op_twin():
    """A no-op with the layer op's signature registered through torch.library.custom_op, for comparison."""
    from vllm_bdlora.kernels.lora_op import fused_lora_slices_

    @functools.wraps(fused_lora_slices_)  # the schema is inferred from the wrapped function's signature
    def twin(*args, **kwargs) -> None:
        return None

    return torch.library.custom_op("vllm_bdlora_bench::custom_op_twin_", mutates_args=("output",))(twin)


def pieces(layer):
    from bench.kernels.fused_lora import table_launch
    from vllm_bdlora.kernels import decode_lora
    from vllm_bdlora.kernels.fused_lora import fused_expand, lora_shrink
    from vllm_bdlora.kernels.lora_op import layer_decode_state, one_launch_plan  # registers the op too
    from vllm_bdlora.kernels.plans import DECODE_MAX_TOKENS, DEFAULT_MAX_MIXED_WIDTH, cuda_table

    x, w, groups, widths, bounds = layer["x"], layer["weight"], layer["groups"], layer["widths"], layer["bounds"]
    op = torch.ops.vllm_bdlora.fused_lora_slices_
    y = x @ w.T
    launch = table_launch(layer)
    shrunk = lora_shrink(x, layer["lora_a"], groups, widths, launch.shrink)
    grouped = (groups.sorted_ids, groups.group_slot, groups.group_count, groups.group_start)
    common = (y, x, layer["lora_a"], layer["lora_b"], widths, bounds, layer["slots"], *grouped)
    skip, run = torch.tensor([True]), torch.tensor([False])
    twin = custom_op_twin()
    found = {
        "cublas_gemm": lambda: torch.mm(x, w.t(), out=y),
        "op_dispatch_only": lambda: op(*common, skip, None, None, None),
        "custom_op_dispatch_only": lambda: twin(*common, skip, None, None, None),
        "our_shrink": lambda: lora_shrink(x, layer["lora_a"], groups, widths, launch.shrink),
        "our_expand": lambda: fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds, config=launch.expand),
        "layer_op_lora_only": lambda: op(*common, run, None, None, None),
        "layer_op_with_gemm": lambda: op(*common, run, None, None, w),
    }
    tokens, (slots, total_width) = x.shape[0], layer["lora_a"].shape[:2]
    shape = (w.shape[0], x.shape[1], total_width, slots)
    state = layer_decode_state(*shape, x.device, widths.shape[0], DEFAULT_MAX_MIXED_WIDTH)
    limits = (DECODE_MAX_TOKENS, DEFAULT_MAX_MIXED_WIDTH)
    plan = one_launch_plan(cuda_table(x.device), tokens, *shape, widths.shape[0], state, *limits)
    if plan is not None:
        found["layer_op_one_launch"] = lambda: op(*common, run, None, None, w, state, *limits)
        found["decode_kernel_launcher"] = lambda: decode_lora.decode_lora_linear(
            y, x, w, layer["lora_a"], layer["lora_b"], widths, bounds, layer["slots"], state, plan=plan
        )  # fmt: skip
    inputs = vllm_lora_inputs(layer)
    if inputs is None:
        return found
    lora_a, lora_b, args = inputs
    buffer = torch.empty(len(lora_a), x.shape[0], WIDTH, dtype=torch.float32, device=x.device)
    found["vllm_shrink"] = lambda: torch.ops.vllm.lora_shrink(x, lora_a, buffer, *args, 1.0)
    found["vllm_expand"] = lambda: torch.ops.vllm.lora_expand(buffer, lora_b, y, *args, offset_start=0,
                                                              add_inputs=True)  # fmt: skip

    def vllm_layer():
        torch.mm(x, w.t(), out=y)
        torch.ops.vllm.lora_shrink(x, lora_a, buffer, *args, 1.0)
        torch.ops.vllm.lora_expand(buffer, lora_b, y, *args, offset_start=0, add_inputs=True)

    found["vllm_layer"] = vllm_layer
    return found


def profile_text(fn, calls: int) -> str:
    """cProfile's top entries (by own time) over `calls` calls of fn (its header: total seconds of them all;
    cProfile's own cost inflates Python-level calls, so read it for shares, the timings for µs)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for launch_overhead.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1], help="batch sizes (default: 1)")
    parser.add_argument("--profile", action="store_true", help="also write launch_overhead_profile.txt")
    args = parser.parse_args()
    rows, profiles = [], []
    for tokens in args.tokens:
        for index, (name, k, heights) in enumerate(LAYERS):
            row = {"layer": name, "tokens": tokens}
            found = pieces(make_layer(k, heights, tokens, 1, WIDTH))
            for piece, fn in found.items():
                row[f"{piece}_us"] = round(host_us(fn), 1)
            print(row, flush=True)
            rows.append(row)
            if args.profile and index == 0:
                for piece in ("layer_op_one_launch", "layer_op_with_gemm"):
                    if piece in found:
                        profiles.append(f"=== {name}, {tokens} tokens, {piece}, 1000 calls ===\n")
                        profiles.append(profile_text(found[piece], 1000))
    print(write_results(args.out, "launch_overhead", rows, {"calls": CALLS}))
    if profiles:
        path = os.path.join(args.out, "launch_overhead_profile.txt")
        with open(path, "w") as f:
            f.write("".join(profiles))
        print(path)


if __name__ == "__main__":
    main()
