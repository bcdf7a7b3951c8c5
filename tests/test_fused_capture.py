"""Features kept while the target regenerates (data_prep/regenerate.py --capture-config).

The reference is independent of the generation: one plain forward of the target over each whole
conversation (the matrix families), and data_prep/capture.py's features directory (the tiny
default, end to end, truncation and a conversation whose features the generation cannot give).
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2.capture.offline import OfflineFeatures
from dflash2.data.regenerate import LocalTargetGenerator, _left_pad
from dflash2.safetensors_io import file_mode
from dflash2.target.hooks import capture_layer_outputs
from dflash2.target.recorded_generate import generate_recording
from tests.run_helpers import REPO, TINY_CONFIG, check_ok, run
from tests.target_families import BY_NAME, FAMILY_NAMES, LAYER_IDS, VOCAB, build_model

# gpt-oss: sliding-window layers (a window counts cache slots, and its cache drops the oldest)
REFUSED = {name for name in FAMILY_NAMES if BY_NAME[name].recurrent} | {"gpt_oss"}
FULL_ATTENTION_FAMILIES = [name for name in FAMILY_NAMES if name not in REFUSED]


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad(), capture_layer_outputs(model, LAYER_IDS, last_hidden=True) as captured:
        model(input_ids=torch.tensor([ids]))
    return captured.features()[0]


@pytest.mark.parametrize("family", FULL_ATTENTION_FAMILIES)
def test_recorded_generation_equals_one_forward_over_each_conversation(family):
    """Prompts of different lengths (left padding), replies cut at different places (a stop token
    early in one row, the whole generation in another) and tails the generation never read; a row
    whose conversation does not start with its prompt gets None."""
    model = build_model(family)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (5, 11, 8, 6)]
    input_ids, attention_mask = _left_pad(prompts, pad_id=0)
    recorded = generate_recording(
        model, LAYER_IDS, input_ids, attention_mask, 0, do_sample=False, max_new_tokens=12, eos_token_id=[2]
    )
    generated = recorded.generated.tolist()
    cuts = (3, 12, 0)  # tokens of the reply kept: some, all generated, none
    tails = ([7, 9], [5], [4, 4, 4])
    conversations = [p + g[:cut] + tail for p, g, cut, tail in zip(prompts, generated, cuts, tails)]
    features = recorded.features([*conversations, prompts[0] + generated[3][:2]])
    assert features[3] is None
    for conversation, kept in zip(conversations, features):
        reference = _reference(model, conversation)
        assert kept.shape == reference.shape
        torch.testing.assert_close(kept, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_target_with_recurrent_or_sliding_layers_is_refused_with_the_fix(family, tiny_tokenizer):
    with pytest.raises(ValueError, match="data_prep/capture.py"):
        LocalTargetGenerator(build_model(family), tiny_tokenizer, 8, record_layer_ids=LAYER_IDS)


def _regenerate(data: Path, out: Path, features: Path | None, *extra: str) -> dict:
    command = [
        sys.executable,
        str(REPO / "data_prep" / "regenerate.py"),
        "--input",
        str(data),
        "--out",
        str(out),
    ]
    command += ["--target", "artifacts/tiny/target", "--batch-size", "4", "--max-new-tokens", "20"]
    if features is not None:
        command += ["--capture-config", str(TINY_CONFIG), "--features-out", str(features), *extra]
    result = check_ok(run(command))
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def conversations(tiny_default, tmp_path_factory) -> Path:
    """Eleven conversations, the first with two assistant turns."""
    rows = [json.loads(line) for line in tiny_default.heldout_jsonl.read_text().splitlines()]
    multi_turn = [row for row in rows if sum(t["role"] == "assistant" for t in row["conversations"]) > 1]
    chosen = multi_turn[:1] + [row for row in rows if row not in multi_turn][:10]
    path = tmp_path_factory.mktemp("data") / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in chosen))
    return path


def test_regeneration_writes_the_features_that_offline_capture_would(conversations, tmp_path):
    """Three replies regenerated without --capture-config, four more with it (a first run, as if
    stopped there), the last four by a rerun that resumes: the first three need a forward."""
    overrides = ["data.max_length=48", f"output_dir={tmp_path / 'run'}"]  # 48: some samples truncated
    lines = conversations.read_text().splitlines(keepends=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(lines[:3]))
    second.write_text("".join(lines[:7]))
    regenerated, features = tmp_path / "regen.jsonl", tmp_path / "features"
    # a first regeneration with --capture-config writes data.train (it was refused as missing)
    fresh = _regenerate(first, tmp_path / "fresh.jsonl", tmp_path / "fresh-features", *overrides)
    assert (fresh["num_written"], fresh["num_staged"]) == (3, 3)
    _regenerate(first, regenerated, None)
    assert _regenerate(second, regenerated, features, *overrides)["num_written"] == 4
    counts = _regenerate(conversations, regenerated, features, *overrides)
    assert (counts["num_done_before"], counts["num_written"]) == (7, 4)
    assert (counts["num_staged"], counts["num_captured"]) == (8, 3)

    reference = tmp_path / "captured"
    command = [sys.executable, str(REPO / "data_prep" / "capture.py"), "--config", str(TINY_CONFIG)]
    command += ["--out", str(reference), f"data.train={regenerated}", *overrides]
    check_ok(run(command))
    manifest = json.loads((features / "manifest.json").read_text())
    expected = json.loads((reference / "manifest.json").read_text())
    assert manifest["format"] == "dflash2-features/2"
    for field in ("target", "tokenizer", "data", "max_length", "target_layer_ids", "dtype", "sample_length"):
        assert manifest[field] == expected[field], field
    assert max(manifest["sample_length"]) == 48  # truncated samples served by a prefix of their features
    # every file readable as any other new file is (safetensors alone writes 0600: dflash2.safetensors_io)
    assert {stat.S_IMODE(p.stat().st_mode) for p in features.iterdir()} == {file_mode()}
    kept = OfflineFeatures(features, manifest, last_hidden=True)
    captured = OfflineFeatures(reference, expected, last_hidden=True)
    for index in range(manifest["num_samples"]):
        torch.testing.assert_close(kept.sample(index), captured.sample(index), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16"])  # torch's name and the run configs'
def test_capture_config_that_disagrees_with_the_regeneration_is_one_message(conversations, tmp_path, dtype):
    command = [sys.executable, str(REPO / "data_prep" / "regenerate.py"), "--input", str(conversations)]
    command += [
        "--out",
        str(tmp_path / "r.jsonl"),
        "--target",
        "artifacts/tiny/target",
        "--dtype",
        dtype,
    ]
    command += ["--capture-config", str(TINY_CONFIG), "--features-out", str(tmp_path / "f")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"--dtype {dtype} is not the run's target dtype" in result.stderr
    assert not (tmp_path / "r.jsonl").exists()
