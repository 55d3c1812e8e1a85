"""Data parallelism from scratch in MXNet: split the batch, forward and backward on every context,
sum the gradients across contexts, apply the same SGD update to every replica (or, with states, the same
update of optimizer.py)."""
from mxnet import autograd, nd

from common.buckets import plan
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


BUCKET_BYTES = None   # the run's --allreduce (common.buckets.bucket_bytes): None, one allreduce per parameter
BUCKET_KEYS = 500     # the kvstore keys of the buckets: past the parameters' (one each), below resnet.KEYS


def allreduce_gradients(grads, bucket_bytes=None):
    """Every parameter's gradient summed across contexts, in place (grads[d]: context d's list): an allreduce per
    parameter (its kvstore key: its index), or per bucket of parameters (common/buckets.py), each context's
    gradients flattened into one buffer (nd.concat) and the sum written back into them, as DDP does."""
    if bucket_bytes is None:
        for key, per_device in enumerate(zip(*grads)):   # one parameter's gradient on every context
            allreduce(list(per_device), key)
        return grads
    for b, bucket in enumerate(plan([g.size for g in grads[0]], bucket_bytes)):
        buffers = allreduce([nd.concat(*[device_grads[i].reshape(-1) for i in bucket], dim=0)
                             for device_grads in grads], BUCKET_KEYS + b)
        for device_grads, buffer in zip(grads, buffers):
            start = 0
            for i in bucket:
                g = device_grads[i]
                g[:] = buffer[start:start + g.size].reshape(g.shape)   # in place: the parameter's .grad
                start += g.size
    return grads


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


def step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size, states=None, bucket_bytes=None):
    """The step on shards already on their contexts: each context's loss and gradients, the gradients summed across
    contexts (allreduce_gradients: per parameter, or by buckets of bucket_bytes), the same update on every replica (the
    recipe's sgd, or optimizer.apply with each replica's state). Returns each context's summed loss."""
    losses, grads = [], []
    for params, X_shard, y_shard in zip(replicas, X_shards, y_shards):   # queued asynchronously:
        loss, device_grads = loss_and_grads(params, X_shard, y_shard)   # the contexts work in parallel
        losses.append(loss)
        grads.append(device_grads)
    allreduce_gradients(grads, bucket_bytes)
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
    losses = step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size or len(X), states,
                            BUCKET_BYTES)
    return sum(loss.asscalar() for loss in losses) / len(X)


def evaluate(params, X, y, batch_size=1000):
    device = params[0].context
    correct = 0
    for i in range(0, len(X), batch_size):
        X_batch = nd.array(X[i:i + batch_size], ctx=device)
        correct += (forward(params, X_batch).argmax(axis=1).asnumpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
