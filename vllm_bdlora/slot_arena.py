"""Every fused BD layer's LoRA slots in one buffer, so that filling a slot is one copy whatever the model's depth.

vLLM fills a slot by calling each LoRA layer's `set_lora` in turn, inside the step that first needs the adapter, and
every running request of that step waits: at Llama-3.1-8B's 128 LoRA layers a fill was about 700 device operations
dispatched one by one from the worker's thread (tens of milliseconds), while the bytes themselves (20 MB per GPU at
BD r'=32, TP=4) take under a millisecond to copy.

So on the fused path the layers' factor buffers (A (slots, slices x width, in) and B (slots, height, width) per
layer) are views of one buffer whose first dimension is the slot (`SlotArena.factors`), and their per-slot widths
views of another (`SlotArena.widths`, slot last, as the kernels index it). An admitted adapter is kept in host memory
in one slot's layout at its own width (`SlotImage`, built on the admission thread in a region of
`vllm_bdlora.image_memory`, the module weights vLLM sees being views of it), and a fill copies the image whole
(`activate_filling_whole_slot`): two copies, the factors and the widths, where the adapter is as wide as the slot.
An adapter narrower than the slot (rank 16 under `--max-lora-rank 64`) keeps only its own columns, so its host
memory and its admission's copies follow its rank, not the slot's, as stock vLLM's do: the slot's layout groups the
layers' blocks (A by input size, B all together), and its fill is one copy per group into the slot's first
columns after zeroing the slot.
A layer's `set_lora` and `reset_lora` do nothing while the arena fills whole slots; vLLM's own layers (embeddings,
lm_head) keep their per-layer fills.

DoRA servers keep the per-layer fill: their layers also hold magnitude scales per slot, which an adapter's image
does not carry.
"""

from __future__ import annotations

import contextlib
import threading
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
    """Where one layer's share of a slot sits in a row of the arena or of an image: its A block (slices x width, in),
    its B block (height, width), and its slices' widths (`widths_at` onwards in the widths buffer)."""

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
class Layout:
    """One slot's factors at one width, in the arena (the slot width) or in an image (the adapter's): every layer's
    place, and the groups of blocks that lie side by side, each one view with the width as its second dimension: A
    blocks of layers with the same input size, (slices, width, in), and B blocks, (rows, width). The arena and its
    images of every width have the same groups in the same order, so an image narrower than the slot fills it in
    one copy per group."""

    width: int
    places: Mapping[int, LayerPlace]  # by id(layer)
    groups: tuple[Strided, ...]
    elements: int


def _layout(layers: list, width: int, a_groups: list[list[int]], b_groups: list[list[int]]) -> Layout:
    """The layout of `layers` at `width`, their A blocks in `a_groups` and their B blocks in `b_groups` (lists of
    indices into `layers`, in order). Each group starts aligned; a group's blocks follow one another."""
    a_at, b_at, groups, elements = {}, {}, [], 0
    for members in a_groups:
        columns = layers[members[0]].lora_a_all.shape[2]
        start, slices = elements, 0
        for n in members:
            a_at[n] = start + slices * width * columns
            slices += len(layers[n].output_slices)
        groups.append(Strided(start, (slices, width, columns), (width * columns, columns, 1)))
        elements = _aligned(start + slices * width * columns)
    for members in b_groups:
        start, rows = elements, 0
        for n in members:
            b_at[n] = start + rows * width
            rows += layers[n].lora_b_all.shape[1]
        groups.append(Strided(start, (rows, width), (width, 1)))
        elements = _aligned(start + rows * width)
    places, slices = {}, 0
    for n, layer in enumerate(layers):
        a_shape = (len(layer.output_slices) * width, layer.lora_a_all.shape[2])
        b_shape = (layer.lora_b_all.shape[1], width)
        places[id(layer)] = LayerPlace(a_at[n], a_shape, b_at[n], b_shape, slices, tuple(layer.slice_offsets))
        slices += len(layer.output_slices)
    return Layout(width, places, tuple(groups), elements)


def _groups(layers: list, width: int) -> tuple[list[list[int]], list[list[int]]]:
    """Which layers' A blocks share a group (the same input size) and which B blocks do (all), at the slot `width`.
    A block whose size is not a multiple of `ALIGNMENT` would leave the next one unaligned: it has a group of its
    own."""
    a_groups: dict = {}
    b_groups: dict = {}
    for n, layer in enumerate(layers):
        columns, rows = layer.lora_a_all.shape[2], layer.lora_b_all.shape[1]
        a_key = columns if (width * columns) % ALIGNMENT == 0 else ("alone", n)
        b_key = "rows" if (width * rows) % ALIGNMENT == 0 else ("alone", n)
        a_groups.setdefault(a_key, []).append(n)
        b_groups.setdefault(b_key, []).append(n)
    return list(a_groups.values()), list(b_groups.values())


