"""Offline capture (data_prep/capture.py) and training from the saved features.

The features on disk are checked against a plain Hugging Face forward of the tiny default target;
a run from data.features_dir against the online run (the real entry point, like test_train.py);
the manifest check; and the embedding / LM head read from safetensors (tied, sharded).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dflash2
from dflash2.capture.offline import OfflineFeatures, feature_identity
from dflash2.config import load_run_config
from dflash2.data.loader import collate
from dflash2.target.head import load_target_head, target_num_parameters
from tests.run_helpers import REPO, TINY_CONFIG, check_ok, launch_train, metrics, run, tiny_subset, torchrun

LAYER_IDS = [1, 3, 4]  # configs/draft/tiny-dflash2.json
NUM_SAMPLES = 31  # odd: with 2 ranks and batches of 3, one rank runs a padding forward


@pytest.fixture(scope="module")
def overrides(tiny_default, tmp_path_factory) -> list[str]:
    data = tiny_subset(tiny_default, tmp_path_factory.mktemp("data"), NUM_SAMPLES)
    return [
        f"model.target={tiny_default.target_dir}",
        f"data.train={data}",
        "data.max_length=96",
        "backend=fsdp",
        "objective.num_anchors=8",
        "train.micro_batch_size=4",
        "train.global_batch_size=null",  # the accumulation steps of the overrides, on any number of ranks
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.lr=3e-3",
        "train.log_every=1",
        "train.progress_bar=false",
        "train.export=false",
    ]


@pytest.fixture(scope="module")
def features_dir(overrides, tmp_path_factory) -> Path:
    """Two processes, each capturing its half of the samples with the FSDP-sharded target."""
    out = tmp_path_factory.mktemp("features")
    script = str(REPO / "data_prep" / "capture.py")
    check_ok(
        run(
            [
                *torchrun(2),
                script,
                "--config",
                str(TINY_CONFIG),
                "--out",
                str(out),
                "--batch-size",
                "3",
                *overrides,
            ]
        )
    )
    return out


def expected_identity(overrides: list[str], *more: str):
    return feature_identity(load_run_config(TINY_CONFIG, [*overrides, "output_dir=unused", *more]), LAYER_IDS)


def test_manifest_covers_every_sample_in_both_ranks_shards(features_dir, overrides):
    manifest = json.loads((features_dir / "manifest.json").read_text())
    assert manifest["num_samples"] == NUM_SAMPLES and manifest["dtype"] == "float32"
    assert manifest["feature_dim"] == 128 * len(LAYER_IDS)
    assert {name.split("-")[1] for name in manifest["shards"]} == {"00000", "00001"}  # both ranks wrote
    assert all((features_dir / name).is_file() for name in manifest["shards"])
    OfflineFeatures(features_dir, expected_identity(overrides))  # the same run: accepted


def test_offline_batches_equal_a_plain_hf_forward(features_dir, overrides, tiny_default, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from dflash2.data.prepare import prepare_dataset

    cfg = load_run_config(TINY_CONFIG, [*overrides, "output_dir=unused"])
    dataset, _ = prepare_dataset(cfg.data.train, tiny_tokenizer, cfg.data.max_length, on_error="fail")
    model = AutoModelForCausalLM.from_pretrained(tiny_default.target_dir, dtype=torch.float32).eval()
    store = OfflineFeatures(features_dir, expected_identity(overrides))
    for indices in ([7, 0, 30, 12], [5], [29, 1]):  # other groupings than at capture time
        batch = collate([dataset[i] for i in indices], tiny_tokenizer.pad_token_id)
        with torch.no_grad():
            hidden = model(
                batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
            )
        reference = torch.cat([hidden.hidden_states[i + 1] for i in LAYER_IDS], dim=-1)
        seq_len = batch["input_ids"].shape[1]
        got = store.batch(indices, seq_len)
        real = batch["attention_mask"].bool()
        assert got.shape == (len(indices), seq_len, 384)
        # padding changes matmul shapes, hence float rounding: fp32 agrees to ~1e-6
        torch.testing.assert_close(got[real], reference[real], rtol=1e-5, atol=1e-5)
        assert got[~real].abs().sum() == 0  # right-padded with zeros


def test_training_from_features_matches_online_and_never_loads_the_target(
    features_dir, overrides, tiny_default, tmp_path
):
    online = check_ok(launch_train(1, [*overrides, f"output_dir={tmp_path / 'online'}"]))
    offline = check_ok(
        launch_train(
            1, [*overrides, f"output_dir={tmp_path / 'offline'}", f"data.features_dir={features_dir}"]
        )
    )
    total = target_num_parameters(tiny_default.target_dir)
    assert f"holds {total}/{total} target parameters" in online.stdout
    assert f"holds 0/{total} target parameters" in offline.stdout
    first = [metrics(tmp_path / name)[0] for name in ("online", "offline")]
    assert first[1]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)
    assert first[1]["num_supervised_tokens"] == first[0]["num_supervised_tokens"]


def test_the_python_api_trains_from_the_configs_features_like_online_capture(
    features_dir, overrides, tmp_path
):
    """build_setup without `features` follows data.features_dir (it once captured online instead)."""
    first_loss = {}
    for name, features in (("online", "null"), ("offline", str(features_dir))):
        cfg = dflash2.load_run_config(
            TINY_CONFIG, [*overrides, f"output_dir={tmp_path / name}", f"data.features_dir={features}"]
        )
        plan = dflash2.resolve_run(cfg)
        setup = dflash2.build_setup(plan, dflash2.LocalBackend.from_run_config(plan.config))
        assert (setup.target is None) == (name == "offline")
        assert isinstance(setup.features, OfflineFeatures) == (name == "offline")
        dflash2.fit(setup)
        first_loss[name] = metrics(tmp_path / name)[0]["loss"]
    assert first_loss["offline"] == pytest.approx(first_loss["online"], rel=1e-5)


def test_the_stored_last_hidden_state_is_the_hf_final_normed_state(
    features_dir, overrides, tiny_default, tiny_tokenizer
):
    """The teacher of the KL / TV terms: hidden_states[L] of a plain HF forward (the final norm's
    output), appended after the features when the reader asks for it."""
    from transformers import AutoModelForCausalLM

    from dflash2.data.prepare import prepare_dataset

    cfg = load_run_config(TINY_CONFIG, [*overrides, "output_dir=unused"])
    dataset, _ = prepare_dataset(cfg.data.train, tiny_tokenizer, cfg.data.max_length, on_error="fail")
    model = AutoModelForCausalLM.from_pretrained(tiny_default.target_dir, dtype=torch.float32).eval()
    plain = OfflineFeatures(features_dir, expected_identity(overrides))
    store = OfflineFeatures(features_dir, expected_identity(overrides), last_hidden=True)
    indices = [3, 30, 8]
    batch = collate([dataset[i] for i in indices], tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    seq_len, real = batch["input_ids"].shape[1], batch["attention_mask"].bool()
    got = store.batch(indices, seq_len)
    assert got.shape == (len(indices), seq_len, 384 + 128)
    assert torch.equal(got[..., :384], plain.batch(indices, seq_len))
    torch.testing.assert_close(got[..., 384:][real], hidden.hidden_states[-1][real], rtol=1e-5, atol=1e-5)


DISTILL = ["objective.kl_weight=0.5", "objective.tv_weight=0.5"]


def test_distillation_from_features_matches_online_capture(features_dir, overrides, tmp_path):
    online = tmp_path / "online"
    check_ok(launch_train(1, [*overrides, *DISTILL, f"output_dir={online}"]))
    offline = tmp_path / "offline"
    check_ok(
        launch_train(1, [*overrides, *DISTILL, f"output_dir={offline}", f"data.features_dir={features_dir}"])
    )
    for step_online, step_offline in zip(metrics(online), metrics(offline), strict=True):
        for name in ("loss", "ce_loss", "kl_loss", "tv_loss", "insample_accept_len_sampled"):
            assert step_offline[name] == pytest.approx(step_online[name], rel=1e-5), name
    assert metrics(online)[0]["kl_loss"] > 0


def test_features_without_the_last_hidden_state_train_ce_only_and_refuse_kl(
    features_dir, overrides, tmp_path
):
    """A directory captured before the last hidden state was stored (its manifest has no
    last_hidden_dim): still read by a cross-entropy run, refused with the fix by a KL or TV run."""
    old = tmp_path / "old_features"
    old.mkdir()
    manifest = json.loads((features_dir / "manifest.json").read_text())
    del manifest["last_hidden_dim"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    for name in manifest["shards"]:
        (old / name).symlink_to(features_dir / name)
    OfflineFeatures(old, expected_identity(overrides))  # a CE-only run reads them
    for weight in ("objective.kl_weight=0.5", "objective.tv_weight=1"):
        refused = launch_train(
            1, [*overrides, weight, f"output_dir={tmp_path / 'run'}", f"data.features_dir={old}"]
        )
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "captured without the target's last hidden state" in refused.stderr
        assert f"recapture: data_prep/capture.py --config <this run's config> --out {old}" in refused.stderr
        assert "Traceback" not in refused.stderr


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("data.max_length=80", "max_length"),
        ("data.chat_template_kwargs={x: 1}", "chat_template_kwargs"),
    ],
)
def test_a_manifest_of_another_setup_is_refused_with_the_fix(features_dir, overrides, override, field):
    with pytest.raises(
        ValueError, match=rf"{field} is .* in the features but .* in this run.*data_prep/capture.py"
    ):
        OfflineFeatures(features_dir, expected_identity(overrides, override))


@pytest.mark.parametrize("override", ["precision=bf16", "model.target_dtype=bf16"])
def test_features_of_another_target_dtype_are_refused_with_the_fix(features_dir, overrides, override):
    with pytest.raises(
        ValueError,
        match=r"captured with the target in float32, but this run's target dtype is bfloat16.*"
        r"set model.target_dtype=fp32 to train on these features, or re-run data_prep/capture.py",
    ):
        OfflineFeatures(features_dir, expected_identity(overrides, override))
    # the fix it names: a bf16 run whose target runs in fp32 reads these features
    OfflineFeatures(features_dir, expected_identity(overrides, "precision=bf16", "model.target_dtype=fp32"))


def test_features_of_other_samples_are_refused_with_the_fix(features_dir, overrides, tiny_tokenizer):
    # a run whose data settings keep other conversations than at capture (data.duplicates=drop on
    # data with a duplicate, data.on_error): every index after the first difference would read
    # another sample's features
    from datasets import Dataset

    from dflash2.data.prepare import prepare_dataset

    data = next(o.split("=", 1)[1] for o in overrides if o.startswith("data.train="))
    dataset, _ = prepare_dataset(data, tiny_tokenizer, 96)
    store = OfflineFeatures(features_dir, expected_identity(overrides))
    store.check_samples(dataset)  # the samples captured: accepted
    ids = dataset["input_ids"]
    fewer = Dataset.from_dict({"input_ids": ids[:5] + ids[6:]})
    with pytest.raises(
        ValueError, match=r"does not hold this run's samples: sample 5 has .*data_prep/capture.py"
    ):
        store.check_samples(fewer)
    with pytest.raises(ValueError, match=r"31 samples were captured, this run's data has 30"):
        store.check_samples(Dataset.from_dict({"input_ids": ids[:30]}))


def test_a_capture_cut_short_by_a_full_disk_resumes_where_it_stopped(
    features_dir, overrides, tmp_path, monkeypatch, capsys
):
    """A full disk at the third shard (one shard a sample here): the rerun captures only the samples
    no complete shard holds (it captured all 31 again before), removes the cut-short file, and the
    directory serves the same features as an uninterrupted capture."""
    import errno

    import dflash2.capture.offline as offline
    from dflash2.run import run_offline_capture

    cfg = load_run_config(TINY_CONFIG, [*overrides, f"output_dir={tmp_path / 'run'}"])
    out = tmp_path / "features"
    save, calls = offline.save_tensors, []

    def disk_fills(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            Path(path).write_bytes(b"cut short")
            raise OSError(errno.ENOSPC, "No space left on device")
        save(tensors, path, metadata=metadata)

    monkeypatch.setattr(offline, "save_tensors", disk_fills)
    with pytest.raises(OSError, match="No space left"):
        run_offline_capture(cfg, out, batch_size=3, shard_bytes=1)
    assert not (out / "manifest.json").exists() and len(list(out.glob("shard-*"))) == 2
    monkeypatch.setattr(offline, "save_tensors", save)
    captured, capture_into = [], offline.capture_into
    monkeypatch.setattr(
        offline,
        "capture_into",
        lambda w, b, t, d, indices, *a: (captured.extend(indices), capture_into(w, b, t, d, indices, *a)),
    )
    capsys.readouterr()
    run_offline_capture(cfg, out, batch_size=3, shard_bytes=1)
    note = capsys.readouterr().out
    assert "2 of 31 samples are in 2 shards already; removed 1 shard files" in note, note
    assert sorted(captured) == list(range(2, NUM_SAMPLES))
    assert not list(out.glob(".*.tmp"))
    resumed = OfflineFeatures(out, expected_identity(overrides), last_hidden=True)
    whole = OfflineFeatures(features_dir, expected_identity(overrides), last_hidden=True)
    for index in range(NUM_SAMPLES):
        torch.testing.assert_close(resumed.sample(index), whole.sample(index), rtol=1e-5, atol=1e-5)
    # a shard cut short after the capture is refused when training opens the directory
    manifest = json.loads((out / "manifest.json").read_text())
    shard = out / manifest["shards"][5]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(
        ValueError, match=f"shard {shard.name} has 100 bytes, {manifest['shard_bytes'][5]} when written"
    ):
        OfflineFeatures(out, expected_identity(overrides))


def test_a_reader_keeps_a_bounded_number_of_shards_mapped(overrides, tmp_path, monkeypatch):
    """A shard a sample (31 shards), two handles at most: each holds a memory map, and a long run
    reads every shard of a capture with tens of thousands (before: every shard read stayed mapped)."""
    import dflash2.capture.offline as offline
    from dflash2.run import run_offline_capture

    cfg = load_run_config(TINY_CONFIG, [*overrides, f"output_dir={tmp_path / 'run'}"])
    run_offline_capture(cfg, tmp_path / "features", batch_size=8, shard_bytes=1)
    monkeypatch.setattr(offline, "OPEN_SHARDS", 2)
    store = OfflineFeatures(tmp_path / "features", expected_identity(overrides))
    assert len(store.manifest["shards"]) == NUM_SAMPLES
    for index in [0, 5, 9, 5, 30, 0]:
        store.sample(index)
        assert len(store._files) <= 2
    assert list(store._files) == [store.manifest["sample_shard"][i] for i in (30, 0)]  # the most recent


def test_changed_layer_ids_or_missing_manifest_are_refused(features_dir, overrides, tmp_path):
    with pytest.raises(ValueError, match=r"target_layer_ids is \[1, 3, 4\] in the features but \[1, 3\]"):
        OfflineFeatures(features_dir, {**expected_identity(overrides), "target_layer_ids": [1, 3]})
    with pytest.raises(ValueError, match="no manifest.json.*data_prep/capture.py"):
        OfflineFeatures(tmp_path, expected_identity(overrides))


@pytest.mark.parametrize("tied", [False, True])
def test_head_is_read_from_sharded_safetensors_like_the_loaded_model(tied, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards + an index json
    assert (tmp_path / "model.safetensors.index.json").is_file()
    head = load_target_head(tmp_path, torch.float32)
    assert torch.equal(head.embed_weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head_weight, model.get_output_embeddings().weight)
    assert target_num_parameters(tmp_path) == sum(p.numel() for p in model.parameters())  # tied: counted once
