"""Draft config: normalisation, contract section 3 validation, Qwen3Config round trip, tensor shapes.

Independent references: the reference package `dflash` (its default layer spread and the tensor
names/shapes of its models) and transformers' Qwen3Config.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from dflash import model as reference
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen3Config

from dflash2.models.config import (
    NESTED_FIRST_KEYS,
    NESTED_ONLY_KEYS,
    check_draft_config,
    default_target_layer_ids,
    draft_value,
    load_config_dict,
    normalize_draft_config,
    to_qwen3_config,
    validate_draft_config,
)
from dflash2.models.registry import expected_tensor_shapes

TINY_V2 = "configs/draft/tiny-dflash2.json"
TINY_V1 = "configs/draft/tiny-dflash.json"
QWEN36_27B = "configs/qwen3.6-27b-dflash2.json"


@pytest.fixture
def v2() -> dict:
    return load_config_dict(TINY_V2)


def make_tokenizer(mask_id: int = 3) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose mask token "<|MASK|>" has id `mask_id`."""
    words = ["<unk>", "<pad>", "<s>", "a", "b", "c", "<mask2>"]
    words.insert(mask_id, "<|MASK|>")
    vocab = {word: i for i, word in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", mask_token="<|MASK|>")


# ---------------------------------------------------------------------------------------------------------
# Shipped configs
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [TINY_V2, TINY_V1, QWEN36_27B])
def test_shipped_configs_are_canonical_and_valid(path):
    cfg = load_config_dict(path)
    assert validate_draft_config(cfg) == []
    assert normalize_draft_config(cfg) == cfg  # already canonical: nothing to move or fill


def test_tiny_config_mask_token_matches_tokenizer(v2, tiny_default):
    assert v2["dflash_config"]["mask_token"] == "<|mask|>"  # by name and by id: the tiny tokenizer's
    assert validate_draft_config(v2, tokenizer=tiny_default.target_dir) == []
    del v2["dflash_config"]["mask_token"]  # by id alone: the id of the tokenizer's mask token
    assert validate_draft_config(v2, tokenizer=make_tokenizer(3)) == []


def test_qwen36_27b_config_matches_published_layout():
    cfg = load_config_dict(QWEN36_27B)
    nested = cfg["dflash_config"]
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert cfg["layer_types"] == ["sliding_attention"] * 5 and cfg["sliding_window"] == 2048
    assert nested["target_layer_ids"] == [5, 19, 33, 47, 61]
    assert (nested["block_size"], nested["mask_token_id"]) == (8, 248070)
    num_params = sum(math.prod(shape) for shape in expected_tensor_shapes(cfg).values())
    assert 1.90e9 < num_params < 1.95e9  # "about 1.92 B parameters"


# ---------------------------------------------------------------------------------------------------------
# Default target layers
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_target, num_draft", [(64, 5), (36, 5), (6, 3), (28, 1), (40, 8), (6, 2)])
def test_default_target_layer_ids_match_reference(num_target, num_draft):
    expected = reference.build_target_layer_ids(num_target, num_draft)
    assert default_target_layer_ids(num_target, num_draft) == expected


def test_default_target_layer_ids_refuses_shallow_target():
    with pytest.raises(ValueError, match="num_target_layers=3"):
        default_target_layer_ids(3, 2)


# ---------------------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------------------


def flatten_to_top_level(cfg: dict) -> dict:
    """The layout some tools write: every DFlash field at the top level, no dflash_config."""
    flat = copy.deepcopy(cfg)
    flat.update(flat.pop("dflash_config"))
    return flat


def test_normalize_moves_top_level_fields_in_and_drops_nothing(v2):
    flat = flatten_to_top_level(v2)
    flat["custom_key"] = {"kept": True}
    normalized = normalize_draft_config(flat)
    for key in NESTED_ONLY_KEYS + ("block_size", "target_layer_ids", "mask_token_id"):
        assert key not in normalized, key
        assert normalized["dflash_config"][key] == v2["dflash_config"][key]
    assert normalized["num_target_layers"] == normalized["dflash_config"]["num_target_layers"] == 6
    assert normalized["custom_key"] == {"kept": True}
    for key, value in flat.items():  # every input value is still readable
        assert draft_value(normalized, key) == value, key
    assert flat == flatten_to_top_level(v2) | {"custom_key": {"kept": True}}  # input untouched
    assert validate_draft_config(flat) != [] and validate_draft_config(normalized) == []


