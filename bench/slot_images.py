"""Slot images at the adapter's width against images as wide as the slot: a worker's host bytes per adapter, the
image's build (the `image` stage of an admission) and a slot fill from it.

A BD worker on the fused kernels keeps each admitted adapter as an image of a GPU slot (`vllm_bdlora.slot_arena`).
An adapter narrower than the slot (rank 16 under `--max-lora-rank 64`, or BD r'=4 at TP=1 in vLLM's smallest slots,
width 8) keeps an image of its own width, the power of two holding its widest module; an image as wide as the slot
holds zeros past the adapter's width. Both kinds of image are made here by the same arena from the same factors, the
slot-width one as `SlotArena.image_of` makes it for an adapter as wide as the slot, and they fill a slot in turns:

    python -m bench.slot_images --shape llama-3.1-8b --tp 1 --slot-width 8 --widths 4,8 --images 8 --out OUT

writes OUT/slot_images.json and OUT/slot_images.md: per adapter width and image kind, the bytes of one image (a
region of `vllm_bdlora.image_memory`), the median milliseconds to build it from the cut shares (one torch thread, as
a GPU worker runs; regions reused, as in a worker whose images fill its budget) and of a fill: the host's time in
`SlotArena.fill` and, on a GPU, the copies' time on the stream (CUDA events). Every fill is checked: the slot's layers
hold the same factors and widths whichever image filled it. No vLLM is needed: the layers are their buffers' shapes
(Llama's packed projections on one GPU of `--tp`, BD-sharded), so it runs on a bare GPU host and on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from bench.shapes import SHAPES


class PackedLayer:
    """A fused BD layer as the slot arena sees it: its buffers' shapes (`lora_a_all` (slots, slices x width, in),
    `lora_b_all` (slots, height, width)) and the views the arena binds it to."""

    dora_scale = None

    def __init__(self, inputs: int, heights: tuple[int, ...], width: int):
        self.output_slices = heights
        self.slice_offsets = tuple(sum(heights[:i]) for i in range(len(heights)))
        self.lora_a_all = torch.empty(1, len(heights) * width, inputs, device="meta")
        self.lora_b_all = torch.empty(1, sum(heights), width, device="meta")

    def bind_slot_buffers(self, lora_a_all, lora_b_all, slot_widths, arena) -> None:
        self.lora_a_all, self.lora_b_all, self.slot_widths = lora_a_all, lora_b_all, slot_widths


@dataclass(frozen=True)
class Target:
    """Where a module's share goes: its packed layer and slice (as `adapter_lifecycle.targets.LoRATarget`)."""

    layer: PackedLayer
    slice_index: int


