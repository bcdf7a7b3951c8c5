"""The matrix of target families (tests/target_families.py): Qwen3, Qwen3.5 hybrid (published
vision-language form and causal-LM form), Qwen3-MoE, Llama, gpt-oss, and the real pretrained
SmolLM2-135M-Instruct (Llama, tied embeddings; its cases are marked slow: it is a 135 M model). For
each, against independent references (Hugging Face's own forward, a cache-free greedy loop, the
reference package):

- the captured features are the outputs of the requested decoder layers, both ends of the range;
- speculative decoding reproduces the target's greedy decoding, and after every verify step the
  target's whole state (KV, sliding windows, conv and recurrent states) equals the state of a
  fresh forward over exactly the committed tokens;
- `python -m dflash2.plan` accepts the checkpoint's own config.json;
- the head read from safetensors is the model's (a tied LM head is the embedding);
- (slow) one 2-process launch per backend runs every family: online capture through the sharded
  target, offline capture, a few training steps, the export (checked, loaded by the reference package);
- (slow) the serving gate passes on the hybrid vision-language checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dflash2 import decode, plan
from dflash2 import evaluate as ev
from dflash2.fixtures.smollm2 import chat_prompt_ids
from dflash2.models import TargetHead, build_draft
from dflash2.target.head import load_target_head
from dflash2.target.hooks import capture_layer_outputs
from dflash2.target.state import TargetState
from tests.dist_scripts.families import family_config, padded_batch
from tests.draft_helpers import plain_greedy, randomize_
from tests.run_helpers import REPO, TIMEOUT_S, metrics, run, tiny_subset, torchrun
from tests.target_families import (
    BY_NAME,
    FAMILY_NAMES,
    LAYER_IDS,
    NUM_LAYERS,
    SMOLLM2,
    VOCAB,
    family_draft_config,
    layer_ids_of,
    save_family,
    save_memorising_family,
)

PROMPT = [5, 17, 42, 8, 99, 3, 250, 61]
REAL_PROMPT = "Write a short story about a cat who learns to swim."  # a chat prompt for a real model
# every family, and the real SmolLM2 (slow: loading and running a 135 M model takes seconds per case)
MATRIX = (*FAMILY_NAMES, pytest.param(SMOLLM2, marks=pytest.mark.slow))
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def family_dirs(tiny_default, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: save_family(name, root / name, tiny_default.target_dir) for name in FAMILY_NAMES}


@pytest.fixture
def family_dir(family, request):
    """The checkpoint of the test's family, built (once per session) only when a test of it runs."""
    if family == SMOLLM2:
        return request.getfixturevalue("smollm2").target_dir
    return request.getfixturevalue("family_dirs")[family]


def prompt_of(family: str, target_dir) -> list[int]:
    """Random ids for a random model; a chat prompt for the real one (its reply is real text)."""
    if family != SMOLLM2:
        return PROMPT
    from transformers import AutoTokenizer

    return chat_prompt_ids(AutoTokenizer.from_pretrained(target_dir), REAL_PROMPT)


def load_target(directory):
    """As evaluation, the serving gate and the backends load it (a VLM checkpoint: its text decoder)."""
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_layer_outputs(model, input_ids, attention_mask, layer_ids) -> torch.Tensor:
    """Reference: Hugging Face's own output_hidden_states, with its last entry left as the output of
    the last decoder layer (by default transformers replaces it with the final-normed state)."""
    decoder_config = model.get_decoder().config
    decoder_config.tie_last_hidden_states = False
    try:
        with torch.no_grad():
            hidden = model(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    finally:
        decoder_config.tie_last_hidden_states = None
    return torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)


# ------------------------------------------------------------------ capture


