"""LeNet in jax.lax ops. A replica is the list of jax arrays on one device, in common.lenet.PARAM_NAMES
order. lax convolutions take any layout they are told (dimension numbers): in the canonical one, NCHW/OIHW,
the weights need no conversion; in the channels-last one, NHWC/HWIO, common/layouts.py converts them.
JAX arrays are immutable: an update makes new arrays, and the replica's list slots are re-pointed at them."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from common.layouts import to_canonical, to_channels_last
from common.lenet import LAYERS, NUM_CLASSES, PARAM_NAMES, POOL

# execution.py names and chooses the layouts (LAYOUTS; its DEFAULT_LAYOUT is this one, kept here for the models).
DIMENSIONS = {"nchw": ("NCHW", "OIHW", "NCHW"), "nhwc": ("NHWC", "HWIO", "NHWC")}   # input, kernel, output
DEFAULT_LAYOUT = "nhwc"


def to_layout(X, layout=DEFAULT_LAYOUT):
    """A canonical NCHW batch in the convolutions' layout (inside the compiled step, XLA fuses the transpose)."""
    return X.transpose(0, 2, 3, 1) if layout == "nhwc" else X


def held(name, a, layout=DEFAULT_LAYOUT):
    """A canonical weight as the layout holds it: channels-last kernels, dense (in, out) and fc1's rows in
    H, W, C order (common/layouts.py), or unchanged."""
    return to_channels_last(name, a) if layout == "nhwc" else a


def get_params(weights, device, layout=DEFAULT_LAYOUT):
    return [jax.device_put(held(name, weights[name], layout), device) for name in PARAM_NAMES]


def avg_pool(h, layout):
    window = tuple(POOL if axis in "HW" else 1 for axis in DIMENSIONS[layout][0])
    return lax.reduce_window(h, 0.0, lax.add, window, window, "VALID") / (POOL * POOL)


def conv(h, w, b, layout):
    """Convolution plus bias, the bias broadcast along the layout's channel axis."""
    dims = DIMENSIONS[layout]
    h = lax.conv_general_dilated(h, w, (1, 1), "VALID", dimension_numbers=dims)
    return h + lax.broadcast_in_dim(b, h.shape, (dims[2].index("C"),))


def forward(params, X, layout=DEFAULT_LAYOUT):
    """Logits of the NCHW batch X on one replica held in `layout` (a Python value: static under jax.jit)."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    if layout == "nchw":                   # canonical dense weights are (out, in)
        w3, w4 = w3.T, w4.T
    h = avg_pool(jax.nn.relu(conv(to_layout(X, layout), w1, b1, layout)), layout)
    h = avg_pool(jax.nn.relu(conv(h, w2, b2, layout)), layout)
    h = h.reshape(h.shape[0], -1)          # C, H, W or H, W, C order: fc1's rows were made to match
    h = jax.nn.relu(h @ w3 + b3)
    return h @ w4 + b4


def loss_sum(logits, y):
    """Cross-entropy summed over the shard: shards add up to the global batch exactly."""
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None].astype(jnp.int32), axis=1))


def summed_loss(params, X, y, layout=DEFAULT_LAYOUT):
    """One shard's summed loss, as a function of the replica: what its gradients are taken of."""
    return loss_sum(forward(params, X, layout), y)


def to_numpy(params, layout=DEFAULT_LAYOUT):
    return {name: np.ascontiguousarray(to_canonical(name, np.asarray(p)) if layout == "nhwc" else p, dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


@functools.partial(jax.jit, static_argnames="layout")
def predict(params, X, layout=DEFAULT_LAYOUT):
    return forward(params, X, layout).argmax(1)


def evaluate(params, X, y, layout=DEFAULT_LAYOUT, batch_size=1000):
    (device,) = params[0].devices()
    correct = 0
    for i in range(0, len(X), batch_size):
        X_batch = jax.device_put(X[i:i + batch_size], device)
        correct += (jax.device_get(predict(params, X_batch, layout)) == y[i:i + batch_size]).sum()
    return float(correct) / len(X)


@dataclasses.dataclass(frozen=True)
class Functional:
    """The LeNet as the recipe writes it (common.interface.FUNCTIONAL): a replica is a list of arrays on one device,
    the forward a function of it. Frozen and hashable, its layout a field: jax.jit takes it as a static argument."""
    layout: str = DEFAULT_LAYOUT
    name = "lenet"
    param_names = PARAM_NAMES

    def get_params(self, weights, device):
        return get_params(weights, device, self.layout)

    def get_bn_state(self, state, device):
        return None   # no BatchNorm

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices):
        """Each device's summed loss and gradients, its own work: dispatched asynchronously, the devices work in
        parallel (JAX places each op where its inputs are)."""
        losses, grads = [], []
        for params, X, y in zip(replicas, X_shards, y_shards):
            loss, device_grads = jax.value_and_grad(summed_loss)(params, X, y, self.layout)
            losses.append(loss)
            grads.append(device_grads)
        return losses, grads, bn_states

    def to_numpy(self, replica):
        return to_numpy(replica, self.layout)

    def bn_state_to_numpy(self, bn_state):
        return {}

    def evaluate(self, replica, bn_state, X, y):
        return evaluate(replica, X, y, self.layout)


class LeNet(nnx.Module):
    """The same LeNet as an idiomatic Flax NNX module. Flax is channels-last (NHWC inputs, HWIO kernels,
    dense (in, out)): the module takes the canonical NCHW batch and transposes it, like Keras's Permute,
    and its weights are the canonical ones converted by common/layouts.py."""

    def __init__(self, rngs):
        (c1, _, k1, _), (c2, _, k2, _) = LAYERS["conv1"][1], LAYERS["conv2"][1]
        (h1, f1), h2 = LAYERS["fc1"][1], LAYERS["fc2"][1][1]
        self.conv1 = nnx.Conv(1, c1, (k1, k1), padding="VALID", rngs=rngs)
        self.conv2 = nnx.Conv(c1, c2, (k2, k2), padding="VALID", rngs=rngs)
        self.fc1 = nnx.Linear(f1, h1, rngs=rngs)
        self.fc2 = nnx.Linear(h2, NUM_CLASSES, rngs=rngs)

    def __call__(self, X):
        pool = lambda h: nnx.avg_pool(h, (POOL, POOL), strides=(POOL, POOL))   # noqa: E731
        h = X.transpose(0, 2, 3, 1)        # NCHW -> NHWC
        h = pool(nnx.relu(self.conv1(h)))
        h = pool(nnx.relu(self.conv2(h)))
        h = h.reshape(h.shape[0], -1)      # H, W, C order: fc1's rows were reordered to match
        return self.fc2(nnx.relu(self.fc1(h)))

    def layers(self):
        """(parameter name, nnx.Param) in PARAM_NAMES order: kernels are Flax's name for weights."""
        for layer in LAYERS:
            module = getattr(self, layer)
            yield f"{layer}.weight", module.kernel
            yield f"{layer}.bias", module.bias


def build_model(weights):
    """The idiomatic Flax model (for the reference loop), holding the canonical weights in Flax's layout."""
    model = LeNet(nnx.Rngs(0))
    for name, param in model.layers():
        param.value = jnp.asarray(to_channels_last(name, weights[name]))
    return model


def model_to_numpy(model):
    """A Flax model's weights in canonical layout (the inverse of build_model)."""
    return {name: np.ascontiguousarray(to_canonical(name, np.asarray(param.value)), dtype=np.float32)
            for name, param in model.layers()}
