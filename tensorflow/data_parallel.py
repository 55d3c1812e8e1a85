"""Data parallelism from scratch in TensorFlow: split the batch, forward and backward on every device,
sum the gradients across devices, apply the same SGD update to every replica (or, with optimizer states,
optimizer.py's update: common/optim.py's)."""
import tensorflow as tf

from common.buckets import plan
from common.sharding import shard_bounds

from . import distributed as dist, optimizer
from .lenet import forward, loss_sum


def split_and_load(array, devices):
    """Copies (a shard never aliases the caller's numpy array) in the array's layout: images stay NCHW
    here, forward makes them NHWC."""
    shards = []
    for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices):
        with tf.device(d):
            shards.append(tf.convert_to_tensor(array[a:b]))
    return shards


def allreduce(tensors):
    """Sum on the first tensor's device, then copy the sum back to every device. TensorFlow tensors are
    immutable: each slot of the list gets a new tensor (a tf.Variable is assigned in place instead).
    In a multi-process run the local sum is also summed across processes by TensorFlow's collectives."""
    with tf.device(tensors[0].device):
        total = tf.add_n(tensors)          # add_n copies the other tensors onto this device
    if dist.is_initialized():
        total = dist.all_reduce(total)
    for i, t in enumerate(tensors):
        with tf.device(t.device):
            if isinstance(t, tf.Variable):
                t.assign(total)
            else:
                tensors[i] = tf.identity(total)
    return tensors


BUCKET_BYTES = None   # the run's --allreduce (common.buckets.bucket_bytes): None, one allreduce per parameter


def allreduce_gradients(grads, bucket_bytes=None):
    """Every parameter's gradient summed across devices (grads[d]: device d's list): an allreduce per parameter, or
    per bucket of parameters (common/buckets.py), each device's gradients flattened into one buffer (tf.concat) and
    the sum cut back into their shapes (tf.split), as DistributedDataParallel does. Returns new lists (tensors are
    immutable)."""
    if bucket_bytes is None:
        summed = [allreduce(list(per_device)) for per_device in zip(*grads)]   # one parameter on every device
        return [list(device_grads) for device_grads in zip(*summed)]
    grads = [list(device_grads) for device_grads in grads]
    for bucket in plan([g.shape.num_elements() for g in grads[0]], bucket_bytes):
        buffers = []
        for device_grads in grads:
            with tf.device(device_grads[bucket[0]].device):
                buffers.append(tf.concat([tf.reshape(device_grads[i], [-1]) for i in bucket], 0))
        for device_grads, buffer in zip(grads, allreduce(buffers)):
            with tf.device(buffer.device):
                pieces = tf.split(buffer, [device_grads[i].shape.num_elements() for i in bucket])
                for i, piece in zip(bucket, pieces):
                    device_grads[i] = tf.reshape(piece, device_grads[i].shape)
    return grads


def sgd(params, grads, lr, batch_size):
    """The recipe's update, lr / batch_size times the summed gradient, made in place (update)."""
    update(params, grads, lr / batch_size)


# The units of the step: execution.use replaces each name of UNITS (lenet.py's forward, imported above, too)
# with its compiled form at the chosen level, or with the function as written here. TensorFlow compiles the
# whole step (tf.function), and XLA each device's part of it (jit_compile=True).
def update(params, grads, scale):
    """The SGD update of one replica, in place: each tf.Variable is assigned on its own device."""
    for p, g in zip(params, grads):
        with tf.device(p.device):
            p.assign_sub(g * scale)


def loss_and_grads(params, X, y):
    """One device's part of the step: its shard's summed loss and the gradients. The unit XLA compiles: an XLA
    cluster runs on one device, so it cannot hold the whole multi-device step."""
    with tf.GradientTape() as tape:
        loss = loss_sum(forward(params, X), y)
    return loss, tape.gradient(loss, params)


def step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size, states=None, bucket_bytes=None):
    """The step on shards already on their devices: each device's loss and gradients, the gradients summed across
    devices (allreduce_gradients: per parameter, or by buckets of bucket_bytes), the same update on every replica: the
    recipe's sgd, or with `states` (one per replica) optimizer.apply. Returns each device's summed loss. As one graph
    (the default level), it is traced per device list, number of replicas and optimizer; reduce_retracing turns the
    shard shapes into None after the first new shape."""
    losses, grads = [], []
    for params, d, X_shard, y_shard in zip(replicas, devices, X_shards, y_shards):
        with tf.device(d):
            loss, device_grads = loss_and_grads(params, X_shard, y_shard)
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
# At import the units are what the default level makes them: one graph for the whole step (faster than eager
# here: docs/results.md).
step_on_shards = tf.function(step_on_shards, reduce_retracing=True)


def train_step(replicas, X, y, devices, lr, batch_size=None, states=None):
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses = step_on_shards(replicas, tuple(devices), X_shards, y_shards,   # tensors: no retrace per value
                            tf.constant(lr, tf.float32), tf.constant(batch_size or len(X), tf.float32), states,
                            BUCKET_BYTES)   # a Python value: a step traced per all-reduce
    return sum(float(loss) for loss in losses) / len(X)


def evaluate(params, X, y, batch_size=1000):
    device = params[0].device
    correct = 0
    for i in range(0, len(X), batch_size):
        with tf.device(device):
            X_batch = tf.convert_to_tensor(X[i:i + batch_size])
            correct += (tf.argmax(forward(params, X_batch), 1).numpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
