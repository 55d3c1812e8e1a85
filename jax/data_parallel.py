"""Data parallelism from scratch in JAX: split the batch, forward and backward on every device, sum the
gradients across devices, apply the same SGD update to every replica. JAX functions are pure and its
arrays immutable: every step makes new arrays, and the lists that hold them are re-pointed at them."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from common.buckets import plan
from common.sharding import shard_bounds

from . import distributed as dist
from . import optimizer
from .lenet import forward, loss_sum


def device_of(array):
    (device,) = array.devices()
    return device


def split_and_load(array, devices):
    """jax.device_put copies the numpy rows onto the device: a shard never aliases the caller's array."""
    return [jax.device_put(array[a:b], d) for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices)]


def allreduce(tensors):
    """Sum on the first tensor's device, then copy the sum to every device. JAX arrays are immutable: each
    slot of the list gets a new array (device_put copies the sum across).
    In a multi-process run the local sum is also summed across processes by JAX's collectives."""
    first = device_of(tensors[0])
    total = tensors[0]
    for t in tensors[1:]:
        total = total + jax.device_put(t, first)
    if dist.is_initialized():
        total = dist.all_reduce(total)
    tensors[:] = [jax.device_put(total, device_of(t)) for t in tensors]
    return tensors


BUCKET_BYTES = None   # the run's --allreduce (common.buckets.bucket_bytes): None, one allreduce per parameter


def allreduce_gradients(grads, bucket_bytes=None):
    """Every parameter's gradient summed across devices (grads[d]: device d's list): an allreduce per parameter, or
    per bucket of parameters (common/buckets.py), each device's gradients flattened into one buffer and the sum cut
    back into their shapes (flatten, unflatten: compiled, on the device that holds them), as DDP does. Returns new
    lists (arrays are immutable)."""
    if bucket_bytes is None:
        summed = [allreduce(list(per_device)) for per_device in zip(*grads)]   # one parameter on every device
        return [list(device_grads) for device_grads in zip(*summed)]
    grads = [list(device_grads) for device_grads in grads]
    for bucket in plan([g.size for g in grads[0]], bucket_bytes):
        buffers = allreduce([flatten([device_grads[i] for i in bucket]) for device_grads in grads])
        for device_grads, buffer in zip(grads, buffers):
            for i, piece in zip(bucket, unflatten(buffer, tuple(device_grads[i].shape for i in bucket))):
                device_grads[i] = piece
    return grads


@jax.jit
def flatten(arrays):
    return jnp.concatenate([a.ravel() for a in arrays])


@functools.partial(jax.jit, static_argnums=1)
def unflatten(buffer, shapes):
    pieces, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        pieces.append(buffer[start:start + size].reshape(shape))
        start += size
    return pieces


def sgd(params, grads, lr, batch_size):
    """A functional update: new arrays, written back into the replica's list slots."""
    params[:] = update(params, grads, lr / batch_size)


# The units of the step: execution.use replaces each name of UNITS (lenet.py's forward, imported above, too)
# with its compiled form at the chosen level, or with the function as written here. JAX compiles loss_and_grads
# and update (jax.jit: XLA, once per shard shape, on the device that holds the inputs).
def update(params, grads, scale):
    """The SGD update of one replica: new arrays."""
    return [p - scale * g for p, g in zip(params, grads)]


def loss_and_grads(params, X, y):
    """One device's part of the step: its shard's summed loss and the gradients."""
    return jax.value_and_grad(lambda p: loss_sum(forward(p, X), y))(params)


def step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size, states=None, bucket_bytes=None):
    """The step on shards already on their devices: each device's loss and gradients, the gradients summed across
    devices (allreduce_gradients: per parameter, or by buckets of bucket_bytes), the same update on every replica (with
    states, optimizer.py's, each replica's state advancing). Returns each device's summed loss."""
    losses, grads = [], []
    for params, X_shard, y_shard in zip(replicas, X_shards, y_shards):   # dispatched asynchronously:
        loss, device_grads = loss_and_grads(params, X_shard, y_shard)   # the devices work in parallel
        losses.append(loss)
        grads.append(device_grads)
    grads = allreduce_gradients(grads, bucket_bytes)
    for i, (params, device_grads) in enumerate(zip(replicas, grads)):
        if states is None:
            sgd(params, device_grads, lr, batch_size)
        else:
            optimizer.apply(params, device_grads, states[i], lr, batch_size)
    return losses


UNITS = {"forward": forward, "update": update, "loss_and_grads": loss_and_grads, "step_on_shards": step_on_shards}
# At import the units are what the default level makes them: jax.jit compiles loss_and_grads and update.
loss_and_grads, update = jax.jit(loss_and_grads), jax.jit(update)


def train_step(replicas, X, y, devices, lr, batch_size=None, states=None):
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses = step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size or len(X), states,
                            BUCKET_BYTES)
    return sum(float(loss) for loss in losses) / len(X)


@jax.jit
def predict(params, X):
    return forward(params, X).argmax(1)


def evaluate(params, X, y, batch_size=1000):
    device = device_of(params[0])
    correct = 0
    for i in range(0, len(X), batch_size):
        X_batch = jax.device_put(X[i:i + batch_size], device)
        correct += (jax.device_get(predict(params, X_batch)) == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
