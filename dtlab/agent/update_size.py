"""How far one optimizer step moved this rank's parameters: ``StepRecord.update_rms``.

Under a sharded optimizer (FSDP2, ZeRO) each rank updates only its own part of the
parameters, so a rank whose optimizer steps differently (its LR, its state, its settings)
trains its shard differently and nothing else shows it. The evidence is the root-mean-square
of the change the step made, on a fixed sample of the elements the rank holds, compared
across ranks by the doctor (``analysis/checks_updates.py``)::

    sample = UpdateSample(params)     # once: the optimizer's parameters
    ...
    sample.before()                   # just before optimizer.step()
    optimizer.step()
    update_rms = sample.after()       # just after: a float, nan when nothing was sampled

The sample: up to ``MAX_TENSORS`` parameters (all of them, or evenly spaced through the
list), each given an equal share of ``SAMPLE_CAP`` elements (a small tensor gives all it
has, the rest go to the larger ones), taken in runs of ``RUN`` consecutive elements at a
fixed stride through its local elements (a DTensor's ``to_local()``: the shard this rank
holds), one strided view per tensor, copied into one buffer per device and dtype. An
equal share per tensor keeps one big tensor (an embedding whose rows most batches leave
alone) from deciding the number alone. The change is taken in float32 (bf16 too).

Cost (2-core CPU shared with other work, torch 2.13, 10.2M parameters in 43 tensors, 32 of
them sampled, 65,424 elements; median of 2,000 calls): ``before()`` ~0.13 ms, ``after()``
~0.20 ms. Neither synchronises with an accelerator, except ``after()``'s one read of its
result per device. Nothing here is seen by autograd (``torch.no_grad()``, strided views of
the local tensors, the parameters never written), and nothing is a collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

SAMPLE_CAP = 65_536  # elements sampled per step in all
MAX_TENSORS = 32  # parameters sampled at most (each costs ~2 us of Python a call)
# elements are taken in runs of RUN consecutive ones (a 64-byte cache line of fp32): the
# copy misses the cache once per run, not once per element
RUN = 16
_BIG_NONCONTIGUOUS = 1 << 20  # a non-contiguous tensor is copied whole to sample it; not past this


@dataclass(frozen=True)
class _Take:
    index: int  # in the parameter list
    numel: int  # the local tensor's, when planned (a change makes a new plan)
    offset: int
    stride: int  # elements from the start of one run to the next
    runs: int
    run: int  # consecutive elements per run (RUN, or all of a small tensor's in one)
    group: tuple  # (device, dtype, 1 or 2 dimensions): copied into one buffer per group

    @property
    def count(self) -> int:
        return self.runs * self.run


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local shard), else the tensor."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _stride(numel: int, runs: int, run: int, last_dim: int) -> int:
    """A stride that spreads ``runs`` runs of ``run`` elements over ``numel`` elements, not
    always at the same columns of a matrix (coprime with its last dimension)."""
    stride = max(run, numel // runs)
    while stride > run and math.gcd(stride, last_dim) != 1:
        stride -= 1
    return stride


class UpdateSample:
    """A fixed sample of the parameters' local elements, copied before an optimizer step
    and compared after it (see the module's description)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        cap: int = SAMPLE_CAP,
        max_tensors: int = MAX_TENSORS,
    ) -> None:
        self.params = list(params)
        self.cap = cap
        n = len(self.params)
        if n > max_tensors:  # evenly spaced through the model, first and last included
            chosen = sorted({round(i * (n - 1) / (max_tensors - 1)) for i in range(max_tensors)})
        else:
            chosen = list(range(n))
        self._chosen = chosen
        self._plan: list[_Take] | None = None
        self._before: dict[tuple, torch.Tensor] | None = None

    @classmethod
    def of_optimizers(cls, optimizers: Iterable[torch.optim.Optimizer], **options) -> UpdateSample:
        """The parameters of every param group of ``optimizers``, each once."""
        seen: dict[int, torch.Tensor] = {}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    seen.setdefault(id(p), p)
        return cls(seen.values(), **options)

    # --- the two calls ------------------------------------------------------------------

    def before(self) -> None:
        """Copy the sample (call just before the optimizer updates the parameters)."""
        with torch.no_grad():
            tensors = self._tensors()
            if self._plan is None or not self._fits(tensors):
                self._plan = self._make_plan(tensors)
            self._before = self._gather(tensors, self._plan)

    def after(self) -> float:
        """RMS of the change since :meth:`before` over the sample (call just after the
        optimizer step); nan when nothing was sampled, before() was not called, or the
        parameters changed shape in between."""
        before, self._before = self._before, None
        plan = self._plan
        if not before or plan is None:
            return math.nan
        with torch.no_grad():
            tensors = self._tensors()
            if not self._fits(tensors):
                self._plan = None
                return math.nan
            now = self._gather(tensors, plan)
            sums: dict[torch.device, list[torch.Tensor]] = {}
            count = 0
            for key, old in before.items():
                change = now[key].to(torch.float32) - old.to(torch.float32)
                sums.setdefault(old.device, []).append(torch.sum(change * change))
                count += old.numel()
            total = sum(torch.stack(s).sum().item() for s in sums.values())  # one read each
        return math.sqrt(total / count) if count else math.nan

    # --- the sample ---------------------------------------------------------------------

    def _tensors(self) -> dict[int, torch.Tensor]:
        return {i: _local(self.params[i]) for i in self._chosen}

    def _fits(self, tensors: dict[int, torch.Tensor]) -> bool:
        """Does the plan still match the tensors (same sizes)?"""
        assert self._plan is not None
        return all(tensors[t.index].numel() == t.numel for t in self._plan)

    def _make_plan(self, tensors: dict[int, torch.Tensor]) -> list[_Take]:
        usable = {}
        for i, t in tensors.items():
            n = t.numel()
            if n == 0 or t.device.type == "meta" or not t.dtype.is_floating_point:
                continue
            if not t.is_contiguous() and n > _BIG_NONCONTIGUOUS:
                continue
            usable[i] = n
        # an equal share each: the smallest first, each taking what it has up to its share
        counts, left = {}, self.cap
        for k, (i, n) in enumerate(sorted(usable.items(), key=lambda item: (item[1], item[0]))):
            counts[i] = min(n, left // (len(usable) - k))
            left -= counts[i]
        plan = []
        for i in sorted(counts):
            t, n, count = tensors[i], usable[i], counts[i]
            if count >= n:  # all of it, as one run
                runs, run, stride = 1, n, n
            elif count >= RUN:
                runs, run = count // RUN, RUN
                stride = _stride(n, runs, run, t.shape[-1] if t.dim() else 1)
            elif count:
                runs, run = count, 1
                stride = _stride(n, runs, run, t.shape[-1] if t.dim() else 1)
            else:
                continue
            offset = min((stride - run) // 2, n - (runs - 1) * stride - run)
            shape = 2 if runs > 1 and run > 1 else 1  # runs of RUN as rows, or a plain strip
            plan.append(_Take(i, n, offset, stride, runs, run, (t.device, t.dtype, shape)))
        return plan

    @staticmethod
    def _gather(tensors: dict[int, torch.Tensor], plan: list[_Take]) -> dict[tuple, torch.Tensor]:
        """The sampled elements, copied: one tensor per (device, dtype)."""
        views: dict[tuple, list[torch.Tensor]] = {}
        for take in plan:
            t = tensors[take.index]
            if not t.is_contiguous():
                t = t.reshape(-1)  # a copy (small: see _BIG_NONCONTIGUOUS)
            at = t.storage_offset() + take.offset
            if take.group[2] == 2:  # runs of RUN elements: a row each
                view = t.as_strided((take.runs, take.run), (take.stride, 1), at)
            elif take.runs == 1:  # one run: the whole of a small tensor
                view = t.as_strided((take.run,), (1,), at)
            else:  # single elements
                view = t.as_strided((take.runs,), (take.stride,), at)
            views.setdefault(take.group, []).append(view)
        return {key: torch.cat(parts) for key, parts in views.items()}
