"""Run configuration: a YAML file plus dotted `key=value` overrides, validated before any process
group starts. Unknown keys are errors. The resolved config is saved in the run directory."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    model_validator,
)

PRECISIONS = ("fp32", "bf16")  # the precision names of a run config (and of the CLIs that take one)
Precision = Literal[PRECISIONS]


def torch_dtype(precision: Precision):
    """The torch dtype of a precision name of this config."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: give one of {', '.join(PRECISIONS)}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


@dataclass(frozen=True)
class BackendEntry:
    """A distribution backend: its `Backend` subclass as "module:Class" (imported only when chosen,
    dflash2.distributed.registry), the run-config keys naming files it reads, with what they are,
    and whether it runs in one process only (checked with the config)."""

    cls: str
    files: tuple[tuple[str, str], ...] = ()
    one_process: bool = False


# The backends a run config may name (adding one: its module and one line here, docs/architecture.md)
BACKENDS = {
    "deepspeed": BackendEntry(
        "dflash2.distributed.deepspeed_backend:DeepSpeedBackend",
        (("ds_config", "a DeepSpeed JSON (e.g. ds_configs/zero3.json)"),),
    ),
    "fsdp": BackendEntry("dflash2.distributed.fsdp_backend:FSDPBackend"),
    "local": BackendEntry("dflash2.distributed.local_backend:LocalBackend", one_process=True),
}
BackendName = Literal[tuple(BACKENDS)]


def _not_a_flag(value: Any) -> Any:
    # pydantic reads true as 1: a YAML `max_steps: true` would train 1 step (numpy's bool too, from Python)
    if isinstance(value, (bool, numpy.bool_)):
        raise ValueError(f"give a number, not {str(value).lower()}")
    return value