def test_normalize_merges_equal_block_size(v2):
    v2["block_size"] = 8
    normalized = normalize_draft_config(v2)
    assert "block_size" not in normalized and normalized["dflash_config"]["block_size"] == 8


@pytest.mark.parametrize("key", NESTED_FIRST_KEYS[:2] + NESTED_ONLY_KEYS[:1])
def test_normalize_conflict_names_both_values(v2, key):
    v2["dflash_config"]["mask_token"] = "<|MASK|>"
    nested_value = v2["dflash_config"][key]
    v2[key] = [0] if key == "target_layer_ids" else 4
    with pytest.raises(ValueError, match=key) as error:
        normalize_draft_config(v2)
    assert repr(nested_value) in str(error.value) and repr(v2[key]) in str(error.value)


def test_normalize_fills_defaults():
    cfg = {
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "num_target_layers": 36,
        "rope_theta": 1e6,
        "conv_kernel_size": 2,
        "architectures": ["DFlash2DraftModel"],
    }
    normalized = normalize_draft_config(cfg)
    assert normalized["model_type"] == "qwen3"
    assert normalized["is_causal"] is False and normalized["tie_word_embeddings"] is False
    assert normalized["layer_types"] == ["full_attention"] * 3
    assert "use_sliding_window" not in normalized
    nested = normalized["dflash_config"]
    assert nested["target_layer_ids"] == reference.build_target_layer_ids(36, 3)
    assert nested["output_multiplier"] == 1.0 and nested["final_logit_softcapping"] is None
    assert normalized["rope_parameters"]["rope_theta"] == 1e6 and normalized["rope_theta"] == 1e6
    assert normalize_draft_config({"num_hidden_layers": 1})["architectures"] == ["DFlashDraftModel"]


@pytest.mark.parametrize(
    "fields",
    [
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
        {"use_sliding_window": True, "max_window_layers": 2},
        {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 0},
        {},
    ],
)
def test_layer_types_left_out_are_what_transformers_reads(v2, fields):
    # the reference: transformers' own Qwen3Config on the same fields
    cfg = {k: v for k, v in v2.items() if k not in ("layer_types", "use_sliding_window", "sliding_window")}
    cfg["num_hidden_layers"] = 3
    cfg.update(fields)
    expected = Qwen3Config(num_hidden_layers=3, **fields).layer_types
    assert normalize_draft_config(cfg)["layer_types"] == expected


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_theta": 1e6,
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
        },
        {
            "rope_theta": 1e6,
            "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
        },
        {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default"}},
    ],
)
def test_the_draft_uses_the_rope_theta_and_scaling_its_config_gives(v2, rope):
    # a legacy rope_scaling or a rope_parameters without its theta: the draft trains with theta 1e6,
    # as transformers reads the raw config, and its export round-trips
    from dflash2.models import build_draft

    cfg = {k: v for k, v in v2.items() if k not in ("rope_theta", "rope_parameters", "rope_scaling")}
    cfg.update(copy.deepcopy(rope))
    normalized = normalize_draft_config(cfg)
    assert "rope_scaling" not in normalized and normalized["rope_theta"] == 1e6
    params = normalized["rope_parameters"]
    assert params["rope_theta"] == 1e6 and params["rope_type"] == (
        "default" if "rope_parameters" in rope else "yarn"
    )
    draft = build_draft(normalized)
    assert draft.config.rope_parameters == params and draft.config.rope_theta == 1e6
    head_dim = draft.config.head_dim
    if params["rope_type"] == "default":  # the reference inverse frequencies at theta 1e6
        expected = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        torch.testing.assert_close(draft.rotary_emb.inv_freq, expected)
    assert normalize_draft_config(draft.config.to_dict())["rope_parameters"] == params  # what export writes


