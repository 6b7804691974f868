import pytest

from vllm_bdlora.adapters import AdapterRejected, BlockDiagonalSpec, parse_block_diagonal_spec
from vllm_bdlora.config import BdLoraSettings, with_bdlora_enabled

PEFT_SECTION = {
    "target_modules_bd_a": ["o_proj", "down_proj"],
    "target_modules_bd_b": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
    "nblocks": 4,
    "match_strict": True,
}


def test_standard_adapter_has_no_spec():
    assert parse_block_diagonal_spec({"r": 8}, "x") is None
    assert parse_block_diagonal_spec({"r": 8, "use_bdlora": None}, "x") is None


def test_factor_follows_peft_substring_rule_on_the_module_name():
    spec = parse_block_diagonal_spec({"use_bdlora": PEFT_SECTION}, "x")
    assert spec == BlockDiagonalSpec(4, ("o_proj", "down_proj"), ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    assert spec.factor_of("model.layers.3.self_attn.o_proj") == "a"
    assert spec.factor_of("model.layers.3.mlp.up_proj") == "b"
    assert spec.factor_of("model.layers.3.mlp.gate_up_proj") == "b"  # PEFT: "up_proj" in "gate_up_proj"
    assert spec.factor_of("model.layers.3.self_attn.rotary") is None
    # The layer index is not part of the match: "o_proj" patterns never see "model.layers.0".
    assert BlockDiagonalSpec(2, ("layers",), ()).factor_of("model.layers.0.mlp.down_proj") is None


def test_block_diagonal_factors_on_experts_are_found_and_refused_from_the_files(tmp_path):
    """BD-LoRA does not shard a mixture of experts' experts (vLLM's fused MoE layer): block-diagonal factors there,
    per-expert or stored as one module, are refused from the files, naming them; BD attention beside standard
    expert LoRA, and a dense MLP's BD factors, are not."""
    import json

    import torch
    from safetensors.torch import save_file

    from vllm_bdlora.adapter_lifecycle.files import check_adapter_dir
    from vllm_bdlora.adapters import block_diagonal_expert_modules

    spec = parse_block_diagonal_spec({"use_bdlora": PEFT_SECTION}, "x")
    prefix = "base_model.model.model.layers.0"
    names = [f"{prefix}.self_attn.q_proj.lora_A.weight", f"{prefix}.mlp.experts.3.up_proj.lora_B.weight",
             f"{prefix}.mlp.experts.3.down_proj.lora_A.weight", f"{prefix}.mlp.shared_expert.gate_proj.lora_B.weight",
             "base_model.model.model.layers.1.mlp.experts.lora_A.weight"]  # fmt: skip
    assert block_diagonal_expert_modules(names, spec) == [
        f"{prefix}.mlp.experts.3.down_proj", f"{prefix}.mlp.experts.3.up_proj",
        "base_model.model.model.layers.1.mlp.experts",
    ]  # fmt: skip
    attention_only = BlockDiagonalSpec(2, ("o_proj",), ("q_proj", "k_proj", "v_proj"))
    assert block_diagonal_expert_modules(names[:3], attention_only) == []
    assert block_diagonal_expert_modules(names, None) == []
    tensors = {f"{prefix}.mlp.experts.{e}.gate_proj.lora_{f}.weight": torch.ones(8, 8) for e in range(2) for f in "AB"}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["gate_proj"], "use_bdlora": PEFT_SECTION}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterRejected) as refused:
        check_adapter_dir(str(tmp_path), "moe-bd")
    message = str(refused.value)
    assert "'moe-bd'" in message and "experts.0.gate_proj" in message and "experts.1.gate_proj" in message
    assert "block-diagonal LoRA factors on an expert" in message and "target_modules_bd_a/b" in message


def test_one_block_is_a_standard_adapter():
    assert BlockDiagonalSpec(1, ("o_proj",), ()).factor_of("x.o_proj") is None


@pytest.mark.parametrize(
    "section,message",
    [
        ({**PEFT_SECTION, "nblocks": 0}, "nblocks must be a positive integer"),
        ({**PEFT_SECTION, "nblocks": "4"}, "nblocks must be a positive integer"),
        ({**PEFT_SECTION, "target_modules_bd_a": "o_proj"}, "target_modules_bd_a must be a list"),
        ({**PEFT_SECTION, "target_modules_bd_a": ["q_proj"]}, "listed in both"),
        ("yes", "use_bdlora must be an object"),
    ],
)
def test_malformed_sections_are_rejected_by_name(section, message):
    with pytest.raises(AdapterRejected, match=message) as info:
        parse_block_diagonal_spec({"use_bdlora": section}, "my-adapter")
    assert "'my-adapter'" in str(info.value)