def image_width_for(module_widths: Iterable[int], slot_width: int) -> int:
    """The width of an adapter's image: the smallest power of two holding its widest module, at most the slot's. A
    power of two, so that a server holds images of a few widths (each width's regions come from slabs of their own,
    `vllm_bdlora.image_memory`)."""
    widest = max(module_widths, default=1)
    return min(slot_width, 1 << max(0, widest - 1).bit_length())


@dataclass(frozen=True)
class SlotImage:
    """One adapter's factors in one region of host memory (`memory`, pinned where the GPU copies from it), laid out
    as a slot is at the image's `width`, the adapter's (`SlotArena.layout_at`): the factors of every arena layer
    (zeros past each module's width and for the layers it does not adapt) and every slice's width, both views of
    `memory`. `modules`: where each of the adapter's modules' A and B lie in `factors` (vLLM's module weights are
    those views)."""

    memory: torch.Tensor
    factors: torch.Tensor
    widths: torch.Tensor
    modules: Mapping[str, tuple[Strided, Strided]]
    width: int
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
        self.layers = list(layers)
        widths = {layer.lora_b_all.shape[2] for layer in self.layers}
        # Images narrower than a slot need one slot width for every layer (vLLM's `--max-lora-rank`, cut alike)
        self.slot_width = max(widths)
        self.narrow_images = len(widths) == 1
        self._groups = _groups(self.layers, self.slot_width)
        self._layouts: dict[int, Layout] = {}
        self.layout = self.layout_at(self.slot_width)
        self.factors = torch.zeros(max_loras, self.layout.elements, dtype=dtype, device=device)
        self.widths = torch.zeros(sum(len(layer.output_slices) for layer in self.layers), max_loras,
                                  dtype=torch.int32, device=device)  # fmt: skip
        self._memories: dict[int, ImageMemory] = {}  # by image width
        self._memories_made = threading.Lock()
        self._last_fills: dict[int, torch.cuda.Event] = {}  # by stream: an event behind its latest fill's copies
        self.filling_whole_slots = False  # while True, the layers' own set_lora/reset_lora do nothing
        # Images carry factors and widths only: a layer with DoRA scales per slot needs its per-layer fill.
        self.takes_images = all(getattr(layer, "dora_scale", None) is None for layer in self.layers)
        for layer in self.layers:
            place = self.place_of(layer)
            a = self.factors[:, place.a_at : place.a_at + place.a_shape[0] * place.a_shape[1]]
            b = self.factors[:, place.b_at : place.b_at + place.b_shape[0] * place.b_shape[1]]
            count = len(layer.output_slices)
            layer.bind_slot_buffers(a.view(max_loras, *place.a_shape), b.view(max_loras, *place.b_shape),
                                    self.widths[place.widths_at : place.widths_at + count], self)  # fmt: skip

    @classmethod
    def of(cls, manager) -> SlotArena | None:
        return getattr(manager, cls.ATTRIBUTE, None)

    def place_of(self, layer) -> LayerPlace:
        return self.layout.places[id(layer)]

    def layout_at(self, width: int) -> Layout:
        """One slot's layout at `width`: the slot's own at `slot_width`, an image's at the adapter's."""
        layout = self._layouts.get(width)
        if layout is None:  # two threads may both make it: the same layout
            layout = self._layouts[width] = _layout(self.layers, width, *self._groups)
        return layout

    def image_width(self, module_widths: Iterable[int]) -> int:
        """The width of the image of an adapter whose BD modules have `module_widths` (see `image_width_for`)."""
        if not self.narrow_images:
            return self.slot_width
        return image_width_for(module_widths, self.slot_width)

    def image_bytes(self, width: int) -> int:
        """Bytes of an image of `width`: its factors, then (64-byte aligned) its widths."""
        return self.image_widths_at(width) + self.widths.shape[0] * 4

    def image_widths_at(self, width: int) -> int:
        return _aligned(self.layout_at(width).elements * self.factors.element_size())

    def memory_for(self, width: int) -> ImageMemory:
        """The regions images of `width` take (each width its own slabs: a region is reused by the same width)."""
        with self._memories_made:
            memory = self._memories.get(width)
            if memory is None:
                memory = self._memories[width] = ImageMemory(self.image_bytes(width), self.factors.device,
                                                             before_reuse=self.wait_for_fills)  # fmt: skip
            return memory

    # -- an admission thread ------------------------------------------------------------------------------------
    def image_of(self, modules: Iterable[tuple[str, object, torch.Tensor, torch.Tensor]],
                 memory: torch.Tensor | None = None, width: int | None = None) -> SlotImage:  # fmt: skip
        """The image of an adapter whose BD modules are `modules`: (name, `targets.LoRATarget`, A (width, in), B
        (height, width)), this rank's share, converted to the LoRA dtype as they are copied in. One region of
        `memory_for(width)` per adapter (`memory`, where the caller took it already for `width`, the image's width
        by `image_width`): vLLM's loader, handed the image's views (`SlotImage.views`), neither copies nor pins
        them again."""
        modules = list(modules)
        if width is None:
            width = self.image_width(lora_a.shape[0] for _, _, lora_a, _ in modules)
        image = self.image_over(self.memory_for(width).take() if memory is None else memory, {}, width)
        factors, places, layout = image.factors, image.modules, self.layout_at(width)
        filled = [0] * image.widths.shape[0]
        targets, sources, made = [], [], {}
        for name, target, lora_a, lora_b in modules:
            place, index, module_width = layout.places[id(target.layer)], target.slice_index, lora_a.shape[0]
            if module_width > width:
                raise ValueError(f"{name}: width {module_width} does not fit an image {width} wide")
            a, b = place.a_of_slice(index, module_width), place.b_of_slice(index, lora_b.shape[0], module_width)
            made[name] = (a.of(factors), b.of(factors))
            targets += made[name]
            sources += [lora_a, lora_b]
            filled[place.widths_at + index] = module_width
            places[name] = (a, b)
        # Zeros wherever the copies leave a slice short of the image's width (the fused expand loads whole tiles of
        # B and multiplies what lies past the width by zeros: it must be finite), and for the slices the adapter
        # does not adapt: the whole image is zeroed first, in one operation, rather than each slice's tails (two
        # views and a zero_ per module: a thousand operations at Llama-8B's depth, each handing the interpreter lock
        # to the worker's other threads and waiting for it back). An adapter whose modules are all as wide as its
        # image, the common case, needs no zeroing at all.
        if any(filled[place.widths_at + index] < width
               for place in layout.places.values() for index in range(len(place.slice_rows))):  # fmt: skip
            factors.zero_()
        # One tensor operation for every copy, and one for the widths, for the same reason.
        if targets:
            torch._foreach_copy_(targets, sources)
        image.widths.copy_(torch.tensor(filled, dtype=image.widths.dtype))
        image.made_views.update(made)
        return image

    def image_over(self, memory: torch.Tensor, modules: Mapping[str, tuple[Strided, Strided]],
                   width: int) -> SlotImage:  # fmt: skip
        """The image of `width` that `memory` holds (a region of `memory_for(width)`, as `image_of` left it or a
        read-back restored it)."""
        elements, widths_at = self.layout_at(width).elements, self.image_widths_at(width)
        factors = memory[: elements * self.factors.element_size()].view(self.factors.dtype)
        widths = memory[widths_at : widths_at + self.widths.shape[0] * 4].view(torch.int32)
        return SlotImage(memory, factors, widths, dict(modules), width)

    # -- a step ---------------------------------------------------------------------------------------------------
    def fill(self, index: int, image: SlotImage) -> None:
        """Slot `index` holds `image`'s adapter: every layer's factors and widths. An image as wide as the slot is
        two copies; a narrower one zeroes the slot and copies each group of blocks into the slot's columns up to its
        width (`Layout`: five groups at Llama's depth, whatever the number of layers). A pageable source (CPU
        servers) is staged before `copy_` returns, a pinned one is read by the GPU in order with the current
        stream's work (the step's, or the fill stream's ahead of a step: `adapter_lifecycle.fill_ahead`)."""
        slot = self.factors[index]
        if image.width == self.slot_width:
            slot.copy_(image.factors, non_blocking=True)
        else:
            slot.zero_()
            for in_slot, in_image in zip(self.layout.groups, self.layout_at(image.width).groups, strict=True):
                in_slot.of(slot).narrow(1, 0, image.width).copy_(in_image.of(image.factors), non_blocking=True)
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
