"""MXNet's input pipeline: a Gluon ArrayDataset and DataLoader whose batch sampler hands this process its part
of every batch (what the SplitSampler of MXNet's distributed-training example does with kv.rank and
kv.num_workers, here in the shared order of common.batches), and gluon.utils.split_and_load to cut each batch
across the process's contexts. With even_split=False, MXNet 1.9.1 cuts an uneven batch as common.sharding
does, larger shards first (tests/test_pipelines.py checks it); the default, even_split=True, refuses a batch
that does not divide evenly, such as an epoch's last."""
from mxnet import gluon

from common.batches import ProcessBatches


class SharedOrderSampler(ProcessBatches, gluon.data.Sampler):
    """This process's rows of every global batch of the epoch, one list per step (a batch sampler)."""


def make_loader(data, order, rank, world, model, devices):
    """One loader thread (thread_pool: no worker processes, the data is in memory), two batches ahead: the gather
    of a batch's rows and their copy into an NDArray happen while the step runs, not between steps (done in the
    loop's own thread they took 6.9% of a 2-process epoch, benchmark 9187df5)."""
    sampler = SharedOrderSampler(order, rank, world)
    loader = gluon.data.DataLoader(gluon.data.ArrayDataset(data.X_train, data.y_train), batch_sampler=sampler,
                                   num_workers=1, thread_pool=True, prefetch=2)
    return loader, sampler, devices


def batches(loader, epoch):
    """The DataLoader's batch (NDArrays on the CPU), cut into one shard per context."""
    loader, sampler, devices = loader
    sampler.set_epoch(epoch)
    for X, y in loader:
        yield (gluon.utils.split_and_load(X, devices, even_split=False),
               gluon.utils.split_and_load(y, devices, even_split=False))


def per_device(batch):
    """What each of this process's devices holds of a batch, as numpy (X, y): for tests and readers."""
    X_shards, y_shards = batch
    return [(X.asnumpy(), y.asnumpy()) for X, y in zip(X_shards, y_shards)]
