"""dtlab's own process group on this rank: a gloo group beside the job's, for the stepping
agreements, checkpoint collectives and pipeline moves (CPU tensors, NCCL jobs too).

Made by a collective (every rank at once: when the stepping channel connects), remade
after a run that ended in an error; a replaced group is left, not destroyed (its last
collective may be pending forever), and its name is kept so that hang reports leave it out.
"""

from __future__ import annotations

from dtlab.agent.state import RANK


def _group_name(group) -> str:
    from torch.distributed.distributed_c10d import _world

    return _world.pg_names.get(group, "")


def retired_groups() -> set[str]:
    """Names of control groups replaced since (their last agreement may be pending
    forever: hang reports leave them out)."""
    return set(RANK.retired_groups)


def control_group(rebuild: bool = False):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if RANK.control_world is not dist.group.WORLD:  # a new world: old groups went with it
        RANK.clear_control_groups()
    if rebuild or RANK.control_group is None:
        if RANK.control_group is not None:  # left, not destroyed: its last collective may hang
            RANK.retired_groups.add(_group_name(RANK.control_group))
        RANK.control_world = dist.group.WORLD
        # CPU tensors, NCCL jobs too; named so that hang reports can say whose it is
        RANK.control_group = dist.new_group(backend="gloo", group_desc="dtlab_control")
    return RANK.control_group
