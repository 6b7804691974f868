"""`vllm-bdlora check`: what a server would do with each adapter, from the model's config and the adapter files
alone (no engine, no model weights), in seconds.

    vllm-bdlora check support=/adapters/support legal=/adapters/legal --model M --tensor-parallel-size 4 \\
        --max-lora-rank 128 [--enable-dora]

It runs the server's own checks (`adapter_lifecycle.files`, the NaN/Inf pass, `sharding.localize` on every tensor-
parallel rank, the per-GPU width rule and vLLM's rank limits) over the projections of Llama-family layers (q, k, v, o,
gate, up, down), computing each rank's shard the way vLLM shards them (KV heads replicated when TP exceeds their
number).
Modules it does not model (a fused qkv_proj, embeddings) are named and left to the server. Exit status: 0 every
adapter would be served, 1 some would be refused, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from vllm_bdlora.adapter_lifecycle.files import check_adapter_dir
from vllm_bdlora.adapters import AdapterRejected, adapter_format
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.sharding import ShardingError, foreign_model_problem, localize
from vllm_bdlora.sizing import (
    COLUMN,
    DTYPE_BYTES,
    ROW,
    ModelShape,
    mib,
    slot_cost,
    slots_kept_for_fills,
    slots_that_fit,
)


def module_tensors(path: str) -> dict[str, dict[str, object]]:
    from safetensors.torch import load_file

    modules: dict[str, dict[str, object]] = {}
    for name, tensor in load_file(path).items():
        for part in ("lora_A", "lora_B", "lora_magnitude_vector"):
            if f".{part}" in name:
                module = name.split(f".{part}", 1)[0].removeprefix("base_model.model.")
                modules.setdefault(module, {})[part] = tensor
    return modules


@dataclass(frozen=True)
class Verdict:
    problems: list[str]  # every problem the server would report; empty: it would be served
    summary: str = ""  # what would be served
    widest: int = 0  # the widest module's LoRA width on one GPU
    host_bytes: int = 0  # what each worker keeps of it (the widest rank's share), in the serving dtype
    dense_bytes: int = 0  # the whole adapter with its BD blocks' zeros: what stock vLLM keeps in each worker's cache
    file_bytes: int = 0  # its tensors as PEFT stores them (BD factors without their zeros), in the serving dtype


def check_adapter(name: str, path: str, shape: ModelShape, tp: int, max_lora_rank: int, dora: bool) -> Verdict:
    from vllm_bdlora.adapter_lifecycle.files import module_scaling
    from vllm_bdlora.adapter_lifecycle.read_and_cut import width_problem
    from vllm_bdlora.adapter_lifecycle.values import value_problems
    from vllm_bdlora.compat import allowed_max_lora_ranks

    try:
        files = check_adapter_dir(path, name)
        fmt = adapter_format(files.config, name)
    except AdapterRejected as e:
        return Verdict(e.problems)
    problems = []
    if fmt.dora and not dora:
        problems.append(f"it is a {fmt.describe()} adapter; serve it with --enable-dora")
    r = files.config["r"]
    if r > max_lora_rank:
        problems.append(f"LoRA rank {r} is greater than max_lora_rank {max_lora_rank}")
    width_limit = max_lora_rank // tp
    widths, unmodelled = set(), []
    modules = module_tensors(os.path.join(path, "adapter_model.safetensors"))
    scaled = ((m, t.get("lora_A"), t.get("lora_B"), module_scaling(files.config, m)) for m, t in modules.items())
    non_finite, gains = value_problems(scaled, shape.dtype)
    problems += non_finite or gains
    element = DTYPE_BYTES[shape.dtype_name]
    kept = dense = stored = 0
    for module, tensors in modules.items():
        a, b = tensors.get("lora_A"), tensors.get("lora_B")
        spec = fmt.block_diagonal
        factor = spec.factor_of(module) if spec else None
        nblocks = spec.nblocks if factor else 1
        for part, tensor in tensors.items():
            stored += tensor.numel() * element
            # PEFT stores a BD factor without its zeros: dense, it is nblocks times that
            dense += tensor.numel() * element * (nblocks if factor and part == f"lora_{factor.upper()}" else 1)
        kind = module.rsplit(".", 1)[-1]
        if kind not in COLUMN + ROW:
            unmodelled.append(module)
            kept += sum(t.numel() for t in tensors.values()) * element
            continue
        foreign = foreign_model_problem(a, shape.geometry(kind, tp, 0), factor)
        if foreign:
            problems.append(f"{module}: {foreign}")
            continue
        try:
            widest = max((localize(a, b, shape.geometry(kind, tp, t), factor, nblocks) for t in range(tp)),
                         key=lambda local: local.width)  # fmt: skip
        except ShardingError as e:
            problems.append(f"{module}: {e}")
            continue
        widths.add(widest.width)
        kept += (widest.lora_a.numel() + widest.lora_b.numel()) * element
        if widest.width > width_limit:
            parallelism = "row" if kind in ROW else "column"
            problems.append(width_problem(module, widest, a.shape[0], max_lora_rank, tp, parallelism))
    if max_lora_rank not in allowed_max_lora_ranks():
        problems.append(f"--max-lora-rank {max_lora_rank} is not one vLLM accepts: {list(allowed_max_lora_ranks())}")
    if problems:
        return Verdict(problems)
    summary = f"{fmt.describe()}, r={r}: per-GPU width {'/'.join(map(str, sorted(widths)))} of {width_limit}"
    if unmodelled:
        summary += f"; left to the server: {len(unmodelled)} module(s) this check does not model"
    return Verdict([], summary, max(widths, default=0), kept, dense, stored)


def sizing_lines(verdicts: list[Verdict], shape: ModelShape, tp: int, max_lora_rank: int, dora: bool,
                 vocabulary: bool, gpu_memory: int | None, host_memory: int | None) -> list[str]:  # fmt: skip
    """What the served adapters cost: the smallest --max-lora-rank, a slot's GPU bytes and what each worker keeps,
    against stock vLLM's, and how many fit the given budgets."""
    from vllm_bdlora.adapter_lifecycle.read_and_cut import smallest_max_lora_rank

    served = [v for v in verdicts if not v.problems]
    if not served:
        return []
    lines = []
    fit = smallest_max_lora_rank(max(v.widest for v in served), tp)
    if fit is not None:
        lines.append(f"smallest --max-lora-rank that serves them all at TP={tp}: {fit}")
    if not shape.layers:
        return lines + ["(the model's config.json has no num_hidden_layers: memory not estimated)"]
    bd = slot_cost(shape, max_lora_rank, tp, block_diagonal=True, vocabulary=vocabulary, dora=dora)
    stock = slot_cost(shape, max_lora_rank, tp, block_diagonal=False, vocabulary=vocabulary)
    vocab_note = (f" (projections {mib(bd.projections)}, embeddings and lm_head {mib(bd.vocabulary)}: "
                  "--lora-target-modules without them drops that)") if bd.vocabulary else ""  # fmt: skip
    lines.append(f"GPU memory per LoRA slot (a BD server has one per adapter a step may run, --max-loras, and "
                 f"fill_ahead_slots ({BdLoraSettings.fill_ahead_slots}) more), each of {tp} GPU(s), "
                 f"{shape.dtype_name}, --max-lora-rank {max_lora_rank}: {mib(bd.total)}{vocab_note}; "
                 f"stock vLLM --enable-lora: {mib(stock.total)}")  # fmt: skip
    kept = max(v.host_bytes for v in served)
    whole = max(v.dense_bytes for v in served)
    stored = max(v.file_bytes for v in served)
    share = "its shard's blocks" if tp > 1 else "at TP=1 the whole adapter, a BD one as one dense block"
    lines.append(f"host memory per admitted adapter, on each of {tp} worker(s): up to {mib(kept)} ({share}); stock "
                 f"vLLM keeps the whole adapter, dense, {mib(whole)}, in every worker's --max-cpu-loras cache; the "
                 f"largest adapter's files hold {mib(stored)} ({shape.dtype_name}, BD factors without their "
                 "zeros)")  # fmt: skip
    if gpu_memory is not None:
        slots = slots_that_fit(gpu_memory, bd)
        per_step = slots - slots_kept_for_fills(slots, BdLoraSettings.fill_ahead_slots)
        lines.append(f"{mib(gpu_memory)} of LoRA GPU memory per GPU holds {slots} slot(s): --max-loras {per_step}, "
                     f"the rest for fills ahead (stock vLLM: {slots_that_fit(gpu_memory, stock)} slot(s), "
                     "--max-loras as many)")  # fmt: skip
    if host_memory is not None:
        lines.append(f"{mib(host_memory)} of host memory per worker keeps {host_memory // max(1, kept)} such "
                     f"adapter(s) (stock vLLM: {host_memory // max(1, whole)})")  # fmt: skip
    return lines


