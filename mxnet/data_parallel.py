"""Data parallelism from scratch in MXNet: split the batch, forward and backward on every context,
sum the gradients across contexts, apply the same SGD update to every replica (or, with states, the same
update of optimizer.py). One step for every network: `model` is lenet.py's or resnet.py's Functional."""
from mxnet import nd

from common.buckets import plan
from common.interface import StepSettings
from common.sharding import micro_batches, shard_bounds

from . import distributed as dist
from . import optimizer


def split_and_load(array, devices):
    """gluon.utils.split_and_load(even_split=False)'s cut, from common.sharding. nd.array copies (a shard
    never aliases the caller's numpy array) and makes every shard float32 unless given the dtype."""
    return [nd.array(array[a:b], ctx=d, dtype=array.dtype)
            for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices)]


def allreduce(tensors, name=("tensor",)):
    """Sum on the first tensor's context, then copy the sum back into every tensor, in place.
    In a multi-process run the local sum is also summed across processes by the kvstore, which needs a name for
    each value, the same in every process (distributed.all_reduce turns it and the shape into a key)."""
    for t in tensors[1:]:
        tensors[0] += t.copyto(tensors[0].context)
    if dist.is_initialized():
        dist.all_reduce(tensors[0], name)
    for t in tensors[1:]:
        tensors[0].copyto(t)
    return tensors


def allreduce_gradients(grads, bucket_bytes=None):
    """Every parameter's gradient summed across contexts, in place (grads[d]: context d's list): an allreduce per
    parameter (named by its index), or per bucket of parameters (common/buckets.py), each context's gradients
    flattened into one buffer (nd.concat) and the sum written back into them, as DDP does."""
    if bucket_bytes is None:
        for i, per_device in enumerate(zip(*grads)):   # one parameter's gradient on every context
            allreduce(list(per_device), ("gradient", i))
        return grads
    for b, bucket in enumerate(plan([g.size for g in grads[0]], bucket_bytes)):
        buffers = allreduce([nd.concat(*[device_grads[i].reshape(-1) for i in bucket], dim=0)
                             for device_grads in grads], ("bucket", b))
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


# The units of the step: execution.compile(level, model) hands train_step (settings.units) each name of UNITS as the
# level makes it, or as written here. MXNet's graph level traces the model's forward with hybridize, inside
# loss_and_grads (the cached graph runs the backward too); update (through sgd) and step_on_shards run as written at
# every level (execution.COMPILERS names no other unit).
def update(params, grads, scale):
    """The SGD update of one replica, in place."""
    for p, g in zip(params, grads):
        p -= scale * g                     # in place: NDArray's -= writes into p


def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices):
    """Every context's part of the step: its shard's summed loss, its replica's gradients and new BatchNorm state
    (model.loss_and_grads: the LeNet's contexts each on their own, queued asynchronously so that they work in
    parallel; the ResNet's in lock-step, layer by layer, for its BatchNorm)."""
    return model.loss_and_grads(replicas, bn_states, X_shards, y_shards, devices)


def accumulated(loss_and_grads, model, replicas, bn_states, X_shards, y_shards, devices, count):
    """Gradient accumulation: each context's shard cut into `count` micro-batches (common.sharding.micro_batches), a
    forward and backward each, their summed losses and gradients added up on the context (copied out of the
    parameters' .grad, which the next backward overwrites); the BatchNorm states go through the micro-batches in
    turn. Nothing crosses contexts here: the all-reduce comes once, after it."""
    if count == 1:
        return loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices)
    parts = [micro_batches(len(y), count) for y in y_shards]
    losses = grads = None
    for i in range(count):
        X_micro = [X[part[i][0]:part[i][1]] for X, part in zip(X_shards, parts)]
        y_micro = [y[part[i][0]:part[i][1]] for y, part in zip(y_shards, parts)]
        micro_losses, micro_grads, bn_states = loss_and_grads(model, replicas, bn_states, X_micro, y_micro, devices)
        if losses is None:
            losses, grads = list(micro_losses), [[g.copy() for g in device_grads] for device_grads in micro_grads]
        else:
            losses = [a + b for a, b in zip(losses, micro_losses)]
            grads = [[a + b for a, b in zip(g, h)] for g, h in zip(grads, micro_grads)]
    return losses, grads, bn_states


def step_on_shards(model, replicas, bn_states, X_shards, y_shards, devices, lr, batch_size, states=None,
                   bucket_bytes=None, units=None, accumulate=1):
    """The step on shards already on their contexts: each context's loss and gradients, the gradients summed across
    contexts (allreduce_gradients: per parameter, or by buckets of bucket_bytes), the same update on every replica (the
    recipe's sgd, or optimizer.apply with each replica's state). `units`: the step's units (None: UNITS). Returns each
    context's summed loss and each replica's new BatchNorm state."""
    units = units or UNITS
    losses, grads, bn_states = accumulated(units["loss_and_grads"], model, replicas, bn_states, X_shards,
                                           y_shards, devices, accumulate)
    allreduce_gradients(grads, bucket_bytes)
    if states is None:
        for params, device_grads in zip(replicas, grads):
            sgd(params, device_grads, lr, batch_size)
    else:
        for params, device_grads, state in zip(replicas, grads, states):
            optimizer.apply(params, device_grads, state, lr, batch_size)
    return losses, bn_states


UNITS = {"update": update, "loss_and_grads": loss_and_grads, "step_on_shards": step_on_shards}


def train_step(model, replicas, bn_states, X, y, devices, lr, batch_size=None, states=None, settings=StepSettings()):
    """One synchronous step of `model` (common.interface.CONTRACT): split_and_load, then step_on_shards with the run's
    settings (its all-reduce's buckets, its compiled units). The replicas' new running statistics go into bn_states."""
    units = settings.units or UNITS
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses, bn_states[:] = units["step_on_shards"](model, replicas, bn_states, X_shards, y_shards, devices, lr,
                                                   batch_size or len(X), states, settings.bucket_bytes, units,
                                                   settings.accumulate)
    return sum(loss.asscalar() for loss in losses) / len(X)


def evaluate(model, replica, bn_state, X, y):
    """Accuracy of one replica, in inference mode (the ResNet's BatchNorm by its running statistics)."""
    return model.evaluate(replica, bn_state, X, y)
