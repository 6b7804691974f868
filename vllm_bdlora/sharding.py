"""Which part of a (BD-)LoRA adapter each tensor-parallel rank holds. Pure tensor rules, no vLLM.

Layouts, as PEFT stores them (r is the adapter's full rank, N = nblocks):

* standard module:   A (r, in),   B (out, r)
* block-diagonal A:  A (r, in/N): N blocks of (r/N, in/N) stacked along dim 0; B (out, r)
* block-diagonal B:  A (r, in);   B (out, r/N): N blocks of (out/N, r/N) stacked along dim 0

Block k of a block-diagonal factor joins rank columns [k·r/N, (k+1)·r/N) to input columns (BD-A) or
output rows (BD-B) [k·d/N, (k+1)·d/N). The dense equivalent is `torch.block_diag(*w.chunk(N, 0))`.

A rank of a column-parallel layer owns some output rows; a rank of a row-parallel layer owns some input
columns. It needs exactly the blocks that touch what it owns, and from each of those blocks r/N rank
columns. `localize` builds the rank's own dense (A, B) from those blocks alone, so with N a multiple of
TP and blocks aligned to shards (the BD-LoRA design) each rank holds an independent rank r/TP adapter
of its own shard: column layers need no all-gather, and row layers add their partial product into the
base layer's partial sum before its existing all-reduce. A standard module is the N = 1 case: column
ranks replicate A and take their rows of B, row ranks take their columns of A and replicate B, which
is vLLM's default (communication-free) sharding.

A factor that is block-diagonal on the "wrong" side for the layer (BD-A on a column layer, BD-B on a
row layer) is densified first: still exact and communication-free, but without the width saving, so
the per-rank width check usually refuses it at TP > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Parallelism = Literal["column", "row"]


class ShardingError(ValueError):
    """The adapter's tensors do not fit the layer they target."""


@dataclass(frozen=True)
class ShardGeometry:
    """One LoRA-adapted projection as seen by one tensor-parallel rank."""

    parallelism: Parallelism
    input_size: int
    output_size: int
    # Half-open global index ranges this rank computes: output rows (column) or input columns (row).
    owned: tuple[tuple[int, int], ...]

    def owned_indices(self) -> torch.Tensor:
        return torch.cat([torch.arange(start, stop) for start, stop in self.owned])


@dataclass(frozen=True)
class LocalFactors:
    lora_a: torch.Tensor  # (width, local input)
    lora_b: torch.Tensor  # (local output, width)
    blocks: tuple[int, ...]  # the adapter blocks this rank holds
    nblocks: int

    @property
    def width(self) -> int:
        return self.lora_a.shape[0]


def localize_magnitude(magnitude: torch.Tensor, geometry: ShardGeometry) -> torch.Tensor:
    """This rank's entries of a per-output-channel vector (a DoRA magnitude): the owned rows of a
    column-parallel projection, all of a row-parallel one (its output is not sharded)."""
    if geometry.parallelism == "row":
        return magnitude
    return magnitude.index_select(0, geometry.owned_indices())


def densify(weight: torch.Tensor, nblocks: int) -> torch.Tensor:
    """The dense matrix of a block-diagonal factor stored without zeros."""
    return torch.block_diag(*weight.chunk(nblocks, dim=0))


def per_rank_width(max_lora_rank: int, tp_size: int) -> int:
    """Width of each rank's stacked LoRA buffers: what a BD adapter of rank `max_lora_rank` needs."""
    if max_lora_rank % tp_size:
        raise ValueError(
            f"--max-lora-rank {max_lora_rank} is not divisible by --tensor-parallel-size {tp_size}: "
            "with --enable-bdlora each GPU holds max_lora_rank/TP LoRA columns. Choose a multiple of the TP size."
        )
    return max_lora_rank // tp_size


def foreign_model_problem(lora_a, geometry: ShardGeometry, factor: str | None) -> str | None:
    """An adapter whose LoRA-A does not take this layer's input size was trained on another base model: say so,
    rather than report the divisibility and shape errors that follow from it. (A block-diagonal A stores a
    fraction of the input per block; its shapes are checked in full by `localize`.)"""
    if factor == "a" or lora_a is None or lora_a.ndim != 2 or lora_a.shape[1] == geometry.input_size:
        return None
    return (
        f"made for another base model: lora_A takes {lora_a.shape[1]} inputs, this model's layer takes "
        f"{geometry.input_size}"
    )


