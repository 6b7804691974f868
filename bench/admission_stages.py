"""Where one rank's admission of an adapter spends its time, stage by stage, beside what stock vLLM's reader costs the
same rank for a standard adapter of the same model.

An admission (`vllm_bdlora.adapter_lifecycle.read_and_cut`) opens the files and maps the weights, cuts every module
to the rank's share (`vllm_bdlora.sharding.localize`, with the rank's shard of each Llama projection; slices of the
mapped file where a share is one), copies the shares into the adapter's slot image (`vllm_bdlora.slot_arena`: one
region of host memory in one GPU slot's layout, pinned where a GPU copies from it), checks the values there
(`values.value_problems`) and hands views of the image to vLLM's `LoRAModel.from_lora_tensors`. One arena serves
every adapter, as on a worker: the warm-up adapter's image takes a fresh slab of `vllm_bdlora.image_memory`, the
timed ones regions their predecessors gave back (a worker's steady state once its images fill its budget and spills,
unloads and read-backs recycle them). Stock vLLM's worker reads the whole adapter on every rank with
`LoRAModel.from_local_checkpoint`. Neither needs the model, so the stages run at any shape on any machine; the whole
admission over HTTP is `bench/many_adapters.py`'s load phase.

    python -m bench.admission_stages --shape llama-3.1-8b --tp 4 --adapters 8 --out OUT

writes OUT/stages.json and OUT/stages.md: milliseconds per adapter (median over the adapters, after one warm-up
adapter of each kind) for each stage, on one torch thread as a vLLM GPU worker runs, with every adapter's files read
into the page cache first. BD's stages are timed twice: alone, and on a thread beside one that spins as a worker's main
thread does on vLLM's message queue (`beside_a_spinning_reader`). A worker's main thread waits instead while its
threads admit and its engine runs no steps (`vllm_bdlora.adapter_lifecycle.worker.wait_for_engine_message`), so the
second timing is the contention that wait avoids, and what a worker pays when it admits while serving; a server's
loads over HTTP (`bench/many_adapters.py`) measure the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bench.adapters import bd_rank_for, write_adapter
from bench.shapes import SHAPES, LlamaShape
from vllm_bdlora.tiny import ALL_PROJECTIONS, BD_A


def module_kind(tensor_name: str) -> str:
    return tensor_name.split(".")[-3]


def bd_admission(path: str, shape: LlamaShape, tp: int, nblocks: int) -> dict[str, float]:
    """Seconds per stage of one rank-0 admission of the BD adapter at `path`."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from vllm_bdlora.adapter_lifecycle.files import open_adapter
    from vllm_bdlora.adapter_lifecycle.values import value_problems
    from vllm_bdlora.adapters import adapter_format
    from vllm_bdlora.sharding import localize

    sizing_shape = shape.sizing_shape()  # its `geometry`: each TP rank's shard, as vLLM shards it
    seconds = {}
    started = time.perf_counter()
    with open_adapter(path, "bench") as opened:
        adapter_format(opened.config, "bench")
        config = opened.config
        views = opened.tensor_views()
        seconds["open and map"] = time.perf_counter() - started
        started = time.perf_counter()
        tensors = {}
        for a_name, lora_a in views.items():
            if not a_name.endswith(".lora_A.weight"):
                continue
            b_name = a_name.replace(".lora_A.", ".lora_B.")
            module = module_kind(a_name)
            factor = "a" if module in BD_A else "b"
            local = localize(lora_a, views[b_name], sizing_shape.geometry(module, tp, 0), factor, nblocks,
                             copy=False)  # fmt: skip
            tensors[a_name], tensors[b_name] = local.lora_a, local.lora_b
        seconds["cut to the rank"] = time.perf_counter() - started
        arena, targets = slot_arena_of(tensors)
        started = time.perf_counter()
        image = arena.image_of((name, targets[name], tensors[name], tensors[name.replace(".lora_A.", ".lora_B.")])
                               for name in targets)  # fmt: skip
        for name in targets:
            tensors[name], tensors[name.replace(".lora_A.", ".lora_B.")] = image.views(name)
        seconds["slot image"] = time.perf_counter() - started
        del views
    started = time.perf_counter()
    modules = [
        (name, tensors[name], tensors[name.replace(".lora_A.", ".lora_B.")], 1.0)
        for name in tensors
        if ".lora_A." in name
    ]
    assert value_problems(modules, torch.bfloat16) == ([], [])
    seconds["check values"] = time.perf_counter() - started
    started = time.perf_counter()
    LoRAModel.from_lora_tensors(lora_model_id=1, tensors=tensors, peft_helper=PEFTHelper.from_dict(config),
                                device="cpu", dtype=torch.bfloat16)  # fmt: skip
    seconds["LoRAModel in host memory"] = time.perf_counter() - started
    return seconds