@pytest.mark.parametrize("family", MATRIX)
def test_captured_features_are_the_layer_outputs(family_dir, family):
    model = load_target(family_dir)
    layer_ids = layer_ids_of(family)
    assert layer_ids[-1] == model.config.get_text_config().num_hidden_layers - 1
    input_ids, attention_mask = padded_batch()
    with torch.no_grad(), capture_layer_outputs(model, layer_ids) as captured:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    expected = hf_layer_outputs(model, input_ids, attention_mask, layer_ids)
    real = attention_mask.bool()
    torch.testing.assert_close(captured.features()[real], expected[real], rtol=1e-5, atol=1e-5)
    # what the default hidden_states[L] holds instead: the final norm of the last layer's output
    with torch.no_grad():
        normed_last = model(
            input_ids, attention_mask=attention_mask, output_hidden_states=True
        ).hidden_states[-1]
    last = captured.outputs[layer_ids[-1]]
    torch.testing.assert_close(normed_last, model.get_decoder().norm(last))
    assert not torch.allclose(normed_last, last, atol=1e-2)


def test_layer_ids_out_of_range_are_refused(family_dirs):
    model = load_target(family_dirs["qwen3_5_vlm"])
    with pytest.raises(ValueError, match=r"target_layer_ids \[6\] out of range .*valid ids: 0\.\.5"):
        with capture_layer_outputs(model, [0, NUM_LAYERS]):
            pass


@pytest.mark.parametrize("family", MATRIX)
def test_head_from_safetensors_is_the_models_head(family_dir, family):
    model = load_target(family_dir)
    head = load_target_head(family_dir, torch.float32)
    assert torch.equal(head.embed_weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head_weight, model.get_output_embeddings().weight)
    # SmolLM2 ties its LM head to the embedding: its checkpoint holds no lm_head tensor at all
    tied = model.config.get_text_config().tie_word_embeddings
    assert tied == (family == SMOLLM2)
    assert torch.equal(head.lm_head_weight, head.embed_weight) == tied


# ------------------------------------------------------------------ speculative decoding


def test_a_checkpoint_whose_head_would_load_random_is_refused(tmp_path):
    """A Qwen3.5 config tying the LM head at its top level only: the VLM class ties it, but the text
    decoder a causal-LM load builds does not, and transformers filled lm_head.weight at random."""
    import transformers as tf

    from dflash2.target.load import load_full_target
    from tests.target_families import build_config

    composite = build_config("qwen3_5_vlm").to_dict()
    for text_tie, name in ((None, "top-only"), (True, "both")):
        text = dict(composite["text_config"])
        text.pop("tie_word_embeddings", None)
        if text_tie is not None:
            text["tie_word_embeddings"] = text_tie
        config = tf.Qwen3_5Config(
            text_config=text, vision_config=composite["vision_config"], tie_word_embeddings=True
        )
        tf.Qwen3_5ForConditionalGeneration(config).save_pretrained(tmp_path / name)
    with pytest.raises(ValueError, match=r"no tensor for \['lm_head.weight'\].*tie_word_embeddings: true"):
        load_full_target(tmp_path / "top-only", torch.float32, "cpu")
    model = load_full_target(tmp_path / "both", torch.float32, "cpu")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def state_tensors(cache) -> dict[str, torch.Tensor]:
    """Everything a cache holds, by layer: KV (sliding windows: the kept window), conv and recurrent states."""
    out = {}
    for index, layer in enumerate(cache.layers):
        for name in ("keys", "values"):
            if getattr(layer, name, None) is not None:
                out[f"{index}.{name}"] = getattr(layer, name)
        for name in ("conv_states", "recurrent_states"):
            for state_index, tensor in (getattr(layer, name, None) or {}).items():
                if tensor is not None:
                    out[f"{index}.{name}.{state_index}"] = tensor
        if hasattr(layer, "cumulative_length"):
            out[f"{index}.cumulative_length"] = torch.tensor(layer.cumulative_length)
    return out


def assert_same_state(cache, reference_cache) -> None:
    got, expected = state_tensors(cache), state_tensors(reference_cache)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        # a block forward and one prompt forward chunk the same sums differently: fp32 rounding only
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def reference_state(target, committed: list[int]) -> TargetState:
    state = TargetState(target, LAYER_IDS)
    state.prefill(committed)
    return state


class CheckedTargetState(TargetState):
    """After every verify step, compares the whole state with a fresh prefill of the committed tokens."""

    num_checks = 0

    def prefill(self, ids):
        self.committed = list(ids)
        return super().prefill(ids)

    def verify(self, ids):
        self.fed = list(ids)
        return super().verify(ids)

    def keep(self, num_kept):
        super().keep(num_kept)
        self.committed += self.fed[:num_kept]
        assert_same_state(self.cache, reference_state(self.target, self.committed).cache)
        CheckedTargetState.num_checks += 1