def _check_shapes(
    lora_a: torch.Tensor, lora_b: torch.Tensor, geometry: ShardGeometry, factor: str | None, nblocks: int
) -> None:
    if lora_a is None or lora_b is None:
        raise ShardingError("the adapter has only one of lora_A / lora_B for this module")
    if lora_a.ndim != 2 or lora_b.ndim != 2:
        raise ShardingError(f"lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)} must be matrices")
    d_in, d_out, r = geometry.input_size, geometry.output_size, lora_a.shape[0]
    n = nblocks if factor else 1
    problems = [
        f"{name}={size} is not divisible by nblocks={n}"
        for name, size in (("r", r), ("in_features", d_in), ("out_features", d_out))
        if size % n and (name == "r" or (name == "in_features") == (factor == "a"))
    ]
    if problems:
        raise ShardingError("; ".join(problems))
    expected_a = (r, d_in // n if factor == "a" else d_in)
    expected_b = (d_out, r // n if factor == "b" else r)
    kind = {
        None: "a standard LoRA module",
        "a": f"a block-diagonal LoRA-A (nblocks={n})",
        "b": f"a block-diagonal LoRA-B (nblocks={n})",
    }[factor]
    if tuple(lora_a.shape) != expected_a or tuple(lora_b.shape) != expected_b:
        raise ShardingError(
            f"expected lora_A {expected_a} and lora_B {expected_b} for {kind} with r={r} on a layer with "
            f"in_features={d_in}, out_features={d_out}; got lora_A {tuple(lora_a.shape)}, lora_B {tuple(lora_b.shape)}"
        )


def owned_pieces(owned: tuple[tuple[int, int], ...], span: int) -> tuple[list[tuple[int, int, int, int]], int]:
    """The owned ranges split at block boundaries (blocks `span` wide): (block, start, stop, local offset) per piece,
    and how many indices are owned in all."""
    pieces, offset = [], 0
    for start, stop in owned:
        while start < stop:
            block = start // span
            end = min(stop, (block + 1) * span)
            pieces.append((block, start, end, offset))
            offset += end - start
            start = end
    return pieces, offset


def _joined(tensors: list[torch.Tensor], dim: int, copy: bool) -> torch.Tensor:
    """`tensors` joined along `dim`: a new contiguous tensor, or where `copy` is False and there is one, that one
    itself (a view of the adapter's mapped file, which the caller copies before the file may change)."""
    if len(tensors) == 1:
        return tensors[0].clone(memory_format=torch.contiguous_format) if copy else tensors[0]
    return torch.cat(tensors, dim)


def localize(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    geometry: ShardGeometry,
    factor: Literal["a", "b"] | None = None,
    nblocks: int = 1,
    copy: bool = True,
) -> LocalFactors:
    """This rank's dense (A, B) for one module, built only from the blocks that touch its shard. Each piece of the
    shard lies in one block, so the cut is slices of the stored factors (an admission cuts a few hundred modules).
    `copy`: new tensors; else a factor that is one slice of the stored one is that slice (a view), for a caller that
    copies it straight to where it is served."""
    _check_shapes(lora_a, lora_b, geometry, factor, nblocks)
    if geometry.parallelism == "column" and factor == "a":
        lora_a, factor = densify(lora_a, nblocks), None
    elif geometry.parallelism == "row" and factor == "b":
        lora_b, factor = densify(lora_b, nblocks), None
    n = nblocks if factor else 1
    rank_per_block = lora_a.shape[0] // n
    span = (geometry.output_size if geometry.parallelism == "column" else geometry.input_size) // n
    pieces, owned = owned_pieces(geometry.owned, span)
    blocks = sorted({block for block, *_ in pieces})
    # Local rank column j*rank_per_block + i holds rank column k*rank_per_block + i of block k = blocks[j].
    position = {block: j for j, block in enumerate(blocks)}
    width = len(blocks) * rank_per_block

    def rank_columns(block: int) -> slice:
        return slice(block * rank_per_block, (block + 1) * rank_per_block)

    def local_columns(block: int) -> slice:
        return rank_columns(position[block])

    if geometry.parallelism == "column":
        # A (r, in) is dense: keep the rank rows of the touched blocks. B's rows are block-local already
        # (rank_per_block columns each).
        local_a = _joined([lora_a[rank_columns(block)] for block in blocks], 0, copy)
        if len(blocks) == 1:
            local_b = _joined([lora_b[start:stop] for _, start, stop, _ in pieces], 0, copy)
        else:
            local_b = lora_b.new_zeros(owned, width)
            for block, start, stop, offset in pieces:
                local_b[offset : offset + stop - start, local_columns(block)] = lora_b[start:stop]
    else:
        # B (out, r) is dense: keep the rank columns of the touched blocks. A's columns are block-local.
        local_b = _joined([lora_b[:, rank_columns(block)] for block in blocks], 1, copy)
        if len(blocks) == 1:
            local_a = _joined([lora_a[rank_columns(block), start - block * span : stop - block * span]
                               for block, start, stop, _ in pieces], 1, copy)  # fmt: skip
        else:
            local_a = lora_a.new_zeros(width, owned)
            for block, start, stop, offset in pieces:
                source = lora_a[rank_columns(block), start - block * span : stop - block * span]
                local_a[local_columns(block), offset : offset + stop - start] = source
    return LocalFactors(local_a, local_b, tuple(blocks), n)
