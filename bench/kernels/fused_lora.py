"""The whole LoRA-adapted layer (base GEMM + LoRA) at Llama-3.1-8B per-GPU shapes (TP=4 unless --tp): vLLM's path
(cuBLAS GEMM, then its Triton shrink and expand kernels, as its GPU punica wrapper calls them) against the
fused kernels of vllm_bdlora.kernels (lora_op.py, fused_lora.py): the custom op BD layers call (layer_op), and its two
orders on their own: shrink + delta-writing expand + cuBLAS GEMM accumulating onto it (delta_first),
cuBLAS GEMM + shrink + in-place fused expand (fused_expand); and shrink + split-graph fused GEMM.

    python -m bench.kernels.fused_lora --out bench/results/kernels/fused-lora-h200 [--tune]

Packed layers keep their slices (qkv: q, k, v; gate_up: gate, up), so each path serves the whole layer.
Batches hold one adapter, or several (tokens dealt round robin, --adapters). Every path is checked against
the torch reference first. `<path>_ms`: median of 200 CUDA-event-timed replays of a CUDA graph holding 10
calls (the kernels' own time, as serving replays graphs), after warm-up; `<path>_eager_ms`: the same path
launched from Python each time. bf16. `lora_overhead_ms` columns subtract the base GEMM alone. --tune also
times a few launch configurations of the fused kernels per point and records the best (the defaults are
what the layers use); --pairs times, at prefill sizes, every pairing of a few shrink and expand configurations
(the shrink's split sets what the expand re-reads), and times the table's pair and the fastest few again in
alternating rounds, the times --write-table decides on. One-adapter batches also time the layer in cuBLAS alone
(`cublas_one_adapter`, a ceiling, not a path the layers can take). --paths layer_op times the layer op alone
(old code beside new). A path that cannot run (vLLM not installed) is reported as such, not skipped silently.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch
import triton

from bench.kernels.harness import (
    CONFIRM_ROUNDS,
    CONFIRM_TOP,
    add_write_table_arguments,
    choose,
    confirm,
    finalists,
    finish,
    kernel_bench_cli,
    medians,
    report_start,
    time_cuda,
    update_plan_table,
    write_report,
)
from bench.shapes import SHAPES
from vllm_bdlora.kernels.plans import DECODE_MAX_TOKENS, DEFAULT_MAX_MIXED_WIDTH

# The model shapes `layers` serves to the kernel benchmarks' --model-shape
MODEL_SHAPES = [name for name in SHAPES if name.startswith("llama-3.1-")]


def layers(tp: int, shape: str = "llama-3.1-8b"):
    """(name, K = input features per GPU, output slice heights per GPU): the packed projections vLLM adapts, of
    a bench.shapes model at this TP."""
    proj = SHAPES[shape].projections()

    def heights(*names):
        return tuple(proj[name][1] // tp for name in names)

    return (
        ("qkv_proj", proj["q_proj"][0], heights("q_proj", "k_proj", "v_proj")),
        ("o_proj", proj["o_proj"][0] // tp, (proj["o_proj"][1],)),
        ("gate_up_proj", proj["gate_proj"][0], heights("gate_proj", "up_proj")),
        ("down_proj", proj["down_proj"][0] // tp, (proj["down_proj"][1],)),
    )


LAYERS = layers(4)
TOKENS = (1, 16, 64, 1024, 2048, 4096, 8192)
WIDTH = 32  # a BD r'=128 adapter at TP=4 (per-GPU width 128 / TP)
GRAPH_REPEATS = 10


def make_layer(k, heights, tokens, adapters, width, seed=0, slots=None):
    """A layer with `slots` LoRA slots (vLLM's --max-loras; default `adapters`), its batch's tokens dealt round
    robin over the first `adapters` of them."""
    from vllm_bdlora.kernels.fused_lora import group_tokens

    torch.manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    n, slots = sum(heights), slots or adapters
    layer = {
        "x": torch.randn(tokens, k, device=dev, dtype=dt),
        "weight": torch.randn(n, k, device=dev, dtype=dt) * k**-0.5,
        "lora_a": torch.randn(slots, len(heights) * width, k, device=dev, dtype=dt) * k**-0.5,
        "lora_b": torch.randn(slots, n, width, device=dev, dtype=dt) * width**-0.5,
        "slots": torch.arange(tokens, device=dev) % adapters,
        "widths": torch.full((len(heights), slots), width, dtype=torch.int32, device=dev),
        "bounds": torch.tensor([sum(heights[:j]) for j in range(len(heights) + 1)], dtype=torch.int32, device=dev),
    }
    layer["groups"] = group_tokens(layer["slots"], slots)
    return layer


def adapter_bytes(tokens: int, adapters: int, k: int, heights, width: int) -> int:
    """Bytes of LoRA A and B a batch must read at least (bf16): every adapter its tokens use (dealt round robin)."""
    return 2 * min(adapters, tokens) * (len(heights) * width * k + sum(heights) * width)


def reference(layer):
    from vllm_bdlora.kernels.reference import lora_linear_slices_reference

    return lora_linear_slices_reference(layer["x"], layer["weight"], layer["lora_a"], layer["lora_b"],
                                        layer["widths"], layer["bounds"], layer["slots"])  # fmt: skip


def vllm_lora_inputs(layer):
    """What vLLM's GPU punica wrapper hands torch.ops.vllm.lora_shrink/lora_expand for this layer's batch:
    per-slice A and B buffers and the kernel-metadata arguments; None (reason printed) where vLLM's LoRA
    ops cannot be imported."""
    try:
        import vllm.lora.ops.triton_ops  # noqa: F401  (registers torch.ops.vllm.lora_shrink/expand)
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
    except Exception as e:  # not installed here: report, do not fake
        print(f"vLLM LoRA ops unavailable: {e}")
        return None
    from vllm_bdlora.kernels.reference import slice_views

    x = layer["x"]
    views = slice_views(layer["lora_a"], layer["lora_b"], layer["widths"], layer["bounds"])
    lora_a = [a.contiguous() for a, _ in views]  # vLLM keeps one contiguous buffer per slice
    lora_b = [b.contiguous() for _, b in views]
    meta = LoRAKernelMeta.make(layer["lora_a"].shape[0], x.shape[0], x.device)
    meta.prepare_tensors(layer["slots"].int())
    return lora_a, lora_b, meta.meta_args(x.shape[0], False)


def vllm_path(layer):
    """vLLM's punica GPU path for one packed layer (None if vLLM's LoRA ops are unavailable)."""
    inputs = vllm_lora_inputs(layer)
    if inputs is None:
        return None
    lora_a, lora_b, args = inputs
    x, width = layer["x"], lora_b[0].shape[-1]

    def run():
        y = x @ layer["weight"].T
        buffer = torch.empty(len(lora_a), x.shape[0], width, dtype=torch.float32, device=x.device)
        torch.ops.vllm.lora_shrink(x, lora_a, buffer, *args, 1.0)
        torch.ops.vllm.lora_expand(buffer, lora_b, y, *args, offset_start=0, add_inputs=True)
        return y

    return run


def table_launch(layer):
    """The shrink and expand launches the GPU's plan table gives this layer's batch (what the layer op runs)."""
    from vllm_bdlora.kernels.plans import launch_for

    x, lora_b = layer["x"], layer["lora_b"]
    return launch_for(x.device, x.shape[0], lora_b.shape[1], x.shape[1], lora_b.shape[2], layer["widths"].shape[0])


def fused_paths(layer, shrink_cfg=None, expand_cfg=None, linear_cfg=None):
    """(fused expand, delta first, fused GEMM) paths for one layer; expand_cfg serves both expand modes; None: the
    plan table's."""
    from bench.kernels.fused_gemm import fused_lora_linear
    from vllm_bdlora.kernels.fused_lora import delta_then_gemm, fused_expand, lora_shrink

    x, groups, widths, bounds = layer["x"], layer["groups"], layer["widths"], layer["bounds"]
    launch = table_launch(layer)
    shrink_cfg, expand_cfg = shrink_cfg or launch.shrink, expand_cfg or launch.expand

    def fused_expand_path():
        y = x @ layer["weight"].T
        shrunk = lora_shrink(x, layer["lora_a"], groups, widths, shrink_cfg)
        return fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds, config=expand_cfg)

    def delta_first_path():
        shrunk = lora_shrink(x, layer["lora_a"], groups, widths, shrink_cfg)
        return delta_then_gemm(x, layer["weight"], shrunk, layer["lora_b"], groups, widths, bounds, config=expand_cfg)

    def fused_linear_path():
        shrunk = lora_shrink(x, layer["lora_a"], groups, widths, shrink_cfg)
        return fused_lora_linear(x, layer["weight"], shrunk, layer["lora_b"], groups, widths, bounds,
                                 config=linear_cfg)  # fmt: skip

    return fused_expand_path, delta_first_path, fused_linear_path


