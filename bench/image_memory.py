"""Host memory for slot images, two ways side by side: one pinned block per image (PyTorch's caching host allocator,
`torch.empty(..., pin_memory=True)`) against regions of `vllm_bdlora.image_memory.ImageMemory`.

A worker keeps every admitted adapter's image in host memory until its budget is used up, so during a load the
images accumulate: each way takes `--images` images and keeps them (as the store does), then drops a third and takes
as many again (spills, unloads and read-backs recycling memory). Reported per way: milliseconds per image while
accumulating and while recycling (means: a slab's allocation is paid by one image in several), the resident memory
the process gained per image kept (pinned memory is resident from its allocation on), the slabs' bytes beyond the
images' regions, and one image's copy to the GPU: its bandwidth and how long the call holds the host (page-locked
memory is copied asynchronously at full speed; pageable memory is staged by the driver while the call waits).

    python -m bench.image_memory --shape llama-3.1-8b --tp 4 --images 24 --out OUT

writes OUT/image_memory.json and OUT/image_memory.md. On a machine without a GPU both ways take pageable memory and
only the timings of the allocation itself mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.shapes import SHAPES, LlamaShape
from vllm_bdlora.image_memory import ImageMemory

MIB = 1 << 20


ROW_PARALLEL = ("o_proj", "down_proj")  # their inputs are sharded, the other projections' outputs


def image_bytes(shape: LlamaShape, tp: int, width: int) -> int:
    """One slot image of the seven projections at per-GPU LoRA width `width`: A (width x in) and B (out x width) of
    each projection's shard, in bf16, then an int32 width per projection (the arena's 64-element alignment is left
    out: every Llama shard is a multiple of it)."""
    elements = 0
    for name, (inputs, outputs) in shape.projections().items():
        inputs, outputs = (inputs // tp, outputs) if name in ROW_PARALLEL else (inputs, outputs // tp)
        elements += width * (inputs + outputs)
    return shape.num_hidden_layers * (elements * 2 + len(shape.projections()) * 4)


def resident_bytes() -> int:
    """This process's resident memory (pinned pages are resident from their allocation on; pageable ones only once
    written, so on a machine without a GPU this says nothing of either way)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def per_image_blocks(nbytes: int, pinned: bool):
    return lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def time_way(take, count: int) -> dict:
    """Take `count` images and keep them; drop a third, take as many again; an image's copy to the GPU."""
    before = resident_bytes()
    kept, accumulate = [], []
    for _ in range(count):
        started = time.perf_counter()
        kept.append(take())
        accumulate.append((time.perf_counter() - started) * 1e3)
    held = resident_bytes() - before
    dropped = count // 3
    del kept[:dropped]
    recycle = []
    for _ in range(dropped):
        started = time.perf_counter()
        kept.append(take())
        recycle.append((time.perf_counter() - started) * 1e3)
    result = {
        "ms_per_image_accumulating": statistics.mean(accumulate),
        "ms_slowest_image": max(accumulate),
        "ms_per_image_recycling": statistics.mean(recycle) if recycle else None,
        "pinned": bool(kept[0].is_pinned()) if torch.cuda.is_available() else False,
        "resident_bytes_per_image": held / count,
    }
    if torch.cuda.is_available():
        device = torch.empty(kept[0].numel(), dtype=torch.uint8, device="cuda")
        source = kept[-1].fill_(1)
        seconds, host_seconds = [], []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            called = time.perf_counter()
            device.copy_(source, non_blocking=True)  # returns at once from page-locked memory, after it otherwise
            host_seconds.append(time.perf_counter() - called)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        result["copy_to_gpu_gb_per_s"] = source.numel() / statistics.median(seconds) / 1e9
        result["copy_host_ms"] = statistics.median(host_seconds) * 1e3
        assert int(device[-1]) == 1
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.image_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--width", type=int, default=8, help="per-GPU LoRA width (BD r'=32 at TP=4: 8)")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    # The GPU the images are copied to, as a worker's: ImageMemory page-locks its slabs for a GPU only, and the
    # per-image blocks follow the same rule
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    pinned = device is not None
    if pinned:  # the CUDA context and the host allocator set up before either way is timed
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    nbytes = image_bytes(SHAPES[args.shape], args.tp, args.width)
    memory = ImageMemory(nbytes, device)
    ways = {
        "one pinned block per image": time_way(per_image_blocks(nbytes, pinned), args.images),
        "regions of shared slabs": time_way(memory.take, args.images),
    }
    ways["regions of shared slabs"]["held_beyond_images_bytes"] = memory.held_bytes - args.images * memory.region_bytes
    result = {
        "command": "python -m bench.image_memory " + " ".join(argv if argv is not None else os.sys.argv[1:]),
        "shape": args.shape, "tp": args.tp, "width": args.width, "images": args.images,
        "image_bytes": nbytes, "region_bytes": memory.region_bytes, "slab_bytes": memory.slab_bytes,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if pinned else None,
        "ways": ways,
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "image_memory.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# Host memory for slot images: {args.shape}, TP={args.tp}, width {args.width} "
        f"({nbytes / MIB:.2f} MiB per image; regions of {memory.region_bytes / MIB:.2f} MiB in slabs of "
        f"{memory.slab_bytes / MIB:.2f} MiB)",
        "",
        f"- {result['gpu'] or 'no GPU (pageable memory)'}, torch {torch.__version__}; `{result['command']}`",
        f"- {args.images} images taken and kept, then a third dropped and as many taken again",
        "",
        "| way | ms per image, accumulating (slowest) | ms per image, recycling | resident MiB per image kept "
        "| pinned | copy to GPU GB/s | copy call, host ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, way in ways.items():
        lines.append(
            f"| {name} | {way['ms_per_image_accumulating']:.2f} ({way['ms_slowest_image']:.1f}) | "
            f"{way['ms_per_image_recycling']:.3f} | {way['resident_bytes_per_image'] / MIB:.2f} | "
            f"{way['pinned']} | {way.get('copy_to_gpu_gb_per_s', 0):.1f} | {way.get('copy_host_ms', 0):.3f} |"
        )
    beyond = ways["regions of shared slabs"]["held_beyond_images_bytes"]
    lines += ["", f"The slabs held {beyond / MIB:.2f} MiB beyond the {args.images} images' regions at their peak."]
    with open(os.path.join(args.out, "image_memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
