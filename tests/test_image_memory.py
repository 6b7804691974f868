"""Host memory for slot images (`vllm_bdlora.image_memory`): slabs of whole regions that hold little beyond the
images, a region free again only once no view of it is left, a recycled region handed out only after the fills that
may still read it, and on a GPU regions that CUDA copies from asynchronously."""

import gc

import pytest
import torch

from vllm_bdlora import image_memory
from vllm_bdlora.image_memory import PAGE, SLAB_BYTES, ImageMemory, slab_size

MIB = 1 << 20


def test_slabs_hold_whole_regions_and_less_than_a_slab_beyond_the_images():
    image = 32 * 335_872 * 2 + 32 * 7 * 4  # Llama-3.1-8B at BD r'=32, TP=4: bf16 factors of 32 layers, widths
    region = -(-image // PAGE) * PAGE
    assert slab_size(region) == 3 * region  # 61.5 MiB for 3 images (a power of two would have been 64 MiB)
    for region in (PAGE, 12_288, 300_000, 3 * MIB, 20 * MIB + PAGE, 100 * MIB):
        size = slab_size(region)
        assert size % region == 0 and size >= region
        assert size <= max(SLAB_BYTES, region)  # an image larger than a slab has a slab of its own
    memory = ImageMemory(20 * MIB + 1)
    assert memory.region_bytes == 20 * MIB + PAGE
    for images in range(1, 8):  # what is held beyond the images' regions: less than one slab, never a region
        while memory.held_bytes < images * memory.region_bytes:
            memory._grow()
        assert memory.held_bytes - images * memory.region_bytes < memory.slab_bytes


def test_a_region_is_free_again_only_when_its_last_view_is_gone_and_is_reused_after_the_fills():
    waits = []
    memory = ImageMemory(300_000, before_reuse=lambda: waits.append(1))
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


def test_pinned_slabs_are_page_locked_exactly_unlocked_when_dropped_and_a_refusal_names_the_setting(monkeypatch):
    calls, unlocked, answer = [], [], [0]

    class Runtime:  # CUDA's names
        def cudaHostRegister(self, address, nbytes, flags):  # noqa: N802
            calls.append((address, nbytes, flags))
            return answer[0]

        def cudaHostUnregister(self, address):  # noqa: N802
            unlocked.append(address)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    memory = ImageMemory(20 * MIB + 1, torch.device("cuda"))
    region = memory.take()
    ((address, nbytes, flags),) = calls
    assert address == region.data_ptr() and address % PAGE == 0  # the slab's start: its first region
    assert nbytes == memory.slab_bytes == 3 * memory.region_bytes and flags == image_memory.CUDA_HOST_REGISTER_PORTABLE
    answer[0] = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="adapter_host_memory"):
        [memory.take() for _ in range(3)]
    assert memory.held_bytes == memory.slab_bytes  # a slab CUDA refused is not kept
    gc.collect()
    assert unlocked == []  # nothing to unlock where CUDA locked nothing
    del memory
    gc.collect()
    assert unlocked == []  # a region is left: its slab stays locked
    del region
    gc.collect()
    assert unlocked == [address]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked host memory needs a CUDA GPU")
def test_regions_are_page_locked_and_copy_to_the_gpu_as_written():
    memory = ImageMemory(3 * MIB + 100, torch.device("cuda"))
    regions = [memory.take() for _ in range(2)]
    assert all(region.is_pinned() for region in regions)  # CUDA knows the slab as page-locked host memory
    assert memory.held_bytes == memory.slab_bytes  # exactly the regions asked for, no power-of-two rounding
    values = torch.arange(regions[1].numel() // 4, dtype=torch.float32)
    regions[1].view(torch.float32).copy_(values)
    on_gpu = torch.empty(values.numel(), dtype=torch.float32, device="cuda")
    on_gpu.copy_(regions[1].view(torch.float32), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), values)
    del memory, regions
    gc.collect()  # unlocked and unmapped: the next slabs may be mapped at the same addresses and lock again
    for _ in range(3):
        again = ImageMemory(3 * MIB + 100, torch.device("cuda", torch.cuda.current_device()))
        assert again.take().is_pinned()
        del again
        gc.collect()