# The number and flag types of the sections: a number given as true/false and a flag given as a number
# or a string are refused (pydantic's lax mode takes them), a number written as a string (YAML 1.1
# reads `lr: 3e-4` as one) is read as the number.
Int = Annotated[int, BeforeValidator(_not_a_flag)]
Float = Annotated[float, BeforeValidator(_not_a_flag)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    draft_config: str  # draft config.json (HF form, see docs/contract.md)
    target: str  # Hugging Face causal LM directory (safetensors + tokenizer)
    target_dtype: Precision | None = None  # default: the run precision
    # Start the draft from the target's weights (dflash2.target.draft_init): its layers from target
    # layers `init_target_layers` (default: the last n, n = the draft's layers), its final norm from
    # the target's, fc reading the deepest captured layer. Only at step 0; a resume loads its checkpoint.
    init_from_target: StrictBool = False
    init_target_layers: list[int] | None = None

    @model_validator(mode="after")
    def _init_layers_need_init(self) -> ModelConfig:
        if self.init_target_layers is not None and not self.init_from_target:
            raise ValueError(
                "model.init_target_layers is set but model.init_from_target is false; set both or neither"
            )
        return self


class DataConfig(_Section):
    train: str  # training_jsonl file, or a dataset directory written by data_prep/prepare.py
    max_length: Int = Field(2048, ge=8)
    on_error: Literal["skip", "fail"] = "fail"
    duplicates: Literal["keep", "drop"] = "keep"  # conversations equal to an earlier one (reported)
    features_dir: str | None = None  # offline capture (data_prep/capture.py): train from saved features
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class ObjectiveSection(_Section):
    """The run config's objective keys; dflash2.objective.ObjectiveConfig adds what the draft fixes."""

    num_anchors: Int = Field(64, ge=1)
    loss_gamma: Float | None = Field(None, gt=0)  # slot k weighted exp(-(k-1)/gamma); None = uniform
    selector_loss_alpha: Float = Field(1.0, ge=0)
    selector_mode: Literal["insert", "strict"] = "insert"
    # what the selector loss trains: "backbone" = the selector and, through the slot states and their
    # unary logits, the draft's layers too; "selector" = the selector's own weights alone (the draft's
    # layers learn from the block loss only)
    selector_grad: Literal["backbone", "selector"] = "backbone"
    logits_chunk_rows: Int = Field(1024, ge=1)  # rows of [supervised slots, V] logits alive at once
    coverage_top_k: Int = Field(16, ge=1)  # top-k of the coverage metrics when the draft has no selector
    # the block loss: ce_weight * CE(label) + kl_weight * KL(p_target || q_draft) + tv_weight * TV,
    # each summed over the supervised slots with the position weights (docs/training.md)
    ce_weight: Float = Field(1.0, ge=0)
    kl_weight: Float = Field(0.0, ge=0)
    tv_weight: Float = Field(0.0, ge=0)
    distill_temperature: Float = Field(1.0, gt=0)  # p_target = softmax(target logits / T)
    # slot weights: "gamma" = exp(-(k-1)/loss_gamma) (uniform when loss_gamma is null), "exponential" =
    # position_decay ** (k-1), "uniform" = 1
    position_weighting: Literal["gamma", "exponential", "uniform"] = "gamma"
    position_decay: Float = Field(0.8, gt=0, le=1)
    # compute the loss over the K tokens most frequent among the training labels instead of the whole
    # vocabulary (a cheaper step: the head's matmuls and softmax shrink V -> K); slots whose label is
    # outside them are not supervised. The exported draft keeps the target's whole head. null: all V.
    loss_vocab_size: Int | None = Field(None, ge=1)
    # the tokens the loss supervises: "replies" = the data's loss_mask (the assistant's replies);
    # "all" = every token of each sequence, the prompts too (with kl_weight / tv_weight the target's own
    # distribution is the teacher there, with ce_weight the text's next token; docs/training.md)
    supervised_tokens: Literal["replies", "all"] = "replies"
    # the token a slot counts as right (the cross-entropy's label, the selector's gold candidate, the
    # accuracy and in-sample acceptance metrics): "data" = the sequence's next token; "target" = the
    # target's own greedy token there (the argmax of its distribution, over the loss vocabulary when
    # one is set), what greedy verification accepts, on prompts and text the target did not write too
    labels: Literal["data", "target"] = "data"

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss needs the target's distribution (its final-normed last hidden state)."""
        return self.kl_weight > 0 or self.tv_weight > 0 or self.labels == "target"

    @model_validator(mode="after")
    def _check_loss_terms(self) -> ObjectiveSection:
        if self.ce_weight == 0 and self.kl_weight == 0 and self.tv_weight == 0:
            raise ValueError(
                "objective.ce_weight, kl_weight and tv_weight are all 0: no loss to train; set at least one > 0"
            )
        if self.loss_gamma is not None and self.position_weighting != "gamma":
            raise ValueError(
                f"objective.loss_gamma={self.loss_gamma} is only read by position_weighting=gamma (it is "
                f"{self.position_weighting!r}); set loss_gamma=null or position_weighting=gamma"
            )
        return self


class OptimConfig(_Section):
    """AdamW, the LR schedule (dflash2.schedule) and clipping; keys of the `train` section."""

    max_steps: Int = Field(1000, ge=1)  # optimizer steps; the LR schedule spans them
    lr: Float = Field(6e-4, gt=0)
    weight_decay: Float = Field(0.0, ge=0)
    warmup_steps: Int = Field(0, ge=0)  # a warmup longer than the run is allowed: the LR ramps throughout
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: Float = Field(0.1, ge=0, le=1)
    max_grad_norm: Float = Field(1.0, gt=0)


class TrainConfig(OptimConfig):
    """The `train` section: the optimizer's keys (OptimConfig) and the loop's."""

    micro_batch_size: Int = Field(1, ge=1)
    grad_accum_steps: Int = Field(1, ge=1)
    # sequences per optimizer step; when set, it decides grad_accum_steps (global_batch_size /
    # (micro_batch_size x data-parallel ranks)), so a job can resume on another number of GPUs
    global_batch_size: Int | None = Field(None, ge=1)
    # end this launch early (with a checkpoint), e.g. a time-limited job
    stop_at_step: Int | None = Field(None, ge=1)
    log_every: Int = Field(10, ge=1)
    save_every: Int = Field(0, ge=0)  # 0: only the final checkpoint
    keep_last: Int = Field(3, ge=1)
    resume: str = "auto"  # auto | none | <checkpoint dir>
    export: StrictBool = True  # write <output_dir>/export (HF, contract-exact) at the end
    progress_bar: StrictBool = True

    @property
    def last_step(self) -> int:
        """The step this launch ends at: stop_at_step when it comes first, else max_steps."""
        return min(self.max_steps, self.stop_at_step or self.max_steps)


class RunConfig(_Section):
    output_dir: str = Field(min_length=1)
    backend: BackendName = "deepspeed"
    topology: Literal["colocated", "disaggregated"] = "colocated"
    capture_ranks: Int = Field(0, ge=0)
    seed: Int = 0
    precision: Precision = "fp32"
    ds_config: str = "ds_configs/zero3.json"
    model: ModelConfig
    data: DataConfig
    objective: ObjectiveSection = Field(default_factory=ObjectiveSection)
    train: TrainConfig = Field(default_factory=TrainConfig)

    @property
    def target_torch_dtype(self):
        return torch_dtype(self.model.target_dtype or self.precision)

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that train the draft: all of them, or those left after the capture ranks."""
        return world_size - self.capture_ranks if self.topology == "disaggregated" else world_size

    def with_batch_layout(self, data_parallel_size: int) -> RunConfig:
        """This config with grad_accum_steps derived from train.global_batch_size (when set) for
        `data_parallel_size` ranks training the draft; the value of grad_accum_steps is then ignored."""
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(
                f"the number of data-parallel ranks must be an int >= 1, got {data_parallel_size!r}"
            )
        t = self.train
        if t.global_batch_size is None:
            return self
        per_step = t.micro_batch_size * data_parallel_size
        if t.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size "
                f"{t.micro_batch_size} x {data_parallel_size} data-parallel ranks = {per_step}; choose a "
                f"multiple of {per_step}, or another micro_batch_size or number of ranks"
            )
        train = t.model_copy(update={"grad_accum_steps": t.global_batch_size // per_step})
        return self.model_copy(update={"train": train})

    @model_validator(mode="after")
    def _check_topology(self) -> RunConfig:
        if self.topology == "disaggregated" and self.capture_ranks < 1:
            raise ValueError("topology=disaggregated needs capture_ranks >= 1 (ranks that run the target)")
        if self.topology == "colocated" and self.capture_ranks:
            raise ValueError(
                f"capture_ranks={self.capture_ranks} is only meaningful with topology=disaggregated"
            )
        if self.topology == "disaggregated" and self.data.features_dir:
            raise ValueError(
                f"data.features_dir={self.data.features_dir!r} with topology=disaggregated: its capture ranks "
                "would run the target anyway and the features go unread; train from the features with "
                "topology=colocated (no capture ranks), or unset data.features_dir"
            )
        entry = BACKENDS[self.backend]
        if entry.one_process and self.topology == "disaggregated":
            raise ValueError(
                f"backend={self.backend} runs in one process; topology=disaggregated needs capture ranks "
                f"and trainer ranks: use {sharded_backends()}"
            )
        return self


def sharded_backends() -> str:
    """The backends a run of any number of processes may name, as a refusal names them:
    `backend=deepspeed or backend=fsdp`."""
    names = [name for name, entry in BACKENDS.items() if not entry.one_process]
    return " or ".join(f"backend={name}" for name in names)


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _parse_value(text: str) -> Any:
    """`key=value` values are YAML scalars: 3 -> int, 1e-3 -> float, null, true, [1, 2]."""
    if _FLOAT.match(text.strip()):  # YAML 1.1 reads 1e-3 (no dot) as a string
        return float(text)
    return yaml.safe_load(text)


def apply_override(tree: dict, dotted: str) -> None:
    if "=" not in dotted:
        raise ValueError(f"override {dotted!r} must look like key=value (e.g. train.max_steps=10)")
    key, text = dotted.split("=", 1)
    node = tree
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is not a section")
    value = _parse_value(text)
    if isinstance(value, dict) and _section_model(parts) is not None:
        section = ".".join(parts)
        keys = " ".join(f"{section}.{name}={_override_text(item)}" for name, item in value.items())
        raise ValueError(
            f"override {dotted!r} would replace the whole {section} section, its other keys back to "
            f"their defaults: set the keys one by one ({keys or f'{section}.<key>=<value>'})"
        )
    node[parts[-1]] = value


def _override_text(value: Any) -> str:
    """A value as the text of a key=value override that reads back as it: a string as it is."""
    return value if isinstance(value, str) else json.dumps(value)


def _section_model(parts: list[str]) -> type[BaseModel] | None:
    """The model of the run config's section the dotted key names (RunConfig for none; model, data,
    objective, train), or None when it names no section."""
    model: type[BaseModel] = RunConfig
    for name in parts:
        field = model.model_fields.get(name)
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read the YAML, apply overrides, validate. Every problem is reported with its dotted key."""
    if isinstance(overrides, str):
        raise ValueError(f"overrides: give a list of key=value strings, e.g. [{overrides!r}], not one string")
    if isinstance(overrides, Mapping):
        listed = [f"{key}={_override_text(value)}" for key, value in overrides.items()]
        raise ValueError(f"overrides: give a list of key=value strings, e.g. {listed!r}, not a dict")
    tree: dict = {}
    if path is not None:
        require_path(path, "config", "file", "the run config YAML")
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not valid YAML ({error})") from None
        if not isinstance(tree, dict):
            raise ValueError(f"{path}: the run config must be a YAML mapping")
    for item in overrides:
        apply_override(tree, item)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        lines = [
            f"  {'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg'].removeprefix('Value error, ')}{_suggestion(e)}"
            for e in err.errors()
        ]
        source = path or "overrides"
        raise ValueError(f"invalid run config ({source}):\n" + "\n".join(lines)) from None


