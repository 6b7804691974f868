"""What an adapter directory must hold, checked from its files before any tensor is read, and the one way they are
opened.

Every file is opened once, through a descriptor of the adapter's directory, without following symlinks, and must be
a regular file: everything after (the checks here, the tensor reads in `read_and_cut.py`) reads those descriptors,
so a path re-pointed while a load runs cannot change what is read. Where the server confines loads
(`--allowed-adapter-roots`) the directory's descriptor is checked for where it really is, after it was opened. A
file that is missing, a symlink, a FIFO, a device or unreadable gets one message, whatever the reason, so an answer
tells nothing about what exists on the server's disk.

Each problem becomes one `AdapterRejected` naming the adapter, the file and the fix (HTTP 400; the server keeps
serving). Checked here: the path is a directory; `adapter_config.json` is a JSON object of at most 1 MiB, nested
at most 64 deep, whose `r`, `lora_alpha`, `rank_pattern` and `alpha_pattern` are numbers of the right kind and
whose scales (`lora_alpha / r`, per pattern, rsLoRA's `/ sqrt(r)`) are within `values.MAX_SCALING`, and
whose module-name patterns are ones `vllm_bdlora.name_patterns` matches in linear time; the
weights are in `adapter_model.safetensors` (pickle files are never loaded); that file's header is well formed,
holds at most `MAX_TENSORS` floating-point tensors laid end to end without gaps or overlaps, and the file is as
long as the header says (a truncated or half-copied file is caught here, not by a tensor reader); every `lora_A`
has as many rows as the rank `adapter_config.json` gives its module (PEFT refuses an adapter whose `r` contradicts
its tensors; serving one would scale it by the wrong `lora_alpha / r`); every module with tensors is one PEFT puts a
LoRA layer on under the config's `target_modules`, `exclude_modules` and `layers_to_transform` (PEFT ignores the
others' tensors; serving them would answer differently); and no block-diagonal factor lies inside
a mixture of experts' experts (vLLM's fused MoE layer, which BD does not shard). Tensor values (NaN/Inf, gains)
are checked once read, in `vllm_bdlora.adapter_lifecycle.values`.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from json.scanner import py_make_scanner

from vllm_bdlora.adapter_lifecycle.values import config_scale_problems, lora_scaling
from vllm_bdlora.adapters import (
    EXPERTS_HINT,
    AdapterRejected,
    block_diagonal_expert_modules,
    parse_block_diagonal_spec,
)
from vllm_bdlora.name_patterns import (
    RE2_HINT,
    first_matching_key,
    matching_work_problem,
    pattern_problems,
    peft_targets,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILES = ("adapter_model.bin", "adapter_model.pt")

# A file changed while it was read, or the ranks read different files.
REWRITE_HINT = "load it again once its files are completely written (write elsewhere, then rename into place)."
RESAVE_HINT = "re-save the adapter with PEFT's save_pretrained (safetensors, the default) and load it again."
# Floating-point tensors only: an integer or boolean "LoRA factor" would be converted and served as something
# other than what was trained.
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
TORCH_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8,
    "U64": 8, **FLOAT_DTYPES,
}  # fmt: skip
_HEADER_LIMIT = 100 * 2**20  # safetensors' own limit on the JSON header
CONFIG_LIMIT = 2**20  # PEFT writes a few KiB
CONFIG_DEPTH_LIMIT = 64  # PEFT nests three deep
# A dense 80-layer model with every projection adapted holds ~1,100 tensors, a 128-expert MoE adapter with
# per-expert factors tens of thousands.
MAX_TENSORS = 2**18

UNREADABLE = "is missing, or not a regular file this server may read, in the adapter directory"
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class AdapterPathRefused(PermissionError):
    """The adapter's directory lies outside the server's allowed roots (found once it was opened). Its message is
    `access.PATH_REFUSED`, which the API server answers with HTTP 403."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


