"""Worker-side adapter loading for a BD-enabled LoRA manager: read an adapter's files once, validate every module
against the layer it targets and cut it to this rank's share, all before anything reaches a LoRA slot; then serve
every later load of it from what was kept (`vllm_bdlora.admission`).

An adapter is accepted whole or rejected whole (`AdapterRejected`, one message listing every problem),
so a bad adapter never leaves half-written state behind.

Reading (`read_adapter`, on an admission thread, no collective and no GPU work): the files are opened once
(`adapter_files.open_adapter`) and the weights file is mapped, so cutting a tensor to this rank's rows reads only
those rows' pages; each module's factors are checked against its layer and cut (`sharding.localize`), then handed to
vLLM's own `LoRAModel.from_lora_tensors` (names, scaling, dtype, pinned memory); their values are checked
(`adapter_values`) and B is multiplied by the module's scaling once, as vLLM would on every load. Finishing
(`finish_admission`, on the worker's own thread, in an add_lora call that every rank runs in the same order): DoRA's
magnitude scales, which need the layers' weights and, at TP > 1, one all-reduce.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vllm_bdlora.adapter_files import WEIGHTS_FILE, open_adapter
from vllm_bdlora.adapter_values import (
    GAIN_HINT,
    NON_FINITE_HINT,
    dora_scale_problems,
    gain_problems,
    non_finite_problems,
)
from vllm_bdlora.adapters import (
    AdapterFormat,
    AdapterRejected,
    adapter_format,
    read_adapter_format,
    refuse_unserved_kinds,
)
from vllm_bdlora.admission import AdapterStore, host_budget_bytes, is_admitting
from vllm_bdlora.compat import adapter_absolute_path, allowed_max_lora_ranks
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.dora import (
    DoraAdapter,
    is_magnitude_tensor,
    magnitude_scales,
    stage_magnitudes,
    unreadable_base_problems,
)
from vllm_bdlora.layers import BlockDiagonalLoRALayer
from vllm_bdlora.metrics import worker_stats
from vllm_bdlora.sharding import LocalFactors, ShardingError, foreign_model_problem, localize

logger = logging.getLogger("vllm.bdlora")

CHANGED_HINT = "load it again once its files are completely written (write elsewhere, then rename into place)."


@dataclass(frozen=True)
class LoRATarget:
    layer: BlockDiagonalLoRALayer
    slice_index: int


def bd_targets(manager) -> dict[str, LoRATarget]:
    """Adapter module name -> the BD layer (and packed slice) it is loaded into."""
    targets = {}
    for name, layer in manager.modules.items():
        if not isinstance(layer, BlockDiagonalLoRALayer):
            continue
        sub_modules = manager.packed_modules.get(name)
        if sub_modules:
            targets.update({sub: LoRATarget(layer, i) for i, sub in enumerate(sub_modules)})
        else:
            targets[name] = LoRATarget(layer, 0)
    return targets


def known_lora_modules(manager) -> set[str]:
    names = set(manager.modules)
    for sub_modules in manager.packed_modules.values():
        names.update(sub_modules)
    return names


def on_other_pipeline_stage(model, module: str) -> bool:
    """True when `module` lies under a layer that pipeline parallelism placed on another stage (vLLM keeps a
    PPMissingLayer in its place): that stage's workers load its LoRA, this one's skip it."""
    from vllm.model_executor.models.utils import PPMissingLayer

    node = model
    for part in module.split("."):
        node = node._modules.get(part) if isinstance(node, torch.nn.Module) else None
        if node is None:
            return False
        if isinstance(node, PPMissingLayer):
            return True
    return False


def smallest_max_lora_rank(width_needed: int, tp_size: int) -> int | None:
    return next((r for r in allowed_max_lora_ranks() if r >= width_needed * tp_size and r % tp_size == 0), None)


def width_problem(module: str, local: LocalFactors, rank: int, max_lora_rank: int, tp: int, parallelism: str) -> str:
    """Why `module` (`local`: its widest rank's share) does not fit the per-GPU LoRA width, and the fix; the server
    and `vllm-bdlora check` both say it."""
    fix = smallest_max_lora_rank(local.width, tp)
    fix_text = f"start the server with --max-lora-rank {fix}" if fix else "this module cannot be served at this TP"
    if local.nblocks == 1:
        why = f"a standard (non-BD) module needs its full rank {rank} on every GPU"
    else:
        why = (
            f"this GPU's shard touches {len(local.blocks)} of the {local.nblocks} blocks "
            f"(rank {rank} / {local.nblocks} per block)"
        )
        if len(local.blocks) * tp > local.nblocks:
            why += ": the blocks do not line up with the tensor-parallel shards (nblocks should be a multiple of TP"
            why += ", and TP must not exceed the number of KV heads)" if parallelism == "column" else ")"
    return (
        f"{module}: needs LoRA width {local.width} per GPU but each GPU has {max_lora_rank // tp} "
        f"(= --max-lora-rank {max_lora_rank} / TP {tp}); {why}; {fix_text}"
    )


@dataclass
class StagedModule:
    name: str
    local: LocalFactors
    target: LoRATarget
    weights: object = None  # vLLM's LoRALayerWeights, once built
    magnitude: torch.Tensor | None = None  # this rank's DoRA magnitude entries


@dataclass
class AdmittedAdapter:
    """An adapter as this rank serves it: vLLM's LoRAModel of the rank's share, B already scaled (scaling 1), built
    once. vLLM merges and packs the LoRAModel it is handed in place, so each load gets a shallow copy
    (`fresh_model`) whose module weights share these tensors."""

    name: str
    template: object
    identity: str  # digest of the files it was read from (`OpenedAdapter.identity`)
    summary: str
    not_served: list[str]
    deployment_targets: Sequence[str] | None
    staged: list[StagedModule] = field(default_factory=list)  # kept until DoRA's scales are computed
    dora: bool = False
    logged: bool = False

    @property
    def nbytes(self) -> int:
        total = 0
        for weights in self.template.loras.values():
            for tensor in (weights.lora_a, weights.lora_b):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    def fresh_model(self):
        model = copy.copy(self.template)
        model.loras = {name: copy.copy(weights) for name, weights in self.template.loras.items()}
        return model


def _grouped_by_module(views: dict, mapper) -> tuple[dict, dict, list[str]]:
    """({vLLM module: {"a": (tensor name, view), "b": ...}}, magnitude views, tensors vLLM's own reader handles
    as they are (embeddings, modules to save))."""
    import vllm.lora.lora_model as lora_model_module
    from vllm.lora.utils import is_base_embedding_weights

    parse = lora_model_module.parse_fine_tuned_lora_name
    modules: dict[str, dict] = {}
    magnitudes, passthrough = {}, []
    for tensor_name, view in views.items():
        if is_magnitude_tensor(tensor_name):
            magnitudes[tensor_name] = view
            continue
        if is_base_embedding_weights(tensor_name) or ".lora_embedding_" in tensor_name:
            passthrough.append(tensor_name)
            continue
        module, is_lora_a = parse(tensor_name, mapper)
        if not tensor_name.endswith((".lora_A.weight", ".lora_B.weight")):
            passthrough.append(tensor_name)
            continue
        modules.setdefault(module, {})["a" if is_lora_a else "b"] = (tensor_name, view)
    return modules, magnitudes, passthrough


def cut_to_rank(views: dict, fmt: AdapterFormat, manager, adapter: str, mapper,
                target_modules: Sequence[str] | None) -> tuple[dict, list[StagedModule], list[str], dict]:  # fmt: skip
    """This rank's share of every module (copies; `views` may be released after), or `AdapterRejected`.
    `target_modules`: vLLM's deployment-time restriction (--lora-target-modules), under which vLLM wraps only those
    modules and drops the adapter's others without a word; they are returned so that the caller can say so.
    Returns (tensor name -> tensor, the BD modules staged, the modules not served, the magnitude vectors)."""
    spec = fmt.block_diagonal
    targets = bd_targets(manager)
    known = known_lora_modules(manager)
    try:
        modules, magnitudes, passthrough = _grouped_by_module(views, mapper)
    except ValueError as e:
        raise AdapterRejected(adapter, [str(e)]) from None
    problems: list[str] = []
    not_served: list[str] = []
    staged: list[StagedModule] = []
    tensors = {name: views[name].clone() for name in passthrough}
    for module, factors in modules.items():
        factor = spec.factor_of(module) if spec else None
        target = targets.get(module)
        (a_name, lora_a), (b_name, lora_b) = factors.get("a", (None, None)), factors.get("b", (None, None))
        if target is None:
            if module not in known and on_other_pipeline_stage(manager.model, module):
                continue
            if module not in known and target_modules is not None:
                not_served.append(module)
            elif module not in known:
                problems.append(
                    f"{module}: no such LoRA-capable module in this model (is the adapter for another base model?)"
                )
            elif factor:
                problems.append(
                    f"{module}: block-diagonal LoRA-{factor.upper()} on a layer kind vllm-bdlora does not shard "
                    f"({type(manager.modules.get(module)).__name__}); train it as a standard LoRA module"
                )
            else:  # a layer vLLM's own classes serve (embeddings, lm_head, experts): vLLM cuts it
                tensors.update({name: view.clone() for name, view in ((a_name, lora_a), (b_name, lora_b)) if name})
            continue
        geometry = target.layer.shard_geometry(target.slice_index)
        foreign = foreign_model_problem(lora_a, geometry, factor)
        if foreign:
            problems.append(f"{module}: {foreign}")
            continue
        try:
            local = localize(lora_a, lora_b, geometry, factor, spec.nblocks if factor else 1)
        except ShardingError as e:
            problems.append(f"{module}: {e}")
            continue
        if local.width > target.layer.lora_width:
            layer = target.layer
            problems.append(width_problem(module, local, lora_a.shape[0], layer.lora_config.max_lora_rank,
                                          layer.tp_size, layer.parallelism))  # fmt: skip
            continue
        staged.append(StagedModule(module, local, target))
        tensors[a_name], tensors[b_name] = local.lora_a, local.lora_b
    if problems:
        raise AdapterRejected(adapter, problems)
    return tensors, staged, sorted(not_served), {name: view.clone() for name, view in magnitudes.items()}


VLLM_REFUSAL_HINT = (
    "train the adapter on this base model with PEFT: LoRA layers only (modules_to_save only for the classification "
    "head of a classification model), over the base model's own vocabulary."
)


def read_adapter(worker_manager, lora_request, settings: BdLoraSettings) -> AdmittedAdapter:
    """Read, check and cut one adapter (see the module's docstring); safe to run on an admission thread."""
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.lora_model import LoRAModel

    from vllm_bdlora.compat import lora_weights_mapper, peft_helper_from_config, validate_read_lora

    manager = worker_manager._adapter_manager
    name = lora_request.lora_name
    if getattr(lora_request, "tensorizer_config_dict", None):
        raise AdapterRejected(name, ["tensorizer-serialized adapters are not served with BD-LoRA"],
                              "save the adapter with PEFT's save_pretrained (safetensors).")  # fmt: skip
    try:
        source = adapter_absolute_path(lora_request.lora_path)
    except ValueError as e:
        raise AdapterRejected(name, [f"lora_path: {e}"]) from None
    if not os.path.exists(source):
        raise LoRAAdapterNotFoundError(name, lora_request.lora_path)
    mapper = lora_weights_mapper(manager.model)
    deployment_targets = getattr(manager.lora_config, "target_modules", None)
    try:
        opened = open_adapter(source, name, settings.allowed_adapter_roots)
    except FileNotFoundError:
        raise LoRAAdapterNotFoundError(name, lora_request.lora_path) from None
    with opened:
        fmt = adapter_format(opened.config, name)
        refuse_unserved_kinds(fmt, settings, name)
        peft_helper = peft_helper_from_config(opened.config, worker_manager)
        try:
            peft_helper.validate_legal(worker_manager.lora_config)
        except ValueError as e:
            raise AdapterRejected(name, [str(e)], rank_limit_hint(str(e), manager)) from None
        views = opened.tensor_views()
        try:
            tensors, staged, not_served, magnitudes = cut_to_rank(views, fmt, manager, name, mapper,
                                                                  deployment_targets)  # fmt: skip
        finally:
            del views
        if not opened.unchanged():
            raise AdapterRejected(name, ["its weights file changed while it was read"], CHANGED_HINT)
        identity = opened.identity
    model = worker_manager._adapter_manager.model
    try:
        lora_model = LoRAModel.from_lora_tensors(
            lora_model_id=lora_request.lora_int_id, tensors={**tensors, **magnitudes}, peft_helper=peft_helper,
            device="cpu", dtype=worker_manager.lora_config.lora_dtype, model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper, skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )  # fmt: skip
        validate_read_lora(worker_manager, lora_model, lora_request)
    except AdapterRejected:
        raise
    except (ValueError, RuntimeError) as e:  # vLLM refusing what this model cannot serve (a head, a vocabulary)
        raise AdapterRejected(name, [f"{WEIGHTS_FILE}: {e}"], VLLM_REFUSAL_HINT) from None
    check_values(lora_model, name, worker_manager.lora_config.lora_dtype)
    for item in staged:
        item.weights = lora_model.loras.get(item.name)
    staged = [item for item in staged if item.weights is not None]
    dora = DoraAdapter.of(lora_model)
    problems = stage_magnitudes(staged, dora.magnitudes, fmt.dora)
    if problems:
        raise AdapterRejected(name, problems)
    for weights in lora_model.loras.values():  # what vLLM's manager would do on every load, done once
        if weights.scaling != 1 and isinstance(weights.lora_b, torch.Tensor):
            weights.lora_b.mul_(weights.scaling)
            weights.scaling = 1.0
    block_diagonal = sum(item.local.nblocks > 1 for item in staged)
    widths = sorted({item.local.width for item in staged})
    targets = bd_targets(manager)
    summary = (
        f"adapter '{name}' ({fmt.describe()}, r={lora_model.rank}): {len(staged)} module(s) sharded, "
        f"{block_diagonal} block-diagonal; per-GPU width {'/'.join(map(str, widths)) or '-'} "
        f"of {next(iter(targets.values())).layer.lora_width if targets else '-'}"
    )
    for item in staged:  # the shares' tensors now live in vLLM's module weights
        item.local = LocalFactors(item.local.lora_a[:0], item.local.lora_b[:0], item.local.blocks, item.local.nblocks)
    return AdmittedAdapter(name, lora_model, identity, summary, not_served, deployment_targets,
                           staged=staged if fmt.dora else [], dora=fmt.dora)  # fmt: skip


def check_values(lora_model, adapter: str, dtype) -> None:
    """NaN/Inf in any factor, then every module's gain (`vllm_bdlora.adapter_values`), on what this rank serves."""
    loras = lora_model.loras
    problems = non_finite_problems((m, w.lora_a, w.lora_b) for m, w in loras.items())
    if problems:
        raise AdapterRejected(adapter, problems, NON_FINITE_HINT)
    problems = gain_problems(((m, w.lora_a, w.lora_b, w.scaling) for m, w in loras.items()), dtype)
    if problems:
        raise AdapterRejected(adapter, problems, GAIN_HINT)


def finish_admission(admitted: AdmittedAdapter, adapter_id: int) -> None:
    """DoRA's magnitude scales (once per adapter, on the worker's own thread: they read the layers' weights and, at
    TP > 1, sum row-parallel norms over the ranks in one all-reduce that every rank reaches in the same order)."""
    if not admitted.dora or not admitted.staged:
        admitted.staged = []
        return
    staged = admitted.staged
    problems = unreadable_base_problems(staged)
    _agree_across_ranks(problems, staged[0].target.layer, admitted.name, adapter_id)
    if problems:
        raise AdapterRejected(admitted.name, problems)
    dora = DoraAdapter.of(admitted.template)
    for item in staged:  # the norm takes the factors as served: B already scaled
        item.local = LocalFactors(item.weights.lora_a, item.weights.lora_b, item.local.blocks, item.local.nblocks)
    scales, problems = magnitude_scales(staged)
    problems += dora_scale_problems(scales)
    if problems:
        raise AdapterRejected(admitted.name, problems)
    dora.scales = scales
    dora.magnitudes = {}
    admitted.staged = []


def _agree_across_ranks(problems: list[str], layer: BlockDiagonalLoRALayer, adapter: str, adapter_id: int) -> None:
    """DoRA scales of row-parallel layers need one all-reduce; every rank must reach it or none may, and
    for the same adapter. A rank whose own checks passed raises when another rank's did not; ranks loading
    different adapters at this point (a load order that differs between ranks, see
    `patch_adapter_load_order`) would sum unrelated norms, so that is an error too."""
    tp = layer.tp_size
    if tp == 1:
        return
    from vllm.distributed import tensor_model_parallel_all_reduce

    # The id in two base-1024 digits (exact in float32 after the sum): for each digit, the sum and the sum of
    # squares equal tp copies of this rank's digit iff every rank holds that digit (ids agree below 2**20).
    digits = [float(adapter_id % 1024), float(adapter_id // 1024 % 1024)]
    local = torch.tensor([float(len(problems))] + digits + [d * d for d in digits], device=layer.device)
    total, *sums = tensor_model_parallel_all_reduce(local).tolist()
    if sums != [tp * d for d in digits] + [tp * d * d for d in digits]:
        raise RuntimeError(
            f"vllm-bdlora: tensor-parallel ranks are loading different adapters at once ('{adapter}' here); "
            "adapter load order must be the same on every rank."
        )
    if total and not problems:
        raise AdapterRejected(adapter, [f"{AdapterRejected.OTHER_RANK} (see its message)"])


def base_quantization(layer) -> str | None:
    return layer.base_quantization() if isinstance(layer, BlockDiagonalLoRALayer) else None


def unreadable_base(layer) -> str | None:
    return layer.base_weight_unreadable() if isinstance(layer, BlockDiagonalLoRALayer) else None


def is_first_tp_rank(manager) -> bool:
    """True on the first tensor-parallel rank only, so each log line appears once per engine."""
    return all(getattr(layer, "tp_rank", 0) == 0 for layer in manager.modules.values())


def adapter_store(worker_manager, settings: BdLoraSettings) -> AdapterStore:
    store = getattr(worker_manager, "_bdlora_store", None)
    if store is None:
        from vllm.platforms import current_platform

        manager = worker_manager._adapter_manager
        tp = next((t.layer.tp_size for t in bd_targets(manager).values()), 1)
        threads = settings.admission_threads or (1 if current_platform.is_cpu() else 4)
        budget = host_budget_bytes(settings.adapter_host_memory, tp)
        store = AdapterStore(budget, settings.adapter_spill_dir, threads)
        worker_manager._bdlora_store = store
    return store


def load_adapter(worker_manager, lora_request, read: Callable):
    """vLLM's `WorkerLoRAManager._load_adapter` with vllm-bdlora's rules: `read(request)` is vLLM's own reader.

    With BD-LoRA on, the adapter comes from this worker's store (`vllm_bdlora.admission`): the result of its
    admission (begun by the engine core before this call), or what was kept when it was admitted. Only an adapter
    this worker never admitted is read here, inside the call (vLLM's own behaviour for a request naming an adapter
    the engine has not seen, which the engine core holds back until its admission is done where it can)."""
    manager = worker_manager._adapter_manager
    settings = getattr(manager, "_bdlora_settings", BdLoraSettings())
    name = lora_request.lora_name
    if not settings.enabled:
        try:
            fmt = read_adapter_format(adapter_absolute_path(lora_request.lora_path), name)
        except AdapterRejected:
            raise
        except (OSError, ValueError):
            fmt = AdapterFormat(None, dora=False)  # vLLM's own reader reports missing or unreadable adapters
        refuse_unserved_kinds(fmt, settings, name)
        started = time.perf_counter()
        lora_model = read(lora_request)  # vLLM's own load, timed for /metrics as it runs: in add_lora or in a step
        worker_stats(worker_manager).record_load("admission" if is_admitting() else "in_step",
                                                 time.perf_counter() - started)  # fmt: skip
        return lora_model
    store = adapter_store(worker_manager, settings)
    stats = worker_stats(worker_manager)
    adapter_id = lora_request.lora_int_id
    started = time.perf_counter()
    read_for = store.reading_seconds(adapter_id)
    admitted = store.take_staged(adapter_id, timeout=settings.adapter_load_timeout_s)
    if admitted is not None:
        stats.record_load("admission", read_for or 0.0)
    if admitted is None and getattr(lora_request, "load_inplace", False) and is_admitting():
        store.forget(adapter_id)  # an in-place reload that was not begun ahead: read it again now
    if admitted is None:
        spilled = adapter_id in store.spilled_ids()
        admitted = store.get(adapter_id)
        if admitted is not None:
            stats.record_load("restore" if spilled else "reread", time.perf_counter() - started)
    if admitted is None:
        admitted = read_adapter(worker_manager, lora_request, settings)
        store.keep(adapter_id, admitted)
        stats.record_load("in_step", time.perf_counter() - started)
    try:
        finish_admission(admitted, adapter_id)
    except BaseException:
        store.forget(adapter_id)
        raise
    if not admitted.logged:
        admitted.logged = True
        if is_first_tp_rank(manager):
            log_admission(admitted)
    return admitted.fresh_model()


def log_admission(admitted: AdmittedAdapter) -> None:
    """One line when an adapter is admitted (later loads of it are routine), and what --lora-target-modules drops."""
    logger.info("vllm-bdlora: %s", admitted.summary)
    if admitted.not_served:
        logger.warning(
            "vllm-bdlora: adapter '%s' is served without its LoRA on %d module(s) that --lora-target-modules %s "
            "leaves out (%s): its outputs differ from the adapter's as trained. Add their names to "
            "--lora-target-modules to serve it whole.",
            admitted.name, len(admitted.not_served), " ".join(admitted.deployment_targets or ()),
            _module_kinds(admitted.not_served),
        )  # fmt: skip


def read_on(device, worker_manager, lora_request, settings: BdLoraSettings) -> AdmittedAdapter:
    """`read_adapter` on an admission thread of a worker whose GPU is `device`: a new thread's current CUDA device is
    the first GPU, and pinning host memory there would open a CUDA context on another worker's GPU."""
    if getattr(device, "type", None) == "cuda":
        torch.cuda.set_device(device)
    return read_adapter(worker_manager, lora_request, settings)


def admission_rpc(worker_manager, op: str, payload):
    """A worker's side of the engine core's admission protocol (`vllm_bdlora.engine_admission`):
    "begin" [requests]: start admitting each on its own thread; "status" [ids]: each one's state;
    "forget" [ids]: drop them (given up, refused elsewhere or unloaded); "stats": what this worker holds where, and
    its counts (`vllm_bdlora.metrics`)."""
    manager = worker_manager._adapter_manager
    settings = getattr(manager, "_bdlora_settings", BdLoraSettings())
    store = adapter_store(worker_manager, settings)
    if op == "begin":
        device = getattr(worker_manager, "device", None)
        for request in payload:
            store.begin(request.lora_int_id, request.lora_name,
                        lambda request=request: read_on(device, worker_manager, request, settings))  # fmt: skip
        return True
    if op == "status":
        return store.status(list(payload))
    if op == "forget":
        return [store.forget(adapter_id) for adapter_id in payload]
    if op == "stats":
        return worker_stats(worker_manager).snapshot(worker_manager, store)
    raise ValueError(f"unknown admission call {op!r}")


def rank_limit_hint(message: str, manager) -> str | None:
    """The fix for vLLM's "LoRA rank R is greater than max_lora_rank M": the smallest --max-lora-rank vLLM accepts
    that holds this adapter (a BD adapter needs >= r; a standard one, served replicated, r * TP)."""
    import re

    found = re.search(r"LoRA rank (\d+) is greater than max_lora_rank", message)
    if not found:
        return None
    rank = int(found.group(1))
    tp = next((t.layer.tp_size for t in bd_targets(manager).values()), 1)
    fit = smallest_max_lora_rank(-(-rank // tp), tp)
    accepted = ", ".join(map(str, allowed_max_lora_ranks()))
    return (f"start the server with --max-lora-rank {fit} (vLLM accepts {accepted}); a standard (non-BD) adapter "
            f"needs its rank x TP") if fit else f"vLLM accepts --max-lora-rank {accepted} only"  # fmt: skip


def _module_kinds(modules: list[str]) -> str:
    """'lm_head, 2 x up_proj' rather than every layer's full name."""
    kinds = Counter(module.rsplit(".", 1)[-1] for module in modules)
    return ", ".join(kind if count == 1 else f"{count} x {kind}" for kind, count in sorted(kinds.items()))
