"""JAX's usual training loop, as in Flax's guides: a Flax NNX module, an Optax optimizer held by
nnx.Optimizer and an nnx.jit step on one device, no harness. The benchmark times it beside the scratch
step to show what the from-scratch recipe costs.
--precision bf16 is Flax's mixed precision as its users write it: the modules built with dtype=bf16 and fp32
parameters (lenet.flax_dtypes), the loss on the logits cast to fp32, the nnx.jit step as it is (XLA's default
options). It differs from common/precision.py where Flax computes otherwise: nnx.Conv and nnx.Linear add their bias in
bf16 to their rounded products (two roundings) and sum the bias's gradient over the batch in bf16; nnx.avg_pool (the
LeNet's) sums in bf16; and XLA's excess precision, left on, keeps the weight gradients' fp32 sums unrounded. Measured
on 64 images against the numpy reference (common/backprop.py): the LeNet's loss 3.6e-4 off, its gradients 3.3e-2 in
norm (the scratch step's: 1e-7 and 1e-5); the ResNet's loss the scratch step's (4.4e-4 off), its gradients 4.4e-2
(the scratch's 3.3e-2): within common/precision.py's BOUND and GRADIENT_BOUND.
--precision fp16 builds the modules with dtype=fp16 alike, their convolutions given Flax's hook for an fp32 sum
(lenet.flax_conv: XLA's CPU may sum an fp16 convolution in fp16). JAX and Flax have no loss scaler: the step is
common/loss_scaling.py's rule written in it (update_if_finite), the scale a traced argument of the nnx.jit step, the
scaler itself (common.loss_scaling.Scaler, moved on the host by the `finite` the step returns) the model's `mixed`.
Measured on 64 images at a scale of 16: the LeNet's loss 1.3e-5 off, its update 2.8e-3 in norm; the ResNet's 7.1e-5
and 2.6e-2 (Flax adds the bias in fp16 after the rounding and sums its gradient in fp16: the spec does neither)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from common.interface import Model, Network, Unavailable
from common.layouts import to_canonical
from common.loss_scaling import Scaler
from common.sharding import micro_batches

from . import resnet
from .lenet import build_model, model_to_numpy, scaled
from .optimizer import canonical_state, flax_paths, get_trainer, load_state

EXEC = "nnx.jit"
COMPILES = "whole step"
LAYOUT = "NHWC (Flax)"


def get_model(weights, devices, optimizer=None, state=None, port="canonical", network=Network()):
    """The recipe's plain SGD (optimizer None or its is_recipe): optax.inject_hyperparams makes the learning rate
    a value of the optimizer state, so a step can set it without recompiling (the recipe's lr / batch size changes
    on an epoch's last, smaller batch). Any other optimizer: optimizer.py's Optax transformation, its own
    schedule driven by its own step count, from the canonical `state` of a checkpoint if given (its buffers and
    counts: the next update is step state["step"]); port="stock", what a straightforward port builds (optimizer.py).
    The network is the LeNet, or the ResNet with nnx.BatchNorm (network.sync changes nothing on one device), with any
    optimizer: Optax's over its nnx.Param (BatchNorm's scale and bias decay too; its BatchStat are no parameters).
    At bf16 (network.precision) the modules are built as Flax's mixed precision is written, dtype=bf16 with fp32
    parameters (lenet.flax_dtypes): the Optax update and its state stay fp32, only the forward and backward compute
    in bf16 (summed_loss). network.loss_scaling (fp16's): a loss scaler with the run's settings, kept as the model's
    `mixed` (Model's field for what mixed precision adds beside the net)."""
    if len(devices) != 1:
        raise Unavailable("the idiomatic loop is the single-device reference: run it with 1 device")
    recipe = optimizer is None or optimizer.is_recipe
    with jax.default_device(devices[0]):
        net = build(weights, network)
        tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0) if recipe else get_trainer(optimizer, port)
        trainer = nnx.Optimizer(net, tx, wrt=nnx.Param)
        if state is not None and not recipe:
            load_state(trainer, state, flax_paths(net))
    scaler = None if network.loss_scaling is None else Scaler(network.loss_scaling)
    return Model(net, trainer, precision=network.precision, mixed=scaler)


def build(weights, network):
    """The idiomatic network: the LeNet, or the ResNet holding network.bn_state, in training mode, computing at
    network.precision."""
    if network.bn_state is None:
        return build_model(weights, network.precision)
    return resnet.build_model(weights, network.bn_state, precision=network.precision)


def is_resnet(net):
    return isinstance(net, resnet.ResNet)


def summed_loss(net, X, y):
    """Summed, not averaged: the step then divides by the global batch size. The loss in fp32 from the logits however
    the net computed them (at bf16 they are bf16: Flax's mixed-precision examples cast them before the loss)."""
    return optax.softmax_cross_entropy_with_integer_labels(net(X).astype(jnp.float32), y).sum()


def scaled_loss(net, X, y, loss_scale):
    """The summed loss times fp16's `loss_scale` (None: as it is), and the loss (the aux: lenet.scaled)."""
    return scaled(summed_loss(net, X, y), loss_scale)


def summed_loss_and_grads(net, X, y, count, loss_scale=None):
    """The summed loss and its gradients (of the loss times `loss_scale`, if given), over `count` micro-batches of
    X, y (common.sharding.micro_batches), added up in the compiled step (the loop unrolled); the ResNet's running
    statistics move once per micro-batch. Optax's MultiSteps would take one micro-batch per call and apply the mean of
    a fixed K of them (an epoch's last batch may cut fewer)."""
    loss = grads = None
    for start, stop in micro_batches(len(y), count):
        (_, micro_loss), micro_grads = nnx.value_and_grad(scaled_loss, has_aux=True)(net, X[start:stop],
                                                                                      y[start:stop], loss_scale)
        if grads is None:
            loss, grads = micro_loss, micro_grads
        else:
            loss, grads = loss + micro_loss, jax.tree.map(jnp.add, grads, micro_grads)
    return loss, grads


def update_if_finite(update, net, trainer, grads, loss_scale):
    """update(net, trainer, grads), at fp16 (a `loss_scale`) on the gradients multiplied by 1/loss_scale in fp32 and
    only where every one is finite: nnx.cond, so a skipped step leaves the parameters, the Optax state and
    nnx.Optimizer's step count as they were (the running statistics the forward moved stay moved). Returns whether
    the gradients were finite. optax.apply_if_finite is not enough: it has no scale to unscale by or to move, it
    applies a non-finite update after max_consecutive_errors skips in a row, and nnx.Optimizer.update counts its step
    even where apply_if_finite skips the update (Optax's count stays), so the two counts would part."""
    if loss_scale is None:
        update(net, trainer, grads)
        return jnp.array(True)
    grads = jax.tree.map(lambda g: g * (1 / loss_scale), grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    nnx.cond(finite, update, lambda net, trainer, grads: None, net, trainer, grads)
    return finite


# The compiled steps, one per micro-batch count; nnx.jit carries the module's and the optimizer's state in and out.
# Each returns the summed loss and whether the update ran; `loss_scale` (None: none) is traced, a scale no recompile.
@functools.partial(nnx.jit, static_argnames="count")
def fit_batch(net, trainer, X, y, lr, loss_scale=None, count=1):
    loss, grads = summed_loss_and_grads(net, X, y, count, loss_scale)

    def update(net, trainer, grads):
        trainer.opt_state.hyperparams["learning_rate"].value = lr
        trainer.update(net, grads)
    return loss, update_if_finite(update, net, trainer, grads, loss_scale)


@functools.partial(nnx.jit, static_argnames="count")
def fit_batch_mean(net, trainer, X, y, batch_size, loss_scale=None, count=1):
    """The optimizer's own schedule sets the rate: its gradient is the global batch's mean."""
    loss, grads = summed_loss_and_grads(net, X, y, count, loss_scale)

    def update(net, trainer, grads):
        trainer.update(net, jax.tree.map(lambda g: g / batch_size, grads))
    return loss, update_if_finite(update, net, trainer, grads, loss_scale)


def train_step(model, X, y, devices, lr, batch_size=None, accumulate=1):
    """The recipe's update: a learning rate of lr / batch_size on the summed loss. Any other optimizer follows its
    own schedule (lr is not used). accumulate: the batch in that many micro-batches, their gradients added up
    before the one update (summed_loss_and_grads). With a loss scaler (model.mixed) the step runs at its scale, and
    whether the step's gradients were finite moves it."""
    net, trainer, scaler = model.net, model.trainer, model.mixed
    X, y = jax.device_put(X, devices[0]), jax.device_put(y, devices[0])   # copies, as split_and_load
    batch_size = batch_size or len(X)
    loss_scale = None if scaler is None else jnp.float32(scaler.scale)
    if hasattr(trainer.opt_state, "hyperparams"):   # the recipe's inject_hyperparams(sgd)
        loss, finite = fit_batch(net, trainer, X, y, lr / batch_size, loss_scale, count=accumulate)
    else:
        loss, finite = fit_batch_mean(net, trainer, X, y, batch_size, loss_scale, count=accumulate)
    if scaler is not None:
        scaler.update(bool(finite))
    return float(loss) / len(X)


def scaler_state(model):
    """The model's loss scaler between steps (common.loss_scaling.ScalerState; None without one)."""
    return None if model.mixed is None else model.mixed.state()


def restore_scaler(model, state):
    """The model's loss scaler carries on from a checkpoint's ScalerState."""
    model.mixed.restore(state)


def to_numpy(model):
    if is_resnet(model.net):
        return resnet.model_to_numpy(model.net)[0]
    return model_to_numpy(model.net)


def bn_state(model):
    return resnet.model_to_numpy(model.net)[1]


def replica_bn_states(model):
    return [bn_state(model)]   # one device


def optimizer_state(model):
    """The canonical state of the model's nnx.Optimizer (its buffers converted as the weights are), by the network's
    parameter names."""
    state = canonical_state(nnx.to_pure_dict(nnx.state(model.trainer)), flax_paths(model.net))
    return {key: value if key == "step" else np.ascontiguousarray(to_canonical(key.split(".", 1)[1], value))
            for key, value in state.items()}


@nnx.jit
def predict(net, X):
    return net(X).argmax(1)


def evaluate(model, X, y, batch_size=1000):
    """In eval mode: the ResNet's BatchNorm by its running statistics (then back to training mode)."""
    net = model.net
    net.eval()
    correct = 0
    for i in range(0, len(X), batch_size):
        correct += (jax.device_get(predict(net, X[i:i + batch_size])) == y[i:i + batch_size]).sum()
    net.train()
    return float(correct) / len(X)