def corrupting_oracle(sequence: list[int], block_size: int, vocab_size: int = VOCAB):
    """A draft proposing the target's own continuation with slot (step % B) made wrong, so the
    steps accept 0, 1, ..., B-2 proposals and then a whole block, in turn."""
    num_steps = [0]

    def draft_block(draft, head, context, anchor, temperature=0.0, generator=None):
        position = context.length  # of the anchor: the draft's context holds the positions before it
        assert sequence[position] == anchor
        proposals = list(sequence[position + 1 : position + block_size])
        wrong = num_steps[0] % block_size
        if wrong < block_size - 1:
            proposals[wrong] = (proposals[wrong] + 1) % vocab_size
        num_steps[0] += 1
        return torch.tensor(proposals), None, torch.full((block_size - 1, vocab_size), 1.0 / vocab_size)

    return draft_block


@pytest.mark.parametrize("family", MATRIX)
def test_greedy_speculative_decoding_is_the_targets_greedy_decoding(family_dir, family, monkeypatch):
    target = load_target(family_dir)
    head = TargetHead.from_target(target)
    # the real 135 M model: fewer tokens (still every number of accepted proposals, twice)
    block_size, num_tokens = 4, (21 if family == SMOLLM2 else 33)
    draft_config = family_draft_config(block_size=block_size, family=family)
    draft = randomize_(build_draft(draft_config), seed=3).eval()
    prompt = prompt_of(family, family_dir)
    reference = plain_greedy(target, prompt, num_tokens + block_size)

    # a random draft: almost every proposal rejected
    result = decode.speculative_generate(draft, target, head, prompt, max_new_tokens=num_tokens)
    assert result.output_ids == reference[:num_tokens]
    assert decode.target_generate(target, prompt, max_new_tokens=num_tokens) == reference[:num_tokens]

    # every number of accepted proposals in turn, the whole state checked after each step
    vocab_size = draft_config["vocab_size"]
    monkeypatch.setattr(decode, "draft_block", corrupting_oracle(prompt + reference, block_size, vocab_size))
    monkeypatch.setattr(decode, "TargetState", CheckedTargetState)
    CheckedTargetState.num_checks = 0
    result = decode.speculative_generate(draft, target, head, prompt, max_new_tokens=num_tokens)
    assert result.output_ids == reference[:num_tokens]
    assert result.acceptance_lengths[:block_size] == [1, 2, 3, 4]
    assert CheckedTargetState.num_checks == len(result.acceptance_lengths)
    partly_rejected = sum(1 for tau in result.acceptance_lengths if tau < block_size)
    # a rollback forward exactly where the state cannot be cropped
    assert result.num_rollback_forwards == (partly_rejected if BY_NAME[family].recurrent else 0)
    assert len(set(reference)) > 3  # the target's greedy decoding is not one repeated token


def test_crop_alone_is_not_a_rollback(family_dirs):
    """Why the rollback exists: on the hybrid, cropping after a partly rejected block leaves every
    recurrent state wrong (and nothing else); on gpt-oss, a cache without past recording cannot
    crop a sliding window that is full."""
    target = load_target(family_dirs["qwen3_5_vlm"])
    reference = plain_greedy(target, PROMPT, 12)
    state = TargetState(target, LAYER_IDS)
    state.prefill(PROMPT + reference[:6])
    state.verify(reference[6:10])
    state.cache.crop(-3)  # keep 1 of 4 without restoring anything
    got = state_tensors(state.cache)
    expected = state_tensors(reference_state(target, PROMPT + reference[:7]).cache)
    wrong = [name for name in expected if not torch.allclose(got[name], expected[name], atol=1e-3)]
    assert sorted(wrong) == sorted(name for name in expected if "recurrent_states" in name), wrong

    from dflash2.target.cache import new_cache

    target = load_target(family_dirs["gpt_oss"])
    cache = new_cache(target)
    with torch.no_grad():
        for ids in (PROMPT + reference[:6], reference[6:10]):  # 14 positions: past the window of 8
            target(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="does not track past states"):
        cache.crop(-3)


