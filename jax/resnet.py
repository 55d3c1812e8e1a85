"""d2l's ResNet-18 (common/resnet.py) in jax.lax ops. A replica is the list of jax arrays on one device, in
common.resnet.PARAM_NAMES order, and its BatchNorm state the list of running statistics in BN_STATE_NAMES order.
lax convolutions take any layout they are told: in NCHW/OIHW the weights are canonical; in NHWC/HWIO
common/layouts.py converts them (global average pooling leaves no flatten order to fix). JAX arrays are
immutable: forward returns the new state, and jax.jit compiles it as a pure function."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from common.layouts import to_canonical, to_channels_last
from common.resnet import (BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, PARAM_NAMES, by_canonical_name, has_projection,
                           layer_arguments, layers)

from .lenet import DIMENSIONS

layout = "nhwc"   # as lenet.layout: execution.DEFAULT_LAYOUT


def to_layout(X):
    """A canonical NCHW batch in the convolutions' layout (inside a compiled step, XLA fuses the transpose)."""
    return X.transpose(0, 2, 3, 1) if layout == "nhwc" else X


def held(name, a):
    """A canonical weight as the layout holds it: channels-last kernels and dense (in, out), or unchanged."""
    return to_channels_last(name, a) if layout == "nhwc" else a


def get_params(weights, device):
    return [jax.device_put(held(name, weights[name]), device) for name in PARAM_NAMES]


def get_bn_state(state, device):
    return [jax.device_put(state[name], device) for name in BN_STATE_NAMES]


def conv(p, name, h):
    """Explicit symmetric padding: "SAME" with stride 2 on an even input pads bottom/right only."""
    _, stride, pad = CONVS[name]
    dims = DIMENSIONS[layout]
    h = lax.conv_general_dilated(h, p[f"{name}.weight"], (stride, stride), ((pad, pad), (pad, pad)),
                                 dimension_numbers=dims)
    return h + lax.broadcast_in_dim(p[f"{name}.bias"], h.shape, (dims[2].index("C"),))


def batch_norm(p, s, name, h, training, bn, new_state):
    """common.resnet.batch_norm written out in jnp. The batch statistics are those of this array; a synchronised
    BatchNorm would all-reduce common.resnet.moments of each shard here (lax.psum under shard_map)."""
    axes, shape = ((0, 1, 2), (1, 1, 1, -1)) if layout == "nhwc" else ((0, 2, 3), (1, -1, 1, 1))
    gamma, beta = p[f"{name}.weight"], p[f"{name}.bias"]
    mean, var = s[f"{name}.running_mean"], s[f"{name}.running_var"]
    if training:
        count = int(np.prod([h.shape[a] for a in axes]))
        batch_mean = h.mean(axis=axes)
        batch_var = jnp.square(h - batch_mean.reshape(shape)).mean(axis=axes)
        running_var = batch_var * count / (count - 1) if bn.unbiased else batch_var
        new_state[f"{name}.running_mean"] = (1 - bn.momentum) * mean + bn.momentum * lax.stop_gradient(batch_mean)
        new_state[f"{name}.running_var"] = (1 - bn.momentum) * var + bn.momentum * lax.stop_gradient(running_var)
        mean, var = batch_mean, batch_var
    h = (h - mean.reshape(shape)) * lax.rsqrt(var.reshape(shape) + bn.eps)
    return h * gamma.reshape(shape) + beta.reshape(shape)


def forward(params, bn_state, X, training, bn=CANONICAL_BN):
    """Logits of the NCHW batch X; in training mode (batch statistics) also the new BatchNorm state, a list in
    BN_STATE_NAMES order. `training` and `bn` are static under jax.jit."""
    p, s, new_state = dict(zip(PARAM_NAMES, params)), dict(zip(BN_STATE_NAMES, bn_state)), {}
    norm = lambda name, h: batch_norm(p, s, name, h, training, bn, new_state)   # noqa: E731
    h = jax.nn.relu(norm("stem.bn", conv(p, "stem.conv", to_layout(X))))
    for block, stride in BLOCKS:
        y = jax.nn.relu(norm(f"{block}.bn1", conv(p, f"{block}.conv1", h)))
        y = norm(f"{block}.bn2", conv(p, f"{block}.conv2", y))
        h = jax.nn.relu(y + (conv(p, f"{block}.conv3", h) if has_projection(stride) else h))
    h = h.mean(axis=(1, 2) if layout == "nhwc" else (2, 3))   # global average pooling
    w = p["fc.weight"] if layout == "nhwc" else p["fc.weight"].T   # canonical dense weights are (out, in)
    logits = h @ w + p["fc.bias"]
    return (logits, [new_state[name] for name in BN_STATE_NAMES]) if training else logits


