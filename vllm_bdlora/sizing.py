"""What adapters cost in memory, from a model's config alone: a LoRA slot's bytes on each GPU and an adapter's bytes in
each worker's host memory, for a BD-LoRA server and for stock vLLM, at a tensor-parallel size. `vllm-bdlora check`
prints them, and a server given its LoRA GPU memory in bytes (`lora_gpu_memory`) turns it into `--max-loras`.

A slot is what `--max-loras` counts: every LoRA-wrapped layer keeps one A and one B buffer per slot, as wide as the
server's `--max-lora-rank` allows on each GPU (BD layers: `max_lora_rank / TP`; stock vLLM: `max_lora_rank`, with
column layers' A and row layers' B replicated on every GPU). vLLM also wraps the token embeddings and `lm_head` unless
`--lora-target-modules` leaves them out, whose buffers span the whole vocabulary at the full `--max-lora-rank`.
A host entry is what a worker keeps of one adapter: with BD-LoRA its own share, cut at admission (1/TP of a BD
adapter with nblocks = TP); stock vLLM keeps the whole adapter in every worker's `--max-cpu-loras` cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from vllm_bdlora.sharding import ShardGeometry

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_name: str = "bfloat16"  # what vLLM serves the model in by default ("auto": the checkpoint's dtype)
    layers: int = 0
    vocab: int = 0

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    @classmethod
    def from_config(cls, model_dir: str) -> ModelShape:
        with open(os.path.join(model_dir, "config.json")) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, config: dict) -> ModelShape:
        c = config.get("text_config", config)
        heads = c["num_attention_heads"]
        dtype = str(c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype") or "bfloat16")
        dtype = dtype.removeprefix("torch.")
        dtype = dtype if dtype in DTYPE_BYTES else "bfloat16"
        return cls(c["hidden_size"], c["intermediate_size"], heads, c.get("num_key_value_heads", heads),
                   c.get("head_dim") or c["hidden_size"] // heads, dtype, c.get("num_hidden_layers", 0),
                   c.get("vocab_size", 0))  # fmt: skip

    def with_dtype(self, dtype_name: str) -> ModelShape:
        from dataclasses import replace

        return replace(self, dtype_name=dtype_name)

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


@dataclass(frozen=True)
class SlotCost:
    """Bytes one LoRA slot takes on each GPU."""

    projections: int  # the attention and MLP projections' buffers
    vocabulary: int  # the embeddings' and lm_head's buffers (0 where --lora-target-modules leaves them out)

    @property
    def total(self) -> int:
        return self.projections + self.vocabulary


LAYOUTS = ("bd", "nfs", "slora")  # BD-LoRA; vLLM's default LoRA layers; its fully sharded ones (S-LoRA)


def slot_cost(shape: ModelShape, max_lora_rank: int, tp: int, *, block_diagonal: bool = True, vocabulary: bool = True,
              dora: bool = False, layout: str | None = None) -> SlotCost:  # fmt: skip
    """One slot's bytes per GPU. `layout`: "bd" (a BD-LoRA server, `block_diagonal`), "nfs" (stock vLLM's default
    layers: column A and row B replicated) or "slora" (stock vLLM's --fully-sharded-loras: A sliced by rank on column
    layers, B by output on row layers)."""
    layout = layout or ("bd" if block_diagonal else "nfs")
    r = max_lora_rank
    width = r // tp if layout == "bd" else r
    column_a = r // tp if layout == "slora" else width  # rows of A a column layer keeps per slice
    row_b_out = shape.hidden // tp if layout == "slora" else shape.hidden  # rows of B a row layer keeps
    h, i_local = shape.hidden, shape.intermediate // tp
    q_local = shape.heads * shape.head_dim // tp
    kv_local = max(1, shape.kv_heads // tp) * shape.head_dim
    qkv_out = q_local + 2 * kv_local
    per_layer = (
        3 * column_a * h
        + qkv_out * width  # q, k, v: A (one per slice), B of this GPU's rows
        + width * q_local
        + row_b_out * width  # o_proj: A of this GPU's input columns, B
        + 2 * column_a * h
        + 2 * i_local * width  # gate, up
        + width * i_local
        + row_b_out * width  # down_proj
    )
    element = DTYPE_BYTES[shape.dtype_name]
    projections = per_layer * shape.layers * element
    if dora and layout == "bd":
        projections += (qkv_out + h + 2 * i_local + h) * shape.layers * 4  # a float32 scale per output channel
    vocab = 0
    if vocabulary and shape.vocab:
        # VocabParallelEmbeddingWithLoRA: A (vocab, rank), B (hidden, rank); LogitsProcessorWithLoRA: A (rank,
        # hidden), B (vocab, rank): whole, at the full --max-lora-rank, on every GPU
        vocab = (shape.vocab * r + h * r) * 2 * element
    return SlotCost(projections, vocab)


def slots_that_fit(budget_bytes: int, cost: SlotCost) -> int:
    return max(0, budget_bytes // max(1, cost.total))


def slots_kept_for_fills(slots: int, spare: int) -> int:
    """Of `slots` that fit a budget, those kept for fills ahead (`fill_ahead_slots`: `spare`), where the budget holds
    at least one slot more; --max-loras is the rest."""
    return max(0, min(spare, slots - 1))


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
