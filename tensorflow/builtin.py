"""TensorFlow's own data parallelism: tf.distribute. In one process MirroredStrategy over its devices;
across processes the MultiWorkerMirroredStrategy that distributed.py joined. Either way the strategy
mirrors the variables, runs the scratch forward on every replica and Keras's SGD sums the gradients."""
import tensorflow as tf

from common.interface import RosettaError

from . import distributed as dist
from .data_parallel import evaluate as evaluate_params, split_and_load
from .lenet import forward, get_params, loss_sum, to_numpy as params_to_numpy

EXEC = "tf.function"


def get_model(weights, devices):
    """On the CPU the in-process strategy reduces on the first device, like the scratch allreduce (its
    default, NCCL, is for GPUs only). MultiWorkerMirroredStrategy picks its own devices: every GPU, or one
    replica per CPU worker (on the worker's CPU:0, whichever logical CPU the worker was given)."""
    if dist.is_initialized():
        strategy = dist.STRATEGY
    elif tf.DeviceSpec.from_string(devices[0]).device_type == "GPU":
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        strategy = tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice(devices[0]))
    replicas = len(strategy.extended.worker_devices)
    if replicas != len(devices):
        raise RosettaError(f"MultiWorkerMirroredStrategy runs {replicas} replica(s) per process here, "
                           f"not {len(devices)}: use as many processes as devices")
    with strategy.scope():   # variables made here are mirrored: one copy per replica, updated together
        params = get_params(weights, None)
        optimizer = tf.keras.optimizers.SGD(learning_rate=0.0)
        optimizer.build(params)
    return strategy, params, optimizer


# One graph for the whole step, traced per model; reduce_retracing as in data_parallel.py.
@tf.function(reduce_retracing=True)
def step_on_replicas(strategy, params, optimizer, X_shards, y_shards):
    def replica_step(X, y):
        with tf.GradientTape() as tape:
            loss = loss_sum(forward(params, X), y)
        grads = tape.gradient(loss, params)
        optimizer.apply_gradients(zip(grads, params))   # sums the gradients over all replicas, then SGD
        return loss
    return strategy.run(replica_step, args=(X_shards, y_shards))


def distribute(strategy, array):
    """Replica i gets the i-th contiguous shard of this process's rows, as in the scratch mode (a tf.data
    dataset would split the batch its own way). Replica ids count the replicas of all processes."""
    shards = split_and_load(array, strategy.extended.worker_devices)
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: shards[ctx.replica_id_in_sync_group % len(shards)])


def train_step(model, X, y, devices, lr, batch_size=None):
    """Keras sums the replicas' gradients (all processes' too) of their summed losses; a learning rate of
    lr / global batch then makes its update the recipe's, computed in float32 like the scratch sgd (so the
    two modes agree bit for bit), even when the shards differ in size."""
    strategy, params, optimizer = model
    optimizer.learning_rate = tf.constant(lr, tf.float32) / (batch_size or len(X))
    losses = step_on_replicas(strategy, params, optimizer, distribute(strategy, X), distribute(strategy, y))
    return sum(float(loss) for loss in strategy.experimental_local_results(losses)) / len(X)


def to_numpy(model):
    return params_to_numpy(model[1])


def evaluate(model, X, y):
    return evaluate_params(model[1], X, y)