PATHS = ("fused_expand", "delta_first", "fused_linear")


def cublas_one_adapter_path(layer):
    """The same layer with every token on slot 0, all in cuBLAS: base GEMM, X·Aᵀ for all slices in one GEMM, then
    one GEMM per slice adding S_j·B_jᵀ into its columns (beta = 1). Not a path the layers can take (it needs the
    host to know the batch holds one adapter, and reads no width table): the ceiling our routed kernels are held
    to where a batch has one adapter. None for batches of several adapters."""
    if int(layer["slots"].max()) != 0:
        return None
    x, a, b, bounds = layer["x"], layer["lora_a"][0], layer["lora_b"][0], layer["bounds"].tolist()
    width = b.shape[1]

    def run():
        y = x @ layer["weight"].T
        s = (x @ a.T).to(x.dtype)
        for j in range(len(bounds) - 1):
            y[:, bounds[j] : bounds[j + 1]].addmm_(s[:, j * width : (j + 1) * width], b[bounds[j] : bounds[j + 1]].T)
        return y

    return run


def layer_op_path(layer, decode_state=None, max_tokens=DECODE_MAX_TOKENS, max_mixed_width=DEFAULT_MAX_MIXED_WIDTH):
    """Exactly what a BD layer runs with lora_kernels fused/auto over an unquantized base: the custom op
    given the base weight (it picks delta first or GEMM first by token count, and its launch configurations),
    and with a `decode_state` the one-launch kernel for decode-sized batches (up to `max_tokens` tokens, adapters
    within `max_mixed_width`: the plugin's one_launch_max_tokens and one_launch_max_mixed_width)."""
    import vllm_bdlora.kernels.lora_op  # noqa: F401 (registers the op)

    x, groups = layer["x"], layer["groups"]
    out = torch.empty(x.shape[0], layer["weight"].shape[0], dtype=x.dtype, device=x.device)

    def run():
        torch.ops.vllm_bdlora.fused_lora_slices_(
            out, x, layer["lora_a"], layer["lora_b"], layer["widths"], layer["bounds"], layer["slots"],
            groups.sorted_ids, groups.group_slot, groups.group_count, groups.group_start, None, None, None,
            layer["weight"], decode_state, max_tokens, max_mixed_width,
        )  # fmt: skip
        return out

    return run