def _suggestion(error: dict) -> str:
    """For an unknown key, the nearest valid key of its section: `; did you mean train.max_steps?`."""
    if error["type"] != "extra_forbidden":
        return ""
    *section, key = map(str, error["loc"])
    model = _section_model(section)
    if model is None:
        return ""
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    return f"; did you mean {'.'.join([*section, close[0]])}?" if close else ""


def require_path(path: str | Path, name: str, kind: str, what: str) -> Path:
    """`path` as a Path when it exists as a `kind` ("file" or "dir"); else a ValueError naming the
    option, the path (and the directory a relative path is taken from) and what it should be. Local
    paths are checked before anything loads: a missing model directory is never taken for a hub id."""
    found = Path(path)
    if found.is_file() if kind == "file" else found.is_dir():
        return found
    where = "" if found.is_absolute() else f" (relative to {os.getcwd()})"
    state = f"is not a {'file' if kind == 'file' else 'directory'}" if found.exists() else "does not exist"
    raise ValueError(f"{name}={str(path)!r}{where} {state}: give {what}")


# the files a model directory's tokenizer loads from (any one: a fast tokenizer's tokenizer.json, its
# tokenizer_config.json, or the vocabulary of a slow, tiktoken or Mistral one); glob patterns
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_MORE_TOKENIZER_FILES = (
    *("tokenizer.model.v*", "*.tiktoken", "tiktoken.model", "tekken.json"),
    *("spiece.model", "sentencepiece.bpe.model", "spm.model", "vocab.txt"),
)


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a model directory holds any tokenizer file."""
    patterns = TOKENIZER_FILES + _MORE_TOKENIZER_FILES
    return any(path.is_file() for pattern in patterns for path in Path(directory).glob(pattern))


def tokenizer_problems(directory: str | Path, name: str) -> list[str]:
    """A model directory without any tokenizer file (transformers would ask for sentencepiece)."""
    if has_tokenizer(directory):
        return []
    return [
        f"{name}={str(directory)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}, ...): copy the "
        "model's tokenizer files into that directory"
    ]


def load_tokenizer(directory: str | Path, name: str):
    """The tokenizer of a local model directory (`name`: the option that gave it, for the message)."""
    _raise_all(tokenizer_problems(directory, name))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def read_json_object(path: Path, name: str, fix: str = "fix the file") -> dict:
    """The JSON object in file `path`; a malformed file or another JSON value is a ValueError that
    names it as `name` (e.g. "ds_config='ds.json'") and ends with `fix`."""
    try:
        value = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{name} is not valid JSON ({error}); {fix}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object, found {type(value).__name__}; {fix}")
    return value


def json_object_arg(text: str) -> dict:
    """An argparse `type` for a JSON object option (--chat-template-kwargs): the dict, or argparse's
    usage error (exit 2) for bad JSON or another JSON value."""
    import argparse

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a JSON object, e.g. '{{\"enable_thinking\": false}}'"
        )
    return value


def check_model_paths(cfg: RunConfig) -> None:
    """model.target and model.draft_config, checked before anything loads (every problem at once)."""
    _raise_all(_model_path_problems(cfg))


def _model_path_problems(cfg: RunConfig) -> list[str]:
    model = "the local directory of a Hugging Face causal LM (config.json, safetensors, tokenizer)"
    problems = _problem(require_path, cfg.model.target, "model.target", "dir", model)
    if not problems and not (Path(cfg.model.target) / "config.json").is_file():
        problems.append(f"model.target={cfg.model.target!r} has no config.json: give {model}")
    if not problems:
        problems += tokenizer_problems(cfg.model.target, "model.target")
    return problems + _problem(
        require_path, cfg.model.draft_config, "model.draft_config", "file", "the draft's config.json"
    )


def check_run_paths(cfg: RunConfig) -> None:
    """Every local path a run reads, checked before anything loads (run from the directory the
    config's relative paths start from, usually the repository root); every problem at once."""
    problems = _model_path_problems(cfg) + _problem(check_data_paths, cfg)
    for key, what in BACKENDS[cfg.backend].files:
        problems += _problem(require_path, getattr(cfg, key), key, "file", what)
    if cfg.train.resume not in ("auto", "none"):
        problems += _problem(
            require_path, cfg.train.resume, "train.resume", "dir", "a checkpoint directory, auto or none"
        )
    problems += _problem(check_output_dir, cfg)
    _raise_all(problems)


def check_output_dir(cfg: RunConfig) -> None:
    """output_dir is a directory, or does not exist yet, and not inside a directory the run reads."""
    if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
        raise ValueError(f"output_dir={cfg.output_dir!r} is a file: give a directory for the run")
    output_dir = Path(cfg.output_dir).resolve()
    for key, read in (
        ("model.target", cfg.model.target),
        ("data.train", cfg.data.train),
        ("data.features_dir", cfg.data.features_dir),
    ):
        if read and Path(read).is_dir() and output_dir.is_relative_to(Path(read).resolve()):
            raise ValueError(
                f"output_dir={cfg.output_dir!r} is inside {key}={read!r}: the run would write its "
                "checkpoints, logs and export among the files it reads; give an output_dir outside it"
            )


def _problem(check: Any, *args: Any) -> list[str]:
    """[the message of the ValueError `check(*args)` raises], or [] when it passes."""
    try:
        check(*args)
    except ValueError as error:
        return [str(error)]
    return []


def _raise_all(problems: list[str]) -> None:
    if problems:
        raise ValueError("\n".join(problems))


def check_data_paths(cfg: RunConfig) -> None:
    """data.train and data.features_dir, checked before anything loads."""
    train = Path(cfg.data.train)
    if train.is_dir() and not (train / "dataset_info.json").is_file():
        raise ValueError(
            f"data.train={cfg.data.train!r} is a directory but not a prepared dataset (no "
            "dataset_info.json): give a training_jsonl file or a directory made by data_prep/prepare.py"
        )
    if not train.is_dir():
        require_path(train, "data.train", "file", "a training_jsonl file or a prepared dataset directory")
        if train.stat().st_size == 0:
            raise ValueError(f"data.train={cfg.data.train!r} is empty: give a file with conversations")
    if cfg.data.features_dir:
        require_path(cfg.data.features_dir, "data.features_dir", "dir", "a directory made by capture.py")


def save_run_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(cfg.model_dump(), f, sort_keys=False)
