"""The whole LoRA-adapted layer (base GEMM + LoRA) at Llama-3.1-8B TP=4 per-GPU shapes: vLLM's path
(cuBLAS GEMM, then its Triton shrink and expand kernels) against the fused kernels of
vllm_bdlora.kernels.fused_lora (shrink + fused expand; shrink + split-graph fused GEMM).

    python -m bench.kernels.fused_lora --out bench/results/kernels-h200

Correctness of every backend is checked against the torch reference before timing; median of 200
CUDA-event trials after 10 warm-ups; achieved TFLOP/s of the base GEMM's 2·T·K·N. bf16. Backends that
cannot run (vLLM not installed) are reported as such, not skipped silently.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.harness import copy_bandwidth_gbs, time_cuda, write_results

# (name, K = input features per GPU, N = output features per GPU): Llama-3.1-8B at TP=4.
LAYERS = (("qkv_proj", 4096, 1536), ("o_proj", 1024, 4096), ("gate_up_proj", 4096, 7168), ("down_proj", 3584, 4096))
TOKENS = (1, 16, 64, 1024, 2048, 4096, 8192)
RANK = 32  # a BD r'=128 adapter at TP=4 (per-GPU width)


def vllm_backend(x, weight, lora_a, lora_b, slots, scale):
    """vLLM's own LoRA ops on one slice, as its punica GPU wrapper calls them (None if unavailable)."""
    try:
        import vllm.lora.ops.triton_ops  # noqa: F401  (registers torch.ops.vllm.lora_shrink/expand)
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
    except Exception as e:  # not installed here: report, do not fake
        print(f"vLLM LoRA ops unavailable: {e}")
        return None
    meta = LoRAKernelMeta.make(lora_a.shape[0], x.shape[0], x.device)
    meta.prepare_tensors(slots.int())
    args = meta.meta_args(x.shape[0], False)
    shrunk = torch.zeros(1, x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)

    def run():
        y = x @ weight.T
        shrunk.zero_()
        torch.ops.vllm.lora_shrink(x, [lora_a], shrunk, *args, scale)
        torch.ops.vllm.lora_expand(shrunk, [lora_b], y, *args, offset_start=0, add_inputs=True)
        return y

    return run


def bench_layer(name, k, n, tokens, rank):
    from vllm_bdlora.kernels.fused_lora import fused_expand, fused_lora_linear, lora_shrink, route_tokens
    from vllm_bdlora.kernels.reference import fused_lora_linear_reference, lora_shrink_reference

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=dt)
    weight = torch.randn(n, k, device=dev, dtype=dt) * k**-0.5
    lora_a = torch.randn(1, rank, k, device=dev, dtype=dt) * k**-0.5
    lora_b = torch.randn(1, n, rank, device=dev, dtype=dt) * rank**-0.5
    slots = torch.zeros(tokens, dtype=torch.long, device=dev)
    ranks = torch.tensor([rank], dtype=torch.int32, device=dev)
    scales = torch.ones(1, device=dev)
    block_m = 16 if tokens <= 64 else 64
    routing = route_tokens(slots, 1, block_m)
    want = fused_lora_linear_reference(x, weight, lora_shrink_reference(x, lora_a, slots, ranks), lora_b, slots,
                                       ranks, scales)  # fmt: skip

    def ours_expand():
        y = x @ weight.T
        return fused_expand(y, lora_shrink(x, lora_a, routing, ranks), lora_b, routing, ranks, scales)

    def ours_linear():
        return fused_lora_linear(x, weight, lora_shrink(x, lora_a, routing, ranks), lora_b, routing, ranks, scales)

    backends = {"vllm": vllm_backend(x, weight, lora_a, lora_b, slots, 1.0), "fused_expand": ours_expand,
                "fused_linear": ours_linear, "base_gemm_only": lambda: x @ weight.T}  # fmt: skip
    row = {"layer": name, "tokens": tokens, "K": k, "N": n, "rank": rank}
    for backend, fn in backends.items():
        if fn is None:
            row[f"{backend}_ms"] = None
            continue
        if backend != "base_gemm_only":
            torch.testing.assert_close(fn(), want, atol=5e-2, rtol=5e-2)
        row[f"{backend}_ms"] = round(time_cuda(fn)["median_ms"], 5)
    if row["vllm_ms"]:
        for backend in ("fused_expand", "fused_linear"):
            row[f"{backend}_speedup"] = round(row["vllm_ms"] / row[f"{backend}_ms"], 3)
    row["fused_linear_tflops"] = round(2 * tokens * k * n / (row["fused_linear_ms"] * 1e-3) / 1e12, 1)
    print(row, flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--rank", type=int, default=RANK)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (kernel timings are CUDA-event timings)")
    copy_gbs = copy_bandwidth_gbs()
    rows = [bench_layer(name, k, n, int(t), args.rank) for name, k, n in LAYERS for t in args.tokens.split(",")]
    write_results(args.out, "fused_lora", rows, {"copy_bandwidth_gbs": round(copy_gbs, 1)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