def candidate_configs(tokens, k, width, slices, out_features):
    """A few launch configurations around the defaults, for --tune: (shrinks, expands, linears)."""
    from bench.kernels.fused_gemm import linear_config
    from vllm_bdlora.kernels.plans import LaunchConfig, all_slices_block, launch_for

    launch = launch_for("cuda", tokens, out_features, k, width, slices)
    s, e = launch.shrink, launch.expand
    lin = linear_config(tokens)
    whole = all_slices_block(width, slices)
    if tokens <= 64:
        rows = sorted({16, max(16, triton.next_power_of_2(tokens))})  # 16-row tiles, or all tokens in one
        shrinks = {s} | {LaunchConfig(bm, bn, 128, split_k=sk, num_stages=2) for bm in rows
                         for bn in (s.block_n, whole) for sk in (4, 8, 16)}  # fmt: skip
        expands = {e} | {LaunchConfig(bm, bn, e.block_k, num_stages=2) for bm in rows for bn in (32, 64, 128, 256)}
        linears = {lin} | {LaunchConfig(16, bn, bk, num_stages=st) for bn, bk, st in
                           ((16, 256, 4), (32, 256, 3), (64, 128, 4), (64, 64, 5))}  # fmt: skip
        return shrinks, expands, linears
    shrinks = {s} | {LaunchConfig(bm, bn, bk, split_k=sk, num_warps=w, num_stages=st)
                     for bm, bn, bk, sk, w, st in ((64, 32, 64, 1, 4, 3), (64, whole, 64, 1, 4, 3),
                                                   (64, whole, 64, 2, 4, 3), (128, whole, 64, 1, 8, 3),
                                                   (32, whole, 128, 1, 4, 4), (64, whole, 128, 1, 8, 3),
                                                   (128, whole, 64, 1, 8, 4), (64, whole, 64, 1, 4, 4))}  # fmt: skip
    if width * slices >= 256:  # X read once per 256 columns of S rather than 128
        shrinks |= {LaunchConfig(64, 256, 64, num_warps=8, num_stages=3), LaunchConfig(128, 256, 32, num_warps=8)}
    expands = {e} | {LaunchConfig(bm, bn, e.block_k, num_warps=w, num_stages=st)
                     for bm, bn, w, st in ((128, 128, 8, 2), (64, 256, 8, 2), (32, 256, 4, 2),
                                           (64, 128, 4, 2))}  # fmt: skip
    if width >= 64:  # wide adapters: the expand is a GEMM over the width, deeper steps and pipelined
        expands |= {LaunchConfig(bm, bn, 64, num_warps=w, num_stages=st)
                    for bm, bn, w, st in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (64, 64, 4, 3),
                                          (128, 128, 8, 1))}  # fmt: skip
    linears = {lin} | {LaunchConfig(128, 256, 64, num_warps=8, num_stages=3),
                       LaunchConfig(128, 128, 64, num_warps=4, num_stages=4)}  # fmt: skip
    return shrinks, expands, linears


def checked_ms(fn, want, label: str) -> float | None:
    """fn's median milliseconds (graph replays, as --tune and --pairs time their candidates) once it matches the
    reference; None, said on stdout, for a configuration that fails to compile (shared memory) or computes wrong."""
    try:
        torch.testing.assert_close(fn(), want, atol=5e-2, rtol=5e-2)
    except Exception as e:
        print(f"{label}: not timed: {str(e).splitlines()[0][:200]}")
        return None
    return graph_ms(fn)


def tune_point(layer, want, tokens, k, width, paths=PATHS) -> dict:
    """Best configuration per fused path (of `paths`), varying one kernel's launch configuration at a time
    around the defaults (each checked against the reference)."""
    shrinks, expands, linears = candidate_configs(tokens, k, width, layer["widths"].shape[0], layer["weight"].shape[0])
    found = {}
    for index, (path, others) in enumerate(zip(PATHS, (expands, expands, linears), strict=True)):
        if path not in paths:
            continue
        trials = [(s, None) for s in shrinks] + [(None, o) for o in others]  # None: the default
        timed = []
        for shrink_cfg, other_cfg in trials:
            cfgs = (shrink_cfg, other_cfg, None) if index < 2 else (shrink_cfg, None, other_cfg)
            ms = checked_ms(fused_paths(layer, *cfgs)[index], want, f"{path} {shrink_cfg} {other_cfg}")
            if ms is not None:
                timed.append((ms, shrink_cfg, other_cfg))
        ms, shrink_cfg, other_cfg = min(timed, key=lambda t: t[0])
        found[f"tuned_{path}_ms"] = round(ms, 5)
        found[f"tuned_{path}_config"] = {"shrink": asdict(shrink_cfg) if shrink_cfg else "default",
                                         "other": asdict(other_cfg) if other_cfg else "default"}  # fmt: skip
    return found