def test_rope_scaling_that_contradicts_rope_parameters_is_refused(v2):
    cfg = {**v2, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(ValueError, match="rope_scaling=.* and rope_parameters=.* are both set and differ"):
        normalize_draft_config(cfg)


def test_normalize_refuses_sliding_layers_whose_loaders_read_another_model(v2):
    # a config of another tool: the loaders apply no window without use_sliding_window, and make
    # sliding layers causal without is_causal; filling either in changed the model it describes
    assert "sliding_attention" in v2["layer_types"]
    v2["use_sliding_window"] = False
    with pytest.raises(ValueError, match="use_sliding_window=False: loaders then apply no window"):
        normalize_draft_config(v2)
    v2["use_sliding_window"] = True
    del v2["is_causal"]
    with pytest.raises(ValueError, match="is_causal is not set: loaders then make those layers causal"):
        normalize_draft_config(v2)
    v2["is_causal"] = False
    assert normalize_draft_config(v2)["use_sliding_window"] is True


def test_check_draft_config_lists_every_problem(v2):
    v2["dflash_config"]["block_size"] = 1
    v2["dflash_config"]["selector_top_k"] = 12
    with pytest.raises(ValueError) as error:
        check_draft_config(v2)
    assert "block_size=1" in str(error.value) and "selector_top_k=12" in str(error.value)


# ---------------------------------------------------------------------------------------------------------
# Validation: one message per problem, naming the field
# ---------------------------------------------------------------------------------------------------------


def _nested(**values):
    def mutate(cfg):
        for key, value in values.items():
            if value is _DELETE:
                cfg["dflash_config"].pop(key, None)
            else:
                cfg["dflash_config"][key] = value

    return mutate


def _top(**values):
    def mutate(cfg):
        for key, value in values.items():
            if value is _DELETE:
                cfg.pop(key, None)
            else:
                cfg[key] = value

    return mutate


def _move_to_top(key):
    def mutate(cfg):
        cfg[key] = cfg["dflash_config"].pop(key)

    return mutate


_DELETE = object()

VALIDATION_CASES = {
    "unknown architecture": (_top(architectures=["EagleDraftModel"]), "architectures=['EagleDraftModel']"),
    "two architectures": (_top(architectures=["DFlashDraftModel", "DFlash2DraftModel"]), "architectures="),
    "model_type": (_top(model_type="llama"), "model_type='llama'"),
    "conv half set": (_nested(conv_kernel_size=0), "conv_kernel_size=0 but conv_group_size=16"),
    "conv negative": (_nested(conv_kernel_size=-1), "conv_kernel_size=-1: must be an int >= 0"),
    "v2 without conv": (
        _nested(conv_kernel_size=_DELETE, conv_group_size=_DELETE),
        "DFlash2DraftModel needs both > 0",
    ),
    "selector half set": (_nested(selector_top_k=_DELETE), "selector_rank=32 but selector_top_k=0"),
    "v2 without selector": (
        _nested(selector_rank=0, selector_top_k=0),
        "selector_rank=0: DFlash2DraftModel needs selector_rank > 0",
    ),
    "v1 with v2 fields": (_top(architectures=["DFlashDraftModel"]), "v1 ignores conv and selector"),
    "group size": (_nested(conv_group_size=24), "conv_group_size=24 does not divide hidden_size=128"),
    "top_k power of two": (_nested(selector_top_k=12), "selector_top_k=12: must be a power of two"),
    "top_k above vocab": (_nested(selector_top_k=2048), "selector_top_k=2048 exceeds vocab_size=1024"),
    "multiplier zero": (_nested(output_multiplier=0), "output_multiplier=0: must be a number > 0"),
    "multiplier negative": (_nested(output_multiplier=-1.0), "output_multiplier=-1.0"),
    "softcap zero": (_nested(final_logit_softcapping=0.0), "final_logit_softcapping=0.0: must be null"),
    "softcap negative": (_nested(final_logit_softcapping=-30.0), "final_logit_softcapping=-30.0"),
    "layer id too big": (_nested(target_layer_ids=[1, 6]), "target_layer_ids[1]=6: out of range [0, 6)"),
    "layer id negative": (_nested(target_layer_ids=[-1, 3]), "target_layer_ids[0]=-1: out of range"),
    "layer id not int": (_nested(target_layer_ids=[1, "3"]), "target_layer_ids[1]='3': must be an int"),
    "layer ids empty": (_nested(target_layer_ids=[]), "target_layer_ids=[]"),
    # SGLang collects the target's layers in order, once each: another order or a repeat is served wrong
    "layer ids out of order": (
        _nested(target_layer_ids=[4, 3, 1]),
        "target_layer_ids=[4, 3, 1]: must be strictly increasing (SGLang collects the target's layers in order, once each): write [1, 3, 4]",
    ),
    "layer id repeated": (
        _nested(target_layer_ids=[1, 1, 4]),
        "target_layer_ids=[1, 1, 4]: must be strictly increasing",
    ),
    "layer ids absent": (_nested(target_layer_ids=_DELETE), "target_layer_ids=None"),
    "num_target_layers absent": (
        lambda cfg: (cfg.pop("num_target_layers"), cfg["dflash_config"].pop("num_target_layers")),
        "num_target_layers=None",
    ),
    "mask id out of vocab": (_nested(mask_token_id=1024), "mask_token_id=1024: out of range [0, 1024)"),
    "mask id negative": (_nested(mask_token_id=-1), "mask_token_id=-1: out of range"),
    "mask id not int": (_nested(mask_token_id="3"), "mask_token_id='3': must be an int"),
    "mask id absent": (_nested(mask_token_id=_DELETE), "mask_token_id=None: must be an int"),
    "block size 1": (_nested(block_size=1), "block_size=1: must be an int >= 2"),
    "block size absent": (_nested(block_size=_DELETE), "block_size=None"),
    "kernel above block": (_nested(conv_kernel_size=9), "conv_kernel_size=9 exceeds block_size=8"),
    "layer_types length": (_top(layer_types=["sliding_attention"]), "layer_types has 1 entries"),
    "layer_types value": (
        _top(layer_types=["sliding_attention", "linear_attention"]),
        "layer_types contains ['linear_attention']",
    ),
    "layer_types absent": (_top(layer_types=_DELETE), "layer_types=None"),
    "sliding window absent": (_top(sliding_window=_DELETE), "sliding_window=None"),
    "sliding window zero": (_top(sliding_window=0), "sliding_window=0"),
    "use_sliding_window false": (_top(use_sliding_window=False), "use_sliding_window=False"),
    "kv heads": (
        _top(num_key_value_heads=3),
        "num_attention_heads=4 is not divisible by num_key_value_heads=3",
    ),
    "head_dim absent": (_top(head_dim=_DELETE), "head_dim=None: must be a positive int"),
    "hidden_act": (_top(hidden_act="gelu"), "hidden_act='gelu'"),
    "tied embeddings": (_top(tie_word_embeddings=True), "tie_word_embeddings=True"),
    "quantized": (_top(quantization_config={"quant_method": "fp8"}), "quantization_config is present"),
    "embedding scale": (_top(input_embedding_scale=2.0), "input_embedding_scale=2.0"),
    "is_causal absent": (_top(is_causal=_DELETE), "is_causal=None: write is_causal: false"),
    "is_causal true": (_top(is_causal=True), "is_causal=True"),
    "dtype disagree": (_top(torch_dtype="bfloat16", dtype="float32"), "torch_dtype='bfloat16' differs"),
    "top-level conv": (_move_to_top("conv_kernel_size"), "top-level conv_kernel_size=2: servers read"),
    "top-level selector": (_move_to_top("selector_rank"), "top-level selector_rank=32"),
    "top-level multiplier": (_move_to_top("output_multiplier"), "top-level output_multiplier=1.0"),
    "block size conflict": (_top(block_size=16), "block_size conflict: dflash_config.block_size=8"),
    "mask id conflict": (_top(mask_token_id=5), "mask_token_id conflict"),
}


@pytest.mark.parametrize("name", list(VALIDATION_CASES))
def test_validation_reports_each_problem(v2, name):
    mutate, message = VALIDATION_CASES[name]
    mutate(v2)
    problems = validate_draft_config(v2)
    assert any(message in problem for problem in problems), problems


def test_top_level_only_conv_fields_are_ignored_by_servers(v2):
    """The failure this check exists for: a v2 config whose conv fields sit at the top level only
    reads as conv-less to a server, so the DFlash 2 requirement fails too."""
    _move_to_top("conv_kernel_size")(v2)
    _move_to_top("conv_group_size")(v2)
    problems = validate_draft_config(v2)
    assert any("top-level conv_group_size=16" in p for p in problems)
    assert any("DFlash2DraftModel needs both > 0" in p for p in problems)


def test_a_misspelled_field_is_refused_with_the_field_it_resembles(v2):
    """A loader ignores a field it does not know and uses its default for a missing one, so a misspelled
    target_layer_ids trained and served the default layers without a word (the export's check passed
    too). Other loaders' own fields, and a key near a field the config has, are kept."""
    nested = v2["dflash_config"]
    nested["target_layers_ids"] = nested.pop("target_layer_ids")
    nested["conv_groups"] = nested.pop("conv_group_size")
    v2["num_hidden_layer"] = v2.pop("num_hidden_layers")
    nested.update(causal=False, use_swa=False, sliding_window=None)  # read by other servers' loaders
    v2.update(tie_encoder_decoder=False, moe_intermediate_size=64, description="a note")
    misspelled = [
        (where, name)
        for where, name in (("dflash_config.target_layers_ids", "target_layer_ids"),
                            ("dflash_config.conv_groups", "conv_group_size"),
                            ("num_hidden_layer", "num_hidden_layers"))
    ]  # fmt: skip
    expected = [
        f"{where}: not a field of a draft config, and {name} is missing: did you mean {name}? (a loader "
        "ignores the one and uses its default for the other)"
        for where, name in misspelled
    ]
    problems = validate_draft_config(v2)
    assert problems[:3] == expected
    assert not any(
        key in " ".join(problems) for key in ("causal", "use_swa", "tie_encoder", "moe_", "description")
    )
    with pytest.raises(ValueError) as refused:  # before normalisation fills a default in the field's place
        check_draft_config(v2)
    assert all(line in str(refused.value) for line in expected)


def test_equal_top_level_block_size_is_allowed(v2):
    v2["block_size"] = 8
    assert validate_draft_config(v2) == []


TARGET = {"hidden_size": 128, "vocab_size": 1024, "num_hidden_layers": 6}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden_size", 256, "hidden_size=128 but the target's hidden_size is 256"),
        ("vocab_size", 2048, "vocab_size=1024 but the target's vocab_size is 2048"),
        ("num_hidden_layers", 8, "num_target_layers=6 but the target has num_hidden_layers=8"),
    ],
)
def test_validation_against_target(v2, field, value, message):
    assert validate_draft_config(v2, target_config=TARGET) == []
    target = dict(TARGET, **{field: value})
    assert any(message in p for p in validate_draft_config(v2, target_config=target))
    # multimodal targets keep the language model's sizes in text_config
    wrapped = {"text_config": target, "hidden_size": 128}
    assert any(message in p for p in validate_draft_config(v2, target_config=wrapped))
    assert validate_draft_config(v2, target_config=Qwen3Config(**TARGET)) == []


