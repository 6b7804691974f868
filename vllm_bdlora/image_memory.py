"""Host memory for slot images: equal regions carved out of a few larger blocks, reused as images come and go.

Every admitted adapter of a fused BD server is kept as one image of a GPU slot (`vllm_bdlora.slot_arena`), pinned on
a GPU so that a slot fill is an asynchronous copy. Pinning each image on its own with PyTorch costs twice over:

* PyTorch's caching host allocator rounds every pinned block up to a power of two, so a 20.5 MiB image (Llama-3.1-8B,
  BD r'=32, TP=4) holds 32 MiB, and a store budgeted at 16 GiB of images pins about 25 GiB;
* a fresh pinned block costs about a millisecond per MiB to map and lock (19.6 ms for that image on an H200 host),
  paid again by every read-back of a spilled image that the allocator's cache cannot serve.

So images take regions of one size (the image's, rounded to a page) from slabs of whole regions, about `SLAB_BYTES`
each (one region where an image is larger), mapped and page-locked by this module (`cudaHostRegister` through
`torch.cuda.cudart()`: exactly the bytes asked, with no power-of-two rounding), allocated as needed and kept for the
life of the worker. The memory held is the peak of images kept at once (the store's budget, plus admissions and
read-backs in flight) plus less than one slab per image width, and a region freed by a spill, an unload or a
replaced adapter is the next image's, with no allocation.

A region is a tensor over its own NumPy view of the slab, so it returns to the pool when its last view is gone (the
module weights vLLM holds are views of an image too), whichever thread drops it. A fill may still be reading a
region when its image dies (the copy is asynchronous): a recycled region is handed out only after `before_reuse`,
which waits for the fills enqueued so far.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

PAGE = 4096
# A slab's size: few enough slabs that mapping and locking them is a small share of admitting their images, small
# enough that the part of the last slab no image uses yet is little memory beside a budget of gigabytes.
SLAB_BYTES = 64 << 20
CUDA_HOST_REGISTER_PORTABLE = 1  # page-locked for every CUDA context of the process, as pinned tensors are


def slab_size(region_bytes: int, slab_bytes: int = SLAB_BYTES) -> int:
    """Bytes of a slab of regions of `region_bytes`: as many whole regions as fit in `slab_bytes`, at least one."""
    return max(1, slab_bytes // region_bytes) * region_bytes


def host_memory(nbytes: int, device: torch.device | None = None) -> np.ndarray:
    """`nbytes` of page-aligned host memory (uint8, zero), page-locked for CUDA copies where `device` is a GPU (the
    one the memory is copied to), through that GPU's context: a thread's current device is the first GPU unless it
    was set, and registering there would open a context on another worker's GPU (a GPU without an index: the
    thread's current one). Mapped here rather than taken from PyTorch, whose pinned blocks are rounded up to a power
    of two; the mapping lives as long as the array."""
    # private, as malloc's large blocks are: a process forked later does not share the adapters' pages
    array = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
    if pins(device):
        address = array.ctypes.data
        with _context_of(device):
            error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE))
        if error:
            raise RuntimeError(
                f"could not page-lock {nbytes} bytes of host memory for adapter images (CUDA error {error}); lower "
                "the bdlora setting adapter_host_memory or free host memory"
            )
        # Unlocked before the mapping goes: pages unmapped while registered stay locked, and a later mapping at the
        # same address could not be registered. Not at exit, where the driver releases them with the process.
        weakref.finalize(array, _unlock, address, device).atexit = False
    return array


def _unlock(address: int, device: torch.device | None) -> None:
    with _context_of(device):
        torch.cuda.cudart().cudaHostUnregister(address)


def pins(device: torch.device | None) -> bool:
    """Whether memory copied to `device` is page-locked: where the copy is to a GPU, so that it can be asynchronous."""
    return device is not None and device.type == "cuda"


def _context_of(device: torch.device | None):
    return contextlib.nullcontext() if device is None or device.index is None else torch.cuda.device(device)


class ImageMemory:
    """Regions of `region_bytes` (rounded up to a page) of host memory for copies to `device`: page-locked where it
    is a GPU (`host_memory`); `before_reuse()` runs before a region that held an image is handed out again."""

    def __init__(self, region_bytes: int, device: torch.device | None = None,
                 before_reuse: Callable[[], None] | None = None):  # fmt: skip
        self.region_bytes = -(-region_bytes // PAGE) * PAGE
        self.slab_bytes = slab_size(self.region_bytes)
        self.device = device
        self.before_reuse = before_reuse
        self._slabs: list = []  # NumPy arrays over the slabs' mappings, which they keep alive
        self._unused: collections.deque = collections.deque()  # (slab, index) never handed out
        self._free: collections.deque = collections.deque()  # handed out, then dropped; appended by finalizers
        self._growing = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return len(self._slabs) * self.slab_bytes

    @property
    def free_regions(self) -> int:
        return len(self._unused) + len(self._free)

    def take(self) -> torch.Tensor:
        """A region (uint8, `region_bytes`), uninitialised; it is free again once no view of it is left."""
        try:
            slab, index = self._unused.popleft()
        except IndexError:
            try:
                slab, index = self._free.popleft()
            except IndexError:
                slab, index = self._grow()
            else:
                if self.before_reuse is not None:
                    self.before_reuse()
        start = index * self.region_bytes
        region = self._slabs[slab][start : start + self.region_bytes]  # a NumPy view: its own object to watch
        weakref.finalize(region, self._free.append, (slab, index)).atexit = False
        return torch.from_numpy(region)

    def _grow(self) -> tuple[int, int]:
        """A new slab; its first region for the caller, the rest free. Allocated outside any lock the finalizers
        take (they take none): pinning a slab takes tens of milliseconds, other admissions keep taking regions."""
        memory = host_memory(self.slab_bytes, self.device)
        with self._growing:
            self._slabs.append(memory)
            slab = len(self._slabs) - 1
        for index in range(1, self.slab_bytes // self.region_bytes):
            self._unused.append((slab, index))
        return slab, 0
