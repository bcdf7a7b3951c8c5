"""The run plan: every fact of a run that its roles share, resolved once after the process group starts.

The target's config, the tokenizer and its pad id, the draft config (normalised and validated against
both) and its `DraftSpec`, the target layer ids, the identities of the inputs, the resume contract,
the objective's settings, and where the run resumes (checkpoint and train state). `resolve_run`
only reads files: it loads no model, starts no collective and draws no random number, so every role
(colocated ranks, capture ranks, trainer ranks, the offline capture, the benchmarks) calls it first
and reads the same facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import datasets
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from dflash2.checkpoint import TrainState, read_train_state, resume_point, run_contract
from dflash2.config import RunConfig, check_data_paths, check_model_paths, check_output_dir
from dflash2.data.loader import pad_token_id_of
from dflash2.data.prepare import build_dataset, check_token_ids_in_vocab
from dflash2.distributed.registry import check_backend_config
from dflash2.identity import RunIdentity
from dflash2.models.config import check_draft_config, load_config_dict, text_config_of, to_qwen3_config
from dflash2.models.spec import DraftSpec
from dflash2.objective import ObjectiveConfig


@dataclass(frozen=True)
class RunPlan:
    config: RunConfig  # resolved: with_batch_layout(data_parallel_size) applied
    data_parallel_size: int  # ranks that train the draft
    target_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    pad_token_id: int
    draft_source: dict  # the draft config, normalised, validated once against target and tokenizer
    spec: DraftSpec  # what the draft built from draft_source holds
    identity: RunIdentity
    contract: dict  # what a checkpoint of this run is only valid for
    objective: ObjectiveConfig
    resume_from: Path | None  # the checkpoint this launch resumes from, None: a fresh start
    start: TrainState  # its train state (a fresh one for None)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.spec.target_layer_ids)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.output_dir)

    @property
    def global_batch_size(self) -> int:
        return self.contract["global_batch_size"]

    @property
    def target_hidden_size(self) -> int:
        return self.target_config.get_text_config().hidden_size

    def dataset(self, is_main: bool) -> datasets.Dataset:
        """The run's dataset (data.train, prepared on the fly or loaded), its token ids checked against
        the target's vocabulary. `is_main`: the rank that reports what was kept and dropped."""
        dataset = build_dataset(self.config.data, self.tokenizer, is_main)
        check_token_ids_in_vocab(dataset, self.target_config.get_text_config().vocab_size)
        return dataset


def global_batch_size(cfg: RunConfig, data_parallel_size: int) -> int:
    """Samples of one optimizer step over all data-parallel ranks."""
    return cfg.train.micro_batch_size * cfg.train.grad_accum_steps * data_parallel_size


def build_contract(
    cfg: RunConfig, draft_config: dict, data_parallel_size: int, identity: RunIdentity | None = None
) -> dict:
    """What a checkpoint is only valid for (training.md section 6); resume compares it field by field:
    the draft's spec fields and the run's own (`checkpoint.RUN_CONTRACT_KEYS`). The batch enters as
    the global batch of one optimizer step: how it is split into ranks, micro-batches and accumulation
    steps may change between launches (the data order depends only on it), so a run can resume on
    another number of ranks. `draft_config`: as given (not validated)."""
    identity = identity or RunIdentity.of(cfg.model.target, cfg.data.train)
    draft = DraftSpec.from_config(draft_config).contract_fields()
    return {**draft, **run_contract(cfg, identity, global_batch_size(cfg, data_parallel_size))}


