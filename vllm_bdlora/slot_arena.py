"""Every fused BD layer's LoRA slots in one buffer, so that filling a slot is one copy whatever the model's depth.

vLLM fills a slot by calling each LoRA layer's `set_lora` in turn, inside the step that first needs the adapter, and
every running request of that step waits: at Llama-3.1-8B's 128 LoRA layers a fill was about 700 device operations
dispatched one by one from the worker's thread (tens of milliseconds), while the bytes themselves (20 MB per GPU at
BD r'=32, TP=4) take under a millisecond to copy.

So on the fused path the layers' factor buffers (A (slots, slices x width, in) and B (slots, height, width) per
layer) are views of one buffer whose first dimension is the slot (`SlotArena.factors`), and their per-slot widths
views of another (`SlotArena.widths`, slot last, as the kernels index it). An admitted adapter is kept in host memory
in exactly one slot's layout (`SlotImage`, built on the admission thread in a region of `vllm_bdlora.image_memory`,
the module weights vLLM sees being views of it), and a fill copies the image whole: two copies, the factors and the
widths (`activate_filling_whole_slot`).
A layer's `set_lora` and `reset_lora` do nothing while the arena fills whole slots; vLLM's own layers (embeddings,
lm_head) keep their per-layer fills.

DoRA servers keep the per-layer fill: their layers also hold magnitude scales per slot, which an adapter's image
does not carry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from vllm_bdlora.image_memory import ImageMemory

# Each layer's A and B start a multiple of this many elements into a slot's row (and rows are a multiple of it
# long), so every view keeps the alignment Triton specialises its pointers and strides on.
ALIGNMENT = 64


def _aligned(elements: int) -> int:
    return -(-elements // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class Strided:
    """A view of a flat buffer: where it starts, its shape and its strides (in elements)."""

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.shape, self.strides, flat.storage_offset() + self.offset)


@dataclass(frozen=True)
class LayerPlace:
    """Where one layer's slot sits in a row of the arena: its A block (slices x width, in), its B block (height,
    width), and its slices' widths (`widths_at` onwards in the widths buffer)."""

    a_at: int
    a_shape: tuple[int, int]
    b_at: int
    b_shape: tuple[int, int]
    widths_at: int
    slice_rows: tuple[int, ...]  # the output row where each slice starts in B

    @property
    def width(self) -> int:
        return self.b_shape[1]

    def a_of_slice(self, index: int, width: int) -> Strided:
        columns = self.a_shape[1]
        return Strided(self.a_at + index * self.width * columns, (width, columns), (columns, 1))

    def b_of_slice(self, index: int, height: int, width: int) -> Strided:
        return Strided(self.b_at + self.slice_rows[index] * self.width, (height, width), (self.width, 1))

    def slice_height(self, index: int) -> int:
        end = self.slice_rows[index + 1] if index + 1 < len(self.slice_rows) else self.b_shape[0]
        return end - self.slice_rows[index]


