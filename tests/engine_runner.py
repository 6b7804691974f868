"""Runs one vLLM engine (`vllm.LLM`) in its own process, as tests/conftest.py's `run_engine` asks:

    python tests/engine_runner.py SPEC.json RESULT.json

SPEC: {"engine": {LLM kwargs}, "adapters": {name: path}, "requests": [{"adapter": name|null,
"prompt_token_ids": [...]}], "max_tokens": N, "top_logprobs": K (default 1),
"count_collectives": [adapter name|null, ...], "expect_errors": [adapter name, ...], "poison": adapter name,
"after": [requests, each run alone after the batch]}

RESULT: {"outputs": [{"token_ids": [...], "logprobs": [...], "top_logprobs": [{token: logprob}]}],
"collectives": {probe: [per-worker {op: count}]}, "errors": {adapter name: message or null},
"after": [outputs], "kv_non_finite": [per-worker count]}. "poison" admits that adapter, then sets every weight
of its LoRA slot to NaN on every worker (what admission refuses, written past it) before the batch runs. Each engine
gets a fresh process so that one test's engine (and its worker processes and memory) cannot leak into the next.
"""

import json
import os
import sys


def _install_counters(worker):
    from collections import Counter

    from vllm.distributed.parallel_state import get_tp_group

    comm = get_tp_group().device_communicator
    counts = Counter()
    worker._bdlora_collectives = counts
    for op in ("all_reduce", "all_gather", "gather", "reduce_scatter", "all_gatherv", "reduce_scatterv", "broadcast"):
        original = getattr(comm, op, None)
        if original is None:
            continue

        def counting(*args, _op=op, _original=original, **kwargs):
            counts[_op] += 1
            return _original(*args, **kwargs)

        setattr(comm, op, counting)
    return True


def _reset_counters(worker):
    worker._bdlora_collectives.clear()
    return True


def _read_counters(worker):
    return dict(worker._bdlora_collectives)


def _poison_slot(worker, adapter_id):
    import torch

    manager = worker.model_runner.lora_manager._adapter_manager
    index = manager.lora_index_to_id.index(adapter_id)
    poisoned = 0
    for module in manager.modules.values():
        for attribute in ("lora_a_stacked", "lora_b_stacked"):
            value = getattr(module, attribute, None)
            for stacked in (value,) if isinstance(value, torch.Tensor) else value or ():
                if isinstance(stacked, torch.Tensor):
                    stacked[index] = float("nan")
                    poisoned += 1
    return poisoned


def _kv_non_finite(worker):
    """Non-finite entries in the worker's KV cache, counted a slice at a time (on a GPU the cache fills most of its
    memory: a mask of the whole of it would not fit beside it)."""
    import torch

    caches = getattr(worker.model_runner, "kv_caches", None) or []
    total = 0
    for cache in caches:
        if not isinstance(cache, torch.Tensor) or not cache.is_floating_point():
            continue
        flat = cache.reshape(-1)
        for start in range(0, flat.numel(), 1 << 26):
            total += int((~torch.isfinite(flat[start : start + (1 << 26)])).sum())
    return total


def _output(o):
    return {
        "token_ids": list(o.outputs[0].token_ids),
        "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)],
        "top_logprobs": [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
    }


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(**spec["engine"])
    ids = {name: i + 1 for i, name in enumerate(spec.get("adapters", {}))}

    def lora(name):
        return None if name is None else LoRARequest(name, ids[name], spec["adapters"][name])

    def generate(requests, max_tokens):
        top = spec.get("top_logprobs", 1)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=top)
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
        return llm.generate(prompts, params, lora_request=[lora(r["adapter"]) for r in requests], use_tqdm=False)

    result = {}
    if spec.get("expect_errors"):
        # add_lora is how the API server validates an adapter before serving requests with it. The
        # requests below run after these failures: the engine must still serve everything else.
        result["errors"] = {}
        for name in spec["expect_errors"]:
            try:
                llm.llm_engine.add_lora(lora(name))
                result["errors"][name] = None
            except Exception as e:  # the message is what the test checks
                result["errors"][name] = f"{type(e).__name__}: {e}"
    if spec.get("poison"):
        llm.llm_engine.add_lora(lora(spec["poison"]))
        assert all(llm.collective_rpc(_poison_slot, args=(ids[spec["poison"]],)))
    if spec.get("requests"):
        outputs = generate(spec["requests"], spec["max_tokens"])
        result["outputs"] = [_output(o) for o in outputs]
    if spec.get("after"):
        result["after"] = [_output(generate([request], spec["max_tokens"])[0]) for request in spec["after"]]
        result["kv_non_finite"] = llm.collective_rpc(_kv_non_finite)
    if spec.get("count_collectives"):
        llm.collective_rpc(_install_counters)
        result["collectives"] = {}
        for probe in spec["count_collectives"]:
            llm.collective_rpc(_reset_counters)
            generate([{"adapter": probe, "prompt_token_ids": [5, 6, 7, 8]}], 4)
            result["collectives"][str(probe)] = llm.collective_rpc(_read_counters)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    main(sys.argv[1], sys.argv[2])
