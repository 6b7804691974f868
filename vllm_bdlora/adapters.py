"""PEFT BD-LoRA adapter format: reading `use_bdlora` and reporting what is wrong with an adapter.

PEFT (>= 0.19) saves `LoraConfig(use_bdlora=BdLoraConfig(...))` adapters with
`"use_bdlora": {"target_modules_bd_a": [...], "target_modules_bd_b": [...], "nblocks": N, ...}`
in `adapter_config.json`, `r` being the full rank, and the block-diagonal factor stored without its
zeros (N blocks stacked along the non-rank dimension). The tensor layouts are documented and handled
in `vllm_bdlora.sharding`; this module only decides, per module, which factor is block-diagonal.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from vllm_bdlora.config import BdLoraSettings

BlockDiagonalFactor = Literal["a", "b"]


class AdapterRejected(ValueError):
    """An adapter that cannot be served as it is. The message names the adapter, every problem found
    and the fix; the server and the other adapters are unaffected."""

    MARKER = "LoRA adapter rejected"
    OTHER_RANK = "rejected by another tensor-parallel rank"

    def __init__(self, adapter: str, problems: list[str], hint: str | None = None):
        self.adapter = adapter
        self.problems = list(problems)
        lines = [f"{self.MARKER}: '{adapter}'."]
        lines += [f"  - {p}" for p in _grouped(self.problems)]
        if hint:
            lines.append(f"  Fix: {hint}")
        super().__init__("\n".join(lines))


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _grouped(problems: list[str], shown: int = 12) -> list[str]:
    """Collapse a problem repeated over decoder layers and modules into one line:
    "model.layers.*.mlp.up_proj, model.layers.*.mlp.gate_proj (layers 0-31): <problem>"."""
    groups: dict[str, tuple[list[str], set[int]]] = {}
    for problem in problems:
        module, sep, message = problem.partition(": ")
        if not sep:
            module, message = "", problem
        indices = _LAYER_INDEX.findall(module)
        if indices:
            module = _LAYER_INDEX.sub(".*.", module, count=1)
        modules, layers = groups.setdefault(message, ([], set()))
        if module not in modules:
            modules.append(module)
        layers.update(int(i) for i in indices)
    lines = []
    for message, (modules, layers) in groups.items():
        where = ", ".join(m for m in modules if m)
        if len(layers) > 1:
            where += f" (layers {_ranges(sorted(layers))})"
        elif len(layers) == 1:
            where = where.replace(".*.", f".{next(iter(layers))}.")
        lines.append(f"{where}: {message}" if where else message)
    if len(lines) > shown:
        lines = lines[:shown] + [f"... and {len(lines) - shown} more problem(s)"]
    return lines


def _ranges(values: list[int]) -> str:
    spans, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(spans)


@dataclass(frozen=True)
class BlockDiagonalSpec:
    """The `use_bdlora` section of an adapter config."""

    nblocks: int
    bd_a_patterns: tuple[str, ...]
    bd_b_patterns: tuple[str, ...]

    def factor_of(self, module_name: str) -> BlockDiagonalFactor | None:
        """Which LoRA factor of `module_name` PEFT made block-diagonal.

        PEFT matches each pattern as a substring of the module's own (last) name; the stored tensors
        follow that rule, so serving must use it too.
        """
        short = module_name.rsplit(".", 1)[-1]
        if self.nblocks == 1:
            return None
        if any(p in short for p in self.bd_a_patterns):
            return "a"
        if any(p in short for p in self.bd_b_patterns):
            return "b"
        return None


# The projections inside a mixture of experts' expert (Mixtral names them w1, w2, w3).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3")
EXPERTS_HINT = (
    "vllm-bdlora shards block-diagonal factors on attention and dense MLP projections only (vLLM runs the experts "
    "in its fused MoE layer); retrain with the experts' projections out of use_bdlora's target_modules_bd_a/b "
    "(standard LoRA there, or no LoRA on the experts)."
)


def block_diagonal_expert_modules(tensor_names: Iterable[str], spec: BlockDiagonalSpec | None) -> list[str]:
    """The adapter's modules inside a mixture of experts' experts (a module path through `experts`) whose factors
    PEFT made block-diagonal: per-expert names (`...experts.3.gate_proj`) by PEFT's own pattern rule, and experts
    stored as one module (`...experts`) when a BD pattern names an expert projection."""
    if spec is None or spec.nblocks == 1:
        return []
    found = set()
    for name in tensor_names:
        module = name.split(".lora_", 1)[0]
        parts = module.split(".")
        if "experts" not in parts:
            continue
        short = parts[-1]
        if short == "experts" or short.isdigit():
            patterns = spec.bd_a_patterns + spec.bd_b_patterns
            if any(p in projection for p in patterns for projection in EXPERT_PROJECTIONS):
                found.add(module)
        elif spec.factor_of(module):
            found.add(module)
    return sorted(found)


def read_adapter_config(adapter_dir: str) -> dict:
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        return json.load(f)


def parse_block_diagonal_spec(config: dict, adapter: str) -> BlockDiagonalSpec | None:
    """The adapter's BD-LoRA section, or None for a standard LoRA adapter."""
    section = config.get("use_bdlora")
    if section in (None, False, {}):
        return None
    problems = []
    if not isinstance(section, dict):
        raise AdapterRejected(adapter, [f"use_bdlora must be an object as PEFT writes it, got {section!r}"])
    nblocks = section.get("nblocks", 1)
    if isinstance(nblocks, bool) or not isinstance(nblocks, int) or nblocks < 1:
        problems.append(f"use_bdlora.nblocks must be a positive integer, got {nblocks!r}")
    patterns = {}
    for key in ("target_modules_bd_a", "target_modules_bd_b"):
        value = section.get(key) or []
        if isinstance(value, str) or not all(isinstance(p, str) for p in value):
            problems.append(f"use_bdlora.{key} must be a list of module names, got {value!r}")
            value = []
        patterns[key] = tuple(value)
    both = sorted(set(patterns["target_modules_bd_a"]) & set(patterns["target_modules_bd_b"]))
    if both:
        problems.append(f"modules {both} are listed in both target_modules_bd_a and target_modules_bd_b")
    if problems:
        raise AdapterRejected(adapter, problems, "re-save the adapter with PEFT's BdLoraConfig.")
    return BlockDiagonalSpec(
        nblocks=nblocks,
        bd_a_patterns=patterns["target_modules_bd_a"],
        bd_b_patterns=patterns["target_modules_bd_b"],
    )


