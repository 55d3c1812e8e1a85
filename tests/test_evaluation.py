"""The test split evaluated by every process of a run together (harness.training.loop.shared_accuracy): each process
its own contiguous rows (common.sharding.evaluation_rows), the correct counts summed, every image counted once
whatever the split's size; and what the stock samplers count instead, written as their users write them
(docs/usage.md quotes these numbers). The real collectives across processes: tests/test_engines.py and
tests/test_optimizers.py (assert_evaluated_together)."""
import collections
import types

import numpy as np
import pytest

from common.sharding import evaluation_rows
from harness.training.loop import shared_accuracy

SIZES = (1, 2, 359, 360, 361, 10_000)   # digits' test split is 360 images, Fashion-MNIST's 10,000
WORLDS = (1, 2, 3, 4, 7)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", WORLDS)
def test_every_image_is_evaluated_by_exactly_one_process(n, world):
    parts = [evaluation_rows(n, rank, world) for rank in range(world)]
    seen = np.concatenate([np.arange(start, stop) for start, stop in parts])
    assert seen.tolist() == list(range(n))   # contiguous, in rank order, nothing twice, nothing dropped
    sizes = [stop - start for start, stop in parts]
    assert max(sizes) - min(sizes) <= 1


class Counted:
    """A runner whose evaluate() scores the rows it is given by a fixed right/wrong vector (its X are row numbers),
    and whose collective is the test's: what the processes' counts add up to."""

    def __init__(self, right, total):
        self.right, self.total = right, total

    def evaluate(self, X, y):
        return float(self.right[X].sum()) / len(X)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", WORLDS)
def test_the_processes_counts_add_up_to_one_process_s_accuracy(n, world):
    right = np.random.default_rng(n + world).random(n) < 0.7
    data = types.SimpleNamespace(X_test=np.arange(n), y_test=np.zeros(n, np.int64))
    counts = []   # each process's count, as it enters the collective
    for rank in range(world):
        shared_accuracy(Counted(right, lambda count: counts.append(count) or count), data, rank, world)
    summed = [shared_accuracy(Counted(right, lambda count: sum(counts)), data, rank, world) for rank in range(world)]
    assert sum(counts) == right.sum()
    assert summed == [float(right.sum()) / n] * world   # bit for bit one process's: the same division


# What the stock samplers would evaluate, each image counted by how many processes see it. PyTorch's
# DistributedSampler evens the parts by repeating images from the start; the SplitSampler of MXNet's distributed
# training tutorial (and GluonCV's) gives each part n // parts images and drops the rest; tf.data's shard takes every
# world-th image, all of them.

def distributed_sampler(n, world):
    from torch.utils.data.distributed import DistributedSampler
    return [list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)) for rank in range(world)]


class SplitSampler:
    """As MXNet's tutorial writes it (a gluon.data.sampler.Sampler; its shuffle left out: it changes no count)."""

    def __init__(self, length, num_parts=1, part_index=0):
        self.part_len = length // num_parts
        self.start = self.part_len * part_index
        self.end = self.start + self.part_len

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_sampler(n, world):
    return [list(SplitSampler(n, world, rank)) for rank in range(world)]


def tf_data_shard(n, world):
    import tensorflow as tf
    return [next(iter(tf.data.Dataset.range(n).shard(world, rank).batch(n))).numpy().tolist() for rank in range(world)]


def counted(parts, n):
    """(images counted twice, images never counted)."""
    times = collections.Counter(i for part in parts for i in part)
    return sum(c - 1 for c in times.values()), n - len(times)


# (n, world) -> (twice, never) for each sampler: docs/usage.md's table.
STOCK = {
    (360, 2): {"DistributedSampler": (0, 0), "SplitSampler": (0, 0), "tf.data shard": (0, 0)},
    (360, 3): {"DistributedSampler": (0, 0), "SplitSampler": (0, 0), "tf.data shard": (0, 0)},
    (360, 7): {"DistributedSampler": (4, 0), "SplitSampler": (0, 3), "tf.data shard": (0, 0)},
    (10_000, 3): {"DistributedSampler": (2, 0), "SplitSampler": (0, 1), "tf.data shard": (0, 0)},
    (10_000, 7): {"DistributedSampler": (3, 0), "SplitSampler": (0, 4), "tf.data shard": (0, 0)},
}
SAMPLERS = {"DistributedSampler": distributed_sampler, "SplitSampler": split_sampler, "tf.data shard": tf_data_shard}


@pytest.mark.parametrize("n,world", list(STOCK))
def test_what_the_stock_samplers_count(n, world):
    got = {name: counted(sampler(n, world), n) for name, sampler in SAMPLERS.items()}
    assert got == STOCK[n, world]
    ours = [list(range(*evaluation_rows(n, rank, world))) for rank in range(world)]
    assert counted(ours, n) == (0, 0)
