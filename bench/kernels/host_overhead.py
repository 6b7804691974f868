"""The layer op's own Python on the host, kernel launches left out: runs on any machine, GPU or not.

    python -m bench.kernels.host_overhead --out archived CPU runs [--tokens 1024]

Outside CUDA graphs (prefills longer than the largest captured graph) every BD layer's op runs its Python on
every step: launch configurations, grids, output buffers, then the Triton launches (`launch_overhead.py` times
those on a GPU). This times what comes before the launches, with `launch` replaced by a no-op: the shrink and
expand wrappers per projection of Llama-3.1-8B at one TP (BD r'=128, one adapter), their configuration
functions (cached, so a repeated call times the cache lookup, as serving's 31 of
32 layers see it), and the integer helpers they size launches with (Triton's constexpr `triton.cdiv` against plain
arithmetic). Medians of many timed loops, µs per call, on this machine's CPU. To compare code versions, run the
same benchmark with another `vllm_bdlora` first on the path (`cd OLD && python -m bench.kernels.host_overhead`,
`bench/` copied beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import triton

from bench.kernels.fused_lora import layers
from bench.kernels.harness import write_results
from bench.shapes import SHAPES

LOOPS, CALLS_PER_LOOP = 200, 50


def host_us(fn) -> float:
    """Median µs per call over LOOPS timed loops of CALLS_PER_LOOP calls."""
    for _ in range(CALLS_PER_LOOP * 5):
        fn()
    loops = []
    for _ in range(LOOPS):
        start = time.perf_counter()
        for _ in range(CALLS_PER_LOOP):
            fn()
        loops.append((time.perf_counter() - start) / CALLS_PER_LOOP)
    return statistics.median(loops) * 1e6


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def pieces(tokens: int, hidden: int, heights: tuple[int, ...], width: int) -> dict:
    """name -> call, for one projection (output slices of `heights`): the wrappers with kernel launches stubbed."""
    from vllm_bdlora.kernels import fused_lora
    from vllm_bdlora.kernels.plans import table_for

    fused_lora.launch = lambda *args, **kwargs: None  # what is left is the wrappers' own Python
    table = table_for("NVIDIA H200", 132)  # the plan lookups a GPU host makes
    slices, out_features = len(heights), sum(heights)
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    lora_a = torch.zeros(1, slices * width, hidden, dtype=torch.bfloat16)
    lora_b = torch.zeros(1, out_features, width, dtype=torch.bfloat16)
    widths = torch.full((slices, 1), width, dtype=torch.int32)
    bounds = torch.tensor([sum(heights[:j]) for j in range(slices + 1)], dtype=torch.int32)
    groups = fused_lora.group_tokens(torch.zeros(tokens, dtype=torch.int32), 1)
    y = torch.empty(tokens, out_features, dtype=torch.bfloat16)
    launch = table.prefill_launch(tokens, out_features, hidden, width, slices)
    shrunk = fused_lora.lora_shrink(x, lora_a, groups, widths, launch.shrink)
    return {
        "plan_lookup": lambda: table.prefill_launch(tokens, out_features, hidden, width, slices),
        "lora_shrink_wrapper": lambda: fused_lora.lora_shrink(x, lora_a, groups, widths, launch.shrink),
        "fused_expand_wrapper": lambda: fused_lora.fused_expand(
            y, shrunk, lora_b, groups, widths, bounds, config=launch.expand
        ),
    }


def helpers() -> dict:
    found = {
        "triton_cdiv": lambda: triton.cdiv(1024, 64),
        "triton_next_power_of_2": lambda: triton.next_power_of_2(384),
    }
    try:
        from vllm_bdlora.kernels.launch_math import cdiv, next_power_of_2
    except ImportError:  # a version before launch_math
        return found
    found.update(launch_math_cdiv=lambda: cdiv(1024, 64), launch_math_next_power_of_2=lambda: next_power_of_2(384))
    return found


def report(rows: list[dict], env: dict) -> str:
    lines = [
        f"# Layer op host Python, kernel launches stubbed ({env['cpu']})",
        "",
        f"- `vllm_bdlora` from `{env['vllm_bdlora_path']}`, torch `{env['torch']}`, triton `{env['triton']}`, "
        f"python `{env['python']}`, {env['time']}",
        f"- command: `{env['command']}`",
        "",
        "| piece | layer | tokens | µs per call |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['piece']} | {r['layer']} | {r['tokens']} | {r['us']:.2f} |" for r in rows]
    wrappers = [r["us"] for r in rows if r["piece"].endswith("_wrapper")]
    lines += ["", f"Shrink + expand wrappers summed over the decoder layer's projections: {sum(wrappers):.1f} µs."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results folder (host_overhead.json/.csv/.md)")
    parser.add_argument("--tokens", type=int, default=1024, help="batch size in tokens (a prefill outside graphs)")
    parser.add_argument("--tp", type=int, default=1, help="per-GPU shapes at this TP")
    parser.add_argument("--model-shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--bd-rank", type=int, default=128, help="BD r': per-GPU LoRA width r' / TP")
    args = parser.parse_args(argv)
    import vllm_bdlora

    rows = [{"piece": name, "layer": "", "tokens": "", "us": host_us(fn)} for name, fn in helpers().items()]
    width = args.bd_rank // args.tp
    for layer, hidden, heights in layers(args.tp, args.model_shape):
        for name, fn in pieces(args.tokens, hidden, heights, width).items():
            rows.append({"piece": name, "layer": layer, "tokens": args.tokens, "us": host_us(fn)})
    where = {"cpu": cpu_name(), "python": platform.python_version(),
             "vllm_bdlora_path": os.path.dirname(vllm_bdlora.__file__)}  # fmt: skip
    path = write_results(args.out, "host_overhead", rows, where)
    with open(path) as f:
        env = {**json.load(f)["environment"], **where}
    text = report(rows, env)
    with open(os.path.join(args.out, "host_overhead.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