@pytest.mark.parametrize(
    "config_class, message",
    [
        ("Gemma2Config", "final_logit_softcapping=30.0"),  # and a scaled embedding
        ("Gemma3TextConfig", "model_type 'gemma3_text' scales its input embeddings"),
        ("CohereConfig", "logit_scale=0.0625"),
        ("GraniteConfig", None),  # defaults 1.0: logits_scaling and embedding_multiplier unset
    ],
)
def test_targets_that_scale_logits_or_embeddings_are_refused(v2, config_class, message):
    """The draft borrows the bare embedding and LM head weights: a target whose own forward scales or
    caps them (transformers' defaults for these families) would be distilled and embedded wrongly."""
    import transformers

    config = getattr(transformers, config_class)(**TARGET, num_attention_heads=4, num_key_value_heads=2)
    problems = validate_draft_config(v2, target_config=config)
    if message is None:
        assert problems == []
        config.logits_scaling, config.embedding_multiplier = 8.0, 12.0
        problems = validate_draft_config(v2, target_config=config)
        assert any("logits_scaling=8.0" in p for p in problems) and any(
            "embedding_multiplier=12.0" in p for p in problems
        )
    else:
        assert any(message in p and "docs/targets.md" in p for p in problems), problems


def test_validation_against_tokenizer(v2):
    del v2["dflash_config"]["mask_token"]  # the id alone, against a tokenizer of other tokens
    tokenizer = make_tokenizer(mask_id=5)
    problems = validate_draft_config(v2, tokenizer=tokenizer)
    assert any("tokenizer's mask token '<|MASK|>' has id 5" in p for p in problems), problems
    v2["dflash_config"]["mask_token"] = "<mask2>"
    problems = validate_draft_config(v2, tokenizer=tokenizer)
    assert any("maps mask_token '<mask2>' to 7" in p for p in problems), problems
    v2["dflash_config"]["mask_token"] = "<nope>"
    problems = validate_draft_config(v2, tokenizer=tokenizer)
    assert any("mask_token='<nope>' is not a token" in p for p in problems), problems
    v2["dflash_config"]["mask_token_id"] = 5
    v2["dflash_config"]["mask_token"] = "<|MASK|>"
    assert validate_draft_config(v2, tokenizer=tokenizer) == []


