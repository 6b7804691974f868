"""The host time of a slot fill: what a step spends in vLLM's `_apply_adapters` when its adapter is not in a GPU slot
and not in vLLM's host cache (the common case when a worker keeps hundreds of admitted adapters and vLLM's cache a
few): load from the worker's store, vLLM's registration (packing q/k/v and gate/up), the activation and the copies.

The Python work grows with the model's depth, not its width, so a deep tiny Llama (`--layers 32`: Llama-3.1-8B's
224 adapted projections) on vLLM's CPU backend measures it; on a GPU the copies are asynchronous, and this is the
part of a fill the step waits for on the host. One slot (`--max-loras 1`) and one host-cache entry, adapters asked
for in turn, so every request fills; the fused kernels, so every adapter is filled from its slot image.

    python -m bench.slot_fill_host --layers 32 --adapters 6 --rounds 5 --out OUT

writes OUT/slot_fill_host.json and OUT/slot_fill_host.md: milliseconds per fill (median, p90) over the timed
rounds, after one round that admits and warms up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.slot_fill_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, each asking for every adapter once")
    parser.add_argument("--workdir", default=None, help="where the model and adapters go (default: a temp dir)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process, to time its calls

    import torch
    import vllm
    import vllm.lora.worker_manager as worker_manager
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_bdlora.tiny import make_adapter, make_tiny_llama

    workdir = args.workdir or tempfile.mkdtemp(prefix="slot-fill-")
    base = os.path.join(workdir, f"llama-{args.layers}-layers")
    if not os.path.exists(base):
        make_tiny_llama(base, num_hidden_layers=args.layers)
    paths = []
    for i in range(args.adapters):
        path = os.path.join(workdir, f"r{args.rank}-{i}")
        if not os.path.exists(path):
            make_adapter(base, path, rank=args.rank, seed=i + 1)
        paths.append(path)
    llm = LLM(model=base, dtype="float32", enable_lora=True, max_lora_rank=args.rank, max_loras=1, max_cpu_loras=1,
              max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0,
              additional_config={"bdlora": {"lora_kernels": "fused"}})  # fmt: skip
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(paths)]
    for request in requests:
        llm.llm_engine.add_lora(request)
    prompt, params = [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1)

    def ask_each():
        for request in requests:
            llm.generate(prompt, params, lora_request=request, use_tqdm=False)

    ask_each()  # admitted, registered once, warmed up
    apply = worker_manager.LRUCacheWorkerLoRAManager._apply_adapters
    seconds = []

    def timed(self, adapter_requests):
        started = time.perf_counter()
        try:
            return apply(self, adapter_requests)
        finally:
            seconds.append(time.perf_counter() - started)

    worker_manager.LRUCacheWorkerLoRAManager._apply_adapters = timed
    try:
        for _ in range(args.rounds):
            ask_each()
    finally:
        worker_manager.LRUCacheWorkerLoRAManager._apply_adapters = apply
    fills = sorted(s * 1e3 for s in seconds)
    result = {
        "command": "python -m bench.slot_fill_host " + " ".join(argv if argv is not None else os.sys.argv[1:]),
        "layers": args.layers, "adapted_projections": 7 * args.layers, "adapters": args.adapters,
        "fills": len(fills), "ms_per_fill_median": statistics.median(fills),
        "ms_per_fill_p90": fills[int(0.9 * (len(fills) - 1))],
        "vllm": vllm.__version__, "torch": torch.__version__, "cpus": os.cpu_count(),
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "slot_fill_host.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = (
        f"# Host time of a slot fill: {args.layers} layers ({7 * args.layers} adapted projections)\n\n"
        f"`{result['command']}`; vLLM {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs\n\n"
        f"| fills | ms per fill, median | p90 |\n|---|---|---|\n"
        f"| {len(fills)} | {result['ms_per_fill_median']:.2f} | {result['ms_per_fill_p90']:.2f} |\n"
    )
    with open(os.path.join(args.out, "slot_fill_host.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
