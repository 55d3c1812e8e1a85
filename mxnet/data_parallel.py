"""Data parallelism from scratch in MXNet: split the batch, forward and backward on every context,
sum the gradients across contexts, apply the same SGD update to every replica."""
from mxnet import autograd, nd

from common.sharding import shard_bounds

from . import distributed as dist
from .lenet import forward, loss_sum


def split_and_load(array, devices):
    """gluon.utils.split_and_load(even_split=False)'s cut, from common.sharding. nd.array copies (a shard
    never aliases the caller's numpy array) and makes every shard float32 unless given the dtype."""
    return [nd.array(array[a:b], ctx=d, dtype=array.dtype)
            for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices)]


def allreduce(tensors, key=0):
    """Sum on the first tensor's context, then copy the sum back into every tensor, in place.
    In a multi-process run the local sum is also summed across processes by the kvstore, which names
    each value by a key: the same value must get the same key in every process (train_step: its index)."""
    for t in tensors[1:]:
        tensors[0] += t.copyto(tensors[0].context)
    if dist.is_initialized():
        dist.all_reduce(tensors[0], key)
    for t in tensors[1:]:
        tensors[0].copyto(t)
    return tensors


def sgd(params, grads, lr, batch_size):
    for p, g in zip(params, grads):
        p -= lr / batch_size * g   # in place: NDArray's -= writes into p


def train_step(replicas, X, y, devices, lr, batch_size=None):
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses = []
    with autograd.record():                # queued asynchronously: the contexts work in parallel
        for params, X_shard, y_shard in zip(replicas, X_shards, y_shards):
            losses.append(loss_sum(forward(params, X_shard), y_shard))
    for loss in losses:
        loss.backward()
    grads = [[p.grad for p in params] for params in replicas]
    for key, per_device in enumerate(zip(*grads)):   # one parameter's gradient on every context
        allreduce(list(per_device), key)
    for params, device_grads in zip(replicas, grads):
        sgd(params, device_grads, lr, batch_size or len(X))
    return sum(loss.asscalar() for loss in losses) / len(X)


def evaluate(params, X, y, batch_size=1000):
    device = params[0].context
    correct = 0
    for i in range(0, len(X), batch_size):
        X_batch = nd.array(X[i:i + batch_size], ctx=device)
        correct += (forward(params, X_batch).argmax(axis=1).asnumpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
