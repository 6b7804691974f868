"""Admit and cut (a worker, on an admission thread): read an adapter's files once, check every module against the
layer it targets and cut it to this rank's share, before anything reaches a LoRA slot. What it returns
(`AdmittedAdapter`) is kept by the worker's store (`store.py`) and every later load of the adapter is built from it.

An adapter is accepted whole or rejected whole (`AdapterRejected`, one message listing every problem), so a bad
adapter never leaves half-written state behind.

The files are opened once (`files.open_adapter`) and the weights file is mapped, so cutting a tensor to this rank's
rows reads only those rows' pages; each module's factors are checked against its layer and cut
(`sharding.localize`), then handed to vLLM's own `LoRAModel.from_lora_tensors` (names, scaling, dtype, pinned
memory). On the fused kernels the BD modules' shares are first copied into the adapter's slot image
(`vllm_bdlora.slot_arena`: one buffer, pinned, in one GPU slot's layout, from which a slot fill is one copy), and
vLLM's loader takes views of it as they are. Their values are checked (`values.py`) and B is multiplied by the
module's scaling once, as vLLM would on every load. No collective and no GPU work runs here: DoRA's magnitude
scales, which need both, are `finish.py`'s.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from vllm_bdlora.adapter_lifecycle.files import REWRITE_HINT, WEIGHTS_FILE, open_adapter
from vllm_bdlora.adapter_lifecycle.targets import (
    StagedModule,
    bd_targets,
    known_lora_modules,
    on_other_pipeline_stage,
    tensor_parallel_size,
)
from vllm_bdlora.adapter_lifecycle.values import GAIN_HINT, NON_FINITE_HINT, value_problems
from vllm_bdlora.adapters import AdapterFormat, AdapterRejected, adapter_format, refuse_unserved_kinds
from vllm_bdlora.compat import adapter_absolute_path, allowed_max_lora_ranks, packing_ahead
from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.dora import DoraAdapter, is_magnitude_tensor, stage_magnitudes
from vllm_bdlora.metrics import StageClock
from vllm_bdlora.sharding import LocalFactors, ShardingError, foreign_model_problem, localize
from vllm_bdlora.slot_arena import IMAGE_ATTRIBUTE, SlotArena, SlotImage


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
    # The BD modules in one GPU slot's layout, their weights being views of it (`vllm_bdlora.slot_arena`); None
    # where the server fills slots layer by layer, and while the adapter is spilled.
    image: SlotImage | None = None
    image_modules: Mapping | None = None  # the image's `modules`, kept while it is spilled
    image_width: int | None = None  # and its width
    arena: SlotArena | None = None  # where the image's memory comes from (a read-back takes a region of it)
    # vLLM's packing (`compat.packing_ahead`) for an imaged adapter: `fresh_model` copies a template packed once
    # (`packed`, remade after a read-back), so that a slot fill's registration neither copies every projection's
    # weights nor packs them again (at Llama-3.1-8B, 224 entries to copy and 128 packs per fill)
    pack: Callable | None = None
    packed: object = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for _, tensor in self.host_tensors())

    def fresh_model(self):
        source = self.template
        if self.pack is not None and self.image is not None:
            if self.packed is None:
                self.pack_ahead()
            source = self.packed
        model = _model_copy(source)
        if self.image is not None:
            setattr(model, IMAGE_ATTRIBUTE, self.image)
        return model

    def pack_ahead(self) -> None:
        """The template as vLLM's registration packs it, made once (on the admission or read-back thread)."""
        if self.pack is not None and self.image is not None:
            packed = _model_copy(self.template)
            self.pack(packed)
            self.packed = packed

    # -- what a spill writes and a read-back restores (`store.AdapterStore`) ----------------------------------------
    def host_tensors(self) -> list[tuple[tuple[str, str], torch.Tensor]]:
        """Every tensor kept in host memory, keyed: the slot image's region, and the module tensors it does not
        hold."""
        found = []
        if self.image is not None:
            found.append((IMAGE_KEY, self.image.memory))
        in_image = self.image.modules if self.image is not None else {}
        for module, weights in self.template.loras.items():
            if module in in_image:
                continue
            for attribute in ("lora_a", "lora_b"):
                tensor = getattr(weights, attribute)
                if isinstance(tensor, torch.Tensor):
                    found.append(((module, attribute), tensor))
        return found

    def release_host_tensors(self) -> None:
        self.packed = None  # its weights are the image's views (models vLLM registered keep their own copies)
        if self.image is not None:
            self.image_modules, self.image_width = self.image.modules, self.image.width
            for module in self.image.modules:
                self.template.loras[module].lora_a = self.template.loras[module].lora_b = None
            self.image = None
        for (module, attribute), _ in self.host_tensors():
            setattr(self.template.loras[module], attribute, None)

    def empty_host_tensor(self, key: tuple[str, str], nbytes: int, pinned: bool) -> torch.Tensor:
        """Uninitialised host memory (uint8) for the tensor `key` of `host_tensors` to be read back into: the image's
        in a region of the arena's image memory (a recycled one, where an image was dropped since)."""
        if key == IMAGE_KEY and self.arena is not None and self.image_width is not None:
            memory = self.arena.memory_for(self.image_width)
            if nbytes == memory.region_bytes:
                return memory.take()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def restore_host_tensors(self, tensors: Mapping[tuple[str, str], torch.Tensor]) -> None:
        for (module, attribute), tensor in tensors.items():
            if module:
                setattr(self.template.loras[module], attribute, tensor)
        if IMAGE_KEY in tensors:
            self.image = self.arena.image_over(tensors[IMAGE_KEY], self.image_modules, self.image_width)
            self.image.bind(self.template.loras)
            self.pack_ahead()


