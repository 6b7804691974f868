"""`vllm-bdlora check`: what a server would do with each adapter, from the model's config and the adapter files
alone (no engine, no model weights), in seconds.

    vllm-bdlora check support=/adapters/support legal=/adapters/legal --model M --tensor-parallel-size 4 \\
        --max-lora-rank 128 [--enable-dora]

It runs the server's own checks (`adapter_files`, the NaN/Inf pass, `sharding.localize` on every tensor-parallel
rank, the per-GPU width rule and vLLM's rank limits) over the projections of Llama-family layers (q, k, v, o, gate,
up, down), computing each rank's shard the way vLLM shards them (KV heads replicated when TP exceeds their number).
Modules it does not model (a fused qkv_proj, embeddings) are named and left to the server. Exit status: 0 every
adapter would be served, 1 some would be refused, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from vllm_bdlora.adapter_files import check_adapter_dir
from vllm_bdlora.adapters import AdapterRejected, adapter_format
from vllm_bdlora.sharding import ShardGeometry, ShardingError, foreign_model_problem, localize

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, model_dir: str) -> ModelShape:
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        return cls(c["hidden_size"], c["intermediate_size"], heads, c.get("num_key_value_heads", heads),
                   c.get("head_dim") or c["hidden_size"] // heads)  # fmt: skip

    def geometry(self, kind: str, tp: int, rank: int) -> ShardGeometry:
        """The shard of projection `kind` that TP rank `rank` computes, as vLLM shards it."""
        if kind in ROW:
            size = self.heads * self.head_dim if kind == "o_proj" else self.intermediate
            return ShardGeometry("row", size, self.hidden, ((rank * size // tp, (rank + 1) * size // tp),))
        if kind in ("k_proj", "v_proj"):
            replicas = max(1, tp // self.kv_heads)  # ranks sharing one KV head's rows
            size = self.kv_heads * self.head_dim
            local = size // tp * replicas
            shard = rank // replicas
            return ShardGeometry("column", self.hidden, size, ((shard * local, (shard + 1) * local),))
        size = self.heads * self.head_dim if kind == "q_proj" else self.intermediate
        return ShardGeometry("column", self.hidden, size, ((rank * size // tp, (rank + 1) * size // tp),))


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


def check_adapter(name: str, path: str, shape: ModelShape, tp: int, max_lora_rank: int, dora: bool) -> Verdict:
    from vllm_bdlora.compat import allowed_max_lora_ranks
    from vllm_bdlora.loading import non_finite_problems, width_problem

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
    problems += non_finite_problems((m, t.get("lora_A"), t.get("lora_B")) for m, t in modules.items())
    for module, tensors in modules.items():
        a, b = tensors.get("lora_A"), tensors.get("lora_B")
        kind = module.rsplit(".", 1)[-1]
        if kind not in COLUMN + ROW:
            unmodelled.append(module)
            continue
        spec = fmt.block_diagonal
        factor = spec.factor_of(module) if spec else None
        nblocks = spec.nblocks if factor else 1
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
    return Verdict([], summary)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm-bdlora check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("adapters", nargs="+", metavar="[NAME=]PATH")
    parser.add_argument("--model", required=True, help="the base model's directory (only config.json is read)")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, dest="tp")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="as given to vllm serve (vLLM's default 16)")
    parser.add_argument("--enable-dora", action="store_true")
    args = parser.parse_args(argv)
    try:
        shape = ModelShape.from_config(args.model)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        parser.error(f"cannot read {args.model}/config.json ({e})")
    refused = 0
    for item in args.adapters:
        name, _, path = item.rpartition("=")
        name = name or os.path.basename(os.path.normpath(path))
        if not os.path.exists(path):
            print(f"{name}: REFUSED\n  - {path} does not exist")
            refused += 1
            continue
        verdict = check_adapter(name, path, shape, args.tp, args.max_lora_rank, args.enable_dora)
        if not verdict.problems:
            print(f"{name}: OK, {verdict.summary}")
            continue
        refused += 1
        print(f"{name}: REFUSED")
        for line in str(AdapterRejected(name, verdict.problems)).splitlines()[1:]:
            print(line)
    return 1 if refused else 0
