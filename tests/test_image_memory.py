"""Host memory for slot images (`vllm_bdlora.image_memory`): regions of slabs sized to leave little over, a region
free again only once no view of it is left, and a recycled region handed out only after the fills that may still
read it."""

import gc

import torch

from vllm_bdlora.image_memory import MIN_SLAB, PAGE, ImageMemory, slab_size

MIB = 1 << 20


def test_slabs_are_powers_of_two_that_leave_at_most_a_twentieth_over():
    image = 32 * 335_872 * 2 + 32 * 7 * 4  # Llama-3.1-8B at BD r'=32, TP=4: bf16 factors of 32 layers, widths
    region = -(-image // PAGE) * PAGE
    assert slab_size(region) == 64 * MIB  # 3 images (a 32 MiB block would hold one and leave 36% over)
    for region in (PAGE, 12_288, 300_000, 3 * MIB, 20 * MIB + PAGE, 100 * MIB):
        size = slab_size(region)
        assert size & (size - 1) == 0 and size >= max(region, MIN_SLAB)
        assert size % region <= 0.05 * size


def test_a_region_is_free_again_only_when_its_last_view_is_gone_and_is_reused_after_the_fills():
    waits = []
    memory = ImageMemory(300_000, pinned=False, before_reuse=lambda: waits.append(1))
    per_slab = memory.slab_bytes // memory.region_bytes
    regions = [memory.take() for _ in range(per_slab)]
    assert memory.held_bytes == memory.slab_bytes and memory.free_regions == 0 and waits == []
    assert all(r.numel() == memory.region_bytes and r.dtype == torch.uint8 for r in regions)
    starts = {r.data_ptr() for r in regions}
    assert len(starts) == per_slab  # disjoint regions of one slab
    kept_view = regions[1][PAGE:].view(torch.float32)  # as vLLM's module weights are views of an image
    dropped = regions[1].data_ptr()
    del regions[1]
    gc.collect()
    assert memory.free_regions == 0  # a view is left
    kept_view.fill_(3.0)
    del kept_view
    assert memory.free_regions == 1
    again = memory.take()
    assert again.data_ptr() == dropped and waits == [1] and memory.held_bytes == memory.slab_bytes
    fresh = memory.take()  # none free: a new slab, nothing to wait for
    assert memory.held_bytes == 2 * memory.slab_bytes and waits == [1] and fresh.data_ptr() not in starts