def test_rejection_groups_repeated_problems():
    problems = [f"model.layers.{i}.mlp.{m}: too wide" for i in range(4) for m in ("up_proj", "down_proj")]
    message = str(AdapterRejected("a", problems + ["model.layers.1.self_attn.q_proj: bad shape"], "fix it"))
    assert "model.layers.*.mlp.up_proj, model.layers.*.mlp.down_proj (layers 0-3): too wide" in message
    assert "model.layers.1.self_attn.q_proj: bad shape" in message
    assert message.endswith("Fix: fix it")


@pytest.mark.parametrize(
    "additional_config,enabled",
    [(None, False), ({}, False), ({"bdlora": {}}, True), ({"bdlora": {"enabled": False}}, False)],
)
def test_settings(additional_config, enabled):
    assert BdLoraSettings.from_additional_config(additional_config).enabled is enabled


@pytest.mark.parametrize(
    "section,message",
    [
        (True, "must be a JSON object"),
        ({"enable": True}, "Unknown key"),
        ({"enabled": "yes"}, "true or false"),
        ({"dora": 1}, "true or false"),
        ({"one_launch_decode": "off"}, "true or false"),
        ({"fill_slots_ahead": 0}, "true or false"),
        ({"fill_ahead_slots": -1}, "must be an integer >= 0"),
        ({"hold_for_slot_fills": "on"}, "true or false"),
        ({"fill_ahead_slots": True}, "must be an integer >= 0"),
        ({"one_launch_max_tokens": 24}, r"must be one of \[16, 32, 64\]"),
        ({"one_launch_max_tokens": True}, r"must be one of \[16, 32, 64\]"),
        ({"lora_kernels": "triton"}, r"must be one of \['vllm', 'fused', 'auto'\]"),
        ({"one_launch_max_mixed_width": -1}, "must be an integer >= 0"),
        ({"one_launch_max_mixed_width": "256"}, "must be an integer >= 0"),
        ({"one_launch_max_mixed_width": False}, "must be an integer >= 0"),
        ({"one_launch_max_adapters": -1}, "must be an integer >= 0"),
        ({"one_launch_max_adapters": 2.5}, "must be an integer >= 0"),
        ({"read_back_hold_s": -1}, "read_back_hold_s"),
        ({"named_kept_s": "30"}, "named_kept_s"),
    ],
)
def test_bad_settings(section, message):
    with pytest.raises(ValueError, match=message):
        BdLoraSettings.from_additional_config({"bdlora": section})


def test_the_read_back_holds_are_settings():
    """How long a request waits for its adapter's read-back, and how long a named adapter is kept from spilling."""
    defaults = BdLoraSettings.from_additional_config({"bdlora": {}})
    assert (defaults.read_back_hold_s, defaults.named_kept_s) == (2.0, 30.0)
    given = BdLoraSettings.from_additional_config({"bdlora": {"read_back_hold_s": 0.5, "named_kept_s": 5}})
    assert (given.read_back_hold_s, given.named_kept_s) == (0.5, 5)


def test_slots_are_filled_ahead_of_the_step_unless_turned_off():
    assert BdLoraSettings.from_additional_config({"bdlora": {}}).fill_slots_ahead
    assert not BdLoraSettings.from_additional_config({"bdlora": {"fill_slots_ahead": False}}).fill_slots_ahead


def test_requests_sit_out_a_step_for_their_slot_fill_unless_turned_off():
    assert BdLoraSettings.from_additional_config({"bdlora": {}}).hold_for_slot_fills
    assert not BdLoraSettings.from_additional_config({"bdlora": {"hold_for_slot_fills": False}}).hold_for_slot_fills


def test_one_slot_is_kept_for_fills_ahead_unless_set_otherwise_or_filling_ahead_is_off():
    spare = lambda section: BdLoraSettings.from_additional_config({"bdlora": section}).spare_slots  # noqa: E731
    assert spare({}) == 1 and spare({"fill_ahead_slots": 2}) == 2 and spare({"fill_ahead_slots": 0}) == 0
    assert spare({"fill_slots_ahead": False}) == 0 and spare({"enabled": False}) == 0


def test_dora_and_kernel_settings():
    settings = BdLoraSettings.from_additional_config({"bdlora": {"dora": True, "lora_kernels": "fused"}})
    assert (settings.enabled, settings.dora, settings.lora_kernels) == (True, True, "fused")
    assert BdLoraSettings.from_additional_config({"bdlora": {"enabled": False, "dora": True}}).dora is False
    assert BdLoraSettings.from_additional_config({"bdlora": {}}).lora_kernels == "auto"  # fused on CUDA only
    assert BdLoraSettings.from_additional_config({"bdlora": {}}).one_launch_decode is True
    assert BdLoraSettings.from_additional_config({"bdlora": {"one_launch_decode": False}}).one_launch_decode is False
    assert BdLoraSettings.from_additional_config({"bdlora": {}}).one_launch_max_tokens == 64
    limited = BdLoraSettings.from_additional_config({"bdlora": {"one_launch_max_tokens": 16}})
    assert limited.one_launch_max_tokens == 16
    assert BdLoraSettings.from_additional_config({"bdlora": {}}).one_launch_max_mixed_width is None  # measured
    unset = BdLoraSettings.from_additional_config({"bdlora": {"one_launch_max_mixed_width": None}})
    assert unset == BdLoraSettings.from_additional_config({"bdlora": {}})
    wide = BdLoraSettings.from_additional_config({"bdlora": {"one_launch_max_mixed_width": 4096}})
    assert wide.one_launch_max_mixed_width == 4096
    assert BdLoraSettings.from_additional_config({"bdlora": {}}).one_launch_max_adapters == 16
    few = BdLoraSettings.from_additional_config({"bdlora": {"one_launch_max_adapters": 4}})
    assert few.one_launch_max_adapters == 4


