"""dtlab's own process group on this rank: a gloo group beside the job's, for the stepping
agreements, checkpoint collectives and pipeline moves (CPU tensors, NCCL jobs too).

Made by a collective (every rank at once: when the stepping channel connects), remade
after a run that ended in an error; a replaced group is left, not destroyed (its last
collective may be pending forever), and its name is kept so that hang reports leave it out.
"""

from __future__ import annotations

_control: dict = {}  # {"world": the default group it was made for, "group": gloo group}


def _group_name(group) -> str:
    from torch.distributed.distributed_c10d import _world

    return _world.pg_names.get(group, "")


def retired_groups() -> set[str]:
    """Names of control groups replaced since (their last agreement may be pending
    forever: hang reports leave them out)."""
    return set(_control.get("retired", ()))


def control_group(rebuild: bool = False):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if _control.get("world") is not dist.group.WORLD:  # a new world: old groups went with it
        _control.clear()
    if rebuild or "group" not in _control:
        if "group" in _control:  # left, not destroyed: its last collective may hang forever
            _control.setdefault("retired", set()).add(_group_name(_control["group"]))
        _control["world"] = dist.group.WORLD
        # CPU tensors, NCCL jobs too; named so that hang reports can say whose it is
        _control["group"] = dist.new_group(backend="gloo", group_desc="dtlab_control")
    return _control["group"]