def _model_copy(model):
    """A LoRAModel sharing `model`'s tensors, with module weights of its own: vLLM packs and optimizes the model it
    registers in place."""
    copied = _shallow_copy(model)
    copied.loras = {name: _shallow_copy(weights) for name, weights in model.loras.items()}
    return copied


def _shallow_copy(obj):
    """`copy.copy(obj)`, for the plain classes vLLM's LoRA models and weights are, without the generic protocol's
    cost: a slot fill copies one per entry of the packed model (128 at Llama-3.1-8B's depth), inside the step. A
    class with a copy or pickle protocol of its own gets `copy.copy`."""
    cls = type(obj)
    if not _is_plain(cls):
        return copy.copy(obj)
    copied = object.__new__(cls)
    copied.__dict__ = obj.__dict__.copy()
    return copied


@functools.cache
def _is_plain(cls: type) -> bool:
    """Whether `copy.copy` of a `cls` is a new instance with a copy of the original's `__dict__`, and nothing else."""
    return (
        cls.__new__ is object.__new__ and not hasattr(cls, "__copy__") and not hasattr(cls, "__slots__")
        and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
        and getattr(cls, "__getstate__", object.__getstate__) is object.__getstate__
    )  # fmt: skip


IMAGE_KEY = ("", "slot_image")  # the image's region among `AdmittedAdapter.host_tensors`


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


