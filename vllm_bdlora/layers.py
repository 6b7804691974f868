"""vLLM LoRA layer classes for BD-LoRA serving.

Each class is vLLM's default (not fully sharded) LoRA layer with two changes:

* its stacked buffers are `max_lora_rank / TP` wide (what a BD adapter needs per rank) instead of
  `max_lora_rank`; vLLM's shrink/expand kernels work over the whole buffer width, so a full-width buffer
  would hand back the compute BD-LoRA saves;
* `set_lora` receives tensors that were already cut to this rank's share at adapter load
  (`vllm_bdlora.adapter_lifecycle.read_and_cut`), so it only checks and copies them.

The forward pass is vLLM's own: column layers add `B_t(A_t x)` to their output shard, row layers add
their partial LoRA product before the base layer's all-reduce. No collective is added anywhere.

The classes only claim layers while a BD-enabled LoRA manager is being built (`selecting_bd_layers`),
so one process can hold a BD engine and a stock engine one after another.

DoRA (`--enable-dora`): each layer also holds a float32 magnitude scale g per LoRA slot and output
channel (1 for plain LoRA adapters and empty slots). The LoRA product then goes to its own buffer and
`torch.ops.vllm_bdlora.dora_compose_` forms `base + (g-1)·(base - bias) + g·lora` per token with that
token's slot (vllm_bdlora.kernels.dora_compose). The compose is linear in (base, lora), so row-parallel
layers apply it to their partial sums before the all-reduce: still no added collective per token.

Fused kernels (`lora_kernels` "auto", the default: on CUDA; "fused": everywhere, the CPU through the torch
reference; "vllm": never): all slices' A and B live in one
buffer each (vLLM sees per-slice views), and one shrink and one fused expand
(vllm_bdlora.kernels.lora_op) add the LoRA delta, or form the DoRA compose, for the whole packed layer,
routed by the token grouping vLLM's punica wrapper builds once per step. With an unquantized base the op
runs the base GEMM as well: for large batches of packed layers the expand writes the delta first and cuBLAS
accumulates the GEMM onto it, so the output is not re-read by a pass of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ClassVar

import torch
from vllm.lora.layers import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.platforms import current_platform

import vllm_bdlora.kernels.dora_compose  # noqa: F401  (registers torch.ops.vllm_bdlora.dora_compose_)
from vllm_bdlora.adapter_lifecycle.fill_ahead import adapters_per_step
from vllm_bdlora.compat import token_groups
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.kernels.lora_op import layer_decode_state  # also registers torch.ops.vllm_bdlora.fused_lora_slices_
from vllm_bdlora.kernels.plans import cuda_table, measured_mixed_width
from vllm_bdlora.sharding import Parallelism, ShardGeometry, per_rank_width

# The settings of the BD-enabled LoRA manager being built, while `selecting_bd_layers` runs: vLLM builds layer
# classes from `can_replace_layer` and `create_lora_weights` alone, so this is how they reach each layer, which keeps
# them as `self.settings`. Outside it no BD layer is created.
_building: ContextVar[BdLoraSettings | None] = ContextVar("bdlora_layer_settings", default=None)


def uses_fused_kernels(lora_kernels: str) -> bool:
    """Whether BD layers run vllm-bdlora's fused kernels under this `lora_kernels` setting: "fused" always,
    "auto" on CUDA (elsewhere the op would run its torch reference, slower than vLLM's CPU LoRA ops)."""
    return lora_kernels == "fused" or (lora_kernels == "auto" and current_platform.is_cuda())


@contextmanager
def selecting_bd_layers(settings: BdLoraSettings) -> Iterator[None]:
    """BD layer classes claim the layers of the manager built inside, and each keeps `settings`."""
    token = _building.set(settings)
    try:
        yield
    finally:
        _building.reset(token)


def _shard_range(shard_id: int, shard_size: int, offset: int = 0) -> tuple[int, int]:
    return offset + shard_id * shard_size, offset + (shard_id + 1) * shard_size


class BlockDiagonalLoRALayer:
    """Mixin placed before a vLLM LoRA layer class; see the module docstring."""

    parallelism: ClassVar[Parallelism]
    layer_kind: ClassVar[str]
    vllm_class: ClassVar[type]
    lora_width: int
    slot_arena = None  # the manager's SlotArena, once it holds this layer's slots (fused kernels only)
    plan_slots = 0  # the slots one batch may use (create_lora_weights); 0: every slot

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None, **kwargs) -> bool:
        return _building.get() is not None and cls.vllm_class.can_replace_layer(
            source_layer=source_layer,
            lora_config=lora_config,
            packed_modules_list=packed_modules_list,
            model_config=model_config,
        )

    # --- geometry: which rows/columns of each adapted projection this rank computes -------------
    def shard_geometry(self, slice_index: int) -> ShardGeometry:
        raise NotImplementedError

    def lora_output_heights(self) -> tuple[int, ...]:
        return (self.output_size,)

    def base_quantization(self) -> str | None:
        """The name of the base layer's quantization method, or None for an unquantized base."""
        method = getattr(self.base_layer, "quant_method", None)
        if method is None or isinstance(method, UnquantizedLinearMethod):
            return None
        return type(method).__name__

    def base_weight_rows(self, slice_index: int) -> torch.Tensor | ProbedWeight:
        """This rank's base weight rows of one output slice (what DoRA's norm is taken over): the weight
        itself when the layer keeps it as a plain unquantized matrix, else the effective (dequantized) weight
        read through the layer's own GEMM. A quantized layer's `weight` is its storage, not W: FP8 keeps it
        transposed with its scales apart, which a square layer's shape does not reveal."""
        offset = self.slice_offsets[slice_index]
        rows = slice(offset, offset + self.output_slices[slice_index])
        weight = self._base_weight_matrix()
        if weight is not None and weight.is_floating_point() and self.base_quantization() is None:
            return weight[rows]
        return ProbedWeight(self.base_layer, self.input_size, rows, self.device)

    def base_weight_unreadable(self) -> str | None:
        """Why the effective weight cannot be read exactly through the layer's GEMM, or None. Identity rows
        pass through dynamic activation quantization exactly (each row's largest entry, 1, maps to the format's
        largest value); a static activation scale quantizes them inexactly."""
        if isinstance(getattr(self.base_layer, "input_scale", None), torch.Tensor):
            return "static activation scale"
        return None

    def _base_weight_matrix(self) -> torch.Tensor | None:
        """The base layer's `weight` if it is still this rank's (out, in) matrix (vLLM's CPU backend and
        some quantization methods replace it with a packed form)."""
        weight = getattr(self.base_layer, "weight", None)
        if weight is not None and tuple(weight.shape) == (sum(self.output_slices), self.input_size):
            return weight
        return None

    # --- buffers -------------------------------------------------------------------------------------
    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        self.settings: BdLoraSettings = _building.get() or BdLoraSettings(enabled=True)
        self.lora_config = lora_config
        dora = self.settings.dora
        self.lora_width = per_rank_width(lora_config.max_lora_rank, self.tp_size)
        heights = self.lora_output_heights()

        def zeros(*shape):
            return torch.zeros(max_loras, *shape, dtype=lora_config.lora_dtype, device=self.device)

        self.output_slices = heights
        # Where each output slice starts in the layer's (local) output columns.
        self.slice_offsets = tuple(sum(heights[:i]) for i in range(len(heights)))
        self.fused_kernels = uses_fused_kernels(self.settings.lora_kernels)
        width = self.lora_width
        # Per slice and slot, the width an adapter really uses: the fused kernels stop there. Only they
        # read it, so other layers skip its per-load device writes.
        self.slot_widths: torch.Tensor | None = None
        if self.fused_kernels:
            # One A and one B buffer for all slices, so one launch serves the packed layer; vLLM (and
            # set_lora) see per-slice views of them. The manager then moves them into its slot arena.
            widths = torch.zeros(len(heights), max_loras, dtype=torch.int32, device=self.device)
            self.bind_slot_buffers(zeros(len(heights) * width, self.input_size), zeros(sum(heights), width), widths)
            self.slice_bounds = torch.tensor([*self.slice_offsets, sum(heights)], dtype=torch.int32, device=self.device)
        else:
            self.lora_a_stacked = tuple(zeros(1, width, self.input_size) for _ in heights)
            self.lora_b_stacked = tuple(zeros(1, height, width) for height in heights)
        # Barrier and S buffers of the one-launch decode kernel (DoRA layers compose on the base output, which
        # that kernel never materialises, so they keep the three-kernel path).
        self.decode_state: torch.Tensor | None = None
        # the slots one batch may use: the adapters a step may run, fewer than the slots where some are kept for
        # fills ahead (the kernels' plans and mixed-adapter limits are chosen for it)
        self.plan_slots = min(max_loras, adapters_per_step(lora_config))
        table = cuda_table(self.device) if self.plan_slots > 1 else None  # None off CUDA
        measured = table.measured_rows(sum(heights), self.input_size, len(heights) * width) if table else None
        self.one_launch_mixed_width = measured_mixed_width(measured, self.settings.one_launch_max_mixed_width,
                                                           self.settings.one_launch_max_adapters, width,
                                                           self.plan_slots)  # fmt: skip
        if self.fused_kernels and self.settings.one_launch_decode and not dora:
            self.decode_state = layer_decode_state(sum(heights), self.input_size, len(heights) * width,
                                                   self.plan_slots, self.device, len(heights),
                                                   self.one_launch_mixed_width)  # fmt: skip
        self.dora_scale: torch.Tensor | None = None
        if dora:
            self.dora_scale = torch.ones(max_loras, sum(heights), dtype=torch.float32, device=self.device)
        if dora or self.fused_kernels:
            # vLLM's optional side-stream LoRA path bypasses _apply_sync, where both happen.
            self._enable_aux_cuda_stream = False

    def bind_slot_buffers(
        self, lora_a_all: torch.Tensor, lora_b_all: torch.Tensor, slot_widths: torch.Tensor, arena=None
    ) -> None:
        """Hold the packed layer's factors in `lora_a_all` (slots, slices x width, in) and `lora_b_all` (slots,
        height, width), its widths in `slot_widths` (slices, slots), and derive vLLM's per-slice views. `arena`:
        the manager's `vllm_bdlora.slot_arena.SlotArena` these are views of, which may fill whole slots."""
        width = lora_b_all.shape[2]
        self.lora_a_all, self.lora_b_all, self.slot_widths, self.slot_arena = lora_a_all, lora_b_all, slot_widths, arena
        slices = len(self.output_slices)
        self.lora_a_stacked = tuple(lora_a_all[:, None, i * width : (i + 1) * width] for i in range(slices))
        self.lora_b_stacked = tuple(
            lora_b_all[:, None, offset : offset + height]
            for offset, height in zip(self.slice_offsets, self.output_slices, strict=True)
        )

    def _arena_fills_slot(self) -> bool:
        """Whether the slot arena is copying a whole slot (every layer's share at once) in place of this call."""
        return self.slot_arena is not None and self.slot_arena.filling_whole_slots

    def reset_lora(self, index: int) -> None:
        if self._arena_fills_slot():
            return
        if self.slot_widths is not None:
            # The fused kernels read nothing of a slot whose widths are 0, so its stale factors can stay: one
            # write, rather than a zero fill per factor and slice inside the step that empties the slot.
            self.slot_widths[:, index] = 0
        else:
            super().reset_lora(index)
        if self.dora_scale is not None:
            self.dora_scale[index].fill_(1.0)

    def set_dora_scale(self, index: int, scales: Sequence[torch.Tensor | None]) -> None:
        """Magnitude scale g of the adapter in slot `index`, one tensor (this rank's rows) per output
        slice; None leaves a slice at 1 (no DoRA)."""
        assert self.dora_scale is not None, "DoRA is not enabled on this layer"
        for offset, height, scale in zip(self.slice_offsets, self.output_slices, scales, strict=True):
            if scale is not None:
                self.dora_scale[index, offset : offset + height].copy_(scale, non_blocking=True)

    def _apply_sync(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused_kernels:
            return self._apply_fused(x, bias)
        if self.dora_scale is None:
            return super()._apply_sync(x, bias)
        if x.ndim != 2:
            raise NotImplementedError("vllm-bdlora DoRA layers take 2-D (tokens, features) inputs")
        output = self._get_quant_method().apply(self.base_layer, x, bias)
        lora = torch.zeros_like(output)
        returned = self.punica_wrapper.add_lora_linear(
            lora, x, self.lora_a_stacked, self.lora_b_stacked, 1.0, self.output_slices
        )
        if not current_platform.can_update_inplace():
            lora = returned
        token_slots = self.punica_wrapper._token_lora_indices[: x.shape[0]]
        torch.ops.vllm_bdlora.dora_compose_(output, lora, self.dora_scale, token_slots, bias)
        return output

    def _apply_fused(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One shrink and one fused expand (LoRA add or DoRA compose) for all slices; for an unquantized
        base the op runs the base GEMM too (before the expand, or after it: `delta_then_gemm`)."""
        weight = self._plain_weight(x.dtype)
        if weight is None:
            output = self._get_quant_method().apply(self.base_layer, x, bias)
        else:
            output = x.new_empty(*x.shape[:-1], weight.shape[0])
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), output.view(-1, output.shape[-1])
        torch.ops.vllm_bdlora.fused_lora_slices_(
            flat_out,
            flat_x,
            self.lora_a_all,
            self.lora_b_all,
            self.slot_widths,
            self.slice_bounds,
            self.punica_wrapper._token_lora_indices,
            *token_groups(self.punica_wrapper),
            self.dora_scale,
            bias,
            weight,
            self.decode_state,
            self.settings.one_launch_max_tokens,
            self.one_launch_mixed_width,
            self.plan_slots,
        )
        return output

    def _plain_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The base weight when the base layer computes exactly x·Wᵀ (+ bias) with it: vLLM's own
        unquantized method (not a subclass that may compute otherwise), and the weight still the (out, in)
        matrix in the activations' dtype, rows contiguous."""
        weight = self._base_weight_matrix()
        if (
            type(self._get_quant_method()) is UnquantizedLinearMethod
            and weight is not None
            and weight.dtype == dtype
            and weight.stride(-1) == 1
        ):
            return weight
        return None

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        """Copy an adapter's factors into slot `index`. vLLM calls this inside the step that first needs the
        adapter, so every device operation here delays that step's running requests: on the fused path a slot
        fill is two copies per slice and one write of the slot's widths (vLLM's own layers zero the whole slot
        first, two more operations per slice), and an adapter kept as a slot image skips it altogether: the slot
        arena copies the whole slot, every layer at once (`vllm_bdlora.slot_arena`)."""
        if self._arena_fills_slot():
            return
        lora_a = lora_a if isinstance(lora_a, (list, tuple)) else [lora_a]
        lora_b = lora_b if isinstance(lora_b, (list, tuple)) else [lora_b]
        if len(lora_a) != self.n_slices or len(lora_b) != self.n_slices:
            raise RuntimeError(
                f"{type(self).__name__} got {len(lora_b)} LoRA slice(s) for a layer of {self.n_slices} slices."
            )
        if self.slot_widths is None:
            self.reset_lora(index)
        elif self.dora_scale is not None:
            self.dora_scale[index].fill_(1.0)  # slices without a magnitude vector compose with g = 1
        widths = [0] * self.n_slices
        for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
            if a is None or b is None:
                continue
            a, b = self._fit_local(i, a, b)
            width = widths[i] = a.shape[0]
            self.lora_a_stacked[i][index, 0, :width, :].copy_(a, non_blocking=True)
            self.lora_b_stacked[i][index, 0, :, :width].copy_(b, non_blocking=True)
            if self.slot_widths is not None and width < self.lora_width:
                # The fused expand multiplies B's columns past the width by zeros (it loads whole tiles of B):
                # they must hold finite values, so a narrower adapter clears what an earlier one left there.
                self.lora_a_stacked[i][index, 0, width:, :].zero_()
                self.lora_b_stacked[i][index, 0, :, width:].zero_()
        if self.slot_widths is not None:
            # One copy of the slot's widths, after its factors: a pageable source is staged before copy_
            # returns, so a later fill cannot change what this one writes.
            self.slot_widths[:, index].copy_(torch.tensor(widths, dtype=torch.int32), non_blocking=True)

    def _fit_local(self, i: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        height = self.output_slices[i]
        if a.shape[1] != self.input_size or b.shape[0] != height or a.shape[0] != b.shape[1]:
            raise RuntimeError(
                f"{type(self).__name__}: LoRA tensors A {tuple(a.shape)}, B {tuple(b.shape)} are not this "
                f"rank's share (expected A (<= {self.lora_width}, {self.input_size}), B ({height}, <= "
                f"{self.lora_width})); adapters must be loaded through vllm_bdlora.adapter_lifecycle.read_and_cut."
            )
        if a.shape[0] > self.lora_width:
            # Only vLLM's warm-up adapters (all zeros, rank 8) get here: real adapters are width-checked
            # at load. Dropping zero columns is exact.
            if a.any() or b.any():
                raise RuntimeError(
                    f"{type(self).__name__}: a rank-{a.shape[0]} adapter does not fit the per-GPU LoRA width "
                    f"{self.lora_width}."
                )
            a, b = a[: self.lora_width], b[:, : self.lora_width]
        return a, b


class BlockDiagonalColumnParallelLinearWithLoRA(BlockDiagonalLoRALayer, ColumnParallelLinearWithLoRA):
    """One column-parallel projection, or a merged one loaded from a single adapter module."""

    parallelism = "column"
    layer_kind = "column-parallel"
    vllm_class = ColumnParallelLinearWithLoRA

    def shard_geometry(self, slice_index: int) -> ShardGeometry:
        base = self.base_layer
        sizes = list(getattr(base, "output_sizes", None) or [base.output_size])
        owned, offset = [], 0
        for size in sizes:
            owned.append(_shard_range(self.tp_rank, size // self.tp_size, offset))
            offset += size
        return ShardGeometry("column", base.input_size, offset, tuple(owned))


class BlockDiagonalMergedColumnParallelLinearWithLoRA(BlockDiagonalLoRALayer, MergedColumnParallelLinearWithLoRA):
    """Packed column projections with one adapter module each, e.g. gate_proj + up_proj."""

    parallelism = "column"
    layer_kind = "merged column-parallel (e.g. gate_up_proj)"
    vllm_class = MergedColumnParallelLinearWithLoRA

    def lora_output_heights(self) -> tuple[int, ...]:
        return tuple(self.output_slices)

    def shard_geometry(self, slice_index: int) -> ShardGeometry:
        size = self.base_layer.output_sizes[slice_index]
        owned = _shard_range(self.tp_rank, size // self.tp_size)
        return ShardGeometry("column", self.base_layer.input_size, size, (owned,))


def _qkv_geometry(layer) -> Sequence[tuple[int, tuple[int, int]]]:
    """(full size, owned global range) of the q, k and v projections for this rank. With TP greater
    than the number of KV heads vLLM replicates KV heads, so several ranks own the same k/v rows."""
    base = layer.base_layer
    kv_shard_id = layer.tp_rank // base.num_kv_head_replicas
    q_local, k_local = base.num_heads * base.head_size, base.num_kv_heads * base.head_size
    v_local = base.num_kv_heads * base.v_head_size
    return (
        (base.total_num_heads * base.head_size, _shard_range(layer.tp_rank, q_local)),
        (base.total_num_kv_heads * base.head_size, _shard_range(kv_shard_id, k_local)),
        (base.total_num_kv_heads * base.v_head_size, _shard_range(kv_shard_id, v_local)),
    )


class BlockDiagonalQKVParallelLinearWithLoRA(BlockDiagonalLoRALayer, QKVParallelLinearWithLoRA):
    """A fused qkv projection loaded from a single adapter module."""

    parallelism = "column"
    layer_kind = "qkv (one adapter module)"
    vllm_class = QKVParallelLinearWithLoRA

    def shard_geometry(self, slice_index: int) -> ShardGeometry:
        owned, offset = [], 0
        for size, (start, stop) in _qkv_geometry(self):
            owned.append((offset + start, offset + stop))
            offset += size
        return ShardGeometry("column", self.base_layer.input_size, offset, tuple(owned))


class BlockDiagonalMergedQKVParallelLinearWithLoRA(BlockDiagonalLoRALayer, MergedQKVParallelLinearWithLoRA):
    """q_proj, k_proj and v_proj packed into one qkv_proj."""

    parallelism = "column"
    layer_kind = "packed qkv (q_proj, k_proj, v_proj)"
    vllm_class = MergedQKVParallelLinearWithLoRA

    def lora_output_heights(self) -> tuple[int, ...]:
        return tuple(self.output_slices)

    def shard_geometry(self, slice_index: int) -> ShardGeometry:
        size, owned = _qkv_geometry(self)[slice_index]
        return ShardGeometry("column", self.base_layer.input_size, size, (owned,))


class BlockDiagonalRowParallelLinearWithLoRA(BlockDiagonalLoRALayer, RowParallelLinearWithLoRA):
    """o_proj, down_proj: the LoRA partial product joins the base layer's partial sum before its
    all-reduce."""

    parallelism = "row"
    layer_kind = "row-parallel (e.g. o_proj, down_proj)"
    vllm_class = RowParallelLinearWithLoRA

    def shard_geometry(self, slice_index: int) -> ShardGeometry:
        base = self.base_layer
        owned = _shard_range(self.tp_rank, base.input_size_per_partition)
        return ShardGeometry("row", base.input_size, base.output_size, (owned,))


class ProbedWeight:
    """Column blocks of a base layer's effective weight W (out, in), read by running the layer's own GEMM
    on identity rows: apply(I[c0:c1]) = I[c0:c1]·Wᵀ = W[:, c0:c1]ᵀ, exact for an unquantized layer.

    vLLM's CPU backend repacks linear weights for oneDNN and drops `weight`; quantized layers store it
    packed. Only `shape`, `device` and `[:, c0:c1]` are provided: what `vllm_bdlora.dora.squared_row_norms`
    reads, one chunk at a time.
    """

    def __init__(self, base_layer, in_features: int, rows: slice, device):
        self.base_layer, self.rows, self.device = base_layer, rows, device
        self.shape = (rows.stop - rows.start, in_features)
        self.dtype = getattr(base_layer, "params_dtype", torch.float32)

    def __getitem__(self, index) -> torch.Tensor:
        everything, columns = index
        assert everything == slice(None) and columns.step is None, "ProbedWeight supports [:, start:stop] only"
        start, stop = columns.start or 0, min(columns.stop, self.shape[1])
        probe = torch.zeros(stop - start, self.shape[1], dtype=self.dtype, device=self.device)
        probe[:, start:stop].fill_diagonal_(1.0)
        with torch.no_grad():
            transposed = self.base_layer.quant_method.apply(self.base_layer, probe, None)
        return transposed[:, self.rows].T


# Most specific first, in vLLM's own order for the classes they extend.
BD_LAYER_CLASSES: tuple[type[BlockDiagonalLoRALayer], ...] = (
    BlockDiagonalColumnParallelLinearWithLoRA,
    BlockDiagonalMergedColumnParallelLinearWithLoRA,
    BlockDiagonalQKVParallelLinearWithLoRA,
    BlockDiagonalMergedQKVParallelLinearWithLoRA,
    BlockDiagonalRowParallelLinearWithLoRA,
)

_SHARDING_STORY = {
    "column": "LoRA-A rows of this GPU's blocks + its own LoRA-B block (standard adapters: replicated A, "
    "B rows of the shard); no all-gather",
    "row": "its own LoRA-A block (input shard) + LoRA-B columns of its blocks (standard adapters: A "
    "columns of the shard, replicated B); partial product rides the base all-reduce",
}


def describe_sharding(layers: Sequence[object], tp_size: int) -> list[str]:
    """One line per BD layer kind and one for what the LoRA slots cost, for the start-up log (none without BD
    layers)."""
    bd_layers = [layer for layer in layers if isinstance(layer, BlockDiagonalLoRALayer)]
    counts = Counter(type(layer) for layer in bd_layers)
    lines = []
    for cls in BD_LAYER_CLASSES:
        if counts[cls]:
            layer = next(la for la in bd_layers if type(la) is cls)
            lines.append(
                f"BD-LoRA {cls.layer_kind}: {counts[cls]} layer(s), TP={tp_size}, per-GPU LoRA width "
                f"{layer.lora_width} (max_lora_rank {layer.lora_config.max_lora_rank} / {tp_size}); each GPU holds "
                f"{_SHARDING_STORY[cls.parallelism]}."
            )
    return lines


def lora_buffer_nbytes(layer) -> int:
    """Device bytes of every per-slot buffer a LoRA layer holds (A, B, and a BD layer's DoRA scales), all slots."""
    total = 0
    for attribute in ("lora_a_stacked", "lora_b_stacked", "dora_scale"):
        value = getattr(layer, attribute, None)
        for tensor in (value,) if isinstance(value, torch.Tensor) else value or ():
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def describe_slots(layers: Sequence[object], max_loras: int, on_gpu: bool, per_step: int | None = None) -> str:
    """The start-up log's line on what the LoRA slots cost: every LoRA layer's buffers (BD layers, and vLLM's own,
    e.g. the embeddings and lm_head), per slot and in all, per GPU (per worker on the CPU backend). `per_step`: the
    adapters one step may run, where the slots (`max_loras`) include some for fills ahead."""
    total = sum(lora_buffer_nbytes(layer) for layer in layers)
    bd = sum(lora_buffer_nbytes(layer) for layer in layers if isinstance(layer, BlockDiagonalLoRALayer))
    per, where = max(1, max_loras), "GPU" if on_gpu else "worker"
    # Sizing --max-loras: with more adapters than slots, vLLM runs only `slots` distinct adapters per step.
    if per_step is None or per_step == max_loras:
        counted = "--max-loras"
    else:
        counted = f"--max-loras {per_step} adapters a step, {max_loras - per_step} for fills ahead"
    return (
        f"LoRA slots: {max_loras} ({counted}) x {total / per / 2**20:.2f} MiB per {where} = {total / 2**20:.2f} MiB "
        f"(BD layers {bd / per / 2**20:.2f} MiB a slot, vLLM's other LoRA layers {(total - bd) / per / 2**20:.2f}), "
        "reserved before the KV cache."
    )


def base_quantization(layer) -> str | None:
    """The quantization of a BD layer's base weight (None: unquantized, or not a BD layer)."""
    return layer.base_quantization() if isinstance(layer, BlockDiagonalLoRALayer) else None


def unreadable_base(layer) -> str | None:
    """Why a BD layer's dequantized base weight cannot be read exactly (None: it can, or not a BD layer)."""
    return layer.base_weight_unreadable() if isinstance(layer, BlockDiagonalLoRALayer) else None
