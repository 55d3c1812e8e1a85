"""Data parallelism from scratch in MXNet: split the batch, forward and backward on every context,
sum the gradients across contexts, apply the same SGD update to every replica (or, with states, the same
update of optimizer.py)."""
from mxnet import autograd, nd

from common.sharding import shard_bounds

from . import distributed as dist
from . import optimizer
from .lenet import forward, hybridized, loss_sum


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
    """The recipe's update, lr / batch_size times the summed gradient, made in place (update)."""
    update(params, grads, lr / batch_size)


# The units of the step: execution.use replaces each name of UNITS (lenet.py's forward, imported above, too)
# with its compiled form at the chosen level, or with the function as written here. MXNet compiles the
# forward (hybridize, which traces a block: lenet.hybridized; the cached graph runs the backward too).
def update(params, grads, scale):
    """The SGD update of one replica, in place."""
    for p, g in zip(params, grads):
        p -= scale * g                     # in place: NDArray's -= writes into p


def loss_and_grads(params, X, y):
    """One context's part of the step: its shard's summed loss and the gradients."""
    with autograd.record():
        loss = loss_sum(forward(params, X), y)
    loss.backward()
    return loss, [p.grad for p in params]


def step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size, states=None):
    """The step on shards already on their contexts: each context's loss and gradients, the gradients summed
    across contexts, the same update on every replica (the recipe's sgd, or optimizer.apply with each replica's
    state). Returns each context's summed loss."""
    losses, grads = [], []
    for params, X_shard, y_shard in zip(replicas, X_shards, y_shards):   # queued asynchronously:
        loss, device_grads = loss_and_grads(params, X_shard, y_shard)   # the contexts work in parallel
        losses.append(loss)
        grads.append(device_grads)
    for key, per_device in enumerate(zip(*grads)):   # one parameter's gradient on every context
        allreduce(list(per_device), key)
    if states is None:
        for params, device_grads in zip(replicas, grads):
            sgd(params, device_grads, lr, batch_size)
    else:
        for params, device_grads, state in zip(replicas, grads, states):
            optimizer.apply(params, device_grads, state, lr, batch_size)
    return losses


UNITS = {"forward": forward, "update": update, "loss_and_grads": loss_and_grads, "step_on_shards": step_on_shards}
# At import the units are what the default level makes them: hybridize compiles the forward.
forward = hybridized(forward)


def train_step(replicas, X, y, devices, lr, batch_size=None, states=None):
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses = step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size or len(X), states)
    return sum(loss.asscalar() for loss in losses) / len(X)


def evaluate(params, X, y, batch_size=1000):
    device = params[0].context
    correct = 0
    for i in range(0, len(X), batch_size):
        X_batch = nd.array(X[i:i + batch_size], ctx=device)
        correct += (forward(params, X_batch).argmax(axis=1).asnumpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
