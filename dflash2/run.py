"""The top of a run: start the process group, pick the topology, hand the pieces to the loop.

    colocated       every rank holds a shard of the target and of the draft; features are captured
                    online inside the step, or read from data.features_dir (offline capture)
    disaggregated   ranks [0, N) (N = capture_ranks) hold the frozen target, sharded among themselves,
                    and send features point-to-point (dflash2.capture.transfer); ranks [N, world)
                    train the draft, sharded among themselves, with only the target's embedding and
                    LM head (never the whole target)

Entry points: `run` (launch/train.py), `run_offline_capture` (data_prep/capture.py) and
`regenerate_and_capture` (data_prep/regenerate.py --capture-config).

Faults (dflash2.faults): a stop signal ends every rank after the same step with a checkpoint, in
either topology (capture ranks stop when the trainers have); every process group waits at most
DFLASH2_DIST_TIMEOUT_S seconds for a peer, so a dead or frozen rank stops the job, never hangs it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash2.capture.features import capture_samples
from dflash2.capture.fused import StagedFeatures, finish_fused_capture, regeneration_stamp
from dflash2.capture.offline import capture_to_dir, feature_identity
from dflash2.capture.transfer import FeatureReceiver, FeatureSender, capture_schedule
from dflash2.checkpoint import STATE_ONLY, check_resume
from dflash2.config import RunConfig, save_run_config
from dflash2.data.loader import step_batches
from dflash2.data.regenerate import LocalTargetGenerator, regenerate_file
from dflash2.distributed import (
    Backend,
    backend_class,
    distributed_run,
    init_distributed,
)
from dflash2.faults import (
    REQUEUE_WAIT_S,
    collective_section,
    enter_end,
    enter_steps,
    in_steps,
    lock_run_dir,
    release_run_dir,
    startup_timeout,
    stop_request,
)
from dflash2.hardware import warn_if_slow_bf16
from dflash2.identity import data_identity
from dflash2.run_plan import RunPlan, resolve_run
from dflash2.train import build_setup, fit

# Keys in the job's rendezvous store (disaggregated): a rank was asked to stop / the trainers have
# taken their first step (the capture ranks wait the steps' timeout from then on) / they are done.
STOP_KEY = "dflash2/stop_requested"
TRAINERS_STEPPING_KEY = "dflash2/trainers_stepping"
TRAINERS_DONE_KEY = "dflash2/trainers_done"
RUN_DIR_KEY = "dflash2/run_dir_lock"  # whether rank 0 locked the output directory ("": it did)


_launch_id = "0"  # this launch's, agreed by every rank (agree_on_launch)


def agree_on_launch() -> None:
    """Every rank takes rank 0's new id for this launch, which the store's keys carry: the store
    outlives a torchrun restart (--max-restarts), and TORCHELASTIC_RESTART_COUNT is counted per node
    (a node whose workers did not fail restarts without counting), so neither tells the ranks of a
    restarted job apart from the failed attempt's keys (a stop asked for, trainers done)."""
    global _launch_id
    ids = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    with collective_section("agreeing on the launch's id"):
        dist.broadcast_object_list(ids, src=0)
    _launch_id = ids[0]


def job_key(name: str) -> str:
    """A key of this launch in the job's rendezvous store (agree_on_launch)."""
    return f"{name}/{_launch_id}"


def run(cfg: RunConfig) -> dict[str, float]:
    """Train with the topology the config names (every rank calls it); returns the last step's metrics
    ({} on capture ranks). `stop_request.stopped` tells whether it ended early on a stop signal
    (launch/train.py installs the stop signals' handlers)."""
    with distributed_run():
        return run_disaggregated(cfg) if cfg.topology == "disaggregated" else run_colocated(cfg)