def cut_to_rank(views: dict, fmt: AdapterFormat, manager, adapter: str, mapper, target_modules: Sequence[str] | None,
                copy_shares: bool = True) -> tuple[dict, list[StagedModule], list[str], dict]:  # fmt: skip
    """This rank's share of every module (copies; `views` may be released after), or `AdapterRejected`; with
    `copy_shares` False the BD modules' shares may be views of `views` (the caller copies them into the adapter's
    slot image before the file can change).
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
            local = localize(lora_a, lora_b, geometry, factor, spec.nblocks if factor else 1, copy=copy_shares)
        except ShardingError as e:
            problems.append(f"{module}: {e}")
            continue
        if local.width > target.layer.lora_width:
            layer = target.layer
            problems.append(width_problem(module, local, lora_a.shape[0], layer.lora_config.max_lora_rank,
                                          layer.tp_size, layer.parallelism))  # fmt: skip
            continue
        staged.append(StagedModule(module, local, target, tensor_names=(a_name, b_name)))
        tensors[a_name], tensors[b_name] = local.lora_a, local.lora_b
    if problems:
        raise AdapterRejected(adapter, problems)
    return tensors, staged, sorted(not_served), {name: view.clone() for name, view in magnitudes.items()}


VLLM_REFUSAL_HINT = (
    "train the adapter on this base model with PEFT: LoRA layers only (modules_to_save only for the classification "
    "head of a classification model), over the base model's own vocabulary."
)


def read_adapter(worker_manager, lora_request, settings: BdLoraSettings, clock: StageClock | None = None
                 ) -> AdmittedAdapter:  # fmt: skip
    """Read, check and cut one adapter (see the module's docstring); safe to run on an admission thread. `clock`, where
    given, is charged each of `metrics.ADMISSION_STAGES` as it ends."""
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
    lap = clock.lap if clock is not None else lambda stage: None
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
        arena = SlotArena.of(manager)
        imaged = arena is not None and arena.takes_images and not fmt.dora
        views = opened.tensor_views()
        lap("open")
        try:
            cut = cut_to_rank(views, fmt, manager, name, mapper, deployment_targets, copy_shares=not imaged)
            tensors, staged, not_served, magnitudes = cut
            lap("cut")
            image = None
            if imaged:
                # BD modules go from the mapped file straight into the adapter's slot image (checked below for a
                # rewrite meanwhile): vLLM's loader gets views of it
                # as wide as the adapter's widest module (a region of that width's; a fresh one is pinned here:
                # timed on its own)
                width = arena.image_width(item.local.lora_a.shape[0] for item in staged)
                region = arena.memory_for(width).take()
                lap("region")
                image = arena.image_of(((item.name, item.target, item.local.lora_a, item.local.lora_b)
                                        for item in staged), region, width)  # fmt: skip
                for item in staged:
                    a_name, b_name = item.tensor_names
                    tensors[a_name], tensors[b_name] = image.views(item.name)
                    item.local = _emptied(item.local)
        finally:
            del views
        if not opened.unchanged():
            raise AdapterRejected(name, ["its weights file changed while it was read"], REWRITE_HINT)
        identity = opened.identity
    lap("image")
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
    if image is not None:
        image.bind(lora_model.loras)  # where vLLM's loader copied what it was handed, the image is what stays
    lap("vllm_model")
    check_values(lora_model, name, worker_manager.lora_config.lora_dtype)
    lap("check")
    for item in staged:
        item.weights = lora_model.loras.get(item.name)
    staged = [item for item in staged if item.weights is not None]
    dora = DoraAdapter.of(lora_model)
    problems = stage_magnitudes(staged, dora.magnitudes, fmt.dora)
    if problems:
        raise AdapterRejected(name, problems)
    # what vLLM's manager would do on every load, done once (in one operation: see `values.norms_and_finite`)
    scaled = [w for w in lora_model.loras.values() if w.scaling != 1 and isinstance(w.lora_b, torch.Tensor)]
    if scaled:
        torch._foreach_mul_([w.lora_b for w in scaled], [float(w.scaling) for w in scaled])
        for weights in scaled:
            weights.scaling = 1.0
    block_diagonal = sum(item.local.nblocks > 1 for item in staged)
    widths = sorted({item.local.width for item in staged})
    targets = bd_targets(manager)
    summary = (
        f"adapter '{name}' ({fmt.describe()}, r={lora_model.rank}): {len(staged)} module(s) sharded, "
        f"{block_diagonal} block-diagonal; per-GPU width {'/'.join(map(str, widths)) or '-'} "
        f"of {next(iter(targets.values())).layer.lora_width if targets else '-'}"
    )
    if image is None:  # the shares' tensors now live in vLLM's module weights (an image's were let go above)
        for item in staged:
            item.local = _emptied(item.local)
    pack = packing_ahead(worker_manager._adapter_manager) if image is not None else None
    admitted = AdmittedAdapter(name, lora_model, identity, summary, not_served, deployment_targets,
                               staged=staged if fmt.dora else [], dora=fmt.dora, image=image,
                               arena=arena if image is not None else None, pack=pack)  # fmt: skip
    admitted.pack_ahead()
    lap("finish")
    return admitted


def _emptied(local: LocalFactors) -> LocalFactors:
    """`local`'s width and blocks without its tensors (which now live elsewhere; no storage of theirs is kept)."""
    width = local.width
    return LocalFactors(local.lora_a.new_empty((width, 0)), local.lora_b.new_empty((0, width)), local.blocks,
                        local.nblocks)  # fmt: skip


def check_values(lora_model, adapter: str, dtype) -> None:
    """NaN/Inf in any factor, then every module's gain (`values.py`), on what this rank serves."""
    non_finite, gains = value_problems(((m, w.lora_a, w.lora_b, w.scaling) for m, w in lora_model.loras.items()), dtype)
    if non_finite:
        raise AdapterRejected(adapter, non_finite, NON_FINITE_HINT)
    if gains:
        raise AdapterRejected(adapter, gains, GAIN_HINT)


def rank_limit_hint(message: str, manager) -> str | None:
    """The fix for vLLM's "LoRA rank R is greater than max_lora_rank M": the smallest --max-lora-rank vLLM accepts
    that holds this adapter (a BD adapter needs >= r; a standard one, served replicated, r * TP)."""
    import re

    found = re.search(r"LoRA rank (\d+) is greater than max_lora_rank", message)
    if not found:
        return None
    rank = int(found.group(1))
    tp = tensor_parallel_size(manager)
    fit = smallest_max_lora_rank(-(-rank // tp), tp)
    accepted = ", ".join(map(str, allowed_max_lora_ranks()))
    return (f"start the server with --max-lora-rank {fit} (vLLM accepts {accepted}); a standard (non-BD) adapter "
            f"needs its rank x TP") if fit else f"vLLM accepts --max-lora-rank {accepted} only"  # fmt: skip


def read_on(device, worker_manager, lora_request, settings: BdLoraSettings,
            record_stages: Callable[[dict], None] | None = None) -> AdmittedAdapter:  # fmt: skip
    """`read_adapter` on an admission thread of a worker whose GPU is `device`: a new thread's current CUDA device is
    the first GPU, and pinning host memory there would open a CUDA context on another worker's GPU. A successful
    admission's stage times go to `record_stages` (`metrics.WorkerAdapterStats.record_stages`)."""
    clock = StageClock()
    if getattr(device, "type", None) == "cuda":
        torch.cuda.set_device(device)
    admitted = read_adapter(worker_manager, lora_request, settings, clock)
    if record_stages is not None:
        record_stages(clock.laps)
    return admitted