@dataclass
class OpenedAdapter:
    """An adapter's files, opened once: its config, the weights file's descriptor and header. Close it (or use it as
    a context manager) when its tensors have been read."""

    name: str
    directory: str
    config: dict
    tensors: dict[str, TensorEntry]
    weights_fd: int
    data_start: int  # where the safetensors data section begins
    size: int
    identity: str  # sha256 of the config's bytes, the header's bytes and the weights file's size and mtime
    _stat: tuple = field(repr=False, default=())
    _mmap: mmap.mmap | None = field(repr=False, default=None)

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: entry.shape for name, entry in self.tensors.items()}

    def tensor_views(self) -> dict:
        """name -> a torch tensor viewing the file's bytes (read lazily by the page cache: slicing rows reads only
        their pages). Valid until `close`; copy what must outlive it."""
        import torch

        if self._mmap is None:
            # private and copy-on-write: the views are writable as torch expects, and nothing can reach the file
            self._mmap = mmap.mmap(self.weights_fd, 0, access=mmap.ACCESS_COPY) if self.size else None
        buffer = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")
        views = {}
        for name, entry in self.tensors.items():
            dtype = getattr(torch, TORCH_DTYPES[entry.dtype])
            start, stop = self.data_start + entry.begin, self.data_start + entry.end
            if stop == start:
                views[name] = torch.empty(entry.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(buffer[start:stop], dtype=torch.uint8)
            views[name] = flat.view(dtype).reshape(entry.shape)
        return views

    def unchanged(self) -> bool:
        """True while the weights file is as it was opened (a write in place changes its size or mtime)."""
        return _file_stamp(os.fstat(self.weights_fd)) == self._stat

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still alive: the mapping goes with it
                pass
            self._mmap = None
        if self.weights_fd >= 0:
            os.close(self.weights_fd)
            self.weights_fd = -1

    def __enter__(self) -> OpenedAdapter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _file_stamp(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_adapter(directory: str, adapter: str, roots: Sequence[str] = ()) -> OpenedAdapter:
    """Open and check an adapter directory, or raise `AdapterRejected` naming the file and the problem
    (`AdapterPathRefused` outside `roots`; FileNotFoundError where `directory` does not exist, vLLM's 404)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        # outside the roots, every failure gets the one uniform refusal
        if roots and not _inside_roots(os.path.realpath(directory), roots):
            raise _refused() from None
        if isinstance(e, FileNotFoundError):
            raise
        if isinstance(e, NotADirectoryError):
            raise AdapterRejected(
                adapter, [f"{directory} is a file, not an adapter directory"],
                f"give the directory that holds {CONFIG_FILE} and {WEIGHTS_FILE}.",
            ) from None  # fmt: skip
        raise AdapterRejected(adapter, ["the adapter directory cannot be read by this server"], None) from None
    try:
        if roots and not _inside_roots(_opened_path(dir_fd, directory), roots):
            raise _refused()
        config_bytes = _read_small_file(dir_fd, CONFIG_FILE, adapter, CONFIG_LIMIT)
        config = parse_config(config_bytes, adapter)
        weights_fd = _open_regular(dir_fd, WEIGHTS_FILE)
        if weights_fd is None:
            pickles = [name for name in PICKLE_WEIGHTS_FILES if _is_regular(dir_fd, name)]
            problem = (
                f"{WEIGHTS_FILE} is missing; {', '.join(pickles)} is a pickle file, which is never loaded (it can run "
                "code)"
                if pickles
                else f"{WEIGHTS_FILE} {UNREADABLE}"
            )
            raise AdapterRejected(adapter, [problem], RESAVE_HINT)
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(weights_fd)
        tensors, data_start, header_bytes = read_safetensors_header(weights_fd, st.st_size, adapter)
        problems = rank_problems(config, {n: e.shape for n, e in tensors.items()})
        if problems:
            fix = (f"make r, rank_pattern and target_modules (layers_to_transform) in {CONFIG_FILE} agree with the "
                   f"tensors, or {RESAVE_HINT}")  # fmt: skip
            raise AdapterRejected(adapter, problems, fix)
        experts = block_diagonal_expert_modules(tensors, parse_block_diagonal_spec(config, adapter))
        if experts:
            problems = [f"{module}: block-diagonal LoRA factors on an expert" for module in experts]
            raise AdapterRejected(adapter, problems, EXPERTS_HINT)
    except BaseException:
        os.close(weights_fd)
        raise
    digest = hashlib.sha256()
    for part in (config_bytes, header_bytes, repr((st.st_size, st.st_mtime_ns)).encode()):
        digest.update(len(part).to_bytes(8, "little") + part)
    return OpenedAdapter(adapter, directory, config, tensors, weights_fd, data_start, st.st_size, digest.hexdigest(),
                         _file_stamp(st))  # fmt: skip


def check_adapter_dir(directory: str, adapter: str, roots: Sequence[str] = ()) -> OpenedAdapter:
    """`open_adapter`, closed again: the config and tensor shapes of a directory that passes every file check."""
    opened = open_adapter(directory, adapter, roots)
    opened.close()
    return opened


def _refused() -> AdapterPathRefused:
    from vllm_bdlora.access import PATH_REFUSED

    return AdapterPathRefused(PATH_REFUSED)


def _inside_roots(real_path: str, roots: Sequence[str]) -> bool:
    from vllm_bdlora.access import is_allowed_adapter_path

    return is_allowed_adapter_path(real_path, roots)


def _opened_path(fd: int, fallback: str) -> str:
    """Where an opened directory really is: the kernel's name for the descriptor (Linux), so that a symlink
    re-pointed after the open cannot move what was opened."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(fallback)


def _open_regular(dir_fd: int, name: str) -> int | None:
    """A descriptor of `name` in the directory if it is a regular file that can be read (never a symlink, FIFO or
    device: opened non-blocking, so a FIFO cannot stall the open), else None."""
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_regular(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _read_small_file(dir_fd: int, name: str, adapter: str, limit: int) -> bytes:
    fd = _open_regular(dir_fd, name)
    if fd is None:
        raise AdapterRejected(adapter, [f"{name} {UNREADABLE}"], RESAVE_HINT)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise AdapterRejected(adapter, [f"{name} is {size} bytes, over the {limit}-byte limit"], RESAVE_HINT)
        return _pread_exactly(fd, size, 0)
    except OSError:
        raise AdapterRejected(adapter, [f"{name} {UNREADABLE}"], RESAVE_HINT) from None
    finally:
        os.close(fd)


def _pread_exactly(fd: int, length: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < length:
        chunk = os.pread(fd, length - done, offset + done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def _depth(value, limit: int) -> int:
    """How deeply `value` nests (iteratively, so that no nesting can exhaust the interpreter's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_config(raw: bytes, adapter: str) -> dict:
    """`adapter_config.json`'s object, its fields checked (see the module's docstring)."""
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterRejected(adapter, [f"{CONFIG_FILE} is not valid JSON ({e})"], RESAVE_HINT) from None
    except RecursionError:
        problem = f"{CONFIG_FILE} nests too deeply to be an adapter config"
        raise AdapterRejected(adapter, [problem], RESAVE_HINT) from None
    if not isinstance(config, dict):
        problem = f"{CONFIG_FILE} must hold a JSON object, got a JSON {type(config).__name__}"
        raise AdapterRejected(adapter, [problem], RESAVE_HINT)
    if _depth(config, CONFIG_DEPTH_LIMIT) > CONFIG_DEPTH_LIMIT:
        raise AdapterRejected(adapter, [f"{CONFIG_FILE} nests more than {CONFIG_DEPTH_LIMIT} levels deep"], RESAVE_HINT)
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
    problems = pattern_problems(config, CONFIG_FILE)
    if problems:
        raise AdapterRejected(adapter, problems, RE2_HINT)
    problems = config_scale_problems(config)
    if problems:
        raise AdapterRejected(adapter, [f"{CONFIG_FILE}: {p}" for p in problems],
                              "train the adapter with a lora_alpha in proportion to its rank.")  # fmt: skip
    return config


# A header up to this size is parsed by json's C parser, which holds the interpreter lock throughout (about 25 ms at
# this size on the CPUs tried); a larger one (the format allows 100 MiB: seconds of a stalled engine step) by its
# Python parser, which lets the engine's step thread run every switch interval.
LOCK_HOLDING_PARSE_LIMIT = 2**20


def parse_header_json(raw: bytes):
    """A safetensors header's JSON, parsed without holding the interpreter lock for long (the worker's engine step
    runs beside the admission thread doing this)."""
    if len(raw) <= LOCK_HOLDING_PARSE_LIMIT:
        return json.loads(raw)
    decoder = json.JSONDecoder()
    decoder.scan_once = py_make_scanner(decoder)
    return decoder.decode(raw.decode("utf-8"))


def read_safetensors_header(fd: int, size: int, adapter: str) -> tuple[dict[str, TensorEntry], int, bytes]:
    """(name -> entry, where the data starts, the header's bytes) of a safetensors file, after checking that the
    header is well formed, that its tensors are floating point and lie end to end from the start of the data
    section, and that the file holds every byte the header promises (no tensor data is read)."""

    def rejected(problem: str) -> AdapterRejected:
        return AdapterRejected(adapter, [f"{WEIGHTS_FILE}: {problem}"], RESAVE_HINT)

    if size == 0:
        raise rejected("the file is empty (0 bytes)")
    prefix = _pread_exactly(fd, 8, 0)
    if len(prefix) < 8:
        raise rejected(f"not a safetensors file ({size} bytes, too short for a header)")
    (header_length,) = struct.unpack("<Q", prefix)
    if header_length > min(_HEADER_LIMIT, size - 8):
        raise rejected(f"not a safetensors file, or truncated (header of {header_length} bytes in a {size}-byte file)")
    header_bytes = _pread_exactly(fd, header_length, 8)
    try:
        header = parse_header_json(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise rejected("corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise rejected("corrupt safetensors header (not a JSON object)")
    if len(header) > MAX_TENSORS + 1:
        raise rejected(f"its header lists {len(header)} tensors, over the limit of {MAX_TENSORS}")
    tensors, not_float = {}, []
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
        if not all(type(n) is int and n >= 0 for n in (*shape, begin, stop)) or stop - begin != expected:
            raise rejected(f"corrupt safetensors header entry for {tensor}")
        if dtype not in FLOAT_DTYPES:
            not_float.append(f"{tensor} is {dtype}")
        tensors[tensor] = TensorEntry(dtype, shape, begin, stop)
    if not_float:
        shown = ", ".join(not_float[:4]) + (f" and {len(not_float) - 4} more" if len(not_float) > 4 else "")
        raise rejected(f"LoRA tensors must be floating point (F16, BF16, F32 or F64): {shown}")
    end = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != end:
            what = "overlaps the tensor before it" if entry.begin < end else "leaves a gap before it"
            raise rejected(f"the data of {name} {what} (bytes {entry.begin}-{entry.end}, expected to start at {end})")
        end = entry.end
    if 8 + header_length + end != size:
        described = 8 + header_length + end
        raise rejected(f"truncated or padded: the header describes {described} bytes, the file has {size}")
    return tensors, 8 + header_length, header_bytes


def module_rank(config: dict, module: str) -> int:
    """The rank PEFT gives `module` (its name in the checkpoint, without `base_model.model.`): the first
    `rank_pattern` key that matches a dotted suffix of the name, else `r`."""
    ranks = config.get("rank_pattern") or {}
    key = first_matching_key(ranks, module)
    return config["r"] if key is None else ranks[key]


def module_scaling(config: dict, module: str) -> float:
    """The scaling PEFT applies to `module`: its alpha (`alpha_pattern` matched as `rank_pattern` is) over its rank, or
    over the rank's square root with rsLoRA."""
    alphas = config.get("alpha_pattern") or {}
    key = first_matching_key(alphas, module)
    alpha = config.get("lora_alpha", 8) if key is None else alphas[key]
    return lora_scaling(alpha, module_rank(config, module), bool(config.get("use_rslora")))


def rank_problems(config: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """`lora_A` has one row per rank in every layout PEFT writes (standard, block-diagonal A and B), on a module PEFT
    targets under the config."""
    problems, untargeted = [], []
    modules = sum(".lora_A" in tensor for tensor in shapes)
    too_much = matching_work_problem(config, modules, CONFIG_FILE)
    if too_much:
        return [too_much]
    for tensor, shape in shapes.items():
        if ".lora_A" not in tensor:
            continue
        module = tensor.split(".lora_A", 1)[0].removeprefix("base_model.model.")
        if not peft_targets(config, module):
            untargeted.append(module)
            continue
        rank = module_rank(config, module)
        if len(shape) != 2 or shape[0] != rank:
            source = "rank_pattern" if rank != config["r"] else "r"
            problems.append(
                f"{module}: lora_A has shape {list(shape)} but {CONFIG_FILE} gives this module {source} {rank} "
                f"(expected [{rank}, ...])"
            )
    if untargeted:
        shown = ", ".join(untargeted[:3]) + (f" and {len(untargeted) - 3} more" if len(untargeted) > 3 else "")
        problems.append(
            f"{WEIGHTS_FILE} has LoRA tensors for {shown}, which {CONFIG_FILE}'s target_modules, exclude_modules and "
            "layers_to_transform leave out (PEFT would not load them)"
        )
    return problems


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