@contextmanager
def run_dir_held(cfg: RunConfig) -> Iterator[None]:
    """The job's hold on its output directory (dflash2.faults.lock_run_dir), by global rank 0 for the
    whole run. The other ranks learn through the job's store whether rank 0 took it, and raise the
    same error when it did not (rank 0 prints it: dflash2.errors)."""
    agree_on_launch()
    store = dist.distributed_c10d._get_default_store()  # the job's rendezvous store (no public getter)
    key = job_key(RUN_DIR_KEY)
    fd = None
    created = not Path(cfg.output_dir).exists()
    if dist.get_rank() == 0:
        outcome = "rank 0 could not lock the output_dir (its log says why)"
        try:
            fd = lock_run_dir(cfg.output_dir)
            outcome = ""
        except ValueError as error:
            outcome = str(error)
            raise
        finally:
            store.set(key, outcome)
    else:
        store.wait([key], timedelta(seconds=REQUEUE_WAIT_S) + startup_timeout())
        if outcome := store.get(key).decode():
            raise ValueError(outcome)
    try:
        yield
    finally:
        if fd is not None:
            release_run_dir(fd, cfg.output_dir, created)


def run_backend(
    cfg: RunConfig, group: dist.ProcessGroup | None = None, scope: object | None = None
) -> Backend:
    """The run's backend; with `group`, target and draft are both sharded over that group only
    (`scope`: what the backend's role_scope yielded for it)."""
    return backend_class(cfg.backend).from_run_config(cfg, group=group, scope=scope)


def save_resolved_config(cfg: RunConfig, backend: Backend) -> None:
    """The resolved run config, as <output_dir>/config.yaml (by the trainers' rank 0)."""
    if backend.is_main:
        save_run_config(cfg, Path(cfg.output_dir) / "config.yaml")


# ------------------------------------------------------------------ colocated


def run_colocated(cfg: RunConfig) -> dict[str, float]:
    init_distributed(cfg.backend)
    with run_dir_held(cfg):  # first: the resume point is read once no other run writes there
        plan = resolve_run(cfg, cfg.data_parallel_size(dist.get_world_size()))
        backend = run_backend(plan.config)
        with collective_section("setup (loading the target and the draft)"):
            setup = build_setup(plan, backend)
        save_resolved_config(plan.config, backend)  # only once the resume has been accepted
        return fit(setup)


def run_offline_capture(cfg: RunConfig, out_dir: str | Path, *, batch_size: int, shard_bytes: int) -> Path:
    """Capture the features of run `cfg` into `out_dir` on every rank (data_prep/capture.py)."""
    with distributed_run():
        init_distributed(cfg.backend)
        plan = resolve_run(cfg)
        backend = run_backend(cfg)
        warn_if_slow_bf16(backend.device, cfg.target_torch_dtype, is_main=backend.is_main)
        dataset = plan.dataset(backend.is_main)
        target = backend.load_target(cfg.model.target, cfg.target_torch_dtype)
        return capture_to_dir(
            cfg,
            backend,
            target,
            dataset,
            plan.layer_ids,
            Path(out_dir),
            hidden_size=plan.target_hidden_size,
            pad_token_id=plan.pad_token_id,
            batch_size=batch_size,
            shard_bytes=shard_bytes,
            identity=plan.identity,
        )


def regenerate_and_capture(
    cfg: RunConfig,
    input_path: str | Path,
    model: torch.nn.Module,
    features_out: str | Path,
    *,
    max_new_tokens: int,
    batch_size: int,
    on_error: str,
    shard_bytes: int,
) -> dict[str, int]:
    """Regenerate `input_path` into data.train of run `cfg` with the local target `model` (loaded in
    the run's target dtype), keeping the run's features on the way, then write the features
    directory `features_out` for it (dflash2.capture.fused). Returns regenerate_file's counts and
    finish_fused_capture's."""
    plan = resolve_run(cfg, check_data=False)  # data.train: the file written here
    stamp = regeneration_stamp(cfg, plan.layer_ids, plan.identity)
    template_kwargs = dict(cfg.data.chat_template_kwargs)
    generator = LocalTargetGenerator(model, plan.tokenizer, max_new_tokens, template_kwargs, plan.layer_ids)
    sink = StagedFeatures(features_out, stamp, plan.target_hidden_size)
    counts = regenerate_file(
        input_path, cfg.data.train, generator, batch_size=batch_size, on_error=on_error, feature_sink=sink
    )
    identity = replace(plan.identity, dataset=data_identity(cfg.data.train))  # the file as it now is
    dataset = plan.dataset(is_main=True)
    finished = finish_fused_capture(
        features_out,
        dataset,
        feature_identity(cfg, plan.layer_ids, identity),
        stamp,
        model,
        layer_ids=plan.layer_ids,
        pad_token_id=plan.pad_token_id,
        batch_size=batch_size,
        shard_bytes=shard_bytes,
    )
    print(
        f"[dflash2] features of {len(dataset)} samples in {features_out}: {finished['num_staged']} kept from "
        f"the regeneration, {finished['num_captured']} captured by a forward",
        flush=True,
    )
    return {**counts, **finished}


