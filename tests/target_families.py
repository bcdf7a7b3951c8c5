"""Tiny random checkpoints of every supported target family, saved with `save_pretrained` next to
the tiny tokenizer (vocab 1024). Each has hidden size 128 and 6 decoder layers, so the tiny draft
configs fit all of them; each is built in a second or two and cached per test session.

One real pretrained checkpoint joins them in the matrix: SmolLM2-135M-Instruct (Llama, 30 layers,
hidden 576, vocabulary 49152, tied embeddings), built by the tests' `smollm2` fixture
(dflash2.fixtures.smollm2), with its own draft config (configs/draft/smollm2-dflash2.json)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

HIDDEN, NUM_LAYERS, VOCAB = 128, 6, 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SLIDING_WINDOW = 8  # gpt-oss: short enough that decoding in tests runs far past it


@dataclass(frozen=True)
class Family:
    name: str
    model_class: str  # the class save_pretrained writes into config.json's architectures
    recurrent: bool  # the target carries a recurrent state (Gated DeltaNet) that crop cannot roll back


FAMILIES = (
    Family("qwen3", "Qwen3ForCausalLM", recurrent=False),
    Family("qwen3_5_vlm", "Qwen3_5ForConditionalGeneration", recurrent=True),
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", recurrent=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", recurrent=False),
    Family("llama", "LlamaForCausalLM", recurrent=False),
    Family("gpt_oss", "GptOssForCausalLM", recurrent=False),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)
SMOLLM2 = "smollm2"  # the real one: not built here (dflash2.fixtures.smollm2)
BY_NAME = {f.name: f for f in (*FAMILIES, Family(SMOLLM2, "LlamaForCausalLM", recurrent=False))}

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=2,
)
_HYBRID_LAYERS = ["linear_attention", "linear_attention", "full_attention"] * (NUM_LAYERS // 3)
_DELTANET = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _qwen3_5_text_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_COMMON, intermediate_size=256, layer_types=_HYBRID_LAYERS, **_DELTANET)


def build_config(name: str):
    """The transformers config of family `name` (tiny sizes)."""
    import transformers as tf

    if name == "qwen3":
        return tf.Qwen3Config(**_COMMON, intermediate_size=256)
    if name == "qwen3_5_text":
        return _qwen3_5_text_config()
    if name == "qwen3_5_vlm":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN)
        vision.update(patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
        text = _qwen3_5_text_config().to_dict()
        return tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **_COMMON, intermediate_size=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2
        )
    if name == "llama":
        return tf.LlamaConfig(**_COMMON, intermediate_size=256)
    if name == "gpt_oss":
        return tf.GptOssConfig(
            **_COMMON,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (NUM_LAYERS // 2),
            # gpt-oss's YaRN, its factor 32 consistent with the tiny context (2048 / 64)
            rope_parameters={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        )
    raise ValueError(f"unknown target family {name!r}; one of {FAMILY_NAMES}")


def build_model(name: str, seed: int = 0):
    """A random model of family `name` in eval mode, with weights large enough that its greedy
    decoding is not one repeated token."""
    import transformers as tf

    torch.manual_seed(seed)
    model = getattr(tf, BY_NAME[name].model_class)(build_config(name)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08, generator=generator)
    return model


def save_family(name: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of family `name` with the tiny tokenizer into out_dir."""
    out_dir = Path(out_dir)
    build_model(name, seed).save_pretrained(out_dir)
    for file in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / file).is_file():
            shutil.copy(Path(tokenizer_dir) / file, out_dir / file)
    return out_dir


# Both ends of the range (0 and L-1) and one in between: the last one is the layer whose output
# Hugging Face's hidden_states does not return (its hidden_states[L] is final-normed).
LAYER_IDS = (0, 2, NUM_LAYERS - 1)
DRAFT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "draft" / "tiny-dflash2.json"

SMOLLM2_LAYERS = 30
SMOLLM2_DRAFT_CONFIG = DRAFT_CONFIG.with_name("smollm2-dflash2.json")
# what each real checkpoint of the matrix is: (its draft config, the layers it reads: both ends, one between)
REAL = {SMOLLM2: (SMOLLM2_DRAFT_CONFIG, (0, SMOLLM2_LAYERS // 2, SMOLLM2_LAYERS - 1))}


def layer_ids_of(name: str) -> tuple[int, ...]:
    return REAL[name][1] if name in REAL else LAYER_IDS


def family_draft_config(
    architecture: str = "DFlash2DraftModel", block_size: int = 8, family: str | None = None
) -> dict:
    """The draft config of `family` reading its layers layer_ids_of(family): for the tiny families
    (and by default) the tiny one (hidden 128, vocab 1024)."""
    import json

    cfg = json.loads((REAL[family][0] if family in REAL else DRAFT_CONFIG).read_text())
    cfg["architectures"] = [architecture]
    dflash = cfg["dflash_config"]
    dflash.update(target_layer_ids=list(layer_ids_of(family)), block_size=block_size)
    if architecture == "DFlashDraftModel":
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            dflash.pop(key)
        for key in ("output_multiplier", "final_logit_softcapping"):
            dflash.pop(key)
    return cfg


def save_memorising_family(
    name: str, out_dir: Path, tokenizer_dir: Path, conversation: list[dict], steps: int = 60
) -> Path:
    """Like save_family, but the model first memorises one conversation (its own tokenizer's
    encoding, chat template included), so that its greedy reply to that prompt is real text whose
    tokens re-encode to themselves: what the serving gate needs (a random model's replies do not)."""
    from transformers import AutoTokenizer

    from dflash2.data.render import render_text

    out_dir = save_family(name, out_dir, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = torch.tensor(
        [tokenizer(render_text(conversation, tokenizer, None), add_special_tokens=False)["input_ids"]]
    )
    model = build_model(name).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(out_dir)
    return out_dir
