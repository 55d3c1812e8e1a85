"""LeNet in jax.lax ops. A replica is the list of jax arrays on one device, in common.lenet.PARAM_NAMES
order. lax convolutions take any layout they are told (dimension numbers): in the canonical one, NCHW/OIHW,
the weights need no conversion; in the channels-last one, NHWC/HWIO, common/layouts.py converts them.
JAX arrays are immutable: an update makes new arrays, and the replica's list slots are re-pointed at them."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from common.layouts import to_canonical, to_channels_last
from common.lenet import LAYERS, NUM_CLASSES, PARAM_NAMES, POOL

# execution.py names and chooses the layouts (LAYOUTS, DEFAULT_LAYOUT).
DIMENSIONS = {"nchw": ("NCHW", "OIHW", "NCHW"), "nhwc": ("NHWC", "HWIO", "NHWC")}   # input, kernel, output
layout = "nhwc"   # the scratch step's: execution.DEFAULT_LAYOUT at import; execution.use_layout replaces it


def to_layout(X):
    """A canonical NCHW batch in the convolutions' layout (inside the compiled step, XLA fuses the transpose)."""
    return X.transpose(0, 2, 3, 1) if layout == "nhwc" else X


def held(name, a):
    """A canonical weight as the layout holds it: channels-last kernels, dense (in, out) and fc1's rows in
    H, W, C order (common/layouts.py), or unchanged."""
    return to_channels_last(name, a) if layout == "nhwc" else a


def get_params(weights, device):
    return [jax.device_put(held(name, weights[name]), device) for name in PARAM_NAMES]


def avg_pool(h):
    window = tuple(POOL if axis in "HW" else 1 for axis in DIMENSIONS[layout][0])
    return lax.reduce_window(h, 0.0, lax.add, window, window, "VALID") / (POOL * POOL)


def conv(h, w, b):
    """Convolution plus bias, the bias broadcast along the layout's channel axis."""
    dims = DIMENSIONS[layout]
    h = lax.conv_general_dilated(h, w, (1, 1), "VALID", dimension_numbers=dims)
    return h + lax.broadcast_in_dim(b, h.shape, (dims[2].index("C"),))


def forward(params, X):
    """A unit of data_parallel.py's step, which execution.use puts back as written at every level (jax.jit
    compiles loss_and_grads around it)."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    if layout == "nchw":                   # canonical dense weights are (out, in)
        w3, w4 = w3.T, w4.T
    h = avg_pool(jax.nn.relu(conv(to_layout(X), w1, b1)))
    h = avg_pool(jax.nn.relu(conv(h, w2, b2)))
    h = h.reshape(h.shape[0], -1)          # C, H, W or H, W, C order: fc1's rows were made to match
    h = jax.nn.relu(h @ w3 + b3)
    return h @ w4 + b4


def loss_sum(logits, y):
    """Cross-entropy summed over the shard: shards add up to the global batch exactly."""
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None].astype(jnp.int32), axis=1))


def to_numpy(params):
    return {name: np.ascontiguousarray(to_canonical(name, np.asarray(p)) if layout == "nhwc" else p, dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


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