def pair_candidates(tokens, k, width, slices, out_features):
    """Prefill-sized batches (over 64 tokens): shrink and expand configurations to time in every pairing
    (`--pairs`), since the shrink's split_k sets how many S parts each expand program sums, and the expand's
    tile how often S and B are re-read. The defaults come first."""
    from vllm_bdlora.kernels.plans import LaunchConfig, all_slices_block, launch_for

    launch = launch_for("cuda", tokens, out_features, k, width, slices)
    whole = all_slices_block(width, slices)
    shrinks = [launch.shrink] + [
        LaunchConfig(bm, whole, bk, split_k=sk, num_warps=w, num_stages=st)
        for bm, bk, sk, w, st in ((64, 64, 1, 4, 4), (64, 64, 2, 4, 4), (64, 128, 1, 8, 3), (128, 64, 1, 8, 4),
                                  (32, 128, 1, 4, 4))]  # fmt: skip
    step = 64 if width >= 64 else launch.expand.block_k
    expands = [launch.expand] + [
        LaunchConfig(bm, bn, bk, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in ((128, 256, step, 8, 3), (128, 128, step, 8, 3), (64, 256, step, 8, 2),
                                  (128, 256, 32, 8, 2), (64, 128, step, 4, 3))]  # fmt: skip
    return list(dict.fromkeys(shrinks)), list(dict.fromkeys(expands))


def pairs_point(layer, want, tokens, k, width) -> dict:
    """The in-place (GEMM first) path at every (shrink, expand) pairing of `pair_candidates`, each checked against
    the reference: the default pair's time, the best pair's, the best five, and all; then the default pair and the
    best CONFIRM_TOP others timed again (`harness.confirm`), the times the table writer decides on."""
    shrinks, expands = pair_candidates(tokens, k, width, layer["widths"].shape[0], layer["weight"].shape[0])
    timed = []
    for shrink_cfg in shrinks:
        for expand_cfg in expands:
            ms = checked_ms(fused_paths(layer, shrink_cfg, expand_cfg)[0], want, f"pair {shrink_cfg} {expand_cfg}")
            if ms is not None:
                timed.append({"ms": round(ms, 5), "shrink": asdict(shrink_cfg), "expand": asdict(expand_cfg)})
    current = {"shrink": asdict(shrinks[0]), "expand": asdict(expands[0])}
    default = next(t["ms"] for t in timed if pair_key(t) == pair_key(current))
    timed.sort(key=lambda t: t["ms"])
    by_key = {pair_key(t): t for t in timed}
    pairs = {key: by_key[key] for key in finalists(list(by_key), pair_key(current))}  # the table's pair first
    paths = {key: fused_paths(layer, *launches(pair))[0] for key, pair in pairs.items()}
    confirmed = confirm(list(pairs), lambda key, _: graph_ms(paths[key]), [tokens])
    median = medians(confirmed)
    again = [{"ms": median[key][tokens], "ms_rounds": rounds[tokens],
              "shrink": pairs[key]["shrink"], "expand": pairs[key]["expand"]}
             for key, rounds in confirmed.items()]  # fmt: skip
    return {"pairs_default_ms": default, "pairs_best_ms": timed[0]["ms"], "pairs_top5": timed[:5],
            "pairs_all": timed, "pairs_default_confirmed_ms": again[0]["ms"],
            "pairs_confirmed": sorted(again, key=lambda t: t["ms"])}  # fmt: skip


def graph_ms(fn) -> float:
    """fn's median milliseconds as the searches time their candidates (graph replays)."""
    return time_cuda(fn, trials=50, graph_repeats=GRAPH_REPEATS)["median_ms"]


def launches(pair: dict) -> tuple:
    """A timed pair's (shrink, expand) launch configurations."""
    from vllm_bdlora.kernels.plans import LaunchConfig

    return LaunchConfig(**pair["shrink"]), LaunchConfig(**pair["expand"])


def with_width_unrolled(fn):
    """fn with the expand's rank steps inline whatever the width (UNROLLED_WIDTH_STEPS raised while it
    launches, so its CUDA graph captures the unrolled variants): the other side of the width-loop A/B."""
    from vllm_bdlora.kernels import fused_lora

    def run():
        default = fused_lora.UNROLLED_WIDTH_STEPS
        fused_lora.UNROLLED_WIDTH_STEPS = 1 << 20
        try:
            return fn()
        finally:
            fused_lora.UNROLLED_WIDTH_STEPS = default

    return run


def width_loops(width: int, expand_block_k: int) -> bool:
    """Whether an expand of this step loops over the adapter's width (too wide to unroll)."""
    from vllm_bdlora.kernels.fused_lora import unrolls_width

    return not unrolls_width(width, expand_block_k)


def bench_point(name, k, heights, tokens, adapters, width, tune, tp=4, pairs=False, only=None, slots=0):
    layer = make_layer(k, heights, tokens, adapters, width, slots=max(slots, adapters))
    want = reference(layer)
    paths = {"vllm": vllm_path(layer), "layer_op": layer_op_path(layer),
             **dict(zip(PATHS, fused_paths(layer), strict=True)), "cublas_one_adapter": cublas_one_adapter_path(layer),
             "base_gemm_only": lambda: layer["x"] @ layer["weight"].T}  # fmt: skip
    # A/B: where the expand loops over the width, the same paths with that loop unrolled
    if width_loops(width, table_launch(layer).expand.block_k):
        paths["layer_op_unrolled"] = with_width_unrolled(paths["layer_op"])
        paths["fused_expand_unrolled"] = with_width_unrolled(paths["fused_expand"])
    if only:  # the others are reported as not run
        paths = {path: fn if path in only or path == "base_gemm_only" else None for path, fn in paths.items()}
    row = {"tp": tp, "layer": name, "tokens": tokens, "adapters": adapters, "K": k, "N": sum(heights),
           "slices": len(heights), "width": width, "slots": max(slots, adapters)}  # fmt: skip
    for path, fn in paths.items():
        if fn is None:
            row[f"{path}_ms"] = None
            continue
        if path != "base_gemm_only":
            try:
                torch.testing.assert_close(fn(), want, atol=5e-2, rtol=5e-2)
            except Exception as e:  # wrong, or failed to compile (shared memory): record it, time the other paths
                row[f"{path}_ms"], row[f"{path}_error"] = None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
                continue
        row[f"{path}_ms"] = round(time_cuda(fn, graph_repeats=GRAPH_REPEATS)["median_ms"], 5)
        row[f"{path}_eager_ms"] = round(time_cuda(fn)["median_ms"], 5)
    if tune:
        row.update(tune_point(layer, want, tokens, k, width, tune))
    if pairs and tokens > 64:
        row.update(pairs_point(layer, want, tokens, k, width))
    if row["vllm_ms"]:
        for path in ("layer_op", *PATHS, *(f"tuned_{p}" for p in PATHS)):
            if row.get(f"{path}_ms"):
                row[f"{path}_speedup"] = round(row["vllm_ms"] / row[f"{path}_ms"], 3)
    for path in ("vllm", "layer_op", *PATHS, "cublas_one_adapter"):
        if row.get(f"{path}_ms"):
            row[f"{path}_lora_overhead_ms"] = round(row[f"{path}_ms"] - row["base_gemm_only_ms"], 5)
    gemm_s = row["base_gemm_only_ms"] * 1e-3
    row["base_gemm_tflops"] = round(2 * tokens * k * row["N"] / gemm_s / 1e12, 1)
    row["base_gemm_gbs"] = round(2 * (tokens * k + k * row["N"] + tokens * row["N"]) / gemm_s / 1e9, 1)
    # Bytes the LoRA work must move at least, beyond the base GEMM's own: X once (shrink) and the output
    # once (the delta-first expand's write); its achieved rate against the measured copy bandwidth.
    lora_bytes = 2 * (tokens * k + tokens * row["N"])
    if row.get("layer_op_lora_overhead_ms", 0) > 0:
        row["layer_op_lora_gbs"] = round(lora_bytes / (row["layer_op_lora_overhead_ms"] * 1e-3) / 1e9, 1)
    print(row, flush=True)
    return row


def add_layer_grid_arguments(parser, tp: str, tokens: str) -> None:
    """The decode-size benchmarks' grid of layer points: --tp, --model-shape, --tokens, --adapters, --bd-rank."""
    parser.add_argument("--tp", default=tp, help="per-GPU layer shapes of the model at these TP sizes (1-8)")
    parser.add_argument("--model-shape", default="llama-3.1-8b", choices=MODEL_SHAPES)
    parser.add_argument("--tokens", default=tokens)
    parser.add_argument("--adapters", default="1,4", help="adapters per batch (tokens dealt round robin)")
    parser.add_argument("--bd-rank", type=int, default=128, help="BD r': per-GPU LoRA width r' / TP")


def layer_grid(args):
    """(tp, layer name, K, output slice heights, tokens, adapters) for every point `add_layer_grid_arguments`'
    arguments name, layer by layer."""
    for tp in map(int, args.tp.split(",")):
        for layer_name, k, heights in layers(tp, args.model_shape):
            for adapters in map(int, args.adapters.split(",")):
                for tokens in map(int, args.tokens.split(",")):
                    yield tp, layer_name, k, heights, tokens, adapters


def run_bd_rank(rows) -> int:
    """The BD r' a kernel benchmark's rows were made with: per-GPU width x TP (the first runs, all TP=4, record no
    TP; decode `--configs` rows of older runs record no width, and all used r'=128)."""
    return rows[0]["width"] * rows[0].get("tp", 4) if rows and "width" in rows[0] else 128


def _or_dash(value, spec: str, unit: float = 1.0) -> str:
    return "-" if value is None else format(value * unit, spec)


def report(json_path: str) -> str:
    """fused_lora.md beside the JSON: one table per adapter count and the layer op's targets, judged from the
    graph-timed whole-layer medians (prefill: 1024-8192 tokens, decode: 1-64 tokens)."""
    _, rows, lines = report_start(
        json_path, "Fused LoRA kernels vs vLLM's LoRA kernels: whole adapted layer (base GEMM + LoRA)"
    )
    missing = [column for column in ("layer_op_ms", "delta_first_ms") if rows and column not in rows[0]]
    if missing:  # the oldest runs timed the kernels alone, before the layer op existed
        raise SystemExit(
            f"{json_path} predates the layer op (no {', '.join(missing)} column): its fused_lora.md was written "
            "by the benchmark of its day and cannot be rebuilt; re-run `python3 -m bench.kernels.fused_lora --out "
            "DIR` on a GPU host for a current report"
        )
    lines += [
        "- times: median of 200 CUDA-event-timed replays of a CUDA graph of 10 calls (ms per call); bf16; "
        f"Llama-3.1-8B TP={rows[0].get('tp', 4)} per-GPU shapes, per-GPU LoRA width "
        f"{rows[0]['width']} (BD r'={run_bd_rank(rows)})"
        + (
            f"; layers of {rows[0]['slots']} LoRA slots (or the batch's adapters, where more)"
            if rows[0].get("slots", rows[0]["adapters"]) > rows[0]["adapters"]
            else ""
        ),
        "- paths: **layer op** = the custom op BD layers call with `lora_kernels: fused`/`auto` over an "
        "unquantized base (our shrink, then from 2048 tokens our expand writing delta + bias and cuBLAS "
        "accumulating X·Wᵀ onto it with beta = 1 (= delta first), below that cuBLAS GEMM then our expand adding "
        "in place (= fused expand, also the path for quantized bases and DoRA)); fused GEMM = our shrink + "
        "split-graph Triton GEMM with the LoRA term in its accumulator (not used by the layers)",
        "- LoRA GB/s: the bytes the LoRA work must move beyond the base GEMM's (X once, the output once) over "
        "the layer op's added time",
        "",
    ]
    tuned = [path for path in PATHS if any(f"tuned_{path}_ms" in r for r in rows)]
    if any(r.get("cublas_one_adapter_ms") for r in rows):
        lines[-1:-1] = ["- cuBLAS LoRA: the whole layer in cuBLAS with every token on one adapter (base GEMM, X·Aᵀ for "
                        "all slices, one GEMM per slice adding S·Bᵀ): a ceiling for one-adapter batches, not a path "
                        "the layers take (it needs the host to know the batch's adapter)"]  # fmt: skip
    for adapters in sorted({r["adapters"] for r in rows}):
        lines += [f"## {adapters} adapter(s) per batch", "",
                  "| layer | tokens | base GEMM ms (TFLOP/s) | vLLM ms | layer op ms (×) | delta first ms (×) "
                  "| fused expand ms (×) | fused GEMM ms (×) | LoRA cost vLLM / layer op, µs (LoRA GB/s) |"
                  + "".join(f" tuned {path.replace('_', ' ')} ms (×) |" for path in tuned)
                  + " cuBLAS LoRA ms, LoRA cost µs |",
                  "|---|---|---|---|---|---|---|---|---|" + "---|" * (len(tuned) + 1)]  # fmt: skip
        for r in (r for r in rows if r["adapters"] == adapters):
            lines.append(
                f"| {r['layer']} | {r['tokens']} | {r['base_gemm_only_ms']:.4f} ({r['base_gemm_tflops']}) | "
                f"{_or_dash(r.get('vllm_ms'), '.4f')} | "
                f"**{_or_dash(r['layer_op_ms'], '.4f')} ({r.get('layer_op_speedup', '-')})** | "
                f"{_or_dash(r['delta_first_ms'], '.4f')} ({r.get('delta_first_speedup', '-')}) | "
                f"{_or_dash(r['fused_expand_ms'], '.4f')} ({r.get('fused_expand_speedup', '-')}) | "
                f"{_or_dash(r['fused_linear_ms'], '.4f')} ({r.get('fused_linear_speedup', '-')}) | "
                f"{_or_dash(r.get('vllm_lora_overhead_ms'), '.1f', 1e3)} / "
                f"{_or_dash(r.get('layer_op_lora_overhead_ms'), '.1f', 1e3)} "
                f"({r.get('layer_op_lora_gbs', '-')}) |"
                + "".join(
                    f" {_or_dash(r.get(f'tuned_{path}_ms'), '.4f')} ({r.get(f'tuned_{path}_speedup', '-')}) |"
                    for path in tuned
                )
                + f" {_or_dash(r.get('cublas_one_adapter_ms'), '.4f')}, "
                f"{_or_dash(r.get('cublas_one_adapter_lora_overhead_ms'), '.1f', 1e3)} |"
            )
        lines.append("")
    lines += per_decoder_layer_lines(rows)
    lines += ["## Targets: the layer op", ""]
    for label, lo, hi, test, goal in (
        ("prefill (1024-8192 tokens): ≥ 1.2× faster than vLLM", 1024, 8192, lambda x: x >= 1.2, "≥ 1.2×"),
        ("decode (1-64 tokens): never slower than vLLM", 1, 64, lambda x: x >= 1.0, "≥ 1.0×"),
    ):
        for layer in dict.fromkeys(r["layer"] for r in rows):
            in_range = [r for r in rows if r["layer"] == layer and lo <= r["tokens"] <= hi]
            speedups = [r["layer_op_speedup"] for r in in_range if r.get("vllm_ms")]
            if not in_range:
                lines.append(f"- {label}, {layer}: no batch of that size in this run")
                continue
            if not speedups:  # a host without vLLM times our kernels only
                lines.append(f"- {label}, {layer}: not measured (no vLLM on the host)")
                continue
            verdict = "met" if all(test(x) for x in speedups) else "MISSED"
            lines.append(f"- {label}, {layer}: {min(speedups):.2f}-{max(speedups):.2f}× ({goal}): {verdict}")
    lines += width_loop_lines(rows)
    failed = [(r, key[: -len("_error")]) for r in rows for key in r if key.endswith("_error")]
    if failed:
        lines += ["", "## Paths that did not run", ""]
        lines += [f"- {r['layer']}, {r['tokens']} tokens, {r['adapters']} adapter(s), {path}: {r[f'{path}_error']}"
                  for r, path in failed]  # fmt: skip
    return write_report(json_path, "fused_lora", lines)


# A decoder layer with this many adapters in its batch should cost at most MANY_ADAPTERS_GOAL x the same layer with one.
MANY_ADAPTERS, MANY_ADAPTERS_GOAL = 12, 1.15


def column_sums(rows, columns) -> tuple[float, ...]:
    """Each of `columns` summed over `rows` (a decoder layer's projections: the layer kinds of one batch)."""
    return tuple(sum(r[column] for r in rows) for column in columns)


def per_decoder_layer_lines(rows) -> list[str]:
    """Where a run has several adapter counts: the four layer kinds summed per (adapters, tokens), our layer op against
    vLLM's and against the same layer op with one adapter in the batch."""
    kinds = len({r["layer"] for r in rows})
    if len({r["adapters"] for r in rows}) < 2 or not any(r["adapters"] == 1 for r in rows):
        return []
    batches = {}
    for r in rows:
        batches.setdefault((r["adapters"], r["tokens"]), []).append(r)
    # (base, vLLM, layer op) ms per batch whose every layer kind ran both paths
    sums = {key: column_sums(picked, ("base_gemm_only_ms", "vllm_ms", "layer_op_ms"))
            for key, picked in sorted(batches.items())
            if len(picked) == kinds and all(r.get("layer_op_ms") and r.get("vllm_ms") for r in picked)}  # fmt: skip
    lines = ["## Per decoder layer (the layer kinds summed), by adapters in the batch", "",
             "µs; × one adapter: the layer op's time over its time with one adapter at the same tokens.", "",
             "| adapters | tokens | base µs | vLLM µs (×base) | layer op µs (×base) | vs vLLM | × one adapter |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (adapters, tokens), (base, vllm, op) in sums.items():
        one = sums.get((1, tokens))
        ratio = f"{op / one[2]:.2f}" if one else "-"
        lines.append(f"| {adapters} | {tokens} | {base * 1e3:.1f} | {vllm * 1e3:.1f} ({vllm / base:.2f}) | "
                     f"{op * 1e3:.1f} ({op / base:.2f}) | {vllm / op:.2f}× | {ratio} |")  # fmt: skip
    goal = [(t, s[2] / sums[(1, t)][2]) for (a, t), s in sums.items() if a == MANY_ADAPTERS and (1, t) in sums]
    if goal:
        worst = max(ratio for _, ratio in goal)
        verdict = "met" if worst <= MANY_ADAPTERS_GOAL else "MISSED"
        lines += ["", f"- {MANY_ADAPTERS} adapters within {MANY_ADAPTERS_GOAL}× of one adapter, per decoder layer: "
                  f"up to {worst:.2f}× ({', '.join(f'{t} tokens {r:.2f}×' for t, r in goal)}): {verdict}"]  # fmt: skip
    return [*lines, ""]


def width_loop_lines(rows) -> list[str]:
    """The width-loop A/B (points whose width the expand loops over rather than unrolls)."""
    ab = [r for r in rows if r.get("layer_op_unrolled_ms")]
    if not ab:
        return []
    lines = ["", "## Expand rank steps: looped (the default past UNROLLED_WIDTH_STEPS) vs unrolled", "",
             "Same run, same points; unrolled/looped > 1 means the loop is faster.", "",
             "| layer | adapters | tokens | layer op looped / unrolled ms (unrolled/looped) "
             "| fused expand looped / unrolled ms (unrolled/looped) |", "|---|---|---|---|---|"]  # fmt: skip
    for r in ab:
        cells = []
        for path in ("layer_op", "fused_expand"):
            looped, unrolled = r.get(f"{path}_ms"), r.get(f"{path}_unrolled_ms")
            ratio = f"{unrolled / looped:.3f}" if looped and unrolled else "-"
            cells.append(f"{_or_dash(looped, '.4f')} / {_or_dash(unrolled, '.4f')} ({ratio})")
        lines.append(f"| {r['layer']} | {r['adapters']} | {r['tokens']} | {cells[0]} | {cells[1]} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--adapters", default="1,4", help="adapters per batch (tokens dealt round robin)")
    p.add_argument("--tp", type=int, default=4, help="Llama-3.1-8B per-GPU layer shapes at this TP")
    p.add_argument("--width", type=int, help="per-GPU LoRA width (default: BD r'=128 / TP)")
    p.add_argument(
        "--tune",
        nargs="?",
        const=",".join(PATHS),
        default="",
        help=f"also time candidate launch configurations of these paths (bare: all of {','.join(PATHS)})",
    )
    p.add_argument("--slots", type=int, default=0, help="LoRA slots of every layer, a server's --max-loras (default: "
                   "the batch's adapters; never fewer)")  # fmt: skip
    p.add_argument("--paths", help="time only these paths (comma-separated, e.g. layer_op) and the base GEMM")
    p.add_argument("--pairs", action="store_true",
                   help="also time GEMM-first prefill (over 64 tokens) at every pairing of a few shrink and expand "
                   f"configurations (pairs_* columns), then the table's pair and the {CONFIRM_TOP} fastest again, "
                   f"{CONFIRM_ROUNDS} rounds in alternating order (pairs_confirmed)")  # fmt: skip
    add_write_table_arguments(
        p,
        "--pairs",
        "per layer and token range, the pair of lowest mean time over the range's "
        "timed batch sizes in the confirming rounds (none finding it slower by more than --min-gain),",
    )

    def kind(args):
        if args.write_table is not None and not args.pairs:
            p.error("--write-table writes what --pairs times: add --pairs")
        return report, "fused_lora"

    started = kernel_bench_cli(p, argv, report, "fused_lora", kind=kind)
    if started is None:
        return 0
    args, copy_gbs, _, _ = started
    width, tune = args.width or 128 // args.tp, tuple(filter(None, args.tune.split(",")))
    rows = [
        bench_point(
            name,
            k,
            heights,
            int(t),
            int(n),
            width,
            tune,
            args.tp,
            args.pairs,
            set(args.paths.split(",")) if args.paths else None,
            args.slots,
        )  # fmt: skip
        for name, k, heights in layers(args.tp)
        for n in args.adapters.split(",")
        for t in args.tokens.split(",")
    ]
    status = finish(args.out, "fused_lora", rows, copy_gbs, report)
    if args.write_table is not None:
        update_plan_table(args.write_table, lambda table: write_prefill_table(rows, table, args.min_gain))
    return status


def write_prefill_table(rows, table, min_gain: float) -> list[str]:
    """Update a plan table's prefill ranges from --pairs rows. The rows of a layer whose token counts fall in one
    range choose one pair for it together: of the pairs timed at every such count, the one of lowest mean time
    relative to the table's launches (the default pair), none of its counts slower than those by more than
    `min_gain`; it replaces the range's shrink and expand (its delta-first choice kept) where that mean saves more
    than `min_gain`. So a range searched at 1,024 and 4,096 tokens takes a pair good at both, not the last count's
    best. Other ranges stay; a layer the table lacks gets the structural default's ranges first. Returns a line per
    range saying what happened."""
    from dataclasses import replace

    from vllm_bdlora.kernels.plans import LaunchConfig, default_prefill_ranges, prefill_key

    groups: dict = {}
    for r in rows:
        if "pairs_top5" not in r:
            continue
        key = prefill_key(r["N"], r["K"], r["width"], r["slices"])
        if key not in table.prefill:
            table.prefill[key] = tuple(default_prefill_ranges(r["N"], r["K"], r["width"], r["slices"]))
        index = max(i for i, rng in enumerate(table.prefill[key]) if rng.from_tokens <= r["tokens"])
        groups.setdefault((key, index), []).append(r)
    said = []
    for (key, index), group in groups.items():
        timed = range_pair_times(group)
        best = choose(timed, CURRENT_LAUNCHES, min_gain)
        ranges = list(table.prefill[key])
        if best == CURRENT_LAUNCHES:
            kept = ", ".join(f"{t} tokens {ms} ms" for t, ms in timed[CURRENT_LAUNCHES].items())
            said.append(f"{key}, range from {ranges[index].from_tokens} tokens: kept ({kept})")
            continue
        shrink, expand = (dict(items) for items in best)
        ranges[index] = replace(ranges[index], shrink=LaunchConfig(**shrink), expand=LaunchConfig(**expand))
        table.prefill[key] = tuple(ranges)
        times = ", ".join(f"{t} tokens {timed[CURRENT_LAUNCHES][t]} -> {ms} ms" for t, ms in timed[best].items())
        said.append(f"{key}, range from {ranges[index].from_tokens} tokens: {times}")
    return said


# The key of the table's launches (the default pair) among a range's timed pairs.
CURRENT_LAUNCHES = "current"


def range_pair_times(group: list) -> dict:
    """The pairs of a range's --pairs rows as `harness.choose` takes them: pair -> {token count: ms, None where that
    row did not keep it}, the table's launches first, then the pairs in the first row's order, so ties break the
    same way every run. Where every row was confirmed (`harness.confirm`), the confirming times alone, so a pair
    competes only where it was timed again at every count; else (rows of a search without that pass) every pair's
    sweep time where rows keep them all, or the five best."""
    if all("pairs_confirmed" in r for r in group):
        kept = [{pair_key(p): p["ms"] for p in r["pairs_confirmed"]} for r in group]
        current = [r["pairs_default_confirmed_ms"] for r in group]
    else:
        kept = [{pair_key(p): p["ms"] for p in r.get("pairs_all") or r["pairs_top5"]} for r in group]
        current = [r["pairs_default_ms"] for r in group]
    timed = {CURRENT_LAUNCHES: {r["tokens"]: ms for r, ms in zip(group, current, strict=True)}}
    for pair in kept[0]:
        timed[pair] = {r["tokens"]: times.get(pair) for r, times in zip(group, kept, strict=True)}
    return timed


def pair_key(pair: dict) -> tuple:
    """A timed pair's launches as a hashable key: (shrink items, expand items)."""
    return tuple(sorted(pair["shrink"].items())), tuple(sorted(pair["expand"].items()))


if __name__ == "__main__":
    raise SystemExit(main())