# Llama's projections as vLLM packs them: (packed layer, slice)
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}  # fmt: skip


class PackedLayerShape:
    """What the slot arena reads of a served model's packed LoRA layer: its buffers' shapes (never allocated here)."""

    dora_scale = None

    def __init__(self, inputs: int, heights: list[int], width: int):
        self.output_slices = tuple(heights)
        self.slice_offsets = tuple(sum(heights[:i]) for i in range(len(heights)))
        self.lora_a_all = torch.empty(1, len(heights) * width, inputs, device="meta")
        self.lora_b_all = torch.empty(1, sum(heights), width, device="meta")

    def bind_slot_buffers(self, *buffers) -> None:
        pass


_ARENAS: dict = {}  # the shares' shapes -> (arena, targets): one arena for every adapter of a shape


def slot_arena_of(tensors: dict) -> tuple:
    """A one-slot arena of the packed layers the cut shares in `tensors` go into, and each A tensor's target."""
    key = tuple((name, tuple(t.shape)) for name, t in tensors.items())
    if key not in _ARENAS:
        _ARENAS[key] = new_slot_arena(tensors)
    return _ARENAS[key]


def new_slot_arena(tensors: dict) -> tuple:
    from vllm_bdlora.adapter_lifecycle.targets import LoRATarget
    from vllm_bdlora.slot_arena import SlotArena

    slices: dict[str, dict[int, tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, lora_a in tensors.items():
        if ".lora_A." in name:
            packed, index = PACKED[module_kind(name)]
            layer = name.rsplit(".", 3)[0] + "." + packed  # e.g. ...layers.0.self_attn.qkv_proj
            slices.setdefault(layer, {})[index] = (name, lora_a, tensors[name.replace(".lora_A.", ".lora_B.")])
    layers, targets = [], {}
    for by_index in slices.values():
        ordered = [by_index[i] for i in sorted(by_index)]
        width = max(a.shape[0] for _, a, _ in ordered)
        layer = PackedLayerShape(ordered[0][1].shape[1], [b.shape[0] for _, _, b in ordered], width)
        layers.append(layer)
        targets.update({name: LoRATarget(layer, i) for i, (name, _, _) in enumerate(ordered)})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return SlotArena(layers, 1, torch.bfloat16, device), targets


def stock_read(path: str) -> dict[str, float]:
    """Seconds of stock vLLM's read of the standard adapter at `path` on one rank (the whole adapter)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    started = time.perf_counter()
    helper = PEFTHelper.from_local_dir(path, None)
    LoRAModel.from_local_checkpoint(path, set(ALL_PROJECTIONS), helper, lora_model_id=1, device="cpu",
                                    dtype=torch.bfloat16)  # fmt: skip
    return {"from_local_checkpoint": time.perf_counter() - started}


def beside_a_spinning_reader(admit):
    """`admit()` on a thread of its own while this thread spins as a vLLM worker's main thread does for a second after
    each call it reads from the engine core's message queue (check the queue, `os.sched_yield`, again; the admission
    polls keep it spinning while adapters are read, unless its engine runs no steps and it waits instead): both need
    the interpreter lock, which the admission thread takes back after every tensor operation that releases it."""
    import threading

    outcome = {}

    def run():
        try:
            outcome["stages"] = admit()
        except BaseException as error:  # raised here, on the calling thread, rather than lost with the thread
            outcome["error"] = error

    worker = threading.Thread(target=run)
    worker.start()
    while worker.is_alive():
        os.sched_yield()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["stages"]


def median_ms(runs: list[dict[str, float]]) -> dict[str, float]:
    stages = list(runs[0])
    table = {stage: 1000 * statistics.median(run[stage] for run in runs) for stage in stages}
    table["total"] = 1000 * statistics.median(sum(run.values()) for run in runs)
    return table


def machine() -> dict:
    import vllm

    from bench.slot_images import machine as torch_machine

    return {**torch_machine(), "vllm": vllm.__version__, "pinned host memory": torch.cuda.is_available()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.admission_stages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size whose rank 0 is timed")
    parser.add_argument("--rank", type=int, default=16, help="standard rank (BD: the paper's pair, e.g. 16 -> 32)")
    parser.add_argument("--adapters", type=int, default=8, help="adapters timed per kind (one more warms up)")
    parser.add_argument("--adapter-dir", default=None, help="where adapters are written (default: OUT/adapters)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: as vLLM's GPU workers run, OMP_NUM_THREADS=1 unless set)",
    )
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    adapter_dir = args.adapter_dir or os.path.join(args.out, "adapters")
    bd_rank = bd_rank_for(args.rank)
    count = args.adapters + 1
    bd = [
        write_adapter(shape, os.path.join(adapter_dir, f"bd{bd_rank}-{i}"), bd_rank, args.tp, seed=i)
        for i in range(count)
    ]
    standard = [
        write_adapter(shape, os.path.join(adapter_dir, f"r{args.rank}-{i}"), args.rank, seed=i) for i in range(count)
    ]
    for path in bd + standard:  # every file in the page cache first: the stages time the work, not the disk
        for name in os.listdir(path):
            with open(os.path.join(path, name), "rb") as f:
                while f.read(1 << 24):
                    pass
    bd_runs = [bd_admission(path, shape, args.tp, args.tp) for path in bd][1:]
    beside_spinner = [
        beside_a_spinning_reader(lambda path=path: bd_admission(path, shape, args.tp, args.tp)) for path in bd
    ][1:]
    stock_runs = [stock_read(path) for path in standard][1:]
    result = {
        "command": "python -m bench.admission_stages " + " ".join(argv if argv is not None else sys.argv[1:]),
        "shape": args.shape, "tp": args.tp, "bd_rank": bd_rank, "nblocks": args.tp, "standard_rank": args.rank,
        "adapters": args.adapters, "machine": machine(),
        "bd_admission_ms": median_ms(bd_runs), "bd_admission_beside_spinning_reader_ms": median_ms(beside_spinner),
        "stock_read_ms": median_ms(stock_runs),
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stages.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# One rank's adapter admission, {args.shape} at TP={args.tp} (rank 0)", "",
             f"`{result['command']}`; {json.dumps(result['machine'])}", "",
             f"BD r'={bd_rank} in {args.tp} blocks (vllm-bdlora's admission) and standard r={args.rank} (stock vLLM's "
             f"read, every rank the whole adapter); median ms per adapter over {args.adapters}.", "",
             "| stage | ms |", "|---|---|"]  # fmt: skip
    lines += [f"| BD: {stage} | {ms:.1f} |" for stage, ms in result["bd_admission_ms"].items()]
    lines += [f"| BD on a thread beside a spinning reader: {stage} | {ms:.1f} |"
              for stage, ms in result["bd_admission_beside_spinning_reader_ms"].items()]  # fmt: skip
    lines += [f"| stock: {stage} | {ms:.1f} |" for stage, ms in result["stock_read_ms"].items() if stage != "total"]
    with open(os.path.join(args.out, "stages.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