# ------------------------------------------------------------------ plan


def plan_output(capsys, *arguments: str) -> str:
    config = str(REPO / "configs" / "tiny-dflash2.yaml")
    assert plan.main([config, "--world-size", "2", "train.global_batch_size=16", *arguments]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_plan_accepts_the_checkpoint_config(family_dirs, family, capsys, tmp_path):
    draft_config = tmp_path / "draft.json"
    draft_config.write_text(json.dumps(family_draft_config()))
    config_json = family_dirs[family] / "config.json"
    out = plan_output(capsys, f"--target-config={config_json}", f"model.draft_config={draft_config}")
    model = load_target(family_dirs[family])
    num_params = sum(p.numel() for p in model.parameters())
    assert f"target {type(model).__name__}: {num_params / 1e9:.3f} B parameters" in out
    assert "fits" in out


def test_plan_of_a_composite_qwen3_6_27b_config_is_the_text_decoders(capsys, tmp_path):
    """A downloaded Qwen3.6-27B config.json (Qwen3_5ForConditionalGeneration: vision + text_config)
    plans exactly like its text decoder alone."""
    text = json.loads((REPO / "configs" / "target" / "qwen3.6-27b.json").read_text())
    composite = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text, "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 27, "hidden_size": 1152, "out_hidden_size": text["hidden_size"]},
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(composite))
    recipe = str(REPO / "configs" / "recipes" / "qwen3.6-27b-dflash2-8gpu-zero3.yaml")
    outputs = []
    for config in (path, REPO / "configs" / "target" / "qwen3.6-27b.json"):
        assert plan.main([recipe, "--world-size", "8", "--target-config", str(config)]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert "target Qwen3_5ForCausalLM: 26.896 B parameters" in outputs[0]


# ------------------------------------------------------------------ evaluate CLI on the hybrid


def test_evaluate_cli_on_the_hybrid_vlm_checkpoint(family_dirs, tiny_default, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dflash2.export import export_draft

    draft = randomize_(build_draft(family_draft_config()), seed=5)
    training_run = {"step": 1234, "chat_template_kwargs": {"enable_thinking": False}}
    export = export_draft(draft, tmp_path / "export", dtype=torch.float32, training_run=training_run)
    args = ["--draft", str(export), "--target", str(family_dirs["qwen3_5_vlm"])]
    args += ["--data", str(tiny_default.heldout_jsonl), "--num-prompts", "2", "--max-new-tokens", "24"]
    (summary,) = ev.main([*args, "--tb-dir", str(tmp_path / "tb"), "--out", str(tmp_path / "eval.json")])
    assert summary["generated_tokens"] == 48 and summary["notes"] == []
    assert summary["chat_template_kwargs"] == {"enable_thinking": False} and summary["step"] == 1234
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/mean_acceptance_length")] == [1234]


# ------------------------------------------------------------------ 2 processes per backend (slow)


@pytest.fixture(scope="module")
def family_runs(family_dirs, tiny_default, tmp_path_factory):
    """family_runs(backend): one 2-process launch of tests/dist_scripts/families.py over every family."""
    cache = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            base = tmp_path_factory.mktemp(f"families-{backend}")
            draft_config = base / "draft.json"
            draft_config.write_text(json.dumps(family_draft_config()))
            command = [
                *torchrun(2),
                str(REPO / "tests" / "dist_scripts" / "families.py"),
                "--backend",
                backend,
            ]
            command += ["--families-dir", str(next(iter(family_dirs.values())).parent)]
            command += ["--families", ",".join(FAMILY_NAMES), "--draft-config", str(draft_config)]
            data = tiny_subset(tiny_default, base, 8)
            command += ["--data", str(data), "--out", str(base / "out")]
            if backend == "deepspeed":
                ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
                ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition the tiny models
                (base / "zero3.json").write_text(json.dumps(ds))
                command += ["--ds-config", str(base / "zero3.json")]
            result = run(command, timeout=TIMEOUT_S)
            cache[backend] = {
                "result": result,
                "out": base / "out",
                "data": data,
                "draft_config": draft_config,
            }
        return cache[backend]

    return get


def family_result(family_runs, backend: str, family: str):
    launch = family_runs(backend)
    out = launch["out"] / family
    errors = sorted(out.glob("error_rank*.txt")) if out.is_dir() else []
    assert not errors, errors[0].read_text()
    proc = launch["result"]
    assert (out / "run" / "export").is_dir(), (
        f"{family} not finished:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_two_process_run(family_runs, family_dirs, backend, family):
    import dflash.model as reference_package
    from transformers import AutoTokenizer

    from dflash2.capture.offline import OfflineFeatures, feature_identity
    from dflash2.data.loader import collate
    from dflash2.data.prepare import prepare_dataset
    from dflash2.export import check_export, read_training_run

    out = family_result(family_runs, backend, family)
    model = load_target(family_dirs[family])
    # as the run loads it: the tokenizer class is the one registered for the config's model_type
    # (Qwen3_5Tokenizer for the vision-language checkpoint), which pre-tokenizes its own way
    tokenizer = AutoTokenizer.from_pretrained(family_dirs[family])

    # online capture through the sharded target: a right-padded batch of 2
    input_ids, attention_mask = padded_batch()
    expected = hf_layer_outputs(model, input_ids, attention_mask, LAYER_IDS)
    online = load_file(str(out / "online.safetensors"))["features"]
    real = attention_mask.bool()
    torch.testing.assert_close(online[real], expected[real], rtol=1e-4, atol=1e-4)

    # offline capture: every sample, read back through the identity check a training run makes
    launch = family_runs(backend)
    args = argparse.Namespace(
        draft_config=launch["draft_config"], data=launch["data"], backend=backend, ds_config=None
    )
    cfg = family_config(args, family_dirs[family], out)
    store = OfflineFeatures(out / "features", feature_identity(cfg, list(LAYER_IDS)))
    dataset, _ = prepare_dataset(launch["data"], tokenizer, cfg.data.max_length, on_error="fail")
    assert store.num_samples == len(dataset) == 8
    for index in range(len(dataset)):
        batch = collate([dataset[index]], tokenizer.pad_token_id)
        reference = hf_layer_outputs(model, batch["input_ids"], batch["attention_mask"], LAYER_IDS)[0]
        torch.testing.assert_close(store.sample(index), reference, rtol=1e-4, atol=1e-4)

    # training: finite losses, an export that checks, records its step and loads in the reference package
    losses = [record["loss"] for record in metrics(out / "run")]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    export = out / "run" / "export"
    assert check_export(export, tokenizer=tokenizer, target_config=family_dirs[family]) == []
    assert read_training_run(export) == {"step": 2, "chat_template_kwargs": {"enable_thinking": False}}
    loaded, info = reference_package.DFlash2DraftModel.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.target_layer_ids == list(LAYER_IDS)


# ------------------------------------------------------------------ serving gate (slow)


@pytest.mark.slow
def test_serving_gate_passes_on_the_hybrid_vlm(tiny_default, tmp_path):
    """The gate's target must reply with real text, so the hybrid first memorises the gate's sample
    (tests/target_families.py: save_memorising_family); the gate then runs as a user runs it."""
    from dflash2.serving_gate import select_samples

    conversation = select_samples(tiny_default.train_jsonl, 1)[0]["conversations"]
    target = save_memorising_family("qwen3_5_vlm", tmp_path / "target", tiny_default.target_dir, conversation)
    draft_config = tmp_path / "draft.json"
    draft_config.write_text(json.dumps(family_draft_config()))
    command = [
        sys.executable,
        "-m",
        "dflash2.serving_gate",
        "--config",
        str(REPO / "configs" / "tiny-dflash2.yaml"),
    ]
    command += ["--data", str(tiny_default.train_jsonl), "--out", str(tmp_path / "result.json")]
    command += [f"output_dir={tmp_path / 'run'}", f"model.target={target}"]
    command += [f"model.draft_config={draft_config}"]
    proc = run(command)
    result = json.loads((tmp_path / "result.json").read_text())
    assert proc.returncode == 0 and result["passed"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["spec_accept_length"] == 8
    assert result["target_prefix_match_tokens"] == result["generated_tokens"] >= 9
