"""Every kind of bad adapter a server must refuse, made from a good one: the corpus that the tests and the
soak (`bench/soak.py`) send. Each kind says what the answer must be: its HTTP status and what its message
names (the adapter's name is always checked besides)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class BadAdapter:
    kind: str
    make: Callable[[str, Path], str]  # (a good adapter's directory, a fresh path) -> the path to load
    status: int
    says: tuple[str, ...]


def _copy(good: str, path: Path) -> Path:
    shutil.copytree(good, path)
    return path


def _edit_bytes(edit: Callable[[bytes], bytes]) -> Callable[[str, Path], str]:
    def make(good: str, path: Path) -> str:
        weights = _copy(good, path) / WEIGHTS
        weights.write_bytes(edit(weights.read_bytes()))
        return str(path)

    return make


def _edit_config(edit: Callable[[dict], object]) -> Callable[[str, Path], str]:
    def make(good: str, path: Path) -> str:
        config_path = _copy(good, path) / CONFIG
        config = json.loads(config_path.read_text())
        replaced = edit(config)
        config_path.write_text(json.dumps(config if replaced is None else replaced))
        return str(path)

    return make


def _edit_weights(edit: Callable[[dict], dict]) -> Callable[[str, Path], str]:
    """The good adapter with its tensors (name -> tensor) replaced by edit(tensors)."""

    def make(good: str, path: Path) -> str:
        from safetensors.torch import load_file, save_file

        weights = _copy(good, path) / WEIGHTS
        save_file(edit(load_file(weights)), weights)
        return str(path)

    return make


def _first(tensors: dict, factor: str) -> str:
    return next(n for n in sorted(tensors) if factor in n)


def _edit_first(factor: str, value: float) -> Callable[[str, Path], str]:
    def edit(tensors: dict) -> dict:
        tensors[_first(tensors, factor)].view(-1)[0] = value
        return tensors

    return _edit_weights(edit)


def _pickle_only(good: str, path: Path) -> str:
    import torch
    from safetensors.torch import load_file

    _copy(good, path)
    torch.save(load_file(path / WEIGHTS), path / "adapter_model.bin")
    os.remove(path / WEIGHTS)
    return str(path)


def _without(name: str) -> Callable[[str, Path], str]:
    def make(good: str, path: Path) -> str:
        os.remove(_copy(good, path) / name)
        return str(path)

    return make


def _a_file(good: str, path: Path) -> str:
    return str(_copy(good, path) / WEIGHTS)


def _missing(good: str, path: Path) -> str:
    return str(path / "does-not-exist")


def _rank_pattern_for_q(config: dict) -> None:
    config["rank_pattern"] = {"q_proj": config["r"] // 2}


def _first_layer_only(config: dict) -> None:
    """PEFT's `layers_to_transform`: it puts LoRA layers on layer 0 only, and would not load the others' tensors."""
    config["layers_to_transform"] = [0]


def _edit_header(edit: Callable[[dict], None]) -> Callable[[str, Path], str]:
    """The weights file with its safetensors header edited (the data left as it is)."""

    def make(good: str, path: Path) -> str:
        import struct

        weights = _copy(good, path) / WEIGHTS
        raw = weights.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        edit(header)
        encoded = json.dumps(header).encode()
        weights.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])
        return str(path)

    return make


def _overlap_first_two(header: dict) -> None:
    """The second tensor's data starts inside the first's (the file's length unchanged)."""
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    first, second = header[names[0]], header[names[1]]
    shift = second["data_offsets"][0] - first["data_offsets"][0]
    second["data_offsets"] = [second["data_offsets"][0] - shift // 2, second["data_offsets"][1] - shift // 2]


def _past_the_end(header: dict) -> None:
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 64, end + 64]


def _many_tensors(header: dict) -> None:
    from vllm_bdlora.adapter_lifecycle.files import MAX_TENSORS

    for i in range(MAX_TENSORS + 1):
        header[f"pad{i}"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}


def _as_dtype(dtype_name: str) -> Callable[[str, Path], str]:
    def edit(tensors: dict) -> dict:
        import torch

        return {name: t.to(getattr(torch, dtype_name)) for name, t in tensors.items()}

    return _edit_weights(edit)


def _scaled_factor(factor: str, scale: float) -> Callable[[str, Path], str]:
    """Every entry of the first `factor` tensor multiplied by `scale` (finite: only the gain check can tell)."""

    def edit(tensors: dict) -> dict:
        name = _first(tensors, factor)
        tensors[name] = tensors[name] * scale
        return tensors

    return _edit_weights(edit)


def _replace_with(name: str, kind: str) -> Callable[[str, Path], str]:
    """`name` in the adapter directory replaced by a FIFO (whose reader would wait forever), a symlink to a file
    outside the directory, or a directory."""

    def make(good: str, path: Path) -> str:
        target = _copy(good, path) / name
        elsewhere = path.parent / f"{path.name}-{name}-elsewhere"
        shutil.copyfile(target, elsewhere)
        os.remove(target)
        if kind == "fifo":
            os.mkfifo(target)
        elif kind == "symlink":
            os.symlink(elsewhere, target)
        elif kind == "system_symlink":
            os.symlink("/etc/passwd", target)
        else:
            os.mkdir(target)
        return str(path)

    return make


def _deeply_nested_config(good: str, path: Path) -> str:
    return _write(_copy(good, path) / CONFIG, "[" * 100_000 + "]" * 100_000)


BAD_ADAPTERS = (
    BadAdapter("truncated_weights", _edit_bytes(lambda b: b[: len(b) // 2]), 400, (WEIGHTS, "truncated")),
    BadAdapter("corrupt_header", _edit_bytes(lambda b: b"\xff" * 16 + b[16:]), 400, (WEIGHTS, "safetensors")),
    BadAdapter("empty_weights", _edit_bytes(lambda b: b""), 400, (WEIGHTS, "empty (0 bytes)")),
    BadAdapter("config_not_json", lambda g, p: _write(_copy(g, p) / CONFIG, "{r: 8"), 400, (CONFIG, "not valid JSON")),
    BadAdapter("config_a_list", _edit_config(lambda c: [c]), 400, (CONFIG, "must hold a JSON object")),
    BadAdapter("alpha_not_a_number", _edit_config(lambda c: c.update(lora_alpha="sixteen")), 400,
               (CONFIG, "lora_alpha must be a number")),
    BadAdapter("r_contradicts_tensors", _edit_config(lambda c: c.update(r=c["r"] // 4)), 400,
               ("lora_A has shape", "gives this module r")),
    BadAdapter("rank_pattern_contradicts_tensors", _edit_config(_rank_pattern_for_q), 400,
               ("self_attn.q_proj", "lora_A has shape", "rank_pattern")),
    BadAdapter("rank_pattern_back_reference", _edit_config(lambda c: c.update(rank_pattern={r"(q)_\1": 8})), 400,
               (CONFIG, "rank_pattern key", "is not a pattern vllm-bdlora matches")),
    BadAdapter("alpha_pattern_look_ahead", _edit_config(lambda c: c.update(alpha_pattern={"(?!k)q_proj": 8})), 400,
               (CONFIG, "alpha_pattern key", "is not a pattern vllm-bdlora matches")),
    BadAdapter("tensors_outside_layers_to_transform", _edit_config(_first_layer_only), 400,
               (WEIGHTS, "layers.1.", "layers_to_transform", "PEFT would not load them")),
    BadAdapter("tensors_outside_target_modules", _edit_config(lambda c: c.update(target_modules=["q_proj"])), 400,
               (WEIGHTS, "target_modules")),
    BadAdapter("nan_weights", _edit_first("lora_B", float("nan")), 400, ("lora_B holds NaN or Inf",)),
    BadAdapter("inf_weights", _edit_first("lora_A", float("inf")), 400, ("lora_A holds NaN or Inf",)),
    BadAdapter("pickle_only", _pickle_only, 400, ("adapter_model.bin is a pickle file", "never loaded")),
    BadAdapter("no_weights", _without(WEIGHTS), 400, (f"{WEIGHTS} is missing",)),
    BadAdapter("no_config", _without(CONFIG), 400, (f"{CONFIG} is missing",)),
    BadAdapter("a_file_not_a_directory", _a_file, 400, ("is a file, not an adapter directory",)),
    BadAdapter("missing_path", _missing, 404, ("No adapter found",)),
    # Values that would overflow the serving dtype and reach other requests through the KV cache.
    BadAdapter("huge_lora_alpha", _edit_config(lambda c: c.update(lora_alpha=1e308)), 400,
               (CONFIG, "lora_alpha 1e+308", "over the limit")),
    BadAdapter("huge_alpha_pattern", _edit_config(lambda c: c.update(alpha_pattern={"q_proj": 1e12})), 400,
               (CONFIG, "alpha_pattern['q_proj'] 1e+12", "over the limit")),
    BadAdapter("huge_factor", _scaled_factor("lora_B", 1e30), 400, ("gain", "over the limit")),
    # Files that are not what they claim, or not files at all.
    BadAdapter("overlapping_offsets", _edit_header(_overlap_first_two), 400, (WEIGHTS, "overlaps")),
    BadAdapter("offsets_past_the_end", _edit_header(_past_the_end), 400, (WEIGHTS, "gap")),
    BadAdapter("too_many_tensors", _edit_header(_many_tensors), 400, (WEIGHTS, "over the limit")),
    BadAdapter("int8_tensors", _as_dtype("int8"), 400, (WEIGHTS, "floating point", "I8")),
    BadAdapter("bool_tensors", _as_dtype("bool"), 400, (WEIGHTS, "floating point", "BOOL")),
    BadAdapter("deeply_nested_config", _deeply_nested_config, 400, (CONFIG, "nests too deeply")),
    BadAdapter("config_a_fifo", _replace_with(CONFIG, "fifo"), 400, (CONFIG, "not a regular file")),
    BadAdapter("weights_a_symlink", _replace_with(WEIGHTS, "symlink"), 400, (WEIGHTS, "not a regular file")),
    BadAdapter("config_a_symlink_to_a_system_file", _replace_with(CONFIG, "system_symlink"), 400,
               (CONFIG, "not a regular file")),
    BadAdapter("weights_a_directory", _replace_with(WEIGHTS, "directory"), 400, (WEIGHTS, "not a regular file")),
)  # fmt: skip


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path.parent)
