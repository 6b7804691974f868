"""Runs vLLM engines (`vllm.LLM`) for the tests, one spec after another, in a long-lived process that imported vLLM
once (tests/conftest.py's `run_engine` and `EngineHost` drive it):

    python tests/engine_runner.py REPLY_FD        # reads one request a line on stdin: {"spec": path, "result": path}

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); an engine of one worker runs that worker
here too (the "uni" executor), a larger one spawns its workers as `vllm serve` does. A spec whose engine arguments
equal the live engine's runs on it; any other spec first shuts the live engine down. So a test pays vLLM's imports
once per run and an engine start once per distinct configuration. For each request a line goes to REPLY_FD:
{"ok": true, "new_engine": bool, "discard": bool} or {"ok": false, "error": text}; after a failure the process
exits, so that no half-built engine can touch the next spec, and after "discard" (a poisoned engine) it waits to be
killed with its workers.

SPEC: {"engine": {LLM kwargs}, "env": {variable: value} (set before the engine starts), "adapters": {name: path},
"requests": [{"adapter": name|null, "prompt_token_ids": [...]}], "max_tokens": N, "top_logprobs": K (default 1),
"count_collectives": [adapter name|null, ...], "expect_errors": [adapter name, ...], "poison": adapter name,
"pin": adapter name (pinned with `pin_lora` after the batch, before "after"), "after": [requests, each run alone
after the batch]}

RESULT: {"outputs": [{"token_ids": [...], "logprobs": [...], "top_logprobs": [{token: logprob}]}],
"collectives": {probe: [per-worker {op: count}]}, "errors": {adapter name: message or null},
"pinned": {"registered_before": [per-worker bool], "returned": bool, "slots": [per-worker slot ids], "id": int},
"after": [outputs], "kv_non_finite": [per-worker count]}; with "adapter_loads" also "adapter_loads" (per-worker loads by
kind, after the batch), and after "after", "adapter_loads_after" and "slots_after" (per-worker slot ids). "poison"
admits that adapter, then sets every weight of its LoRA slot to NaN on every worker (what admission refuses, written
past it) before the batch runs; the host is discarded after that spec, so no other spec meets the poisoned slot.
"""

import gc
import json
import os
import sys
import traceback

# The engine core in this process: one process fewer to start (and to import vLLM in) per engine.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function


def _install_counters(worker):
    from collections import Counter

    from vllm.distributed.parallel_state import get_tp_group

    if hasattr(worker, "_bdlora_collectives"):  # the engine served an earlier spec's probe
        return True
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


def _poison_slot(worker, lora_request):
    import torch

    # A load takes room in vLLM's caches only where there is some: put the adapter in a slot as a step would.
    worker.model_runner.lora_manager.add_adapter(lora_request)
    manager = worker.model_runner.lora_manager._adapter_manager
    index = manager.lora_index_to_id.index(lora_request.lora_int_id)
    poisoned = 0
    for module in manager.modules.values():
        for attribute in ("lora_a_stacked", "lora_b_stacked"):
            value = getattr(module, attribute, None)
            for stacked in (value,) if isinstance(value, torch.Tensor) else value or ():
                if isinstance(stacked, torch.Tensor):
                    stacked[index] = float("nan")
                    poisoned += 1
    return poisoned


def _slot_adapter_ids(worker):
    """The adapter id in each GPU slot of this worker (None: a free slot)."""
    return list(worker.model_runner.lora_manager._adapter_manager.lora_index_to_id)


def _registered_adapter_ids(worker):
    """The adapters vLLM's host cache on this worker holds."""
    return sorted(worker.model_runner.lora_manager._adapter_manager._registered_adapters)


def _adapter_loads(worker):
    """How this worker's adapters reached their slots (loads by kind: admission, reread, restore, slot_fill, ...),
    and which of the adapters it keeps in memory are slot images."""
    from vllm_bdlora.adapter_lifecycle.worker import WorkerAdapters

    adapters = WorkerAdapters.of(worker.model_runner.lora_manager)
    kept = adapters.kept
    resident = sorted(kept.resident_ids()) if kept is not None else []
    return {"loads": {kind: histogram.count for kind, histogram in adapters.stats.loads.items()},
            "imaged": [i for i in resident if kept.get(i).image is not None]}  # fmt: skip