def main(argv: list[str]) -> int:
    from vllm_bdlora.config import parse_bytes

    parser = argparse.ArgumentParser(prog="vllm-bdlora check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("adapters", nargs="+", metavar="[NAME=]PATH")
    parser.add_argument("--model", required=True, help="the base model's directory (only config.json is read)")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, dest="tp")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="as given to vllm serve (vLLM's default 16)")
    parser.add_argument("--enable-dora", action="store_true")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                        help="the serving dtype (default: the checkpoint's, as vLLM's 'auto')")  # fmt: skip
    parser.add_argument("--projections-only", action="store_true",
                        help="the server leaves embeddings and lm_head out (--lora-target-modules)")  # fmt: skip
    parser.add_argument("--gpu-memory", metavar="SIZE", default=None,
                        help='LoRA GPU memory per GPU to size --max-loras from, e.g. "4GiB"')  # fmt: skip
    parser.add_argument("--host-memory", metavar="SIZE", default=None,
                        help='host memory per worker for admitted adapters, e.g. "16GiB"')  # fmt: skip
    args = parser.parse_args(argv)
    try:
        shape = ModelShape.from_config(args.model)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        parser.error(f"cannot read {args.model}/config.json ({e})")
    if args.dtype:
        shape = shape.with_dtype(args.dtype)
    try:
        budgets = [parse_bytes(v, flag) if v is not None else None
                   for v, flag in ((args.gpu_memory, "--gpu-memory"), (args.host_memory, "--host-memory"))]  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    refused = 0
    verdicts = []
    for item in args.adapters:
        name, _, path = item.rpartition("=")
        name = name or os.path.basename(os.path.normpath(path))
        if not os.path.exists(path):
            print(f"{name}: REFUSED\n  - {path} does not exist")
            refused += 1
            continue
        verdict = check_adapter(name, path, shape, args.tp, args.max_lora_rank, args.enable_dora)
        verdicts.append(verdict)
        if not verdict.problems:
            print(f"{name}: OK, {verdict.summary}")
            continue
        refused += 1
        print(f"{name}: REFUSED")
        for line in str(AdapterRejected(name, verdict.problems)).splitlines()[1:]:
            print(line)
    for line in sizing_lines(verdicts, shape, args.tp, args.max_lora_rank, args.enable_dora,
                             not args.projections_only, *budgets):  # fmt: skip
        print(line)
    return 1 if refused else 0
