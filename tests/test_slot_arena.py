"""The slot arena (`vllm_bdlora.slot_arena`): a whole-slot fill from an adapter's slot image leaves every layer's slot
exactly as the layers' own per-layer fills would, vLLM's per-layer calls do nothing meanwhile, and an image survives
a spill and read-back. The engine test of the fused kernels (`test_engine_vs_peft.py`) serves through it against PEFT.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm_bdlora.adapter_lifecycle.read_and_cut import AdmittedAdapter
from vllm_bdlora.adapter_lifecycle.store import AdapterStore
from vllm_bdlora.adapter_lifecycle.targets import LoRATarget
from vllm_bdlora.image_memory import ImageMemory
from vllm_bdlora.layers import BlockDiagonalLoRALayer
from vllm_bdlora.slot_arena import ALIGNMENT, IMAGE_ATTRIBUTE, SlotArena, activate_filling_whole_slot, image_width_for

SLOTS, WIDTH = 3, 16


class FusedLayer:
    """What a fused BD layer's slot fill and the arena use of it, with the layer class's own methods."""

    set_lora = BlockDiagonalLoRALayer.set_lora
    reset_lora = BlockDiagonalLoRALayer.reset_lora
    bind_slot_buffers = BlockDiagonalLoRALayer.bind_slot_buffers
    _fit_local = BlockDiagonalLoRALayer._fit_local
    _arena_fills_slot = BlockDiagonalLoRALayer._arena_fills_slot
    slot_arena = None
    dora_scale = None
    fused_kernels = True

    def __init__(self, heights: tuple[int, ...], hidden: int):
        self.output_slices, self.n_slices, self.input_size, self.lora_width = heights, len(heights), hidden, WIDTH
        self.slice_offsets = tuple(sum(heights[:i]) for i in range(len(heights)))
        a, b = torch.zeros(SLOTS, len(heights) * WIDTH, hidden), torch.zeros(SLOTS, sum(heights), WIDTH)
        self.bind_slot_buffers(a, b, torch.zeros(len(heights), SLOTS, dtype=torch.int32))


# a packed qkv-like layer, a row-parallel one (odd input size), a gate/up-like one
SHAPES = (((24, 8, 8), 40), ((40,), 23), ((30, 30), 40))


def model_layers():
    return [FusedLayer(heights, hidden) for heights, hidden in SHAPES]


def adapter(widths: dict, seed: int) -> dict:
    """{(layer, slice): (A, B)} of random non-zero factors of the given widths (slices left out are not adapted)."""
    g = torch.Generator().manual_seed(seed)
    factors = {}
    for (layer, index), width in widths.items():
        heights, hidden = SHAPES[layer]
        a, b = torch.randn(width, hidden, generator=g), torch.randn(heights[index], width, generator=g)
        factors[(layer, index)] = (a, b)
    return factors


def fill_layer_by_layer(layers, slot: int, factors: dict) -> None:
    """vLLM's activation: every layer's set_lora with its slices' factors (None where not adapted), or reset_lora."""
    for n, layer in enumerate(layers):
        pairs = [factors.get((n, i), (None, None)) for i in range(layer.n_slices)]
        if all(a is None for a, _ in pairs):
            layer.reset_lora(slot)
        else:
            layer.set_lora(slot, [a for a, _ in pairs], [b for _, b in pairs])


def image_of(arena: SlotArena, layers, factors: dict):
    """The adapter's image, and module weights bound to it as the loader's are ({module name: weights})."""
    image = arena.image_of((f"{n}.{i}", LoRATarget(layers[n], i), a, b) for (n, i), (a, b) in factors.items())
    weights = {f"{n}.{i}": SimpleNamespace(lora_a=None, lora_b=None) for n, i in factors}
    image.bind(weights)
    return image, weights