def parse_dora_flag(config: dict, adapter: str) -> bool:
    """`use_dora` as PEFT writes it. BD-DoRA (PEFT cannot train it yet) is defined here as PEFT's BD-LoRA
    tensors plus `lora_magnitude_vector` per module, with both `use_bdlora` and `use_dora` set."""
    value = config.get("use_dora", False)
    if not isinstance(value, bool):
        raise AdapterRejected(adapter, [f"use_dora must be true or false, got {value!r}"])
    return value


@dataclass(frozen=True)
class AdapterFormat:
    block_diagonal: BlockDiagonalSpec | None
    dora: bool

    def describe(self) -> str:
        variant = "DoRA" if self.dora else "LoRA"
        if self.block_diagonal:
            return f"BD-{variant} nblocks={self.block_diagonal.nblocks}"
        return f"standard {variant}"


def adapter_format(config: dict, adapter: str) -> AdapterFormat:
    return AdapterFormat(parse_block_diagonal_spec(config, adapter), parse_dora_flag(config, adapter))


def read_adapter_format(adapter_dir: str, adapter: str) -> AdapterFormat:
    return adapter_format(read_adapter_config(adapter_dir), adapter)


@dataclass(frozen=True)
class AdapterLoadFailure:
    """What a worker returns, instead of raising, when an adapter fails to load in `add_lora`.

    vLLM's multiprocess executor stops reading worker replies at the first failed one, so a failure
    raised by every TP rank leaves the other ranks' replies queued, and the next RPC (the next adapter
    load, say) reads a stale error. Returning the failure keeps every reply read; the executor raises it.
    """

    message: str


ENABLE_HINT = (
    'start the server with --enable-bdlora (Python API: LLM(..., enable_lora=True, additional_config={"bdlora": {}}))'
)
DORA_HINT = (
    "start the server with --enable-dora (Python API: LLM(..., enable_lora=True, "
    'additional_config={"bdlora": {"dora": True}}))'
)


def refuse_unserved_kinds(fmt: AdapterFormat, settings: BdLoraSettings, adapter: str) -> None:
    """A BD adapter on a server without BD-LoRA would be served as dense (wrong output); a DoRA adapter
    without DoRA serving would lose its magnitudes. Both are refused with the flag that serves them."""
    spec = fmt.block_diagonal
    if spec is not None and not settings.enabled:
        problem = f"it is a BD-LoRA adapter (use_bdlora, nblocks={spec.nblocks}) and BD-LoRA is off"
        raise AdapterRejected(adapter, [problem], ENABLE_HINT)
    if fmt.dora and not settings.dora:
        problem = f"it is a {fmt.describe()} adapter (use_dora) and DoRA serving is off"
        raise AdapterRejected(adapter, [problem], DORA_HINT)
