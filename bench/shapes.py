"""Model shapes for the serving benchmarks, and dummy model folders for `--load-format dummy`.

A folder holds a Llama config and a word-level tokenizer whose tokens round-trip exactly (so the random
prompts of `vllm bench serve` keep their length); vLLM fills the weights with random values.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from vllm_bdlora.tiny import make_tokenizer


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 8192

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA target in one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def sizing_shape(self, dtype: str = "bfloat16"):
        """The shape as vllm-bdlora's sizing rules see it (`vllm_bdlora.sizing.ModelShape`: slot costs, each TP
        rank's shard of a projection)."""
        from vllm_bdlora.sizing import ModelShape

        return ModelShape(self.hidden_size, self.intermediate_size, self.num_attention_heads, self.num_key_value_heads,
                          self.head_dim, dtype, self.num_hidden_layers, self.vocab_size)  # fmt: skip


SHAPES = {
    "llama-3.1-8b": LlamaShape(4096, 14336, 32, 32, 8, 128, 128256),
    "llama-3.1-70b": LlamaShape(8192, 28672, 80, 64, 8, 128, 128256),
    # small enough for a CPU server, at the depth of a served model (16 layers: 112 LoRA modules)
    "llama-3.2-1b": LlamaShape(2048, 8192, 16, 32, 8, 64, 128256),
    # CPU dry runs of the whole pipeline
    "tiny": LlamaShape(128, 256, 2, 4, 2, 32, 512, max_position_embeddings=1024),
}


def make_dummy_model(shape_name: str, path: str) -> str:
    shape = SHAPES[shape_name]
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(shape),
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    make_tokenizer(path, shape.vocab_size, shape.max_position_embeddings)
    return path
