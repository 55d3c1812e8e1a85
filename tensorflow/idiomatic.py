"""TensorFlow's minimal training loop, the guide's "custom training loop": a keras.Sequential,
keras.optimizers.SGD and a tf.function step with GradientTape on one device, no harness. The
benchmark times it beside the scratch step to show what the from-scratch recipe costs."""

import tensorflow as tf

from common.interface import Model, Network, Unavailable
from common.lenet import PARAM_NAMES
from common.loss_scaling import ScalerState
from common.precision import check as check_precision

from . import resnet
from .data_parallel import micro_bounds
from .lenet import build_model, to_numpy as params_to_numpy
from .optimizer import follows_its_schedule, get_trainer, canonical_state, load_state, unwrapped, with_loss_scaling

EXEC = "tf.function"
COMPILES = "whole step"
LAYOUT = "NHWC (Keras)"

# Each precision's Keras dtype policy, given to every layer as its dtype (not keras.mixed_precision.set_global_policy,
# the process's): None, Keras's default float32, at fp32; at bf16 "mixed_bfloat16" (at fp16 "mixed_float16"), Keras's
# mixed precision: float32 variables (the master weights, and the optimizer's variables made after them), each layer
# casting its inputs and its variables to bfloat16 (float16) and computing in it, BatchNormalization in float32
# (common/precision.py).
POLICIES = {"fp32": None, "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}

# Summed, not averaged: the step then divides by the global batch size, as the recipe does. On bf16 logits too: a
# Keras Loss converts y_pred to its own dtype, float32 (keras/src/losses/loss.py, Loss.__call__), so the softmax and
# the sum run in fp32.
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")


def get_model(weights, devices, optimizer=None, state=None, port="canonical", network=Network()):
    """The recipe's SGD (optimizer None or the recipe's), or Keras's optimizer and schedule for a
    common.optim.Optimizer: computing its update ("canonical"), or as a straightforward port has it ("stock":
    optimizer.get_trainer says what differs); from a checkpoint's canonical `state` if given. The network is the
    LeNet, or the ResNet with BatchNormalization (network.sync changes nothing on one device); Keras's optimizer trains
    every trainable variable, the ResNet's BatchNorm gamma and beta and every bias included (weight decay too). At bf16
    the layers compute under Keras's mixed_bfloat16 policy (POLICIES), at fp16 under mixed_float16; the variables and
    the update stay float32. With network.loss_scaling the trainer is inside Keras's LossScaleOptimizer
    (optimizer.with_loss_scaling)."""
    check_precision(network.precision)
    if len(devices) != 1:
        raise Unavailable("the idiomatic loop is the single-device reference: run it with 1 device")
    with tf.device(devices[0]):
        net = build(weights, network)
        if optimizer is None or optimizer.is_recipe:
            trainer = tf.keras.optimizers.SGD(learning_rate=0.0)
        else:
            trainer = get_trainer(optimizer, port)
        trainer.build(net.trainable_variables)
        if state is not None:
            load_state(trainer, state, parameters(net))
        trainer = with_loss_scaling(trainer, network.loss_scaling, net.trainable_variables)
    return Model(net, trainer, precision=network.precision)


def build(weights, network, synchronized=False):
    """The idiomatic network: the LeNet, or the ResNet holding network.bn_state (its BatchNormalization layers
    synchronised over a strategy's replicas if asked), its layers at network.precision's dtype policy."""
    dtype = POLICIES[network.precision]
    if network.bn_state is None:
        return build_model(weights, dtype)
    return resnet.build_model(weights, network.bn_state, synchronized=synchronized, dtype=dtype)


def is_resnet(net):
    return any(layer.name == "stem.conv" for layer in net.layers)


def parameters(net):
    """canonical parameter name -> the Keras model's trainable variable, in the canonical order: the LeNet's in its
    Sequential order (PARAM_NAMES), the ResNet's by layer name (its BatchNorm's gamma and beta; the moving statistics
    are not trained and have no optimizer state)."""
    if is_resnet(net):
        variables = resnet.keras_variables(net)
        return {name: variables[name] for name in resnet.PARAM_NAMES}
    return dict(zip(PARAM_NAMES, net.trainable_variables, strict=True))


def accumulated(net, X, y, count, trainer=None):
    """The Keras net's summed loss and its gradients, over `count` micro-batches of X, y (common.sharding
    .micro_batches: data_parallel.micro_bounds), the loop unrolled in the step's graph; the BatchNorm's moving
    statistics go through them in turn. Keras 3's own accumulation, an optimizer's gradient_accumulation_steps, averages
    a fixed K calls (an epoch's last batch may cut fewer) with a schedule that counts micro-batches; and under
    MirroredStrategy in a tf.function it cannot run: it applies the update inside a cond, and the all-reduce in that
    cond is a merge_call, which the strategy refuses (RuntimeError "merge_call called while defining a new graph":
    keras-team/keras 17429, tensorflow/tensorflow 59487; tests/test_accumulation.py runs it). Under a `trainer` that
    scales the loss (a LossScaleOptimizer) every micro-batch's gradients are of its loss times the trainer's scale,
    Keras's scale_loss in the tape, as its guide writes a custom loop; the loss returned is unscaled."""
    loss = grads = None
    parts = [(X, y)] if count == 1 else [(X[a:b], y[a:b]) for a, b in micro_bounds(y, count)]
    for X_micro, y_micro in parts:
        with tf.GradientTape() as tape:
            micro_loss = loss_fn(y_micro, net(X_micro, training=True))   # summed over the rows
            target = trainer.scale_loss(micro_loss) if is_loss_scaled(trainer) else micro_loss
        micro_grads = tape.gradient(target, net.trainable_variables)
        if grads is None:
            loss, grads = micro_loss, micro_grads
        else:
            loss, grads = loss + micro_loss, [a + b for a, b in zip(grads, micro_grads)]
    return loss, grads


def is_loss_scaled(trainer):
    """Whether `trainer` is Keras's dynamic loss scaler (optimizer.with_loss_scaling)."""
    return isinstance(trainer, tf.keras.optimizers.LossScaleOptimizer)


# One graph for the step, per micro-batch count; reduce_retracing: the last, smaller batch of an epoch does not
# retrace again.
@tf.function(reduce_retracing=True)
def fit_batch(net, trainer, X, y, batch_size=None, accumulate=1):
    """batch_size (a tensor) divides the summed loss's gradients: the batch's mean, for an optimizer's trainer. A
    LossScaleOptimizer gets the scaled gradients: its apply unscales them and skips the update if one is not finite."""
    loss, grads = accumulated(net, X, y, accumulate, trainer)
    if batch_size is not None:
        grads = [g / batch_size for g in grads]
    trainer.apply_gradients(zip(grads, net.trainable_variables))
    return loss


def train_step(model, X, y, devices, lr, batch_size=None, accumulate=1):
    """The recipe's SGD: a learning rate of lr / batch_size on the summed loss. An optimizer's trainer: the batch's
    mean gradient, at the rate of its own schedule (lr, the spec's, is not needed). accumulate: the batch in that many
    micro-batches, their gradients added up before the one update (accumulated)."""
    net, trainer = model.net, model.trainer
    batch_size = batch_size or len(X)
    with tf.device(devices[0]):   # copies, as split_and_load
        X, y = tf.convert_to_tensor(X), tf.convert_to_tensor(y)
    if follows_its_schedule(trainer):
        return float(fit_batch(net, trainer, X, y, tf.constant(batch_size, tf.float32), accumulate)) / len(X)
    trainer.learning_rate = tf.constant(lr, tf.float32) / batch_size
    return float(fit_batch(net, trainer, X, y, accumulate=accumulate)) / len(X)


def scaler_state(model):
    """Keras's LossScaleOptimizer between steps (common.loss_scaling.ScalerState; None without one): its variables
    dynamic_scale and step_counter (the finite steps since the scale last changed), the same on every replica."""
    if not is_loss_scaled(model.trainer):
        return None
    scale = float(model.trainer.dynamic_scale.numpy())
    return ScalerState(scale, scale, int(model.trainer.step_counter.numpy()))


def restore_scaler(model, state):
    """The LossScaleOptimizer carries on from a checkpoint's ScalerState: its two variables assigned (on every
    replica, under a strategy)."""
    model.trainer.dynamic_scale.assign(state.scale)
    model.trainer.step_counter.assign(state.good_steps)


def to_numpy(model):
    if is_resnet(model.net):
        return resnet.model_to_numpy(model.net)[0]
    return params_to_numpy(model.net.weights)   # to_canonical on each, in PARAM_NAMES order


def bn_state(model):
    return resnet.model_to_numpy(model.net)[1]


def replica_bn_states(model):
    return [bn_state(model)]   # one device


def optimizer_state(model):
    return canonical_state(unwrapped(model.trainer), parameters(model.net))


def evaluate(model, X, y, batch_size=1000):
    """training=False: inference mode, the ResNet's BatchNorm by its moving statistics."""
    net = model.net
    correct = 0
    for i in range(0, len(X), batch_size):
        logits = net(X[i:i + batch_size], training=False)
        correct += (tf.argmax(logits, 1).numpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
