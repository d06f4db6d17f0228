"""Data for dp x sp: shard samples over data-parallel ranks only; one sp group shares every batch.

The original EasyContext gave every rank the whole (unsharded) loader in sp modes and relied on equal seeds
for the ranks of a sequence to see the same sample, and could not combine data and sequence parallelism.
Here the sampler is a ``DistributedSampler(num_replicas=dp, rank=dp_rank, seed=seed)``: the sample order
is a pure function of (seed, epoch, dp_rank), identical on the sp ranks of one group by construction,
disjoint across dp groups. ``state_dict()`` / ``load_state_dict()`` resume mid-epoch without loading the
skipped batches.
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler


def _to_device(batch, device):
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class ShardedLoader:
    """Iterates this dp rank's batches; re-shuffles per epoch (seed + epoch) and can resume mid-epoch."""

    def __init__(self, dataset, batch_size: int, collate_fn, dp: int, dp_rank: int, shuffle: bool,
                 seed: int = 0, drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False,
                 device=None):
        # pad (drop_last=False in the sampler) so every dp rank runs the same number of steps
        self.sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=shuffle, seed=seed,
                                          drop_last=False)
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.drop_last, self.num_workers, self.pin_memory, self.device = drop_last, num_workers, pin_memory, device
        self.dp, self.dp_rank = dp, dp_rank
        self.epoch, self.position, self._skip = 0, 0, 0

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._skip = epoch, 0, 0

    def state_dict(self) -> dict:
        """Where the next batch comes from: ``{"epoch", "batch"}`` (batches already yielded this epoch)."""
        return {"epoch": self.epoch, "batch": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._skip = int(state["epoch"]), int(state["batch"])
        self.position = self._skip

    def _epoch_indices(self) -> list[int]:
        """This rank's row indices of the current epoch, in order (easy_context_train/dp_balance.py reorders them)."""
        self.sampler.set_epoch(self.epoch)
        return list(self.sampler)

    def __iter__(self):
        indices = self._epoch_indices()[self._skip * self.batch_size:]  # resume: skip indices, not loads
        self.position, self._skip = self._skip, 0
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=indices, collate_fn=self.collate_fn,
                            drop_last=self.drop_last, num_workers=self.num_workers, pin_memory=self.pin_memory)
        for batch in loader:
            self.position += 1
            yield _to_device(batch, self.device)
        self.epoch, self.position = self.epoch + 1, 0


def _dp_coords(mode, layout) -> tuple[int, int]:
    if layout is not None:
        if layout.mode.name != mode.name:
            raise ValueError(f"prepare_dataloader({mode.name!r}) got a layout built for {layout.seq_algo!r}")
        return layout.dp, layout.dp_rank
    import torch.distributed as dist
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    # without a layout: no sequence parallelism = dp over the world; sp modes = one sp group over the world (dp 1)
    return (world, rank) if not mode.is_parallel else (1, 0)


def prepare_dataloader(seq_algo, dataloader: DataLoader, accelerator=None, layout=None, *, seed: int = 0):
    """This rank's loader: samples sharded over the dp ranks of ``layout`` (None: dp = world for
    ``data_parallel``, dp = 1 for sp modes); identical batches on the ranks of one sp group.

        prepare_dataloader(dataloader, layout)                   # the layout carries the mode and the dp split
        prepare_dataloader("zigzag_ring_attn", dataloader, accelerator, layout=None)   # string form

    Keeps ``batch_size``, ``collate_fn``, ``drop_last``, ``num_workers`` and shuffling (a RandomSampler
    becomes a seeded per-epoch shuffle). ``data_parallel`` with an ``accelerator`` and no layout goes through
    ``accelerator.prepare`` as before; otherwise batches are moved to ``accelerator.device`` when given.
    """
    from .parallel_layout import ParallelLayout
    from .registry import get_mode
    if isinstance(dataloader, ParallelLayout):  # the (dataloader, layout[, accelerator]) order
        seq_algo, dataloader, layout, accelerator = dataloader.mode, seq_algo, dataloader, accelerator
    mode = get_mode(seq_algo)
    if not mode.is_parallel and accelerator is not None and layout is None:
        return accelerator.prepare(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        raise ValueError("prepare_dataloader needs a map-style dataset (len and indexing) to shard it over "
                         "data-parallel ranks; convert the IterableDataset (e.g. datasets.Dataset, not streaming)")
    if dataloader.batch_size is None:
        raise ValueError("prepare_dataloader needs a DataLoader built with batch_size= (not a custom batch_sampler)")
    dp, dp_rank = _dp_coords(mode, layout)
    return ShardedLoader(dataloader.dataset, dataloader.batch_size, dataloader.collate_fn, dp, dp_rank,
                         shuffle=isinstance(dataloader.sampler, RandomSampler), seed=seed,
                         drop_last=dataloader.drop_last, num_workers=dataloader.num_workers,
                         pin_memory=dataloader.pin_memory,
                         device=getattr(accelerator, "device", None))


__all__ = ["prepare_dataloader", "ShardedLoader"]