def to_numpy(params):
    return {name: np.ascontiguousarray(to_canonical(name, np.asarray(p)) if layout == "nhwc" else p, dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: np.asarray(t, dtype=np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


class Residual(nnx.Module):
    """d2l's Residual in Flax NNX: channels-last, explicit ((1, 1), (1, 1)) padding (Conv's default is 'SAME')."""

    def __init__(self, c_in, c, stride, bn_args, rngs):
        pad = ((1, 1), (1, 1))
        self.conv1 = nnx.Conv(c_in, c, (3, 3), strides=stride, padding=pad, rngs=rngs)
        self.bn1 = nnx.BatchNorm(c, **bn_args, rngs=rngs)
        self.conv2 = nnx.Conv(c, c, (3, 3), padding=pad, rngs=rngs)
        self.bn2 = nnx.BatchNorm(c, **bn_args, rngs=rngs)
        self.conv3 = nnx.Conv(c_in, c, (1, 1), strides=stride, padding="VALID", rngs=rngs) \
            if has_projection(stride) else None

    def __call__(self, X):
        Y = nnx.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        return nnx.relu(Y + (self.conv3(X) if self.conv3 is not None else X))


class ResNet(nnx.Module):
    """The same ResNet-18 as an idiomatic Flax NNX module: it takes the canonical NCHW batch and transposes it, like
    Keras's Permute. model.train() / model.eval() switch its BatchNorm layers (use_running_average)."""

    def __init__(self, width, bn_args, rngs):
        self.conv = nnx.Conv(1, width, (3, 3), padding=((1, 1), (1, 1)), rngs=rngs)
        self.bn = nnx.BatchNorm(width, **bn_args, rngs=rngs)
        blocks, c_in = [], width
        for block, stride in BLOCKS:
            c = layers(width)[f"{block}.conv1"][1][0]
            blocks.append(Residual(c_in, c, stride, bn_args, rngs))
            c_in = c
        self.blocks = nnx.List(blocks)
        self.fc = nnx.Linear(c_in, layers(width)["fc"][1][0], rngs=rngs)

    def __call__(self, X):
        h = nnx.relu(self.bn(self.conv(X.transpose(0, 2, 3, 1))))   # NCHW -> NHWC
        for residual in self.blocks:
            h = residual(h)
        return self.fc(h.mean(axis=(1, 2)))   # global average pooling


# canonical suffix -> the Flax variable's attribute (Param, or BatchStat for the running statistics)
FLAX_NAMES = {"weight": ("kernel", "scale"), "bias": ("bias",), "running_mean": ("mean",), "running_var": ("var",)}


def flax_variables(model):
    """canonical name -> nnx.Variable, for parameters and BatchNorm state alike."""
    return by_canonical_name(model, FLAX_NAMES)


def build_model(weights, bn_state, bn=CANONICAL_BN):
    """The idiomatic Flax model holding the canonical weights and state in Flax's layout, its nnx.BatchNorm set to
    `bn`'s momentum (Flax's weighs the running value: 0.9, not PyTorch's 0.1) and epsilon; in training mode."""
    model = ResNet(weights["stem.conv.weight"].shape[0], layer_arguments("jax", bn), nnx.Rngs(0))
    for name, variable in flax_variables(model).items():
        variable.value = jnp.asarray(to_channels_last(name, {**weights, **bn_state}[name]))
    return model


def model_to_numpy(model):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse."""
    found = {name: np.ascontiguousarray(to_canonical(name, np.asarray(v.value)), dtype=np.float32)
             for name, v in flax_variables(model).items()}
    return {name: found[name] for name in PARAM_NAMES}, {name: found[name] for name in BN_STATE_NAMES}