def test_the_log_says_which_decode_batches_run_as_one_kernel():
    """With --max-loras above 1 the one-kernel limit depends on how wide a batch's token rows are together and how
    many adapters it may mix; the start-up log states the resulting limit and the settings that move it."""
    from vllm_bdlora.kernels.plans import DEFAULT_MAX_MIXED_ADAPTERS, DEFAULT_MAX_MIXED_WIDTH
    from vllm_bdlora.manager import one_launch_summary

    settings = BdLoraSettings.from_additional_config({"bdlora": {}})
    assert settings.one_launch_max_mixed_width is None  # the GPU's measured limits, else DEFAULT_MAX_MIXED_WIDTH
    assert settings.one_launch_max_adapters == DEFAULT_MAX_MIXED_ADAPTERS
    assert one_launch_summary(settings, 1, 512).startswith("Decode batches of up to 64 tokens")
    many = one_launch_summary(settings, 12, 8)  # TP=4, BD r'=32, 12 slots: 16 rows of 8 columns
    assert many.startswith("Decode batches of up to 16 tokens") and f"within {DEFAULT_MAX_MIXED_WIDTH} columns" in many
    assert "plan table has measured" in many
    set_width = BdLoraSettings.from_additional_config({"bdlora": {"one_launch_max_mixed_width": 64}})
    narrow = one_launch_summary(set_width, 12, 8)
    assert narrow.startswith("Decode batches of up to 8 tokens") and '"one_launch_max_mixed_width": 64' in narrow
    assert "measured" not in narrow
    assert one_launch_summary(settings, 4, 32).startswith("Decode batches of up to 4 tokens")  # TP=4, BD r'=128
    assert one_launch_summary(settings, 4, 128).startswith("Decode batches of up to 1 token:")  # TP=1, BD r'=128
    assert one_launch_summary(settings, 4, 512).startswith("Decode batches take the three kernels")
    few = BdLoraSettings.from_additional_config({"bdlora": {"one_launch_max_adapters": 4}})
    mixing_four = one_launch_summary(few, 12, 8)
    assert mixing_four.startswith("Decode batches of up to 4 tokens") and '"one_launch_max_adapters": 4' in mixing_four
    limited = BdLoraSettings.from_additional_config({"bdlora": {"one_launch_max_tokens": 16}})
    assert one_launch_summary(limited, 1, 128).startswith("Decode batches of up to 16 tokens")


def test_token_limits_the_setting_allows_are_the_decode_kernels_row_tiles():
    from vllm_bdlora.config import ONE_LAUNCH_TOKEN_LIMITS
    from vllm_bdlora.kernels.plans import ROW_TILES

    assert ONE_LAUNCH_TOKEN_LIMITS == ROW_TILES


def test_enabling_keeps_other_sections():
    assert with_bdlora_enabled({"other": 1, "bdlora": {}}) == {"other": 1, "bdlora": {"enabled": True}}


def test_start_up_log_says_which_steps_run_outside_cuda_graphs():
    """Prefills longer than the largest captured graph run eagerly, where the LoRA layers' host time shows in time to
    first token: the log names the size and the setting that moves it, and stays quiet where every step fits."""
    from types import SimpleNamespace

    from vllm_bdlora.manager import eager_steps_summary

    def config(largest, batched, eager=False, mode=None):
        return SimpleNamespace(
            compilation_config=SimpleNamespace(max_cudagraph_capture_size=largest, cudagraph_mode=mode),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=batched),
            model_config=SimpleNamespace(enforce_eager=eager),
        )

    line = eager_steps_summary(config(128, 8192))
    assert line.startswith("Steps of more than 128 tokens") and "up to 8192 per step" in line
    assert '"max_cudagraph_capture_size": N' in line
    assert eager_steps_summary(config(1024, 1024)) is None
    assert eager_steps_summary(config(128, 8192, eager=True)).startswith("CUDA graphs are off")
    assert eager_steps_summary(config(128, 8192, mode=SimpleNamespace(name="NONE"))).startswith("CUDA graphs are off")
