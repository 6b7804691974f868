"""What an adapter directory must hold before any tensor is read, checked from its files alone.

Each problem becomes one `AdapterRejected` naming the adapter, the file and the fix, so a client gets HTTP 400
and the server keeps serving. Checked here: the path is a directory; `adapter_config.json` is a JSON object whose
`r`, `lora_alpha`, `rank_pattern` and `alpha_pattern` are numbers of the right kind; the weights are in
`adapter_model.safetensors` (pickle files are never loaded); that file's header is well formed and the file is
as long as the header says (a truncated or half-copied file is caught here, not by the tensor reader); and
every `lora_A` tensor has as many rows as the rank `adapter_config.json` gives its module (PEFT refuses an
adapter whose `r` contradicts its tensors; serving one would scale it by the wrong `lora_alpha / r`); and no
block-diagonal factor lies inside a mixture of experts' experts (vLLM's fused MoE layer, which BD does not shard).
Tensor values (NaN/Inf) are checked after the read, in `vllm_bdlora.loading`.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

from vllm_bdlora.adapters import (
    EXPERTS_HINT,
    AdapterRejected,
    block_diagonal_expert_modules,
    parse_block_diagonal_spec,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILES = ("adapter_model.bin", "adapter_model.pt")
# The files vLLM reads from an adapter directory once pickle files are refused; nothing else is copied.
SERVED_FILES = (CONFIG_FILE, WEIGHTS_FILE)

RESAVE_HINT = "re-save the adapter with PEFT's save_pretrained (safetensors, the default) and load it again."
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_HEADER_LIMIT = 100 * 2**20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class AdapterFiles:
    directory: str
    config: dict
    tensor_shapes: dict[str, tuple[int, ...]]


def check_adapter_dir(directory: str, adapter: str) -> AdapterFiles:
    """The adapter's config and tensor shapes, or `AdapterRejected` naming the file and the problem.
    `directory` must exist (a missing path is vLLM's 404)."""
    if not os.path.isdir(directory):
        raise AdapterRejected(
            adapter, [f"{directory} is a file, not an adapter directory"],
            f"give the directory that holds {CONFIG_FILE} and {WEIGHTS_FILE}.",
        )  # fmt: skip
    config = read_config(directory, adapter)
    weights = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        pickles = [name for name in PICKLE_WEIGHTS_FILES if os.path.isfile(os.path.join(directory, name))]
        problem = (
            f"{WEIGHTS_FILE} is missing; {', '.join(pickles)} is a pickle file, which is never loaded (it can run code)"
            if pickles
            else f"{WEIGHTS_FILE} is missing"
        )
        raise AdapterRejected(adapter, [problem], RESAVE_HINT)
    shapes = read_safetensors_shapes(weights, adapter)
    problems = rank_problems(config, shapes)
    if problems:
        raise AdapterRejected(
            adapter, problems, f"make r (and rank_pattern) in {CONFIG_FILE} agree with the tensors, or {RESAVE_HINT}"
        )
    experts = block_diagonal_expert_modules(shapes, parse_block_diagonal_spec(config, adapter))
    if experts:
        problems = [f"{module}: block-diagonal LoRA factors on an expert" for module in experts]
        raise AdapterRejected(adapter, problems, EXPERTS_HINT)
    return AdapterFiles(directory, config, shapes)


def read_config(directory: str, adapter: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterRejected(adapter, [f"{CONFIG_FILE} is missing from {directory}"], RESAVE_HINT) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterRejected(adapter, [f"{CONFIG_FILE} is not valid JSON ({e})"], RESAVE_HINT) from None
    if not isinstance(config, dict):
        problem = f"{CONFIG_FILE} must hold a JSON object, got a JSON {type(config).__name__}"
        raise AdapterRejected(adapter, [problem], RESAVE_HINT)
    problems = []
    if not _is_positive_int(config.get("r")):
        problems.append(f"{CONFIG_FILE}: r must be a positive integer, got {config.get('r')!r}")
    if not _is_number(config.get("lora_alpha", 8)):
        problems.append(f"{CONFIG_FILE}: lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    for key, valid, kind in (("rank_pattern", _is_positive_int, "positive integers"), ("alpha_pattern", _is_number,
                                                                                       "numbers")):  # fmt: skip
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(isinstance(k, str) and valid(v) for k, v in pattern.items()):
            problems.append(f"{CONFIG_FILE}: {key} must map module names to {kind}, got {pattern!r}")
    if problems:
        raise AdapterRejected(adapter, problems, RESAVE_HINT)
    return config


def read_safetensors_shapes(path: str, adapter: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header, after checking that the header is well formed and
    that the file holds every byte the header promises (no tensor data is read)."""
    name = os.path.basename(path)
    size = os.path.getsize(path)

    def rejected(problem: str) -> AdapterRejected:
        return AdapterRejected(adapter, [f"{name}: {problem}"], RESAVE_HINT)

    if size == 0:
        raise rejected("the file is empty (0 bytes)")
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise rejected(f"not a safetensors file ({size} bytes, too short for a header)")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(_HEADER_LIMIT, size - 8):
            raise rejected(
                f"not a safetensors file, or truncated (header of {header_length} bytes in a {size}-byte file)"
            )
        try:
            header = json.loads(f.read(header_length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise rejected("corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise rejected("corrupt safetensors header (not a JSON object)")
    shapes, end = {}, 0
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            expected = _DTYPE_BYTES[dtype]
            for n in shape:
                expected *= n
        except (KeyError, TypeError, ValueError):
            raise rejected(f"corrupt safetensors header entry for {tensor}") from None
        if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, stop)) or stop - begin != expected:
            raise rejected(f"corrupt safetensors header entry for {tensor}")
        shapes[tensor] = shape
        end = max(end, stop)
    if 8 + header_length + end != size:
        described = 8 + header_length + end
        raise rejected(f"truncated or padded: the header describes {described} bytes, the file has {size}")
    return shapes


def module_rank(config: dict, module: str) -> int:
    """The rank PEFT gives `module` (its name in the checkpoint, without `base_model.model.`): the first
    `rank_pattern` key that matches a dotted suffix of the name, else `r`."""
    for key, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return rank
    return config["r"]


def rank_problems(config: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """`lora_A` has one row per rank in every layout PEFT writes (standard, block-diagonal A and B)."""
    problems = []
    for tensor, shape in shapes.items():
        if ".lora_A" not in tensor:
            continue
        module = tensor.split(".lora_A", 1)[0].removeprefix("base_model.model.")
        rank = module_rank(config, module)
        if len(shape) != 2 or shape[0] != rank:
            source = "rank_pattern" if rank != config["r"] else "r"
            problems.append(
                f"{module}: lora_A has shape {list(shape)} but {CONFIG_FILE} gives this module {source} {rank} "
                f"(expected [{rank}, ...])"
            )
    return problems


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
