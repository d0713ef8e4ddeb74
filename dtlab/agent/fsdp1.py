"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) seen through the model's
own parameter names.

FSDP1 flattens the parameters of each wrapped unit into one ``FlatParameter`` and keeps
this rank's shard of it (``_fsdp_wrapped_module._flat_param``; with
``use_orig_params=True`` the original parameters stay registered, as 1-D views of their
part of the shard, empty on a rank that holds none of one). Neither is what a user reads
in a record, nor can ranks compare them: they hold different shards. A
:class:`FlatView` maps back through the FlatParameter's metadata (``_fqns``, ``_shapes``,
``_numels_with_padding``, ``_is_padding_mask``, ``_shard_param_infos``) so that a job
records one entry per original parameter, under its own name (``blocks.0.attn.weight``)
and in the model's order, each whole: every unit's shard is all-gathered once (on the
unit's own process group), split into its parameters, summarised, and dropped before the
next unit, as FSDP's own forward holds one unit whole at a time. So gradient and parameter
fingerprints agree across ranks as they do under DDP and FSDP2.

Checkpoints keep each unit's flat shard as FSDP laid it out (:func:`flat_state`), per
rank: they load on the same number of ranks, wrapped the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PREFIX = "_fsdp_wrapped_module."


def is_fsdp1(model: torch.nn.Module) -> bool:
    """Whether ``model`` is, or holds, an FSDP1 ``FullyShardedDataParallel`` module."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def clean(name: str) -> str:
    """A name without FSDP1's wrapper segments: the name in the unwrapped model."""
    return name.replace(PREFIX, "").removesuffix("._fsdp_wrapped_module")


@dataclass(frozen=True)
class Unit:
    """One FSDP1 module's flat parameter: ``prefix`` (its place in the model, cleaned),
    the FlatParamHandle, and the process group its shards are spread over."""

    prefix: str
    handle: object
    group: object

    @property
    def flat(self):
        return self.handle.flat_param  # type: ignore[attr-defined]

    @property
    def sharded(self) -> bool:
        return bool(self.handle.uses_sharded_strategy)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Entry:
    """One original parameter: inside ``unit`` at ``index``, or (``unit`` None) a plain
    parameter FSDP left alone (an ignored module's), replicated as under DDP."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    unit: Unit | None = None
    index: int = 0
    plain: torch.Tensor | None = None


class FlatView:
    """The original parameters of an FSDP1 model (see the module docstring); ``names``
    and ``entries`` in the model's own order. Every method that gathers is a collective:
    every rank calls it at the same point."""

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        order = {id(m): i for i, m in enumerate(model.modules())}
        self.units: list[Unit] = []
        found: list[tuple[tuple[int, int], Entry]] = []
        in_flat: set[int] = set()
        for name, module in model.named_modules():
            handle = getattr(module, "_handle", None) if isinstance(module, FSDP) else None
            if handle is None:
                continue
            prefix = clean(name)
            unit = Unit(prefix + "." if prefix else "", handle, module.process_group)
            self.units.append(unit)
            flat = unit.flat
            in_flat.add(id(flat))
            in_flat.update(id(p) for p in getattr(flat, "_params", None) or ())
            for i, (fqn, info) in enumerate(zip(flat._fqns, flat._param_infos, strict=True)):
                entry = Entry(
                    unit.prefix + clean(fqn),
                    tuple(flat._shapes[i]),
                    flat.dtype,
                    int(flat._numels[i]),
                    unit,
                    i,
                )
                found.append(((order.get(id(info.module), len(order)), len(found)), entry))
        owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
        for name, param in model.named_parameters():
            if id(param) not in in_flat:  # FSDP left it alone (ignored_modules)
                shape, numel = tuple(param.shape), param.numel()
                entry = Entry(clean(name), shape, param.dtype, numel, plain=param)
                key = (order.get(id(owners.get(id(param))), len(order)), len(found))
                found.append((key, entry))
        self.entries: tuple[Entry, ...] = tuple(e for _, e in sorted(found, key=lambda f: f[0]))
        self.names: tuple[str, ...] = tuple(e.name for e in self.entries)

    # --- whole tensors ------------------------------------------------------------------
    def _whole_flat(self, unit: Unit, local: torch.Tensor) -> torch.Tensor:
        """The unit's whole flat tensor (unpadded) from this rank's shard of it: one
        all-gather on the unit's group, unless FSDP holds it whole right now."""
        import torch.distributed as dist

        flat = unit.flat
        full = flat._unpadded_unsharded_size.numel()
        if unit.sharded and local.numel() == flat._sharded_size.numel():
            world = dist.get_world_size(unit.group)
            out = local.new_empty(local.numel() * world)
            dist.all_gather_into_tensor(out, local.detach().contiguous(), group=unit.group)
            local = out
        return local.detach()[:full]

    def _split(self, unit: Unit, whole: torch.Tensor) -> list[torch.Tensor]:
        """The unit's original parameters, shaped, from its whole flat tensor."""
        flat = unit.flat
        views, index = [], 0
        for part, padding in zip(
            torch.split(whole, list(flat._numels_with_padding)),
            flat._is_padding_mask,
            strict=True,
        ):
            if padding:
                continue
            if flat._contiguities[index]:
                views.append(part.view(flat._shapes[index]))
            else:
                views.append(part.as_strided(flat._shapes[index], flat._strides[index]))
            index += 1
        return views

    def _each_whole(self, what: str):
        """(entry index, whole tensor or None) for every entry, unit by unit: each unit's
        tensors are dropped before the next is gathered."""
        position = {(id(e.unit), e.index): i for i, e in enumerate(self.entries) if e.unit}
        for unit in self.units:
            local = unit.flat if what == "param" else unit.flat.grad
            parts: list = [None] * len(unit.flat._fqns)
            if local is not None:
                parts = self._split(unit, self._whole_flat(unit, local))
            for index, tensor in enumerate(parts):
                yield position[(id(unit), index)], tensor
            del parts
        for i, entry in enumerate(self.entries):
            if entry.plain is not None:
                yield i, entry.plain if what == "param" else entry.plain.grad

    def param_prints(self) -> list[int]:
        """Fingerprint of every original parameter, whole (a collective)."""
        from dtlab.agent.recorder import fingerprint

        prints = [0] * len(self.entries)
        for i, tensor in self._each_whole("param"):
            prints[i] = 0 if tensor is None else fingerprint(tensor)
        return prints

    def grad_summary(self):
        """(norms, non-finite counts, missing indices, fingerprints) of every original
        parameter's whole gradient, as :func:`dtlab.agent.recorder.grad_summary` (a
        collective)."""
        from dtlab.agent.recorder import fingerprint, grad_stats

        count = len(self.entries)
        norms, bad, prints = [float("nan")] * count, [0] * count, [0] * count
        missing: list[int] = []
        for i, grad in self._each_whole("grad"):
            (norms[i],), (bad[i],), gone = grad_stats([grad])
            if gone:
                missing.append(i)
            prints[i] = 0 if grad is None else fingerprint(grad)
        return norms, bad, sorted(missing), prints

    # --- this rank's part ---------------------------------------------------------------
    def local_part(self, name: str, what: str) -> torch.Tensor | None:
        """This rank's part of parameter ``name`` (or of its gradient), flattened, as
        FSDP holds it: empty where this rank holds none of it; no collective."""
        entry = self.entries[self.names.index(name)]
        if entry.unit is None:
            assert entry.plain is not None
            return entry.plain if what == "param" else entry.plain.grad
        unit = entry.unit
        local = unit.flat if what == "param" else unit.flat.grad
        if local is None:
            return None
        if not unit.sharded:
            return self._split(unit, local.detach())[entry.index].reshape(-1)
        info = unit.flat._shard_param_infos[entry.index]
        if not info.in_shard:
            return local.detach().new_empty(0)
        start = info.offset_in_shard
        return local.detach()[start : start + info.numel_in_shard]

    # --- checkpoints --------------------------------------------------------------------
    def flat_state(self) -> dict[str, torch.Tensor]:
        """Each unit's flat parameter as this rank holds it (its shard), under the unit's
        name (``blocks.0._flat_param``), plus parameters FSDP left alone; a load writes
        into these very tensors (the original parameters are views of them)."""
        state = {f"{unit.prefix}_flat_param": unit.flat.detach() for unit in self.units}
        for entry in self.entries:
            if entry.plain is not None:
                state[entry.name] = entry.plain.detach()
        return state


def view_of(model: torch.nn.Module) -> FlatView | None:
    """A :class:`FlatView` of ``model`` when it is FSDP1-wrapped, else None."""
    return FlatView(model) if is_fsdp1(model) else None
