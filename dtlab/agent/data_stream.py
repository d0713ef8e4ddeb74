"""The attached job's data, read batch by batch, and where in it the job is.

The position (epoch, batches drawn in it) is what a checkpoint keeps of the data; with it
the RNG states the epoch's iterator was made from, since making one draws from torch's
RNG (a DataLoader's base seed, a shuffling sampler's order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dtlab.agent import rng


def describe_data(data) -> str:
    """How ``data`` hands out batches, for advice chosen from the evidence: a DataLoader
    and its sampler (or batch sampler), else what it is instead."""
    if hasattr(data, "dataset") and hasattr(data, "batch_sampler"):  # a DataLoader
        sampler = getattr(data, "sampler", None)
        batches = getattr(data, "batch_sampler", None)
        kind = type(sampler).__name__ if sampler is not None else type(batches).__name__
        if batches is not None and type(batches).__name__ != "BatchSampler":
            kind = type(batches).__name__  # the user's own batch sampler decides
        return f"DataLoader, {kind}"
    if hasattr(data, "dataset") and hasattr(data, "data_sampler"):  # deepspeed.initialize's
        # DeepSpeedDataLoader: a DataLoader over its data_sampler (a DistributedSampler over
        # the data-parallel ranks unless it was given one), made afresh at each pass
        return f"DeepSpeedDataLoader, {type(data.data_sampler).__name__}"
    return f"no DataLoader: {type(data).__name__}"


class DataStream:
    def __init__(self, data: Iterable, on_epoch: Callable[[int], None] | None):
        self.data = data
        self.on_epoch = on_epoch  # e.g. sampler.set_epoch, before each pass after the first
        self.epoch = 0
        self.offset = 0  # batches drawn in this epoch
        self.epoch_rng = rng.capture()
        self._iterator = iter(data)

    def next_batch(self):
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.start_epoch(self.epoch + 1)
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise RuntimeError(
                    "the data yields no batch (an empty dataset, or a DistributedSampler "
                    "with drop_last and fewer samples than ranks x batch size)"
                ) from None
        self.offset += 1
        return batch

    def start_epoch(self, epoch: int, rngs: dict | None = None) -> None:
        self.epoch, self.offset = epoch, 0
        if self.on_epoch is not None:
            self.on_epoch(epoch)
        if rngs is not None:  # as they were when this epoch's iterator was first made
            rng.restore(rngs)
        self.epoch_rng = rng.capture()
        self._iterator = iter(self.data)

    def seek_problem(self, offset: int) -> str | None:
        """Why ``seek(epoch, offset)`` would fail on this data (None: it would not)."""
        try:
            batches = len(self.data)
        except TypeError:  # an iterable without a length: found out while seeking
            return None
        if offset > batches:
            return (
                f"the data position is batch {offset} of an epoch, but this rank's data "
                f"has {batches} batches an epoch: not the data it was saved with"
            )
        return None

    def seek(self, epoch: int, offset: int, rngs: dict | None = None) -> None:
        """Go to batch ``offset`` of pass ``epoch`` (a restored checkpoint's), the epoch's
        iterator made from ``rngs``. Skips by drawing batches: an iterator cannot jump."""
        self.start_epoch(epoch, rngs)
        for _ in range(offset):
            if next(self._iterator, None) is None:
                raise ValueError(
                    f"the data has fewer than {offset} batches in epoch {epoch}: it is not "
                    "the data the checkpoint was taken with"
                )
        self.offset = offset
