import numpy as np
import pytest

from common import RosettaError
from common.batches import epoch_batches
from common.sharding import check_device_count, shard_bounds


@pytest.mark.parametrize("n,k,sizes", [(10, 3, [4, 3, 3]), (10, 4, [3, 3, 2, 2]), (8, 2, [4, 4]),
                                       (5, 5, [1] * 5), (256, 1, [256])])
def test_shard_sizes_are_contiguous_and_differ_by_at_most_one(n, k, sizes):
    bounds = shard_bounds(n, k)
    assert [b - a for a, b in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))
    assert sizes == [len(s) for s in np.array_split(np.arange(n), k)]


def test_too_few_rows_or_devices_is_a_clear_error():
    with pytest.raises(RosettaError, match="cannot split 3 rows across 4 devices"):
        shard_bounds(3, 4)
    with pytest.raises(RosettaError):
        shard_bounds(3, 0)
    with pytest.raises(RosettaError, match=">= 1"):
        check_device_count(0, 0)
    with pytest.raises(RosettaError, match="only 2 GPU"):
        check_device_count(3, 2)
    check_device_count(16, 0)   # virtual CPU devices: any number


def test_batches_are_a_reproducible_permutation_per_epoch():
    a = epoch_batches(1000, 256, seed=1, epoch=0)
    assert [len(b) for b in a] == [256, 256, 256, 232]
    assert sorted(np.concatenate(a).tolist()) == list(range(1000))
    again = epoch_batches(1000, 256, seed=1, epoch=0)
    assert all((x == y).all() for x, y in zip(a, again))
    other_epoch = epoch_batches(1000, 256, seed=1, epoch=1)
    assert not (np.concatenate(a) == np.concatenate(other_epoch)).all()
    other_seed = epoch_batches(1000, 256, seed=2, epoch=0)
    assert not (np.concatenate(a) == np.concatenate(other_seed)).all()


def test_a_last_batch_smaller_than_the_device_count_is_dropped():
    assert [len(b) for b in epoch_batches(257, 256, 0, 0, min_size=2)] == [256]
    assert [len(b) for b in epoch_batches(258, 256, 0, 0, min_size=2)] == [256, 2]