def llama_layers(shape_name: str, tp: int, slot_width: int) -> list[PackedLayer]:
    """One GPU's packed projections of every decoder layer: qkv, o, gate_up, down, with vLLM's TP sharding."""
    shape = SHAPES[shape_name].sizing_shape()
    q_local = shape.heads * shape.head_dim // tp
    kv_local = max(1, shape.kv_heads // tp) * shape.head_dim
    i_local = shape.intermediate // tp
    layers = []
    for _ in range(shape.layers):
        layers += [PackedLayer(shape.hidden, (q_local, kv_local, kv_local), slot_width),
                   PackedLayer(q_local, (shape.hidden,), slot_width),
                   PackedLayer(shape.hidden, (i_local, i_local), slot_width),
                   PackedLayer(i_local, (shape.hidden,), slot_width)]  # fmt: skip
    return layers


def random_shares(layers: list[PackedLayer], width: int, seed: int) -> list[tuple]:
    """(name, target, A (width, in), B (height, width)) of every slice: random non-zero bfloat16 factors, contiguous
    as the cut shares of a weights file are."""
    g = torch.Generator().manual_seed(seed)
    shares = []
    for n, layer in enumerate(layers):
        inputs = layer.lora_a_all.shape[2]
        for index, height in enumerate(layer.output_slices):
            a = (torch.rand(width, inputs, generator=g) + 0.5).bfloat16()
            b = (torch.rand(height, width, generator=g) + 0.5).bfloat16()
            shares.append((f"{n}.{index}", Target(layer, index), a, b))
    return shares


def slot_of(arena, layers: list[PackedLayer], slot: int) -> list[torch.Tensor]:
    """What the kernels read of `slot`: every layer's A, B and widths (copied to the host)."""
    return [t[slot].cpu() for layer in layers for t in (layer.lora_a_all, layer.lora_b_all)] + [
        arena.widths[:, slot].cpu()
    ]


def timed_fill(arena, slot: int, image) -> tuple[float, float | None]:
    """(host seconds in `fill`, seconds of its copies on the GPU's stream or None on a CPU)."""
    if not arena.factors.is_cuda:
        started = time.perf_counter()
        arena.fill(slot, image)
        return time.perf_counter() - started, None
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    started = time.perf_counter()
    arena.fill(slot, image)
    host = time.perf_counter() - started
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / 1000


def measure(args, width: int) -> dict:
    from vllm_bdlora.slot_arena import SlotArena

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = llama_layers(args.shape, args.tp, args.slot_width)
    arena = SlotArena(layers, 2, torch.bfloat16, device)
    kinds = {"adapter's width": arena.image_width([width]), "slot's width": arena.slot_width}
    found = {kind: {"image_width": w, "image_bytes": arena.memory_for(w).region_bytes, "build_s": [], "fill_s": [],
                    "fill_gpu_s": []} for kind, w in kinds.items()}  # fmt: skip
    for i in range(args.images + 1):  # the first of each kind warms up (a fresh slab), the rest reuse its region
        shares = random_shares(layers, width, seed=i)
        held = {}
        for kind, image_width in kinds.items():
            started = time.perf_counter()
            image = arena.image_of(shares, width=image_width)
            built = time.perf_counter() - started
            host, gpu = timed_fill(arena, 0, image)
            held[kind] = slot_of(arena, layers, 0)
            if i:
                found[kind]["build_s"].append(built)
                found[kind]["fill_s"].append(host)
                if gpu is not None:
                    found[kind]["fill_gpu_s"].append(gpu)
            del image
        narrow, wide = held.values()
        if not all(torch.equal(x, y) for x, y in zip(narrow, wide, strict=True)):
            raise SystemExit(f"width {width}: the slot differs between the two images' fills (image {i})")
    out = {"adapter_width": width, "kinds": {}}
    for kind, values in found.items():
        out["kinds"][kind] = {
            "image_width": values["image_width"], "image_bytes": values["image_bytes"],
            "build_ms": 1000 * statistics.median(values["build_s"]),
            "fill_host_ms": 1000 * statistics.median(values["fill_s"]),
            "fill_gpu_ms": 1000 * statistics.median(values["fill_gpu_s"]) if values["fill_gpu_s"] else None,
        }  # fmt: skip
    return out


def machine() -> dict:
    import platform

    found = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
             "torch threads": torch.get_num_threads()}  # fmt: skip
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.slot_images", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size whose GPU's share is imaged")
    parser.add_argument("--slot-width", type=int, default=8,
                        help="LoRA columns of a slot per GPU (BD: --max-lora-rank / TP)")  # fmt: skip
    parser.add_argument("--widths", default="4,8", help="adapters' LoRA columns per GPU, comma-separated")
    parser.add_argument("--images", type=int, default=8, help="images timed per width and kind (one more warms up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as vLLM's GPU workers run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",")]
    if any(w < 1 or w > args.slot_width for w in args.widths):
        parser.error(f"--widths: each from 1 to --slot-width ({args.slot_width})")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "command": "python -m bench.slot_images " + " ".join(argv if argv is not None else sys.argv[1:]),
        "shape": args.shape, "tp": args.tp, "slot_width": args.slot_width, "machine": machine(),
        "widths": [measure(args, width) for width in args.widths],
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "slot_images.json"), "w") as f:
        json.dump(result, f, indent=1)
    on_gpu = "gpu" in result["machine"]
    lines = [f"# Slot images at the adapter's width against the slot's: {args.shape}, one GPU's share at TP={args.tp}",
             "", f"`{result['command']}`; {json.dumps(result['machine'])}", "",
             f"Slots {args.slot_width} LoRA columns wide per GPU; median ms over {args.images} images per row. "
             "Fill: the host's time in `SlotArena.fill`" + ("; on the GPU, its copies' time on the stream." if on_gpu
                                                            else " (pageable memory on a CPU)."), "",
             "| adapter width | image | image width | MiB per adapter | build ms | fill, host ms | fill, GPU ms |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["widths"]:
        for kind, k in row["kinds"].items():
            gpu = f"{k['fill_gpu_ms']:.3f}" if k["fill_gpu_ms"] is not None else "-"
            lines.append(f"| {row['adapter_width']} | {kind} | {k['image_width']} | {k['image_bytes'] / 2**20:.2f} | "
                         f"{k['build_ms']:.2f} | {k['fill_host_ms']:.3f} | {gpu} |")  # fmt: skip
    with open(os.path.join(args.out, "slot_images.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
