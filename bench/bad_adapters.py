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


def _edit_first(factor: str, value: float) -> Callable[[str, Path], str]:
    def make(good: str, path: Path) -> str:
        from safetensors.torch import load_file, save_file

        weights = _copy(good, path) / WEIGHTS
        tensors = load_file(weights)
        name = next(n for n in sorted(tensors) if factor in n)
        tensors[name].view(-1)[0] = value
        save_file(tensors, weights)
        return str(path)

    return make


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
    BadAdapter("nan_weights", _edit_first("lora_B", float("nan")), 400, ("lora_B holds NaN or Inf",)),
    BadAdapter("inf_weights", _edit_first("lora_A", float("inf")), 400, ("lora_A holds NaN or Inf",)),
    BadAdapter("pickle_only", _pickle_only, 400, ("adapter_model.bin is a pickle file", "never loaded")),
    BadAdapter("no_weights", _without(WEIGHTS), 400, (f"{WEIGHTS} is missing",)),
    BadAdapter("no_config", _without(CONFIG), 400, (f"{CONFIG} is missing",)),
    BadAdapter("a_file_not_a_directory", _a_file, 400, ("is a file, not an adapter directory",)),
    BadAdapter("missing_path", _missing, 404, ("No adapter found",)),
)  # fmt: skip


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path.parent)
