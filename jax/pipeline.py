"""JAX's input pipeline: every process gathers its own part of each batch (in numpy: JAX has no data loader of
its own; larger programs use grain or tf.data for this part), and jax.make_array_from_process_local_data
assembles the parts of all processes into one global array sharded over the device mesh, block i on device i.
A sharded array has equal blocks, so each device's shard (common.sharding) is padded to the size of the
largest shard anywhere, and a mask marks the real rows."""
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from common.sharding import shard_bounds


def padded(array, devices, size):
    """This process's rows, each device's shard padded with zeros to `size` rows, shards back to back."""
    blocks = []
    for a, b in shard_bounds(len(array), len(devices)):
        blocks += [array[a:b], np.zeros((size - (b - a), *array.shape[1:]), array.dtype)]
    return np.concatenate(blocks)


def global_batch(mesh, devices, X, y, global_size):
    """(X, y, mask, rows): one global array each, sharded along the mesh's "devices" axis, from this
    process's rows X, y of a global batch of global_size rows; rows counts this process's real rows."""
    size = -(-global_size // mesh.size)    # the largest shard of the global batch
    sharding = NamedSharding(mesh, P("devices"))
    to_global = lambda a: jax.make_array_from_process_local_data(   # noqa: E731
        sharding, padded(a, devices, size), (mesh.size * size, *a.shape[1:]))
    mask = np.ones(len(y), np.float32)
    return to_global(X), to_global(y.astype(np.int32)), to_global(mask), len(y)


def make_loader(data, order, rank, world, model, devices):
    return data, order, rank, world, model.placement, devices


def batches(loader, epoch):
    data, order, rank, world, mesh, devices = loader
    for rows, global_size in order.parts(epoch, rank, world):
        yield global_batch(mesh, devices, data.X_train[rows], data.y_train[rows], global_size)


def per_device(batch):
    """What each of this process's devices holds of a batch, as numpy (X, y), padding removed: for tests
    and readers."""
    def blocks(array):   # this process's shards, in row order
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
        return [np.asarray(s.data) for s in shards]
    X, y, mask, _ = batch
    return [(x[m > 0], t[m > 0]) for x, t, m in zip(blocks(X), blocks(y), blocks(mask))]
