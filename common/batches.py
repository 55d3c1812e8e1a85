"""The order in which training examples are seen: identical for every framework and every process."""
import numpy as np

from .sharding import shard_bounds


def epoch_batches(n, batch_size, seed, epoch, min_size=1):
    """Index arrays of one epoch's batches: a fresh permutation per (seed, epoch). A last batch with
    fewer than min_size rows (one per device) is dropped; all others are kept, the last may be short."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    batches = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    return [b for b in batches if len(b) >= min_size]


def process_part(batch, rank, world):
    """This process's rows of one global batch: its contiguous shard (common.sharding), which its
    devices then split again among themselves."""
    start, stop = shard_bounds(len(batch), world)[rank]
    return batch[start:stop]


class Order:
    """The batch order of a run, for the input pipelines: the loop and every framework's sampler or
    dataset ask it for the same epoch's batches, so they cannot disagree."""

    def __init__(self, n, batch_size, seed, min_size=1):
        self.n, self.batch_size, self.seed, self.min_size = n, batch_size, seed, min_size

    def batches(self, epoch):
        return epoch_batches(self.n, self.batch_size, self.seed, epoch, self.min_size)

    def parts(self, epoch, rank, world):
        """(this process's rows, global batch size) of every batch of the epoch."""
        return [(process_part(b, rank, world), len(b)) for b in self.batches(epoch)]


class ProcessBatches:
    """A batch sampler over an Order: this process's rows of every global batch of the epoch, one list per
    step, with DistributedSampler's set_epoch (call it before every epoch, or every epoch repeats the first's
    order). Each framework's pipeline mixes it into its own Sampler base class (PyTorch's, Gluon's)."""

    def __init__(self, order, rank, world):
        self.order, self.rank, self.world, self.epoch = order, rank, world, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for rows, _ in self.order.parts(self.epoch, self.rank, self.world):
            yield rows.tolist()

    def __len__(self):
        return len(self.order.batches(self.epoch))