@dataclass(frozen=True)
class SlotImage:
    """One adapter in one slot's layout, in one region of host memory (`memory`, pinned where the GPU copies from it):
    the factors of every arena layer (zeros past each module's width and for the layers it does not adapt) and every
    slice's width, both views of `memory`. `modules`: where each of the adapter's modules' A and B lie in `factors`
    (vLLM's module weights are those views)."""

    memory: torch.Tensor
    factors: torch.Tensor
    widths: torch.Tensor
    modules: Mapping[str, tuple[Strided, Strided]]
    # the views `image_of` made to copy into: `views` hands them out rather than making two more per module
    made_views: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    def views(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`module`'s A and B, as views of the image."""
        made = self.made_views.get(module)
        if made is not None:
            return made
        a, b = self.modules[module]
        return a.of(self.factors), b.of(self.factors)

    def bind(self, loras: Mapping) -> None:
        """Point the module weights in `loras` (vLLM's LoRALayerWeights by module name) at their place here."""
        for name in self.modules:
            weights = loras[name]
            weights.lora_a, weights.lora_b = self.views(name)


class SlotArena:
    """The slots of a manager's fused BD layers: `factors` (slots, elements of one slot) in the LoRA dtype and
    `widths` (slices, slots) int32. Made once, when the manager is built (`bind_slot_arena`), before anything reads
    the layers' buffers: the kernels and CUDA graphs keep their addresses."""

    ATTRIBUTE = "_bdlora_slot_arena"  # on vLLM's LoRA model manager

    def __init__(self, layers: Iterable, max_loras: int, dtype: torch.dtype, device: torch.device):
        self.places: dict[int, LayerPlace] = {}
        elements = slices = 0
        layers = list(layers)
        for layer in layers:
            a_shape, b_shape = tuple(layer.lora_a_all.shape[1:]), tuple(layer.lora_b_all.shape[1:])
            a_at, b_at = elements, elements + _aligned(a_shape[0] * a_shape[1])
            elements = b_at + _aligned(b_shape[0] * b_shape[1])
            self.places[id(layer)] = LayerPlace(a_at, a_shape, b_at, b_shape, slices, tuple(layer.slice_offsets))
            slices += len(layer.output_slices)
        self.factors = torch.zeros(max_loras, elements, dtype=dtype, device=device)
        self.widths = torch.zeros(slices, max_loras, dtype=torch.int32, device=device)
        # An image: one slot's factors, then (64-byte aligned) its widths
        self.image_widths_at = _aligned(elements * self.factors.element_size())
        self.image_memory = ImageMemory(self.image_widths_at + slices * 4, pinned=self.factors.is_cuda,
                                        before_reuse=self.wait_for_fills)  # fmt: skip
        self._last_fills: dict[int, torch.cuda.Event] = {}  # by stream: an event behind its latest fill's copies
        self.filling_whole_slots = False  # while True, the layers' own set_lora/reset_lora do nothing
        # Images carry factors and widths only: a layer with DoRA scales per slot needs its per-layer fill.
        self.takes_images = all(getattr(layer, "dora_scale", None) is None for layer in layers)
        for layer in layers:
            place = self.places[id(layer)]
            a = self.factors[:, place.a_at : place.a_at + place.a_shape[0] * place.a_shape[1]]
            b = self.factors[:, place.b_at : place.b_at + place.b_shape[0] * place.b_shape[1]]
            count = len(layer.output_slices)
            layer.bind_slot_buffers(a.view(max_loras, *place.a_shape), b.view(max_loras, *place.b_shape),
                                    self.widths[place.widths_at : place.widths_at + count], self)  # fmt: skip

    @classmethod
    def of(cls, manager) -> SlotArena | None:
        return getattr(manager, cls.ATTRIBUTE, None)

    def place_of(self, layer) -> LayerPlace:
        return self.places[id(layer)]

    # -- an admission thread ------------------------------------------------------------------------------------
    def image_of(self, modules: Iterable[tuple[str, object, torch.Tensor, torch.Tensor]],
                 memory: torch.Tensor | None = None) -> SlotImage:  # fmt: skip
        """The image of an adapter whose BD modules are `modules`: (name, `targets.LoRATarget`, A (width, in), B
        (height, width)), this rank's share, converted to the LoRA dtype as they are copied in. One region of
        `image_memory` per adapter (`memory`, where the caller took it already): vLLM's loader, handed the image's
        views (`SlotImage.views`), neither copies nor pins them again."""
        image = self.image_over(self.image_memory.take() if memory is None else memory, {})
        factors, places = image.factors, image.modules
        filled = [0] * image.widths.shape[0]
        targets, sources, made = [], [], {}
        for name, target, lora_a, lora_b in modules:
            place, index, width = self.place_of(target.layer), target.slice_index, lora_a.shape[0]
            a, b = place.a_of_slice(index, width), place.b_of_slice(index, lora_b.shape[0], width)
            made[name] = (a.of(factors), b.of(factors))
            targets += made[name]
            sources += [lora_a, lora_b]
            filled[place.widths_at + index] = width
            places[name] = (a, b)
        # Zeros wherever the copies leave a slice short of the buffer width (the fused expand loads whole tiles of B
        # and multiplies what lies past the width by zeros: it must be finite), and for the slices the adapter does
        # not adapt: the whole image is zeroed first, in one operation, rather than each slice's tails (two views
        # and a zero_ per module: a thousand operations at Llama-8B's depth, each handing the interpreter lock to
        # the worker's other threads and waiting for it back). An adapter of full width everywhere, the common
        # case, needs no zeroing at all.
        if any(filled[place.widths_at + index] < place.width
               for place in self.places.values() for index in range(len(place.slice_rows))):  # fmt: skip
            factors.zero_()
        # One tensor operation for every copy, and one for the widths, for the same reason.
        if targets:
            torch._foreach_copy_(targets, sources)
        image.widths.copy_(torch.tensor(filled, dtype=image.widths.dtype))
        image.made_views.update(made)
        return image

    def image_over(self, memory: torch.Tensor, modules: Mapping[str, tuple[Strided, Strided]]) -> SlotImage:
        """The image `memory` holds (a region of `image_memory`, as `image_of` left it or a read-back restored it)."""
        factors = memory[: self.factors.shape[1] * self.factors.element_size()].view(self.factors.dtype)
        widths = memory[self.image_widths_at : self.image_widths_at + self.widths.shape[0] * 4].view(torch.int32)
        return SlotImage(memory, factors, widths, dict(modules))

    # -- a step ---------------------------------------------------------------------------------------------------
    def fill(self, index: int, image: SlotImage) -> None:
        """Slot `index` holds `image`'s adapter: every layer's factors and widths, in two copies. A pageable source
        (CPU servers) is staged before `copy_` returns, a pinned one is read by the GPU in order with the current
        stream's work (the step's, or the fill stream's ahead of a step: `adapter_lifecycle.fill_ahead`)."""
        self.factors[index].copy_(image.factors, non_blocking=True)
        self.widths[:, index].copy_(image.widths, non_blocking=True)
        if self.factors.is_cuda:  # the image's region may be reused once these copies are done (`wait_for_fills`)
            stream = torch.cuda.current_stream()
            done = torch.cuda.Event()
            done.record(stream)
            self._last_fills[stream.stream_id] = done

    def wait_for_fills(self) -> None:
        """Until every fill enqueued so far has read its image (each stream's fills run in order)."""
        for done in list(self._last_fills.values()):
            done.synchronize()

    @contextlib.contextmanager
    def whole_slot_fill(self) -> Iterator[None]:
        self.filling_whole_slots = True
        try:
            yield
        finally:
            self.filling_whole_slots = False


IMAGE_ATTRIBUTE = "_bdlora_slot_image"  # on the LoRAModel vLLM registers (see AdmittedAdapter.fresh_model)


def bind_slot_arena(manager) -> SlotArena | None:
    """Put the manager's fused BD layers' slots in one arena (see the module's docstring); None where it has none."""
    from vllm_bdlora.layers import BlockDiagonalLoRALayer

    layers = [layer for layer in manager.modules.values()
              if isinstance(layer, BlockDiagonalLoRALayer) and layer.fused_kernels]  # fmt: skip
    if not layers:
        return None
    first = layers[0].lora_a_all
    arena = SlotArena(layers, first.shape[0], first.dtype, first.device)
    setattr(manager, SlotArena.ATTRIBUTE, arena)
    return arena


def activate_filling_whole_slot(manager, lora_id: int, activate: Callable[[], bool]) -> bool:
    """vLLM's slot activation (`activate`) for adapter `lora_id`; where the adapter has a slot image, the BD layers'
    per-layer copies are skipped and the image fills the slot vLLM chose instead."""
    arena = SlotArena.of(manager)
    registered = manager._registered_adapters.get(lora_id) if arena is not None else None
    image = getattr(registered, IMAGE_ATTRIBUTE, None)
    if image is None:
        return activate()
    with arena.whole_slot_fill():
        activated = activate()
    if activated:
        arena.fill(manager.lora_index_to_id.index(lora_id), image)
    return activated
