"""A small random Llama model and PEFT adapters, made locally (no model hub): the demo's embedded
default and the tests' fixtures.

The model has GQA (4 query heads, 2 KV heads) so TP=2 shards q, k and v like a real Llama, and a
word-level tokenizer whose tokens round-trip exactly. Adapters are made with PEFT itself (so they are in
PEFT's own format, BD-LoRA blocks stored without zeros) and then given random non-zero weights: PEFT
initialises LoRA-B (and block-diagonal B) to zero, which would make every adapter a no-op.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_PROJECTIONS = ATTENTION + MLP
# The BD-LoRA rule: column-parallel projections get a block-diagonal B, row-parallel ones A (Llama's names, and
# the fused qkv_proj / gate_up_proj modules of families that keep them as one module).
BD_A = ("o_proj", "down_proj")
BD_B = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")

TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def word(i: int) -> str:
    return f"w{i}"


def make_tokenizer(path: str, vocab_size: int, model_max_length: int = TINY_LLAMA["max_position_embeddings"]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3}
    vocab.update({word(i): i for i in range(4, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "model_max_length": model_max_length,
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            },
            f,
        )


# Tiny random models of other families, from Transformers' own config classes (no hub), with the Llama one's
# shapes and each family's own module names and quirks: Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's single
# qkv_proj and gate_up_proj modules. family -> (config class, model class, the projections adapters target).
PHI3_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", ALL_PROJECTIONS),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", ALL_PROJECTIONS),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", ALL_PROJECTIONS),
    "mistral": ("MistralConfig", "MistralForCausalLM", ALL_PROJECTIONS),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", PHI3_PROJECTIONS),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", ALL_PROJECTIONS),
    # A mixture of experts: BD on attention (the experts' MLPs are vLLM's fused MoE, which BD does not shard)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", ATTENTION),
}
# What a family's config needs beyond the Llama one's shapes (vLLM's Gemma 2 always ties its embeddings).
FAMILY_OVERRIDES = {
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=64, tie_word_embeddings=True),
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
}


def make_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """Save a random LlamaForCausalLM (float32) with its tokenizer to `path`."""
    return make_tiny_model(path, "llama", seed, **overrides)


def make_tiny_model(path: str, family: str, seed: int = 0, **overrides) -> str:
    """Save a random model of `family` (a FAMILIES key; float32) with its tokenizer to `path`."""
    import transformers

    config_class, model_class, _ = FAMILIES[family]
    os.makedirs(path, exist_ok=True)
    config = getattr(transformers, config_class)(
        **{**TINY_LLAMA, **FAMILY_OVERRIDES.get(family, {}), **overrides}, torch_dtype="float32"
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            # Wider than the usual 0.02 so that greedy choices have clear margins.
            param.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 1.0 / param.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path, config.vocab_size)
    return path


def randomize_lora_weights(model: torch.nn.Module, seed: int, std: float = 0.1) -> int:
    """Give every LoRA factor random non-zero weights; returns how many tensors were set."""
    generator = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
                count += 1
    if not count:
        raise RuntimeError("no LoRA parameters found to randomize")
    return count


def make_adapter(
    base_model: str,
    out_dir: str,
    rank: int,
    nblocks: int | None = None,
    target_modules: Sequence[str] = ALL_PROJECTIONS,
    lora_alpha: int | None = None,
    seed: int = 1,
    std: float = 0.1,
) -> str:
    """Train-free PEFT adapter: BD-LoRA with `nblocks` blocks, or standard LoRA when nblocks is None."""
    from peft import BdLoraConfig, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model, torch_dtype=torch.float32)
    bd = None
    if nblocks is not None:
        bd = BdLoraConfig(
            target_modules_bd_a=[m for m in BD_A if m in target_modules],
            target_modules_bd_b=[m for m in BD_B if m in target_modules],
            nblocks=nblocks,
        )
    config = LoraConfig(
        r=rank,
        lora_alpha=lora_alpha or rank,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        use_bdlora=bd,
    )
    model = get_peft_model(base, config)
    randomize_lora_weights(model, seed, std)
    model.save_pretrained(out_dir)
    return out_dir


def make_bd_experts_adapter(out_dir: str, rank: int = 8) -> str:
    """A BD-LoRA adapter in PEFT's format whose block-diagonal factors lie on a mixture of experts' experts (up_proj
    of experts 0 and 1 in layer 0 of the tiny Qwen3-MoE): what vllm-bdlora refuses, naming the experts."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    prefix = "base_model.model.model.layers.0.mlp.experts"
    tensors = {f"{prefix}.{e}.up_proj.lora_{f}.weight": torch.full((rank, rank), 0.01) for e in range(2) for f in "AB"}
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    bd = {"target_modules_bd_a": ["down_proj"], "target_modules_bd_b": ["up_proj"], "nblocks": 2}
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["up_proj"], "use_bdlora": bd}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def densify_adapter(bd_dir: str, out_dir: str) -> str:
    """Write a BD-LoRA adapter as the equivalent standard LoRA adapter (zeros written out)."""
    from safetensors.torch import load_file, save_file

    from vllm_bdlora.adapters import parse_block_diagonal_spec, read_adapter_config
    from vllm_bdlora.sharding import densify

    config = read_adapter_config(bd_dir)
    spec = parse_block_diagonal_spec(config, bd_dir)
    tensors = load_file(os.path.join(bd_dir, "adapter_model.safetensors"))
    dense = {}
    for key, value in tensors.items():
        module = key.split(".lora_")[0]
        if key.endswith(".lora_magnitude_vector"):
            dense[key] = value  # one value per output feature: the same dense or block-diagonal
            continue
        factor = spec.factor_of(module) if spec else None
        is_a = ".lora_A." in key
        if factor == ("a" if is_a else "b"):
            value = densify(value, spec.nblocks)
        dense[key] = value.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(dense, os.path.join(out_dir, "adapter_model.safetensors"))
    config.pop("use_bdlora", None)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def add_dora_magnitudes(adapter_dir: str, base_model: str, out_dir: str, seed: int = 1) -> str:
    """Turn a LoRA or BD-LoRA adapter into a DoRA / BD-DoRA one: `use_dora: true` plus a
    `lora_magnitude_vector` per module, m = ||W_row|| · U(0.5, 1.5), so that g = m/||W + s·B·A|| is far
    from 1. BD-DoRA is PEFT's BD-LoRA tensors plus the magnitudes (PEFT cannot train it yet)."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = load_file(os.path.join(base_model, "model.safetensors"))
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
        module = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
        weight = base[module + ".weight"]
        jitter = 0.5 + torch.rand(weight.shape[0], generator=generator)
        tensors[key.removesuffix(".lora_A.weight") + ".lora_magnitude_vector"] = weight.norm(dim=1) * jitter
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    copy_json_with(os.path.join(adapter_dir, "adapter_config.json"), os.path.join(out_dir, "adapter_config.json"),
                   use_dora=True)  # fmt: skip
    for name in os.listdir(adapter_dir):
        if name not in ("adapter_model.safetensors", "adapter_config.json"):
            src = os.path.join(adapter_dir, name)
            if os.path.isfile(src):
                shutil.copy(src, out_dir)
    return out_dir


def make_int8_checkpoint(model_dir: str, out_dir: str, dequantized_dir: str) -> tuple[str, str]:
    """A compressed-tensors W8A8 checkpoint of `model_dir` (decoder projections int8, symmetric, one scale per
    output channel; activations quantized per token at run time, as llm-compressor's W8A8 scheme writes them), and
    beside it the same model with those projections dequantized (float32): the weights a reference must use."""

    def int8_channel(name: str, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
        scale = weight.abs().amax(dim=1, keepdim=True) / 127.0
        q = torch.round(weight / scale).clamp(-127, 127).to(torch.int8)
        return {name: q, name + "_scale": scale.to(weight.dtype)}, q.to(torch.float32) * scale

    scheme = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None,
              "actorder": None, "observer": None, "observer_kwargs": {}}  # fmt: skip
    group = {"targets": ["Linear"], "format": "int-quantized", "output_activations": None,
             "weights": {**scheme, "strategy": "channel", "dynamic": False, "observer": "minmax"},
             "input_activations": {**scheme, "strategy": "token", "dynamic": True}}  # fmt: skip
    return _write_quantized(model_dir, out_dir, dequantized_dir, int8_channel, "int-quantized", group)


def make_w4a16_checkpoint(model_dir: str, out_dir: str, dequantized_dir: str, group_size: int = 32) -> tuple[str, str]:
    """A compressed-tensors W4A16 checkpoint of `model_dir` (decoder projections 4-bit, symmetric, one scale per
    `group_size` inputs of each output channel, packed eight to an int32 by compressed-tensors' own packer;
    activations unquantized: llm-compressor's W4A16 scheme, the GPTQ-style 4-bit layout), and the same model with
    those projections dequantized (float32) beside it."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    def int4_groups(name: str, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
        rows, columns = weight.shape
        grouped = weight.reshape(rows, columns // group_size, group_size)
        # scales stored in bfloat16 (as llm-compressor stores them, and what vLLM's 4-bit CPU kernel computes in):
        # the weights are quantized and dequantized with the rounded scale
        scale = (grouped.abs().amax(dim=2, keepdim=True) / 7.0).to(torch.bfloat16).float()
        q = torch.round(grouped / scale).clamp(-8, 7).to(torch.int8)
        stem = name.removesuffix("weight")
        stored = {stem + "weight_packed": pack_to_int32(q.reshape(rows, columns), 4),
                  stem + "weight_scale": scale.squeeze(2).to(torch.bfloat16),
                  stem + "weight_shape": torch.tensor([rows, columns], dtype=torch.int64)}  # fmt: skip
        return stored, (q.to(torch.float32) * scale).reshape(rows, columns)

    group = {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None, "output_activations": None,
             "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
                         "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                         "observer_kwargs": {}}}  # fmt: skip
    return _write_quantized(model_dir, out_dir, dequantized_dir, int4_groups, "pack-quantized", group)


def _write_quantized(model_dir, out_dir, dequantized_dir, quantize, fmt: str, group: dict) -> tuple[str, str]:
    """Write `model_dir` with each decoder projection's weight replaced by `quantize(name, weight)`'s tensors under
    compressed-tensors' config for `group` (to `out_dir`), and with its dequantized weight (to `dequantized_dir`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            stored, dequantized[name] = quantize(name, tensor)
            quantized.update(stored)
        else:
            quantized[name] = dequantized[name] = tensor
    quantization = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
                    "config_groups": {"group_0": group}}  # fmt: skip
    for directory, weights in ((out_dir, quantized), (dequantized_dir, dequantized)):
        shutil.copytree(model_dir, directory, dirs_exist_ok=True)
        save_file(weights, os.path.join(directory, "model.safetensors"))
    config = os.path.join(out_dir, "config.json")
    copy_json_with(config, config, quantization_config=quantization)
    return out_dir, dequantized_dir


def copy_json_with(source: str, target: str, **changes) -> None:
    """Write the JSON object in `source` to `target` (which may be `source`) with `changes` set."""
    with open(source) as f:
        config = json.load(f)
    with open(target, "w") as f:
        json.dump({**config, **changes}, f, indent=2)
