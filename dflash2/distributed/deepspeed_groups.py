"""DeepSpeed ZeRO-3 confined to a sub-group of the world: the roles of the disaggregated topology.

DeepSpeed takes a data-parallel group through its model-parallel-unit argument (`mpu`), but in
version 0.19.8 three things still address the whole world:
  - zero.Init partitions over the world group unless given `data_parallel_group` (and checks the
    config's batch sizes against the world size unless given `mpu`), and transformers opens
    zero.Init itself, with neither, when it builds the target (`from_pretrained`);
  - building the stage-3 optimizer calls `deepspeed.comm.barrier()` without a group
    (`DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer` and
    `_create_fp16_partitions_with_defragmentation`);
  - the parameter-trace check after the first forward or backward
    (`PartitionedParameterCoordinator.reset_step` -> `zero.utils.assert_ints_same_as_other_ranks`)
    broadcasts from global rank 0 to the world (`assert_lst_len_same_as_other_ranks`,
    `get_lst_from_rank0`).
When capture ranks and trainer ranks run different code, each of these meets the other role's
collectives or waits forever. `confine_deepspeed(group)` redirects exactly these to the role's group
while the role runs, and only for the DeepSpeed version it was checked against.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import deepspeed
import deepspeed.comm
import deepspeed.runtime.zero.utils as zero_utils
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

VERIFIED_VERSION = "0.19.8"  # the version whose call sites the patches below were checked against


class GroupMpu:
    """DeepSpeed's model-parallel unit for a data-parallel `group` without model parallelism."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        # DeepSpeed all-reduces gradient norms over the model-parallel group: one of this rank alone
        self.model_parallel_group = dist.new_group([dist.get_rank()], use_local_synchronization=True)

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def _int_tensor(values) -> torch.Tensor:
    device = torch.device(get_accelerator().device_name(os.environ.get("LOCAL_RANK", 0)))
    return torch.tensor(values, dtype=int, device=device, requires_grad=False)


def _trace_checks_on(group: dist.ProcessGroup):
    """zero.utils' two helpers of the trace check, broadcasting from the group's first rank within it."""
    src = dist.get_global_rank(group, 0)
    is_first = dist.get_rank(group) == 0

    def assert_lst_len_same_as_other_ranks(lst: list[int]) -> None:
        first_len = _int_tensor(len(lst) if is_first else -1)
        dist.broadcast(first_len, src=src, group=group)
        if first_len.item() != len(lst):
            raise RuntimeError(
                f"Detected a disagreement on list length between rank {src} and rank {dist.get_rank()}: "
                f"{first_len.item()} vs {len(lst)}"
            )

    def get_lst_from_rank0(lst: list[int]) -> list[int]:
        values = _int_tensor(lst if is_first else [-1] * len(lst))
        dist.broadcast(values, src=src, group=group)
        return [int(v) for v in values.cpu()]

    return assert_lst_len_same_as_other_ranks, get_lst_from_rank0


@contextmanager
def confine_deepspeed(group: dist.ProcessGroup) -> Iterator[GroupMpu]:
    """While inside, DeepSpeed's world-wide collectives listed above use `group`; the `as` value is
    the group's model-parallel unit, the `mpu` to pass to `deepspeed.initialize` (DeepSpeedBackend's
    `mpu`). Every rank of `group` enters it, no other rank does."""
    if deepspeed.__version__ != VERIFIED_VERSION:
        raise ValueError(
            f"DeepSpeed {deepspeed.__version__} is installed; topology=disaggregated with backend=deepspeed "
            f"is verified on {VERIFIED_VERSION} only (its world-wide collectives are redirected call by call): "
            f"install deepspeed=={VERIFIED_VERSION} or use backend=fsdp"
        )
    assert not hasattr(deepspeed.zero.Init, "role_mpu"), "confine_deepspeed does not nest"
    role_group = group
    originals = (
        deepspeed.comm.barrier,
        zero_utils.assert_lst_len_same_as_other_ranks,
        zero_utils.get_lst_from_rank0,
        deepspeed.zero.Init,
    )
    barrier, _, _, zero_init = originals

    def barrier_on_role(group=None, async_op=False, device_ids=None):
        return barrier(group=role_group if group is None else group, async_op=async_op, device_ids=device_ids)

    def zero_init_on_role(*args, data_parallel_group=None, mpu=None, **kwargs):
        # the group partitions the parameters; the mpu sizes the config's batch checks to the group
        group_, mpu_ = data_parallel_group or role_group, mpu or role_mpu
        return zero_init(*args, data_parallel_group=group_, mpu=mpu_, **kwargs)

    deepspeed.comm.barrier = barrier_on_role
    zero_utils.assert_lst_len_same_as_other_ranks, zero_utils.get_lst_from_rank0 = _trace_checks_on(
        role_group
    )
    deepspeed.zero.Init = zero_init_on_role
    role_mpu = GroupMpu(role_group)
    zero_init_on_role.role_mpu = role_mpu  # marks the patch: nesting is refused above
    try:
        yield role_mpu
    finally:
        (
            deepspeed.comm.barrier,
            zero_utils.assert_lst_len_same_as_other_ranks,
            zero_utils.get_lst_from_rank0,
            deepspeed.zero.Init,
        ) = originals