def _kv_non_finite(worker):
    """Non-finite entries in the worker's KV cache, counted a slice at a time (on a GPU the cache fills most of its
    memory: a mask of the whole of it would not fit beside it). The slices are views along the leading dimensions,
    never a reshape, which copies a cache whose strides are permuted (36 GiB on an H100)."""
    import torch

    def count(tensor) -> int:
        if tensor.numel() <= 1 << 26 or tensor.dim() == 1:
            return int((~torch.isfinite(tensor)).sum())
        step = max(1, (1 << 26) // max(1, tensor[0].numel()))
        if step == 1:
            return sum(count(tensor[i]) for i in range(tensor.shape[0]))
        return sum(count_flat(tensor[i : i + step]) for i in range(0, tensor.shape[0], step))

    def count_flat(view) -> int:
        return int((~torch.isfinite(view)).sum())

    caches = getattr(worker.model_runner, "kv_caches", None) or []
    return sum(count(c) for c in caches if isinstance(c, torch.Tensor) and c.is_floating_point())


def _output(o):
    return {
        "token_ids": list(o.outputs[0].token_ids),
        "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)],
        "top_logprobs": [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
        "finish_reason": o.outputs[0].finish_reason,
        "stop_reason": o.outputs[0].stop_reason,
    }


class Engine:
    """One live `LLM` and the adapter ids it has given out: an id names one (name, path) for the engine's life, as
    vLLM's caches expect, and a name another spec gave a different path is served under a name of its own."""

    def __init__(self, engine_args: dict):
        from vllm import LLM

        workers = engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
        args = dict(engine_args)
        if workers == 1:
            args.setdefault("distributed_executor_backend", "uni")
        self.key = json.dumps(engine_args, sort_keys=True)
        self.llm = LLM(**args)
        self.ids: dict[tuple[str, str], int] = {}
        self.names: dict[str, str] = {}  # served name -> path

    def lora(self, name, path):
        from vllm.lora.request import LoRARequest

        if name is None:
            return None
        if (name, path) not in self.ids:
            self.ids[(name, path)] = len(self.ids) + 1
        served = name if self.names.setdefault(name, path) == path else f"{name}-{self.ids[(name, path)]}"
        self.names[served] = path
        return LoRARequest(served, self.ids[(name, path)], path)

    def close(self):
        from vllm.distributed import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()


def run_spec(engine: Engine, spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, adapters = engine.llm, spec.get("adapters", {})

    def lora(name):
        return engine.lora(name, adapters[name] if name is not None else None)

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
    if spec.get("request_errors"):
        # a request is the first to name each of these adapters: its generate call must fail with the refusal, and
        # the requests below still run (the engine must not wait for the refused request)
        result["request_errors"] = {}
        for name in spec["request_errors"]:
            try:
                generate([{"adapter": name, "prompt_token_ids": [5, 6, 7, 8]}], 2)
                result["request_errors"][name] = None
            except Exception as e:  # the message is what the test checks
                result["request_errors"][name] = f"{type(e).__name__}: {e}"
    if spec.get("load_first"):
        # add_lora for each adapter, as load requests do, before any request names them: which GPU slots they took
        loads = [lora(name) for name in spec["load_first"]]
        before = llm.collective_rpc(_slot_adapter_ids)
        for request in loads:
            llm.llm_engine.add_lora(request)
        names = {request.lora_int_id: name for request, name in zip(loads, spec["load_first"], strict=True)}
        result["slots_around_loads"] = {"loaded": [request.lora_int_id for request in loads], "names": names,
                                        "before": before, "after": llm.collective_rpc(_slot_adapter_ids)}  # fmt: skip
    if spec.get("poison"):
        poisoned = lora(spec["poison"])
        llm.llm_engine.add_lora(poisoned)
        assert all(llm.collective_rpc(_poison_slot, args=(poisoned,)))
    if spec.get("requests"):
        outputs = generate(spec["requests"], spec["max_tokens"])
        result["outputs"] = [_output(o) for o in outputs]
    if spec.get("adapter_loads"):
        result["adapter_loads"] = llm.collective_rpc(_adapter_loads)
    if spec.get("pin"):
        pinned = lora(spec["pin"])
        registered = [pinned.lora_int_id in ids for ids in llm.collective_rpc(_registered_adapter_ids)]
        returned = llm.llm_engine.pin_lora(pinned.lora_int_id)
        result["pinned"] = {"registered_before": registered, "returned": returned, "id": pinned.lora_int_id,
                            "slots": llm.collective_rpc(_slot_adapter_ids)}  # fmt: skip
    if spec.get("after"):
        result["after"] = [_output(generate([request], spec["max_tokens"])[0]) for request in spec["after"]]
        result["kv_non_finite"] = llm.collective_rpc(_kv_non_finite)
        if spec.get("adapter_loads"):
            result["adapter_loads_after"] = llm.collective_rpc(_adapter_loads)
            result["slots_after"] = llm.collective_rpc(_slot_adapter_ids)
    if spec.get("count_collectives"):
        llm.collective_rpc(_install_counters)
        result["collectives"] = {}
        for probe in spec["count_collectives"]:
            llm.collective_rpc(_reset_counters)
            generate([{"adapter": probe, "prompt_token_ids": [5, 6, 7, 8]}], 4)
            result["collectives"][str(probe)] = llm.collective_rpc(_read_counters)
    return result


def main(reply_fd: int) -> None:
    replies = os.fdopen(reply_fd, "w", buffering=1)
    environment, cpus = dict(os.environ), os.sched_getaffinity(0)
    engine = None
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("close"):  # the caller is done with the live engine (it keeps this process)
            if engine is not None:
                engine.close()
                engine = None
            replies.write(json.dumps({"ok": True}) + "\n")
            continue
        try:
            with open(request["spec"]) as f:
                spec = json.load(f)
            key = json.dumps(spec["engine"], sort_keys=True)
            new_engine = engine is None or engine.key != key
            if new_engine:
                if engine is not None:
                    engine.close()
                    engine = None
                # Each engine sees this process's environment and cores as it started, plus its spec's variables
                # (a worker run here binds this thread to its cores).
                os.environ.clear()
                os.environ.update(environment | spec.get("env", {}))
                os.sched_setaffinity(0, cpus)
                engine = Engine(spec["engine"])
            result = run_spec(engine, spec)
            with open(request["result"], "w") as f:
                json.dump(result, f)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            replies.write(json.dumps({"ok": False, "error": traceback.format_exc(limit=3)}) + "\n")
            os._exit(1)  # a half-built or failed engine must not serve the next spec
        sys.stdout.flush()
        sys.stderr.flush()
        # A poisoned engine serves nothing after its spec: the caller kills this host and its workers (shutting
        # such an engine down in process at TP=2 on a GPU did not return within 12 minutes).
        discard = bool(spec.get("poison"))
        replies.write(json.dumps({"ok": True, "new_engine": new_engine, "discard": discard}) + "\n")
        if discard:
            sys.stdin.read()  # until the caller kills the host
            return
    if engine is not None:
        engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