# ------------------------------------------------------------------ disaggregated


def check_capture_ranks(capture_ranks: int, world_size: int) -> None:
    """At least one capture rank and one trainer rank (the run config has checked capture_ranks >= 1)."""
    if not 1 <= capture_ranks < world_size:
        raise ValueError(
            f"capture_ranks={capture_ranks} must be in [1, {world_size - 1}] for {world_size} processes: "
            "at least one capture rank and one trainer rank (launch more processes or lower capture_ranks)"
        )


def run_disaggregated(cfg: RunConfig) -> dict[str, float]:
    """Every rank calls it; returns the trainers' last metrics ({} on capture ranks)."""
    init_distributed(cfg.backend)
    check_capture_ranks(cfg.capture_ranks, dist.get_world_size())
    with run_dir_held(cfg):  # first: the resume point is read once no other run writes there
        plan = resolve_run(cfg, cfg.data_parallel_size(dist.get_world_size()))
        if plan.resume_from is not None:  # on every rank: capture ranks would load the target first
            check_resume(plan.resume_from, plan.contract, STATE_ONLY)  # trainers: their RNG in build_setup
        num_capture, world_size, timeout = cfg.capture_ranks, dist.get_world_size(), startup_timeout()
        # every rank creates every group, in the same order
        capture_group = dist.new_group(list(range(num_capture)), timeout=timeout)
        trainer_group = dist.new_group(list(range(num_capture, world_size)), timeout=timeout)
        transfer_group = dist.new_group(list(range(world_size)), timeout=timeout)
        t0 = time.perf_counter()
        is_capture = dist.get_rank() < num_capture
        with backend_class(cfg.backend).role_scope(capture_group if is_capture else trainer_group) as scope:
            if is_capture:
                run_capture_rank(plan, capture_group, transfer_group, scope)
                summary = {}
            else:
                summary = run_trainer_rank(plan, trainer_group, transfer_group, scope)
        with collective_section("the end of the run"):
            dist.barrier(group=transfer_group)  # the job ends together (capture ranks may host the store)
        if dist.get_rank() == 0:
            print(f"[dflash2] disaggregated run done in {time.perf_counter() - t0:.1f} s", flush=True)
        return summary