WIDE = {(0, 0): WIDTH, (0, 1): WIDTH, (0, 2): WIDTH, (1, 0): WIDTH, (2, 0): WIDTH, (2, 1): WIDTH}
# narrower, slice 1 of the packed layer and the whole row-parallel layer left out (an image as wide as the slot)
NARROW = {(0, 0): 5, (0, 2): 12, (2, 0): 8, (2, 1): 1}
# half the slot's width everywhere (an image half as wide), and narrower still with slices left out (the same width)
HALF = {key: WIDTH // 2 for key in WIDE}
QUARTER_OR_LESS = {(0, 1): 3, (1, 0): 4, (2, 1): 1}


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal, the alignment gaps between layers (never written, NaN here) included."""
    return torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def served(layer, slot: int) -> list:
    """What the fused kernels read of a slot: each slice's width and its factors up to that width."""
    out = []
    for i, width in enumerate(layer.slot_widths[:, slot].tolist()):
        out.append((width, layer.lora_a_stacked[i][slot, 0, :width], layer.lora_b_stacked[i][slot, 0, :, :width]))
    return out


@pytest.fixture(autouse=True)
def images_start_as_nan(monkeypatch):
    """An image's region starts uninitialised: all bits set here (NaN as floats, -1 as widths), so that whatever the
    image fails to write or zero shows."""
    take = ImageMemory.take
    monkeypatch.setattr(ImageMemory, "take", lambda self: take(self).fill_(255))


def test_a_whole_slot_fill_serves_what_the_layers_own_fills_serve():
    """Adapters as wide as the slot, half as wide, narrower still, adapting fewer slices, one after another through
    the same slot: after every fill the arena's layers (from images: two copies where the image is as wide as the
    slot, a zeroing and one copy per group of blocks where it is narrower) serve what layers filled by their own
    set_lora/reset_lora serve, hold zeros past every width (the kernels read whole tiles of B), and the neighbouring
    slot keeps what it held."""
    by_layer, in_arena = model_layers(), model_layers()
    arena = SlotArena(in_arena, SLOTS, torch.float32, torch.device("cpu"))
    assert all(layer.slot_arena is arena for layer in in_arena)
    fills = [(0, WIDE, WIDTH), (1, WIDE, WIDTH), (1, NARROW, WIDTH), (1, HALF, WIDTH // 2), (1, WIDE, WIDTH),
             (1, QUARTER_OR_LESS, 4), (1, HALF, WIDTH // 2)]  # fmt: skip
    for seed, (slot, widths, image_width) in enumerate(fills):
        factors = adapter(widths, seed)
        fill_layer_by_layer(by_layer, slot, factors)
        image = image_of(arena, in_arena, factors)[0]
        assert image.width == image_width
        arena.fill(slot, image)
        for want, got in zip(by_layer, in_arena, strict=True):
            for s in (0, 1):
                for (w_width, w_a, w_b), (g_width, g_a, g_b) in zip(served(want, s), served(got, s), strict=True):
                    assert w_width == g_width and torch.equal(w_a, g_a) and torch.equal(w_b, g_b)
            assert torch.equal(got.lora_a_all[0], want.lora_a_all[0])
            assert torch.equal(got.lora_b_all[0], want.lora_b_all[0])
            for i, width in enumerate(got.slot_widths[:, slot].tolist()):
                assert not got.lora_a_stacked[i][slot, 0, width:].any()
                assert not got.lora_b_stacked[i][slot, 0, :, width:].any()
    assert in_arena[0].slot_widths[:, 1].tolist() == [8, 8, 8] and in_arena[1].slot_widths[:, 1].tolist() == [8]
    assert in_arena[1].slot_widths[:, 0].tolist() == [WIDTH]
    # the layers' buffers are views of the arena's (the kernels read them there)
    assert in_arena[2].lora_b_all.untyped_storage().data_ptr() == arena.factors.untyped_storage().data_ptr()


def test_an_image_holds_the_adapters_factors_in_the_lora_dtype_and_module_weights_are_views_of_it():
    layers = model_layers()
    arena = SlotArena(layers, SLOTS, torch.bfloat16, torch.device("cpu"))
    factors = adapter(NARROW, 4)  # float32, as a weights file may hold them
    image, weights = image_of(arena, layers, factors)
    for name, module in weights.items():
        a, b = factors[tuple(int(p) for p in name.split("."))]
        assert torch.equal(module.lora_a, a.bfloat16()) and torch.equal(module.lora_b, b.bfloat16())
        assert module.lora_b.untyped_storage().data_ptr() == image.memory.untyped_storage().data_ptr()
    assert image.factors.data_ptr() == image.memory.data_ptr() and image.widths.dtype == torch.int32
    assert image.width == WIDTH and image.memory.numel() >= arena.factors[0].numel() * 2 + arena.widths.shape[0] * 4


def test_an_adapter_narrower_than_the_slot_keeps_an_image_of_its_own_width():
    """Host memory follows the adapter's width, not the slot's: an adapter half the slot's width keeps about half
    the bytes, in regions of that width's own; its module weights are views of it holding its factors."""
    layers = model_layers()
    arena = SlotArena(layers, SLOTS, torch.bfloat16, torch.device("cpu"))
    whole, whole_weights = image_of(arena, layers, adapter(WIDE, 11))
    factors = adapter(HALF, 12)
    half, weights = image_of(arena, layers, factors)
    assert half.width == WIDTH // 2 and whole.width == WIDTH
    assert half.memory.numel() == arena.memory_for(WIDTH // 2).region_bytes
    assert half.factors.numel() * 2 <= whole.factors.numel() + 2 * ALIGNMENT * len(arena.layout.groups)
    assert half.factors.numel() * 2 >= whole.factors.numel() - 2 * ALIGNMENT * len(arena.layout.groups)
    for name, module in weights.items():
        a, b = factors[tuple(int(p) for p in name.split("."))]
        assert torch.equal(module.lora_a, a.bfloat16()) and torch.equal(module.lora_b, b.bfloat16())
        assert module.lora_a.is_contiguous() and module.lora_b.is_contiguous()
        assert module.lora_b.untyped_storage().data_ptr() == half.memory.untyped_storage().data_ptr()


@pytest.mark.parametrize(("widths", "slot", "want"), [
    ((5, 3), 16, 8), ((12,), 16, 16), ((16, 16), 16, 16), ((1,), 16, 1), ((), 16, 1), ((7,), 12, 8), ((9,), 12, 12),
])  # fmt: skip
def test_an_images_width_is_the_power_of_two_holding_its_widest_module_at_most_the_slots(widths, slot, want):
    assert image_width_for(widths, slot) == want


def test_the_slot_layout_keeps_every_layers_blocks_aligned_apart_and_grouped():
    """The layers' A and B blocks never overlap, each starts aligned (Triton specialises on it), and the groups a
    narrow image fills through cover every block: A blocks of the same input size side by side, a block that would
    leave the next unaligned (the row-parallel layer's odd input size) in a group of its own."""
    layers = model_layers()
    arena = SlotArena(layers, SLOTS, torch.float32, torch.device("cpu"))
    spans = []
    for layer in layers:
        place = arena.place_of(layer)
        assert place.a_at % ALIGNMENT == 0 and place.b_at % ALIGNMENT == 0
        spans += [(place.a_at, place.a_at + place.a_shape[0] * place.a_shape[1]),
                  (place.b_at, place.b_at + place.b_shape[0] * place.b_shape[1])]  # fmt: skip
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    shapes = [group.shape for group in arena.layout.groups]
    assert shapes == [(5, WIDTH, 40), (1, WIDTH, 23), (40 + 40 + 60, WIDTH)]
    covered = sum(group.shape[0] * group.shape[1] * (group.shape[2] if len(group.shape) == 3 else 1)
                  for group in arena.layout.groups)  # fmt: skip
    assert covered == sum(end - start for start, end in spans)


def test_an_activation_of_an_imaged_adapter_skips_the_layers_own_fills_and_copies_the_image():
    """vLLM's activation picks the slot and calls every layer's set_lora (here with factors that do not fit, which
    would raise if a layer copied them); with an image the layers do nothing and the image fills the slot."""
    layers = model_layers()
    arena = SlotArena(layers, SLOTS, torch.float32, torch.device("cpu"))
    image, _ = image_of(arena, layers, adapter(WIDE, 5))
    registered = {8: SimpleNamespace(**{IMAGE_ATTRIBUTE: image})}
    manager = SimpleNamespace(lora_index_to_id=[7, None, None], _registered_adapters=registered,
                              **{SlotArena.ATTRIBUTE: arena})  # fmt: skip

    def vllm_activation():
        manager.lora_index_to_id[1] = 8
        for layer in layers:
            layer.set_lora(1, [torch.ones(WIDTH + 1, 3)] * layer.n_slices, [torch.ones(2, WIDTH + 1)] * layer.n_slices)
            layer.reset_lora(1)
        return True

    assert activate_filling_whole_slot(manager, 8, vllm_activation)
    assert same(arena.factors[1], image.factors) and torch.equal(arena.widths[:, 1], image.widths)
    assert not arena.filling_whole_slots and not arena.factors[2].any()
    with pytest.raises(RuntimeError):  # outside an imaged activation the layers fill (and check) as before
        layers[1].set_lora(2, [torch.ones(WIDTH + 1, 3)], [torch.ones(2, WIDTH + 1)])


def test_an_imaged_adapter_is_spilled_and_read_back_whole(tmp_path):
    """The store writes an image as one piece and reads it back with the module weights pointing into it again;
    module tensors outside the image (a layer vLLM serves itself) are spilled and restored beside it."""
    layers = model_layers()
    arena = SlotArena(layers, SLOTS, torch.float32, torch.device("cpu"))

    def admitted(seed: int, widths: dict) -> AdmittedAdapter:
        image, loras = image_of(arena, layers, adapter(widths, seed))
        loras["lm_head"] = SimpleNamespace(lora_a=torch.full((4, 8), float(seed)), lora_b=torch.ones(8, 4))
        return AdmittedAdapter(f"a{seed}", SimpleNamespace(loras=loras), f"id{seed}", "", [], None, image=image,
                               arena=arena)  # fmt: skip

    for widths, width in ((NARROW, WIDTH), (HALF, WIDTH // 2)):
        first, second = admitted(6, widths), admitted(7, widths)
        want = first.image.factors.clone(), first.image.widths.clone(), {k: t.clone() for k, t in first.host_tensors()}
        store = AdapterStore(host_budget=first.nbytes, spill_dir=str(tmp_path))
        store.keep(1, first)
        store.keep(2, second)
        assert store.spilled_ids() == {1} and first.image is None
        assert all(w.lora_a is None and w.lora_b is None for w in first.template.loras.values())
        assert getattr(first.fresh_model(), IMAGE_ATTRIBUTE, None) is None  # a spilled adapter is not filled from one
        memory = arena.memory_for(width)
        free = memory.free_regions
        restored = store.get(1)
        # read back into a region of its width's image memory, as the one spilled to make room gave its own back
        assert restored.image.memory.numel() == memory.region_bytes and store.spilled_ids() == {2}
        assert memory.free_regions == free and restored.image.width == width
        assert same(restored.image.factors, want[0]) and torch.equal(restored.image.widths, want[1])
        for key, tensor in restored.host_tensors():
            assert same(tensor, want[2][key])
        weights = restored.template.loras["0.2"]
        assert weights.lora_a.untyped_storage().data_ptr() == restored.image.factors.untyped_storage().data_ptr()
        assert torch.equal(weights.lora_b, adapter(widths, 6)[(0, 2)][1])
        assert getattr(restored.fresh_model(), IMAGE_ATTRIBUTE) is restored.image
        arena.fill(2, restored.image)
        assert torch.equal(layers[0].lora_b_stacked[2][2, 0, :, : widths[(0, 2)]], weights.lora_b)


@pytest.mark.gpu
def test_on_a_gpu_images_are_pinned_and_a_recycled_region_waits_for_the_fill_reading_it():
    """A fill copies from the pinned image asynchronously; an image dropped while its fill is still queued gives its
    region back, and the region is handed out again only once the fill has read it."""
    layers = model_layers()
    arena = SlotArena(layers, SLOTS, torch.float16, torch.device("cuda"))
    image, weights = image_of(arena, layers, adapter(WIDE, 8))
    assert image.memory.is_pinned() and image.factors.is_pinned()
    want = image.factors.clone()
    # the slab's regions never handed out go first (they need no wait): take them all, so that the next region
    # handed out is the one this image gives back
    never_used = [arena.memory_for(WIDTH).take() for _ in range(arena.memory_for(WIDTH).free_regions)]
    assert arena.memory_for(WIDTH).free_regions == 0 and never_used
    torch.cuda._sleep(200_000_000)  # the stream is busy for a while: the fill's copy waits behind it
    arena.fill(2, image)
    del image, weights
    assert arena.memory_for(WIDTH).free_regions == 1
    recycled = arena.memory_for(WIDTH).take()
    assert all(done.query() for done in arena._last_fills.values())  # the fill that read the region is done first
    recycled.fill_(255)
    torch.cuda.synchronize()
    assert torch.equal(arena.factors[2].cpu().nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.gpu
def test_on_a_gpu_an_image_narrower_than_the_slot_fills_it_as_on_the_cpu():
    """The narrow fill's copies into the slot's first columns, from pinned memory and asynchronously, leave the slot
    as the same fill on the CPU does, over a slot that held a wider adapter."""
    on_cpu, on_gpu = model_layers(), model_layers()
    cpu = SlotArena(on_cpu, SLOTS, torch.float16, torch.device("cpu"))
    gpu = SlotArena(on_gpu, SLOTS, torch.float16, torch.device("cuda"))
    for widths, seed in ((WIDE, 13), (HALF, 14), (QUARTER_OR_LESS, 15)):
        factors = adapter(widths, seed)
        cpu.fill(1, image_of(cpu, on_cpu, factors)[0])
        image = image_of(gpu, on_gpu, factors)[0]
        assert image.memory.is_pinned()
        torch.cuda._sleep(50_000_000)  # the copies queue behind other work, as a fill ahead of a step does
        gpu.fill(1, image)
        torch.cuda.synchronize()
        for got, want in zip(on_gpu, on_cpu, strict=True):
            assert torch.equal(got.slot_widths.cpu(), want.slot_widths)
            for s in range(got.n_slices):
                assert torch.equal(got.lora_a_stacked[s][1].cpu(), want.lora_a_stacked[s][1])
                assert torch.equal(got.lora_b_stacked[s][1].cpu(), want.lora_b_stacked[s][1])


def test_an_imaged_adapter_is_packed_once_and_again_only_after_a_read_back(tmp_path):
    """vLLM packs the model it registers in place (q/k/v -> qkv_proj). An imaged adapter is packed once, when it is
    admitted, and a load copies the packed template, which packing again leaves as it is. A spill drops the packed
    template, so the image's region goes back to the pool; the read-back packs the restored image's views."""
    layers = model_layers()
    arena = SlotArena(layers, SLOTS, torch.float32, torch.device("cpu"))
    packs = []

    def pack(model):  # as vLLM's _create_merged_loras_inplace: the packed layer's slices into one entry
        packs.append(sorted(model.loras))  # names only: a model kept here would keep its image's region
        slices = [model.loras.pop(f"0.{i}", None) for i in range(3)]
        if any(slices):
            model.loras["0"] = SimpleNamespace(lora_a=[s.lora_a if s else None for s in slices],
                                               lora_b=[s.lora_b if s else None for s in slices])  # fmt: skip

    def admitted(seed: int) -> AdmittedAdapter:
        image, loras = image_of(arena, layers, adapter(NARROW, seed))
        kept = AdmittedAdapter(f"a{seed}", SimpleNamespace(loras=loras), f"id{seed}", "", [], None, image=image,
                               arena=arena, pack=pack)  # fmt: skip
        kept.pack_ahead()
        return kept

    first = admitted(9)
    assert len(packs) == 1 and sorted(first.template.loras) == ["0.0", "0.2", "2.0", "2.1"]  # the template stays
    model = first.fresh_model()
    assert sorted(model.loras) == ["0", "2.0", "2.1"] and model.loras["0"].lora_a[1] is None
    assert model.loras["0"] is not first.packed.loras["0"]  # vLLM gets weights of its own to pack and optimize
    pack(model)  # vLLM's registration: nothing left to pack
    assert sorted(model.loras) == ["0", "2.0", "2.1"] and len(packs) == 2
    assert model.loras["0"].lora_b[2].untyped_storage().data_ptr() == first.image.memory.untyped_storage().data_ptr()
    del model
    store = AdapterStore(host_budget=first.nbytes, spill_dir=str(tmp_path))
    store.keep(1, first)
    free = arena.memory_for(WIDTH).free_regions
    store.keep(2, admitted(10))
    assert store.spilled_ids() == {1} and first.packed is None
    assert arena.memory_for(WIDTH).free_regions == free  # the second image's region taken, the spilled one's given back
    restored = store.get(1)
    assert len(packs) == 4  # the second adapter's, and the read-back's
    weights = restored.fresh_model().loras["0"]
    assert weights.lora_a[0].untyped_storage().data_ptr() == restored.image.memory.untyped_storage().data_ptr()
    assert torch.equal(weights.lora_a[0], adapter(NARROW, 9)[(0, 0)][0])