# ---------------------------------------------------------------------------------------------------------
# Qwen3Config round trip
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [TINY_V2, TINY_V1, QWEN36_27B])
def test_qwen3_config_round_trip(path):
    cfg = load_config_dict(path)
    config = to_qwen3_config(cfg)
    assert isinstance(config, Qwen3Config)
    assert config.sliding_window == cfg["sliding_window"] and config.use_sliding_window is True
    assert config.rope_parameters["rope_theta"] == cfg["rope_theta"] == config.rope_theta
    assert config.is_causal is False and config.num_target_layers == cfg["num_target_layers"]
    for key, value in cfg["dflash_config"].items():
        assert draft_value(config, key) == value, key
    # what a loader sees after save_pretrained -> from_pretrained
    reloaded = Qwen3Config.from_dict(json.loads(config.to_json_string()))
    assert reloaded.sliding_window == cfg["sliding_window"]
    assert reloaded.dflash_config == cfg["dflash_config"]
    assert validate_draft_config(reloaded.to_dict()) == []


def test_qwen3_config_from_flat_config_keeps_sliding_window(v2):
    flat = flatten_to_top_level(v2)
    config = to_qwen3_config(flat)
    assert config.sliding_window == 2048
    assert draft_value(config, "conv_kernel_size") == 2
    # without use_sliding_window, Qwen3Config (and so the reference loader) drops the window: such a
    # config describes another model than one with the window, and is refused rather than filled in
    del flat["use_sliding_window"]
    assert Qwen3Config(**{k: v for k, v in flat.items() if k != "dflash_config"}).sliding_window is None
    with pytest.raises(ValueError, match="use_sliding_window=None: loaders then apply no window"):
        to_qwen3_config(flat)


# ---------------------------------------------------------------------------------------------------------
# Expected tensor shapes, against the reference package's models
# ---------------------------------------------------------------------------------------------------------


def reference_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    cls = (
        reference.DFlash2DraftModel
        if cfg["architectures"] == ["DFlash2DraftModel"]
        else reference.DFlashDraftModel
    )
    with torch.device("meta"):
        model = cls(to_qwen3_config(cfg))
    # The reference keeps the codebooks as nn.Embedding and maps the contract names onto them on load.
    return {
        name.removesuffix(".weight") if "_codebook." in name else name: tuple(tensor.shape)
        for name, tensor in model.state_dict().items()
    }


@pytest.mark.parametrize("path", [TINY_V2, TINY_V1])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_expected_tensor_shapes_match_reference(path, attention_bias):
    cfg = load_config_dict(path)
    cfg["attention_bias"] = attention_bias
    assert expected_tensor_shapes(cfg) == reference_shapes(cfg)


def test_expected_tensor_shapes_match_reference_27b():
    cfg = load_config_dict(QWEN36_27B)
    assert expected_tensor_shapes(cfg) == reference_shapes(cfg)
