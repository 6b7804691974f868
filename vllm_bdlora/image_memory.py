"""Host memory for slot images: equal regions carved out of a few large blocks, reused as images come and go.

Every admitted adapter of a fused BD server is kept as one image of a GPU slot (`vllm_bdlora.slot_arena`), pinned on
a GPU so that a slot fill is an asynchronous copy. Pinning each image on its own costs twice over:

* PyTorch's caching host allocator rounds every pinned block up to a power of two, so a 20.5 MiB image (Llama-3.1-8B,
  BD r'=32, TP=4) holds 32 MiB, and a store budgeted at 16 GiB of images pins about 25 GiB;
* a fresh pinned block costs about a millisecond per MiB to map and lock (19.6 ms for that image on an H200 host),
  paid again by every read-back of a spilled image that the allocator's cache cannot serve.

So images take regions of one size (the image's, rounded to a page) from slabs of a power-of-two size chosen so that
little of a slab is left over (`slab_size`), allocated as needed and kept for the life of the worker: the memory held
is the peak of images kept at once (the store's budget, plus admissions and read-backs in flight) and at most a few
percent more, and a region freed by a spill, an unload or a replaced adapter is the next image's, with no allocation.

A region is a tensor over its own NumPy view of the slab, so it returns to the pool when its last view is gone (the
module weights vLLM holds are views of an image too), whichever thread drops it. A fill may still be reading a
region when its image dies (the copy is asynchronous): a recycled region is handed out only after `before_reuse`,
which waits for the fills enqueued so far.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable

import torch

PAGE = 4096
MIN_SLAB = 1 << 20
MAX_LEFT_OVER = 0.05  # of a slab


def slab_size(region_bytes: int, min_slab: int = MIN_SLAB, max_left_over: float = MAX_LEFT_OVER) -> int:
    """The smallest power of two of at least `min_slab` bytes holding whole regions of `region_bytes` with at most
    `max_left_over` of it left over (a pinned block is a power of two whatever is asked, so anything else wastes the
    rounding)."""
    size = max(min_slab, 1 << (region_bytes - 1).bit_length())
    while (size % region_bytes) > max_left_over * size:
        size *= 2
    return size


class ImageMemory:
    """Regions of `region_bytes` (rounded up to a page) of host memory, pinned where `pinned`; `before_reuse()` runs
    before a region that held an image is handed out again."""

    def __init__(self, region_bytes: int, pinned: bool, before_reuse: Callable[[], None] | None = None):
        self.region_bytes = -(-region_bytes // PAGE) * PAGE
        self.slab_bytes = slab_size(self.region_bytes)
        self.pinned = pinned
        self.before_reuse = before_reuse
        self._slabs: list = []  # NumPy views of the slab tensors, which they keep alive
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
        memory = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pinned).numpy()
        with self._growing:
            self._slabs.append(memory)
            slab = len(self._slabs) - 1
        for index in range(1, self.slab_bytes // self.region_bytes):
            self._unused.append((slab, index))
        return slab, 0
