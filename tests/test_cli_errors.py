"""User errors in every command-line tool: one message naming the problem and the fix, exit code 2,
no traceback (unless --debug or DFLASH2_DEBUG=1), and nothing loaded before the paths were checked:
a missing model directory is never taken for a Hugging Face hub id. Each tool runs as `__main__`,
as from the shell, in this process."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
import sys
import warnings

import pytest

from dflash2.errors import COMMANDS, EXIT_USER_ERROR, run_main
from tests.run_helpers import REPO, TINY_CONFIG


def run_cli(monkeypatch, capsys, tool: str, arguments: list[str]) -> tuple[int, str]:
    """Run `tool` (a script path under the repo, or a module name) as __main__; (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", [tool, *arguments])
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were the hub ever asked, this would fail differently
    # a tool ends its process with errors.exit_process (os._exit): here it must end the tool only
    monkeypatch.setattr("dflash2.errors.exit_process", sys.exit)
    with pytest.raises(SystemExit) as exited, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        if tool.endswith(".py"):
            runpy.run_path(str(REPO / tool), run_name="__main__")
        else:
            runpy.run_module(tool, run_name="__main__", alter_sys=True)
    return exited.value.code, capsys.readouterr().err


def assert_one_message(code: int, stderr: str, *fragments: str) -> None:
    assert code == EXIT_USER_ERROR, stderr
    assert stderr.count("error:") == 1 and stderr.startswith("error: "), stderr
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in stderr, stderr


def test_train_names_a_missing_relative_target_and_never_asks_the_hub(monkeypatch, capsys, tiny_default):
    code, stderr = run_cli(
        monkeypatch,
        capsys,
        "launch/train.py",
        ["--config", str(TINY_CONFIG), "model.target=artifacts/no-such-target"],
    )
    assert_one_message(
        code, stderr, "model.target='artifacts/no-such-target'", f"(relative to {REPO})", "does not exist"
    )


@pytest.mark.parametrize(
    "arguments,fragments",
    [
        (["--config", "configs/missing.yaml"], ["config='configs/missing.yaml'", "does not exist"]),
        (["--config", str(TINY_CONFIG), "train.max_steps"], ["must look like key=value"]),
        (
            ["--config", str(TINY_CONFIG), "train.nonsense=1"],
            ["train.nonsense: Extra inputs are not permitted"],
        ),
        (
            ["--config", str(TINY_CONFIG), "data.train=/nowhere/data.jsonl"],
            ["data.train='/nowhere/data.jsonl'"],
        ),
        (
            ["--config", str(TINY_CONFIG), "train.max_step=5"],
            ["train.max_step: Extra inputs are not permitted; did you mean train.max_steps?"],
        ),
        (["--config", str(TINY_CONFIG), "train.resume=/nowhere"], ["train.resume='/nowhere'"]),
        (["--config", str(TINY_CONFIG), "model.target=/nowhere/target"], ["model.target='/nowhere/target'"]),
        (  # its last slot weighed 0 and dropped out of the metrics as if it were not supervised
            ["--config", str(TINY_CONFIG), "objective.loss_gamma=0.01"],
            ["objective.loss_gamma=0.01: slot 7 of a block of 8 would weigh 0", "raise objective.loss_gamma"],
        ),
    ],
    ids=[
        "config",
        "override",
        "unknown-key",
        "did-you-mean",
        "data",
        "resume",
        "absolute-target",
        "slot-weight",
    ],
)
def test_train_config_errors(monkeypatch, capsys, tiny_default, arguments, fragments):
    overrides = [f"model.target={tiny_default.target_dir}", f"data.train={tiny_default.train_jsonl}"]
    arguments = arguments[:2] + overrides + arguments[2:] if arguments[1] == str(TINY_CONFIG) else arguments
    code, stderr = run_cli(monkeypatch, capsys, "launch/train.py", arguments)
    assert_one_message(code, stderr, *fragments)


def test_bad_yaml_and_an_empty_data_file(monkeypatch, capsys, tiny_default, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("output_dir: [unclosed\n")
    assert_one_message(
        *run_cli(monkeypatch, capsys, "launch/train.py", ["--config", str(bad)]), "not valid YAML"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    arguments = [
        "--config",
        str(TINY_CONFIG),
        f"model.target={tiny_default.target_dir}",
        f"data.train={empty}",
    ]
    assert_one_message(*run_cli(monkeypatch, capsys, "launch/train.py", arguments), "is empty")


def test_other_tools(monkeypatch, capsys, tiny_default, tmp_path):
    target, data = str(tiny_default.target_dir), str(tiny_default.train_jsonl)
    cases = {
        "data_prep/prepare.py": (
            ["--input", "nope.jsonl", "--tokenizer", target, "--out", str(tmp_path / "p"), "--max-length", "64"],
            "--input='nope.jsonl'",
        ),
        "data_prep/regenerate.py": (["--input", data, "--out", str(tmp_path / "r"), "--target", "nope"], "--target='nope'"),
        "data_prep/capture.py": (
            ["--config", str(TINY_CONFIG), "--out", str(tmp_path / "f"), "model.target=nope"],
            "model.target='nope'",
        ),
        "dflash2.export": (["nope", str(tmp_path / "e")], "source='nope'"),
        "dflash2.evaluate": (["--draft", "nope", "--target", target, "--data", data], "--draft='nope'"),
        "dflash2.serving_gate": (["--config", str(TINY_CONFIG), "--data", "nope.jsonl", f"model.target={target}"], "--data='nope.jsonl'"),
        "dflash2.plan": (["configs/nope.yaml"], "config='configs/nope.yaml'"),
    }  # fmt: skip
    for tool, (arguments, fragment) in cases.items():
        code, stderr = run_cli(monkeypatch, capsys, tool, arguments)
        assert_one_message(code, stderr, fragment, "does not exist")


def test_capture_refuses_a_batch_size_of_0(monkeypatch, capsys, tiny_default, tmp_path):
    arguments = ["--config", str(TINY_CONFIG), "--out", str(tmp_path / "f"), "--batch-size", "0"]
    arguments.append(f"model.target={tiny_default.target_dir}")
    assert_one_message(*run_cli(monkeypatch, capsys, "data_prep/capture.py", arguments), "--batch-size (0)")
    assert not (tmp_path / "f").exists()


def test_on_error_fail_gives_the_reported_line_without_a_traceback(
    monkeypatch, capsys, tiny_default, tmp_path
):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    arguments = [
        "--input",
        str(path),
        "--tokenizer",
        str(tiny_default.target_dir),
        "--out",
        str(tmp_path / "o"),
    ]
    arguments += ["--max-length", "64", "--on-error", "fail"]
    assert_one_message(
        *run_cli(monkeypatch, capsys, "data_prep/prepare.py", arguments), f"{path}:1: no assistant turn"
    )


def test_debug_shows_the_traceback_and_other_ranks_stay_quiet(monkeypatch, capsys):
    def main(argv):
        raise ValueError("the fix is to do X")

    monkeypatch.setenv("DFLASH2_DEBUG", "1")
    assert run_main(main, []) == EXIT_USER_ERROR
    stderr = capsys.readouterr().err
    assert "Traceback" in stderr and stderr.rstrip().endswith("error: the fix is to do X")
    monkeypatch.delenv("DFLASH2_DEBUG")
    monkeypatch.setenv("RANK", "1")  # the same error on every rank is printed once, by rank 0
    assert run_main(main, []) == EXIT_USER_ERROR and capsys.readouterr().err == ""


EXIT_PROCESS_SCRIPT = """
import atexit, sys, threading, time
from dflash2.errors import exit_process

atexit.register(lambda: print("exit handler ran", flush=True))
def late_writer():
    time.sleep(0.5)
    with open(sys.argv[1], "w") as f:
        f.write("written by a non-daemon thread")
threading.Thread(target=late_writer).start()
sys.stdout.write("buffered, not flushed; ")
exit_process(75)
print("never reached")
"""


def test_exit_process_ends_like_python_does_only_without_the_teardown(tmp_path):
    """What a normal exit would do still happens: the code, a non-daemon thread finishes its write,
    the exit handlers run, buffered output reaches the pipe; nothing after the call runs."""
    written = tmp_path / "out.txt"
    ended = subprocess.run(
        [sys.executable, "-c", EXIT_PROCESS_SCRIPT, str(written)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ended.returncode == 75, ended.stderr
    assert ended.stdout == "buffered, not flushed; exit handler ran\n", ended.stdout
    assert written.read_text() == "written by a non-daemon thread"


def test_a_user_error_met_first_by_another_rank_is_still_printed_by_rank_0(tmp_path):
    # torchrun ends every worker as soon as one has exited: rank 1 meets the error at once, rank 0 a
    # second later, and its message must still come out, once, with the job's exit code 2
    script = tmp_path / "refuse.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from dflash2.errors import exit_process, run_main\n"
        "def main(argv):\n"
        "    if os.environ['RANK'] == '0':\n"
        "        time.sleep(1.0)\n"
        "    raise ValueError('option x is wrong: set x=1')\n"
        "exit_process(run_main(main))\n"
    )
    launcher = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=2"]
    result = subprocess.run([*launcher, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert result.stderr.count("error: option x is wrong: set x=1") == 1, result.stderr
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr, result.stderr


GROUP_SCRIPT = """
import os, sys, time
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from dflash2.errors import exit_process, run_main
from dflash2.faults import collective_section
def main(argv):
    dist.init_process_group("gloo")
    if os.environ["RANK"] == "0":
        if {rank_0_errs!r}:
            time.sleep(1.0)
            raise ValueError("features_dir /data/f: no manifest.json: capture the features first")
        with collective_section("the step's all-reduce"):
            dist.barrier()  # waits for rank 1, which exits: a ReportedError, quiet here
    raise ValueError("features_dir /data/f: no manifest.json: capture the features first")
exit_process(run_main(main))
"""


@pytest.mark.parametrize("rank_0_errs", [True, False], ids=["every-rank", "rank-1-alone"])
def test_a_user_error_after_the_group_starts_is_printed_once(tmp_path, rank_0_errs):
    # every rank meets it (rank 0 a second late): rank 0 prints it, rank 1 sees that in the store and
    # stays quiet; rank 1 alone (a path missing on one node; rank 0 waits in a collective): rank 1
    # prints it after USER_ERROR_GRACE_S, saying which rank it is
    script = tmp_path / "refuse.py"
    script.write_text(GROUP_SCRIPT.format(repo=str(REPO), rank_0_errs=rank_0_errs))
    launcher = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=2"]
    result = subprocess.run([*launcher, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    message = "features_dir /data/f: no manifest.json: capture the features first"
    printed = ("error: " if rank_0_errs else "error (rank 1): ") + message
    assert result.stderr.count(printed) == 1, result.stderr
    assert result.stderr.count("error") == 1 and "Traceback" not in result.stderr, result.stderr


def test_what_the_trainer_would_refuse_late_is_refused_before_anything_loads(
    monkeypatch, capsys, tiny_default, tmp_path
):
    """The SLURM pre-flight, the trainer's launcher and the planner refuse a DeepSpeed JSON the run
    cannot use (checked after the target had loaded before: gradient_clipping and bf16.enabled) and
    a draft config of another target (the pre-flight passed it before), naming the file and the fix."""
    ds = json.loads((REPO / "ds_configs/zero3.json").read_text())
    files = {
        "stage2.json": json.dumps({**ds, "zero_optimization": {"stage": 2}}),
        "clipping.json": json.dumps({**ds, "gradient_clipping": 0.5}),
        "bf16.json": json.dumps({**ds, "bf16": {"enabled": False}}),
        "malformed.json": '{"zero_optimization": {stage: 3}}',
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    base = [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        "backend=deepspeed",
    ]
    cases = [
        ([f"ds_config={tmp_path / 'stage2.json'}"], "zero_optimization.stage = 3"),
        (
            [f"ds_config={tmp_path / 'clipping.json'}"],
            "gradient_clipping=0.5 but train.max_grad_norm gives 1.0",
        ),
        (
            [f"ds_config={tmp_path / 'bf16.json'}", "precision=bf16"],
            "bf16.enabled=False but precision='bf16' gives True",
        ),
        (
            [f"ds_config={tmp_path / 'malformed.json'}"],
            f"ds_config='{tmp_path / 'malformed.json'}' is not valid JSON",
        ),
        (["model.draft_config=configs/draft/smollm2-dflash2.json"], "hidden_size=576"),
    ]
    for overrides, fragment in cases:
        preflight = ["--world-size", "1", str(TINY_CONFIG), *base, *overrides]
        assert_one_message(*run_cli(monkeypatch, capsys, "launch/slurm/preflight.py", preflight), fragment)
        train = ["--config", str(TINY_CONFIG), *base, *overrides]
        assert_one_message(*run_cli(monkeypatch, capsys, "launch/train.py", train), fragment)
    planner = [str(TINY_CONFIG), "--world-size", "1", "--target-config", str(tiny_default.target_dir)]
    assert_one_message(*run_cli(monkeypatch, capsys, "dflash2.plan", [*planner, *cases[1][0]]), cases[1][1])


def test_every_missing_path_and_a_setting_that_would_be_ignored_are_named_at_once(
    monkeypatch, capsys, tmp_path
):
    arguments = [
        "--config",
        str(TINY_CONFIG),
        "model.target=/nowhere/target",
        "data.train=/nowhere/data.jsonl",
    ]
    code, stderr = run_cli(monkeypatch, capsys, "launch/train.py", arguments)  # one of them at a time before
    assert_one_message(code, stderr, "model.target='/nowhere/target'", "data.train='/nowhere/data.jsonl'")
    arguments = [
        "--config",
        str(TINY_CONFIG),
        "topology=disaggregated",
        "capture_ranks=1",
        f"data.features_dir={tmp_path}",
    ]
    code, stderr = run_cli(
        monkeypatch, capsys, "launch/train.py", arguments
    )  # the features went unread before
    assert_one_message(code, stderr, "with topology=disaggregated", "topology=colocated")


STOP_SCRIPT = """
import os, signal, sys, time
code = int(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *args: sys.exit(code))
open(os.path.join(sys.argv[2], "up" + os.environ["RANK"]), "w").write(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("worker_code", [75, 1], ids=["stopped", "failed"])
def test_after_a_forwarded_signal_the_launcher_exits_with_its_workers_code(tmp_path, worker_code):
    """Before: 75 ("stopped, run again to resume") whatever the workers did, even when writing their
    checkpoint failed."""
    import os
    import signal
    import time

    script = tmp_path / "worker.py"
    script.write_text(STOP_SCRIPT)
    launcher = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=2"]
    command = [*launcher, str(script), str(worker_code), str(tmp_path)]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"up{rank}").exists() for rank in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "the workers did not start"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        for up in tmp_path.glob("up*"):  # workers run in their own sessions: never leave one behind
            pid = int(up.read_text() or -1)
            if pid > 0:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert proc.returncode == worker_code, stderr[-3000:]
    said = "they stopped with a checkpoint" if worker_code == 75 else "they failed (exit codes [1, 1])"
    assert f"[dflash2] launcher: SIGTERM forwarded to the workers; {said}" in stderr, stderr[-3000:]


def test_more_refusals_that_were_tracebacks_silent_or_destructive(
    monkeypatch, capsys, tiny_default, tmp_path
):
    """Each was a traceback, a success that wrote nothing usable, or (the builds) lost a directory."""
    target, data = str(tiny_default.target_dir), str(tiny_default.train_jsonl)
    kept = tmp_path / "runs"  # a directory of the user's, given as a build's --out
    (kept / "notes.txt").parent.mkdir()
    (kept / "notes.txt").write_text("mine")
    no_reply = tmp_path / "no-reply.jsonl"
    no_reply.write_text('{"id": "a", "conversations": [{"role": "user", "content": "hi"}]}\n')
    prepare = ["--tokenizer", target, "--out", str(tmp_path / "p"), "--max-length", "64"]
    usage = [  # argparse's usage errors: exit 2, "prog: error: ..."
        ("data_prep/prepare.py", [*prepare, "--input", data, "--chat-template-kwargs", "[1]"], "give a JSON object"),
        ("data_prep/prepare.py", ["--tokenizer", target, "--out", data, "--max-length", "64", "--input", data], "is a file"),
        ("data_prep/capture.py", ["--config", str(TINY_CONFIG), "--out", data], "is a file: give a directory for the features"),
        ("data_prep/regenerate.py", ["--input", data, "--out", data, "--target", target], "--out is --input"),
        ("data_prep/real_prompts.py", ["--out", str(tmp_path / "rp"), "--num-train", "0"], "--num-train must be >= 1"),
    ]  # fmt: skip
    for tool, arguments, fragment in usage:
        code, stderr = run_cli(monkeypatch, capsys, tool, arguments)
        assert code == EXIT_USER_ERROR and fragment in stderr and "Traceback" not in stderr, (tool, stderr)
    cases = {
        "data_prep/build_tiny_default.py": (["--out", str(kept)], "holds files and is not an earlier build"),
        "data_prep/prepare.py": ([*prepare, "--input", str(no_reply)], "no conversation of"),
        "dflash2.plan": (["configs/tiny-dflash2.yaml", "--world-size", "1", "--device-gb", "nan"], "--device-gb must be a number > 0, got nan"),
        "launch/slurm/preflight.py": (["--world-size", "1", "--device-gb", "-8", str(TINY_CONFIG)], "--device-gb must be a number > 0, got -8.0"),
        "dflash2.serving_gate": (["--config", str(TINY_CONFIG), "--data", data, "--max-new-tokens", "0", f"model.target={target}"], "--max-new-tokens must be >= 1"),
    }  # fmt: skip
    for tool, (arguments, fragment) in cases.items():
        code, stderr = run_cli(monkeypatch, capsys, tool, arguments)
        assert_one_message(code, stderr, fragment)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]  # before: replaced by a tiny build
    assert not (tmp_path / "p").exists()
    # a dataset smaller than one global batch: refused before the target loads or anything is written
    small = tmp_path / "small.jsonl"
    small.write_text("".join(open(data).readlines()[:3]))
    run_dir = tmp_path / "run"
    overrides = [f"model.target={target}", f"data.train={small}", f"output_dir={run_dir}", "backend=local"]
    code, stderr = run_cli(monkeypatch, capsys, "launch/train.py", ["--config", str(TINY_CONFIG), *overrides])
    assert_one_message(
        code, stderr, "the dataset has 3 samples, fewer than one global batch", "give more data"
    )
    assert not run_dir.exists()  # before: config.yaml, metrics, tb; then the lock file alone


def test_a_model_directory_without_a_tokenizer_is_named_before_anything_loads(
    monkeypatch, capsys, tiny_default, tmp_path
):
    """transformers' own message asked for sentencepiece or tiktoken, which would not help."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(tiny_default.target_dir / name)
    data = str(tiny_default.train_jsonl)
    fix = "has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, ...)"
    cases = {
        "launch/train.py": (["--config", str(TINY_CONFIG), f"model.target={bare}", f"output_dir={tmp_path / 'run'}"], "model.target="),
        "data_prep/prepare.py": (["--input", data, "--tokenizer", str(bare), "--out", str(tmp_path / "p"), "--max-length", "64"], "--tokenizer="),
        "data_prep/regenerate.py": (["--input", data, "--out", str(tmp_path / "r.jsonl"), "--target", str(bare)], "--target="),
        "dflash2.evaluate": (["--draft", str(tmp_path), "--target", str(bare), "--data", data], "--target="),
        "dflash2.export": (["--check", str(tmp_path), "--tokenizer", str(bare)], "--tokenizer="),
    }  # fmt: skip
    for tool, (arguments, option) in cases.items():
        code, stderr = run_cli(monkeypatch, capsys, tool, arguments)
        assert_one_message(code, stderr, f"{option}'{bare}' {fix}: copy the model's tokenizer files")
    assert not (tmp_path / "run").exists() and not (tmp_path / "p").exists()


def test_a_path_error_under_torchrun_is_one_message_from_rank_0(tmp_path, tiny_default):
    """Every rank checks the paths before the group starts; rank 0 prints the error and exits, and
    torchrun then sends SIGTERM to a rank still starting: that rank said it would stop after this
    optimizer step (a line under the error, in every such launch here), and says nothing now."""
    launcher = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=2"]
    train = [str(REPO / "launch" / "train.py"), "--config", str(TINY_CONFIG), "backend=fsdp"]
    missing = tmp_path / "draft.json"
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        "train.micro_batch_size=4",
        f"model.draft_config={missing}",
    ]
    result = subprocess.run(
        [*launcher, *train, *overrides], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    said = [line for line in result.stderr.splitlines() if "error" in line or "[dflash2]" in line]
    assert said[0] == f"error: model.draft_config='{missing}' does not exist: give the draft's config.json"
    assert not any("[dflash2]" in line or line.startswith("error") for line in said[1:]), result.stderr


def test_python_m_of_the_training_loop_names_the_commands_which_all_run(monkeypatch, capsys):
    """`python -m dflash2.train` (a newcomer's guess) ran nothing and exited 0; now it, `dflash2.run`
    and `python -m dflash2` name the commands, and each command named parses its --help."""
    for module in ("dflash2.train", "dflash2.run"):
        code, stderr = run_cli(monkeypatch, capsys, module, ["--config", str(TINY_CONFIG)])
        assert_one_message(code, stderr, f"{module} is not a command; the commands are:\n{COMMANDS}")
    assert run_cli(monkeypatch, capsys, "dflash2", ["train"]) == (
        EXIT_USER_ERROR,
        f"error: python -m dflash2 runs nothing; the commands are:\n{COMMANDS}",
    )
    modules = re.findall(r"python -m (dflash2\.\w+)", COMMANDS)
    scripts = ["launch/train.py", *(f"data_prep/{name}.py" for name in ("prepare", "regenerate", "capture"))]
    assert len(modules) == 5 and all(script.split("/")[-1] in COMMANDS for script in scripts)
    for tool in [*modules, *scripts]:
        assert run_cli(monkeypatch, capsys, tool, ["--help"])[0] == 0, tool


def test_an_output_dir_inside_a_directory_the_run_reads_is_refused(
    monkeypatch, capsys, tiny_default, tmp_path
):
    """Before: the run wrote its checkpoints, logs, export and lock among the target's files."""
    target = tmp_path / "target"
    shutil.copytree(tiny_default.target_dir, target)
    before = sorted(target.iterdir())
    for inside in (target, target / "run"):
        overrides = [f"model.target={target}", f"output_dir={inside}", "backend=local"]
        code, stderr = run_cli(
            monkeypatch, capsys, "launch/train.py", ["--config", str(TINY_CONFIG), *overrides]
        )
        assert_one_message(code, stderr, f"output_dir='{inside}' is inside model.target='{target}'")
    assert sorted(target.iterdir()) == before


def test_the_usual_slips_with_overrides_get_the_fix_in_the_usage_error(monkeypatch, capsys):
    """argparse alone said `unrecognized arguments: --train.max_steps=5` and `the following arguments
    are required: --config`, without the fix."""
    slips = {
        ("launch/train.py", "--config", str(TINY_CONFIG), "--train.max_steps=5"): "(overrides take no dashes: train.max_steps=5)",
        ("launch/train.py", str(TINY_CONFIG), "train.max_steps=5"): f"(give the run config as --config {TINY_CONFIG})",
        ("dflash2.plan", str(TINY_CONFIG), "--world-size", "1", "--train.lr=3"): "(overrides take no dashes: train.lr=3)",
    }  # fmt: skip
    for (tool, *arguments), fix in slips.items():
        code, stderr = run_cli(monkeypatch, capsys, tool, arguments)
        assert code == EXIT_USER_ERROR and stderr.rstrip().endswith(fix), stderr
