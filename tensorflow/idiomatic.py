"""TensorFlow's minimal training loop, the guide's "custom training loop": a keras.Sequential,
keras.optimizers.SGD and a tf.function step with GradientTape on one device, no harness. The
benchmark times it beside the scratch step to show what the from-scratch recipe costs."""

import tensorflow as tf

from common.interface import Model, Unavailable

from .lenet import build_model, to_numpy as params_to_numpy

EXEC = "tf.function"
COMPILES = "whole step"
LAYOUT = "NHWC (Keras)"

# Summed, not averaged: the step then divides by the global batch size, as the recipe does.
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")


def get_model(weights, devices):
    if len(devices) != 1:
        raise Unavailable("the idiomatic loop is the single-device reference: run it with 1 device")
    with tf.device(devices[0]):
        net = build_model(weights)
        trainer = tf.keras.optimizers.SGD(learning_rate=0.0)
        trainer.build(net.trainable_variables)
    return Model(net, trainer)


# One graph for the step; reduce_retracing: the last, smaller batch of an epoch does not retrace again.
@tf.function(reduce_retracing=True)
def fit_batch(net, trainer, X, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, net(X, training=True))
    grads = tape.gradient(loss, net.trainable_variables)
    trainer.apply_gradients(zip(grads, net.trainable_variables))
    return loss


def train_step(model, X, y, devices, lr, batch_size=None):
    """A learning rate of lr / batch_size on the summed loss: the recipe's update."""
    net, trainer, _ = model
    trainer.learning_rate = tf.constant(lr, tf.float32) / (batch_size or len(X))
    with tf.device(devices[0]):   # copies, as split_and_load
        X, y = tf.convert_to_tensor(X), tf.convert_to_tensor(y)
    return float(fit_batch(net, trainer, X, y)) / len(X)


def to_numpy(model):
    return params_to_numpy(model.net.weights)   # to_canonical on each, in PARAM_NAMES order


def evaluate(model, X, y, batch_size=1000):
    net = model.net
    correct = 0
    for i in range(0, len(X), batch_size):
        logits = net(X[i:i + batch_size], training=False)
        correct += (tf.argmax(logits, 1).numpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
