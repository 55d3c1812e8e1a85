"""TensorFlow's own data parallelism: tf.distribute with Keras. In one process MirroredStrategy over its
devices; across processes the MultiWorkerMirroredStrategy that distributed.py joined. The Keras model is built
under strategy.scope(), so its variables are mirrored (one copy per replica, updated together); strategy.run
runs the step on every replica with its shard of pipeline.py's distributed dataset, and the Keras optimizer
sums the replicas' gradients (all processes' too) before it applies the same update to every copy. For an optimizer
of common/optim.py the step sums them itself, before the Keras optimizer clips them (optimizer.py: Canonical)."""

import tensorflow as tf

from common.interface import Model, Network, Unavailable
from common.precision import check as check_precision

from . import distributed as dist, resnet
from .idiomatic import accumulated, build, evaluate as evaluate_keras, parameters, restore_scaler, scaler_state, \
    to_numpy as keras_to_numpy   # noqa: F401 (scaler_state, restore_scaler: both engines' trainer is Keras's)
from .optimizer import (Canonical, SGD, follows_its_schedule, get_trainer, canonical_state, load_state, unwrapped,
                        with_loss_scaling)

EXEC = "tf.function"
COMPILES = "whole step"
# Its gradients' reduction (harness/studies/split.py): in a tf.function the strategy packs them (CommunicationOptions'
# bytes_per_pack, 0 by default: every gradient in one pack), one collective a step, as one bucket does.
ALLREDUCE = "bucketed"
LAYOUT = "NHWC (Keras)"


def get_model(weights, devices, optimizer=None, state=None, network=Network()):
    """On the CPU the in-process strategy reduces on the first device, like the scratch allreduce (its
    default, NCCL, is for GPUs only). MultiWorkerMirroredStrategy picks its own devices: every GPU, or one
    replica per CPU worker (on the worker's CPU:0, whichever logical CPU the worker was given). The trainer is the
    recipe's SGD (optimizer None or the recipe's), or Keras's optimizer and schedule computing `optimizer`, from a
    checkpoint's canonical `state` if given (its mirrored variables assigned on every replica). The ResNet's
    BatchNormalization normalises each replica's shard by its own moments, or with network.sync by the moments
    summed over every replica of the strategy (synchronized=True: across processes too). At bf16 the model's layers
    compute under Keras's mixed_bfloat16 policy (idiomatic.POLICIES), at fp16 under mixed_float16: the mirrored
    variables, the all-reduce and the update stay float32. With network.loss_scaling the trainer is inside Keras's
    LossScaleOptimizer (optimizer.with_loss_scaling), the recipe's SGD then one that leaves the sum to the step
    (step_on_replicas says why)."""
    check_precision(network.precision)
    if dist.is_initialized():
        strategy = dist.STRATEGY
    elif tf.DeviceSpec.from_string(devices[0]).device_type == "GPU":
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        strategy = tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice(devices[0]))
    replicas = len(strategy.extended.worker_devices)
    if replicas != len(devices):   # MultiWorkerMirroredStrategy takes a worker's GPUs, but one CPU device only
        raise Unavailable(f"MultiWorkerMirroredStrategy runs {replicas} replica(s) per process here, not "
                          f"{len(devices)} (on a CPU, one): run TensorFlow's engine with as many processes as devices")
    with strategy.scope():   # everything that makes variables: the model and the optimizer's state
        net = build(weights, network, synchronized=network.sync)
        if optimizer is not None and not optimizer.is_recipe:
            trainer = get_trainer(optimizer)
        elif network.loss_scaling is None:
            trainer = tf.keras.optimizers.SGD(learning_rate=0.0)
        else:
            trainer = SGD(learning_rate=0.0)   # Keras's SGD, but the step sums the gradients
        trainer.build(net.trainable_variables)
        if state is not None:
            load_state(trainer, state, parameters(net))
        trainer = with_loss_scaling(trainer, network.loss_scaling, net.trainable_variables)
    return Model(net, trainer, strategy, network.precision)


# One graph for the whole step, traced per model and micro-batch count; reduce_retracing: shard shapes become None
# after one change.
@tf.function(reduce_retracing=True, autograph=False)
def step_on_replicas(strategy, net, trainer, X, y, batch_size=None, accumulate=1):
    """batch_size (a tensor), for an optimizer's trainer: the replicas' gradients are summed here and divided by
    it, the global batch's mean on every replica, which the trainer clips and applies as it is (Keras would clip
    each replica's own before its sum). accumulate: each replica's shard in that many micro-batches, a forward and
    backward each, their gradients added up on the replica before the one sum (Keras's own
    gradient_accumulation_steps cannot run here: accumulated's docstring).
    Under loss scaling the gradients are of the scaled loss and are always summed here, before the
    LossScaleOptimizer sees them: on a strategy that merges (every CPU one) its apply decides whether they are finite
    from the first replica's gradients alone, which in Keras 3 are not summed yet (the inner optimizer sums them
    later, inside the update): a non-finite gradient on another replica would be summed into the weights (inf, nan) and
    counted as a finite step (keras/src/optimizers/loss_scale_optimizer.py, _tf_apply's comment assumes the sum;
    tests/test_fp16_tensorflow.py shows it). Summed first, every replica checks the same sums."""
    def replica_step(X, y):
        loss, grads = accumulated(net, X, y, accumulate, trainer)
        if isinstance(unwrapped(trainer), Canonical):   # it leaves the sum to the step
            grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
        if batch_size is not None:
            grads = [g / batch_size for g in grads]
        trainer.apply_gradients(zip(grads, net.trainable_variables))   # the recipe's: all-reduce (sum), then SGD
        return loss, tf.shape(y)[0]
    return strategy.run(replica_step, args=(X, y))


def train_step(model, batch, lr, batch_size, accumulate=1):
    """The recipe's SGD: a learning rate of lr / global batch on the summed gradients makes the update the
    recipe's, computed in float32 like the scratch sgd, even when the shards differ in size. An optimizer's
    trainer: the global batch's mean gradient, at the rate of its own schedule (lr is not needed). accumulate: each
    replica's shard in that many micro-batches, one all-reduce per update. Returns the mean loss of this process's
    rows."""
    net, trainer, strategy = model.net, model.trainer, model.placement
    if follows_its_schedule(trainer):
        outputs = step_on_replicas(strategy, net, trainer, *batch, tf.constant(batch_size, tf.float32), accumulate)
    else:
        trainer.learning_rate = tf.constant(lr, tf.float32) / batch_size
        outputs = step_on_replicas(strategy, net, trainer, *batch, accumulate=accumulate)
    losses, sizes = (strategy.experimental_local_results(v) for v in outputs)
    return sum(float(loss) for loss in losses) / sum(int(n) for n in sizes)


def to_numpy(model):
    return keras_to_numpy(model)   # the Keras model, as idiomatic.py holds it


def bn_state(model):
    return resnet.model_to_numpy(model.net)[1]


def replica_bn_states(model):
    """Each replica's copy of the moving statistics, as the strategy keeps them (experimental_local_results)."""
    variables = resnet.keras_variables(model.net)
    copies = [model.placement.experimental_local_results(variables[name].value) for name in resnet.BN_STATE_NAMES]
    return [resnet.bn_state_to_numpy(replica) for replica in zip(*copies)]


def optimizer_state(model):
    return canonical_state(unwrapped(model.trainer), parameters(model.net))   # the first replica's copy: all equal


def evaluate(model, X, y):
    return evaluate_keras(model, X, y)