@torch.no_grad()
def run_capture_rank(
    plan: RunPlan,
    capture_group: dist.ProcessGroup,
    transfer_group: dist.ProcessGroup,
    scope: object | None = None,
) -> None:
    """Walk the trainers' own data order from their checkpointed position, one target forward per
    micro-batch and trainer served, and send the features."""
    cfg, start = plan.config, plan.start
    num_capture, num_trainers, train = cfg.capture_ranks, plan.data_parallel_size, cfg.train
    backend = run_backend(cfg, capture_group, scope)
    dataset = plan.dataset(is_main=False)
    target = backend.load_target(cfg.model.target, cfg.target_torch_dtype)
    local, total = backend.parameter_numel(target)
    print(f"[dflash2] capture rank {backend.rank}: holds {local}/{total} target parameters", flush=True)
    rounds = capture_schedule(num_capture, num_trainers)
    mine = [t for row in rounds if (t := row[backend.rank]) is not None]
    order = (len(dataset), train.micro_batch_size, train.grad_accum_steps, cfg.seed)
    position = {"epoch": start.epoch, "start_step": start.step_in_epoch}
    streams = {t: step_batches(*order, t, num_trainers, **position) for t in mine}
    sender = FeatureSender(
        transfer_group, train.micro_batch_size, backend.device, served=[num_capture + t for t in mine]
    )
    store = dist.distributed_c10d._get_default_store()  # the job's rendezvous store (no public getter)
    threading.Thread(target=_relay_stop_request, args=(store,), name="stop-relay", daemon=True).start()

    def send(number: int, micro: dict[int, list[int]]) -> bool:
        """Capture micro-batch `number` for every trainer served; False: the trainers have stopped."""
        if not in_steps() and store.check([job_key(TRAINERS_STEPPING_KEY)]):
            enter_steps(steps_per_wait=2)  # a send waits for a trainer's step, then maybe a checkpoint write
        with collective_section(f"capture of micro-batch {number}"):
            trainers_done = store.check([job_key(TRAINERS_DONE_KEY)])
            if stop_request.agreed(backend, trainers_done):  # every capture rank agrees
                stop_request.stopped = True
                return False
            for row in rounds:
                trainer = row[backend.rank]
                indices = micro[trainer] if trainer is not None else []
                last_hidden = cfg.objective.needs_teacher
                features = capture_samples(
                    backend, target, dataset, indices, plan.layer_ids, plan.pad_token_id, last_hidden
                )
                if trainer is not None:
                    sender.send(num_capture + trainer, indices, features)
        return True

    # what fit() consumes from the resumed step on, unless the trainers stop earlier
    for step in range(train.last_step - start.step):
        steps = {t: next(streams[t]) for t in mine}
        accum = train.grad_accum_steps
        if not all(
            send(step * accum + j + 1, {t: s.micro[j] for t, s in steps.items()}) for j in range(accum)
        ):
            break
    # The trainers' last steps, their final checkpoint and export come before they take the end marker:
    # wait for all of it as long as a start-up may take, at least, not a step's timeout.
    enter_end()
    with collective_section("delivering the last features"):
        sender.close()


def _relay_stop_request(store: dist.Store) -> None:
    """Tell the trainers, who decide when to stop, that this capture rank got a stop signal: as soon
    as it comes, even while this rank waits for them (it may have sent everything long before)."""
    while stop_request.signal_name is None:
        time.sleep(0.1)
    store.set(job_key(STOP_KEY), stop_request.signal_name)


def run_trainer_rank(
    plan: RunPlan,
    trainer_group: dist.ProcessGroup,
    transfer_group: dist.ProcessGroup,
    scope: object | None = None,
) -> dict[str, float]:
    cfg = plan.config
    backend = run_backend(cfg, trainer_group, scope)
    source = backend.rank % cfg.capture_ranks  # trainer t is served by capture rank t % N
    receiver = FeatureReceiver(source, transfer_group, cfg.train.micro_batch_size, backend.device)
    with collective_section("setup (loading the draft and the target's head)"):
        setup = build_setup(plan, backend, features=receiver)
    save_resolved_config(cfg, backend)  # only once the resume has been accepted
    store = dist.distributed_c10d._get_default_store()  # the job's rendezvous store (no public getter)
    told = False

    def stop_vote() -> bool:
        """This trainer's vote on stopping, asked before each step; once a step is done, trainer 0
        tells the capture ranks, which then wait for the trainers the steps' timeout too."""
        nonlocal told
        if backend.is_main and in_steps() and not told:
            store.set(job_key(TRAINERS_STEPPING_KEY), "1")
            told = True
        return stop_request.signal_name is not None or store.check([job_key(STOP_KEY)])

    summary = fit(setup, stop_vote=stop_vote)
    if backend.is_main:
        store.set(job_key(TRAINERS_DONE_KEY), "1")  # the capture ranks stop sending
    with collective_section("receiving the features sent past the last step"):
        receiver.drain()  # up to the capture rank's end marker
    receiver.thread.join()
    return summary


if __name__ == "__main__":  # python -m dflash2.run: a newcomer's guess at the training command
    from dflash2.errors import not_a_command

    not_a_command("dflash2.run")
