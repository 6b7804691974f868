"""Module-name patterns select what PEFT's own functions select, and no pattern an adapter can carry makes matching
take long: the hostile keys below take Python's `re` (and PEFT) exponential time on these names."""

import time

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from vllm_bdlora.name_patterns import first_matching_key, peft_targets

MODULES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.self_attn.q_proj",
    "model.layers.12.self_attn.k_proj",
    "model.layers.3.mlp.down_proj",
    "model.layers.3.mlp.experts.0.down_proj",
    "model.decoder.h.2.attn.c_attn",
    "model.layers.0.self_attn.xq_proj",
    "lm_head",
    "model.embed_tokens",
    "q_proj",
]

RANK_KEYS = [
    ["q_proj"],
    ["layers.0.self_attn.q_proj", "q_proj"],
    [r"layers\.\d+\.self_attn\.(q|k)_proj"],
    ["model.layers.1.self_attn.q_proj"],
    [".*_proj"],
    ["a)|(q_proj"],  # a key that closes PEFT's group: the same text is matched the same way
    ["mlp.*"],
    ["(.|.)*!", "down_proj"],
    ["[dk]"],
]


@pytest.mark.parametrize("keys", RANK_KEYS, ids=lambda k: "|".join(k))
def test_rank_and_alpha_pattern_keys_pick_what_peft_picks(keys):
    for module in MODULES:
        peft_key = get_pattern_key(keys, module) if "(.|.)*!" not in keys else get_pattern_key(keys[1:], module)
        expected = peft_key if peft_key in keys else None
        assert first_matching_key(keys, module) == expected, (keys, module)


TARGET_CONFIGS = [
    {"target_modules": ["q_proj", "k_proj"]},
    {"target_modules": ["q_proj"], "layers_to_transform": [1]},
    {"target_modules": ["q_proj", "k_proj", "down_proj"], "layers_to_transform": [0, 12, 3]},
    {"target_modules": ["q_proj", "k_proj"], "layers_to_transform": 12},
    {"target_modules": ["c_attn", "down_proj"], "layers_to_transform": [2], "layers_pattern": "h"},
    {"target_modules": ["down_proj"], "layers_to_transform": [3], "layers_pattern": ["layers", "h"]},
    {"target_modules": r".*\.(q|k)_proj"},
    {"target_modules": r".*layers\.[01]\..*"},
    {"target_modules": ["q_proj", "xq_proj"], "exclude_modules": ["xq_proj"]},
    {"target_modules": ["q_proj", "down_proj"], "exclude_modules": r".*experts.*"},
    {"target_modules": ["model.layers.0.self_attn.q_proj"], "layers_to_transform": [5]},
]


@pytest.mark.parametrize("fields", TARGET_CONFIGS, ids=str)
def test_target_modules_layers_and_exclusions_select_what_peft_selects(fields):
    config = LoraConfig(r=8, **fields)
    for module in MODULES:
        assert peft_targets(fields, module) == bool(check_target_module_exists(config, module)), (fields, module)


@pytest.mark.parametrize(
    "key",
    ["(.|.)*!", "(a|aa)+$", "(x+x+)+y", r"(\w+\.)*\d!", "((a*)*)*b"],
)
def test_hostile_keys_match_long_attacker_chosen_names_in_calls_that_each_end_at_once(key):
    """The worker's step thread runs beside the admission thread; a match holds the interpreter lock for at most its
    own call, so each call must end at once (Python's re does not finish one of these names in an hour). A tensor
    name is the attacker's choice: names of 4,000 characters."""
    names = ["a." * 2000, "a" * 4000, "x" * 4000, "a" * 3999 + "!"]
    longest = 0.0
    for _ in range(20):
        for name in names:
            started = time.perf_counter()
            first_matching_key([key, "q_proj"], name)
            longest = max(longest, time.perf_counter() - started)
    assert longest < 0.5, f"{key!r}: one match took {longest:.3f} s"  # bounded, not a speed claim
