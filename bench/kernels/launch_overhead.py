"""Host time per call of the LoRA layer's pieces: what prefill pays outside CUDA graphs (vLLM replays
graphs for decode-sized batches only; larger batches launch every kernel from Python on every layer).

    python -m bench.kernels.launch_overhead --out bench/results/kernels-h200

Each piece is called back to back many times on a 1-token batch (GPU work of a few µs, so the host is the
bottleneck) and timed with the wall clock between two synchronisations: µs per call. Pieces: op dispatch
alone (torch.ops with vLLM's no-LoRA flag set, so it returns at once; as registered now, and as
torch.library.custom_op would register it), our shrink and expand launches, the whole layer op with and
without the base GEMM, and vLLM's shrink and expand ops (when vLLM is installed) beside a bare cuBLAS GEMM.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from bench.kernels.fused_lora import LAYERS, WIDTH, make_layer, vllm_lora_inputs
from bench.kernels.harness import write_results

CALLS = 2000


def host_us(fn, calls: int = CALLS) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


@functools.cache
def custom_op_twin():
    """A no-op with the layer op's signature registered through torch.library.custom_op, for comparison."""
    from vllm_bdlora.kernels.fused_lora import fused_lora_slices_

    @functools.wraps(fused_lora_slices_)  # the schema is inferred from the wrapped function's signature
    def twin(*args, **kwargs) -> None:
        return None

    return torch.library.custom_op("vllm_bdlora_bench::custom_op_twin_", mutates_args=("output",))(twin)


def pieces(layer):
    import vllm_bdlora.kernels.fused_lora  # noqa: F401 (registers the op)
    from vllm_bdlora.kernels.fused_lora import fused_expand, lora_shrink

    x, w, groups, widths, bounds = layer["x"], layer["weight"], layer["groups"], layer["widths"], layer["bounds"]
    op = torch.ops.vllm_bdlora.fused_lora_slices_
    y = x @ w.T
    shrunk = lora_shrink(x, layer["lora_a"], groups, widths)
    grouped = (groups.sorted_ids, groups.group_slot, groups.group_count, groups.group_start)
    common = (y, x, layer["lora_a"], layer["lora_b"], widths, bounds, layer["slots"], *grouped)
    skip, run = torch.tensor([True]), torch.tensor([False])
    twin = custom_op_twin()
    found = {
        "cublas_gemm": lambda: torch.mm(x, w.t(), out=y),
        "op_dispatch_only": lambda: op(*common, skip, None, None, None),
        "custom_op_dispatch_only": lambda: twin(*common, skip, None, None, None),
        "our_shrink": lambda: lora_shrink(x, layer["lora_a"], groups, widths),
        "our_expand": lambda: fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds),
        "layer_op_lora_only": lambda: op(*common, run, None, None, None),
        "layer_op_with_gemm": lambda: op(*common, run, None, None, w),
    }
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for launch_overhead.json")
    args = parser.parse_args()
    rows = []
    for name, k, heights in LAYERS:
        row = {"layer": name, "tokens": 1}
        for piece, fn in pieces(make_layer(k, heights, 1, 1, WIDTH)).items():
            row[f"{piece}_us"] = round(host_us(fn), 1)
        print(row, flush=True)
        rows.append(row)
    print(write_results(args.out, "launch_overhead", rows, {"calls": CALLS}))


if __name__ == "__main__":
    main()