def position_limit(config: PretrainedConfig) -> tuple[int | None, str]:
    """The positions a model is made for, and how that number was read: max_position_embeddings, or
    its RoPE scaling's factor times the original length it names where that is more (a YaRN config
    that keeps the original max_position_embeddings); with RoPE parameters per layer type (a dict
    of them, as models mixing sliding and full attention have), the most any type's scaling reaches."""
    limit = getattr(config, "max_position_embeddings", None)
    limit = limit if isinstance(limit, int) else None
    how = f"max_position_embeddings={limit}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return limit, how
    per_type = rope and all(isinstance(value, dict) for value in rope.values())
    for layer_type, params in rope.items() if per_type else [(None, rope)]:
        if params.get("rope_type", params.get("type")) in (None, "default"):
            continue
        # factor x original where the config names the original length (yarn, longrope, llama3); a
        # scaling without it (Gemma 3's linear) has max_position_embeddings at the scaled length
        factor, original = params.get("factor"), params.get("original_max_position_embeddings")
        if (
            isinstance(factor, (int, float))
            and isinstance(original, int)
            and int(original * factor) > (limit or 0)
        ):
            kind = params.get("rope_type", params.get("type"))
            where = f" ({layer_type} layers)" if layer_type is not None else ""
            limit, how = (
                int(original * factor),
                f"{kind} RoPE scaling{where}, factor {factor:g} over {original} positions",
            )
    return limit, how


def check_positions(cfg: RunConfig, target_config: PretrainedConfig, draft_config: PretrainedConfig) -> None:
    """data.max_length within the positions the target and the draft were made for: past the target's
    limit its features are of positions it never saw; past the draft's it would train at positions
    its config (and a server's RoPE table) does not cover."""
    for name, config, source in (
        ("the target", text_config_of(target_config), f"{cfg.model.target}/config.json"),
        ("the draft", draft_config, cfg.model.draft_config),
    ):
        limit, how = position_limit(config)
        if limit is not None and cfg.data.max_length > limit:
            raise ValueError(
                f"data.max_length={cfg.data.max_length} is above the {limit} positions {name} is made for "
                f"({source}: {how}); set data.max_length <= {limit}"
            )


def resolve_run(cfg: RunConfig, data_parallel_size: int = 1, *, check_data: bool = True) -> RunPlan:
    """The plan of run `cfg` (a RunConfig: `load_run_config(path, overrides)`) with `data_parallel_size`
    ranks training the draft (file reads only; the paths it reads are checked first). `check_data`:
    False where data.train is the file the caller is about to write (regeneration)."""
    from transformers import AutoConfig, AutoTokenizer

    if not isinstance(cfg, RunConfig):
        raise ValueError(
            f"resolve_run takes a RunConfig, not {type(cfg).__name__}: pass load_run_config(path)"
        )
    check_model_paths(cfg)
    check_output_dir(cfg)
    check_backend_config(cfg)
    if check_data:
        check_data_paths(cfg)
    cfg = cfg.with_batch_layout(data_parallel_size)
    target_config = AutoConfig.from_pretrained(cfg.model.target)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.target)
    source = check_draft_config(
        load_config_dict(cfg.model.draft_config),
        target_config=target_config,
        tokenizer=tokenizer,
        source=cfg.model.draft_config,
    )
    draft_config = to_qwen3_config(source)
    check_positions(cfg, target_config, draft_config)
    spec = DraftSpec.from_config(draft_config)
    identity = RunIdentity.of(cfg.model.target, cfg.data.train)
    resume_from = resume_point(cfg.train.resume, Path(cfg.output_dir))
    objective = ObjectiveConfig.for_spec(spec, **cfg.objective.model_dump())
    if spec.selector is None and objective.top_k > draft_config.vocab_size:
        raise ValueError(
            f"objective.coverage_top_k={objective.top_k} is above the target's vocabulary "
            f"({draft_config.vocab_size}); set objective.coverage_top_k <= {draft_config.vocab_size}"
        )
    return RunPlan(
        config=cfg,
        data_parallel_size=data_parallel_size,
        target_config=target_config,
        tokenizer=tokenizer,
        pad_token_id=pad_token_id_of(tokenizer),
        draft_source=source,
        spec=spec,
        identity=identity,
        contract=build_contract(cfg, draft_config.to_dict(), data_parallel_size, identity),
        objective=objective,
        resume_from=resume_from,
        start=read_train_state(resume_from),
    )
