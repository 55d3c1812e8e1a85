"""LeNet in jax.lax ops. A replica is the list of jax arrays on one device, in common.lenet.PARAM_NAMES
order. lax convolutions take any layout they are told (dimension numbers): in the canonical one, NCHW/OIHW,
the weights need no conversion; in the channels-last one, NHWC/HWIO, common/layouts.py converts them.
JAX arrays are immutable: an update makes new arrays, and the replica's list slots are re-pointed at them.
JAX has no automatic mixed precision: at bf16 or fp16 (common/precision.py) the casts are written here, in the traced
forward, and jax.grad transposes them (a cast's transpose widens the gradient back to the fp32 master weight).
Nor has it a loss scaler: at fp16 the step differentiates the loss times the scale it is given (scaled_loss)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from common.layouts import to_canonical, to_channels_last
from common.lenet import LAYERS, NUM_CLASSES, PARAM_NAMES, POOL
from common.precision import DTYPES, is_low

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
    """Summed in fp32 whatever h's precision, rounded back to it once (common/precision.py): XLA rounds every partial
    sum of a bf16 reduce_window to bf16."""
    window = tuple(POOL if axis in "HW" else 1 for axis in DIMENSIONS[layout][0])
    return (lax.reduce_window(h.astype(jnp.float32), 0.0, lax.add, window, window, "VALID")
            / (POOL * POOL)).astype(h.dtype)


def compute_dtype(precision):
    """The dtype a convolution or dense layer computes in at a low precision: bfloat16 or float16."""
    return jnp.dtype(DTYPES[precision])


def low(x, precision):
    """x as a convolution or dense layer at `precision` takes it: cast to bf16 at bf16, to fp16 at fp16, unchanged
    at fp32."""
    return x.astype(compute_dtype(precision)) if is_low(precision) else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def accumulated_conv(h, w, strides, padding, dims):
    """The bf16 (or fp16) convolution given in fp32 (preferred_element_type), for its bias to be added before the one
    rounding. Its own backward: JAX 0.7's transpose of it convolves the fp32 cotangent with a bf16 operand, which lax
    rejects ("requires arguments to have the same dtypes"; jax-ml/jax#31592, fixed after 0.7.1)."""
    return lax.conv_general_dilated(h, w, strides, padding, dimension_numbers=dims, preferred_element_type=jnp.float32)


def accumulated_conv_forward(h, w, strides, padding, dims):
    return accumulated_conv(h, w, strides, padding, dims), (h, w)


def accumulated_conv_backward(strides, padding, dims, operands, g):
    """The cotangent comes back through the output's cast to bf16 (fp16): a bf16 (fp16) value, cast to it exactly.
    Both gradients are fp32 convolutions of the low-precision values (their products are exact in fp32), each summed in
    fp32 and rounded once to the low precision (common/precision.py), as a bf16 convolution computes on XLA's CPU
    (widened to fp32, one rounding: the same bits). An fp16 convolution XLA's CPU may run in fp16 itself, rounding as
    it sums (9 of 10 outputs a rounding off on an Intel Xeon with AVX512-FP16; an AMD EPYC Zen 4 widens it), so the
    input's gradient is written in fp32 too. The weight's sum over the batch stays fp32 until the rounding: under jit
    over a mesh (builtin.py) the all-reduce XLA places inside that sum is then fp32, where after a bf16 convolution it is a bf16 one (XLA's CPU sums it in fp32 and rounds the sum back
    to bf16); at fp16 its one rounding is where an overflow makes inf. What preferred_element_type=f32 would say,
    which JAX 0.7.1 cannot transpose (accumulated_conv)."""
    h, w = operands

    def conv(h, w):
        return lax.conv_general_dilated(h, w, strides, padding, dimension_numbers=dims)
    wide = lambda x: x.astype(jnp.float32)   # noqa: E731
    g = wide(g.astype(h.dtype))
    dh = jax.vjp(lambda h: conv(h, wide(w)), wide(h))[1](g)[0]
    dw = jax.vjp(lambda w: conv(wide(h), w), wide(w))[1](g)[0]
    return dh.astype(h.dtype), dw.astype(w.dtype)


accumulated_conv.defvjp(accumulated_conv_forward, accumulated_conv_backward)


def convolution(h, w, b, strides, padding, dims, precision="fp32"):
    """Convolution plus bias, the bias broadcast along the output's channel axis. At bf16 input, weight and bias in
    bf16, the products and the bias summed in fp32 and rounded to bf16 once (common/precision.py); at fp16 in fp16."""
    if is_low(precision):
        h = accumulated_conv(low(h, precision), low(w, precision), strides, padding, dims)
        b = low(b, precision).astype(jnp.float32)   # widened before broadcasting: its gradient summed in fp32
        h = h + lax.broadcast_in_dim(b, h.shape, (dims[2].index("C"),))
        return h.astype(compute_dtype(precision))
    h = lax.conv_general_dilated(h, w, strides, padding, dimension_numbers=dims)
    return h + lax.broadcast_in_dim(b, h.shape, (dims[2].index("C"),))


def conv(h, w, b, layout, precision="fp32"):
    """LeNet's convolutions: stride 1, no padding."""
    return convolution(h, w, b, (1, 1), "VALID", DIMENSIONS[layout], precision)


def dense(h, w, b, precision="fp32"):
    """h @ w + b; at bf16 (fp16) on bf16 (fp16) values, the products and the bias summed in fp32
    (preferred_element_type) and rounded to bf16 (fp16) once."""
    if is_low(precision):
        h = jnp.matmul(low(h, precision), low(w, precision), preferred_element_type=jnp.float32) + low(b, precision)
        return h.astype(compute_dtype(precision))
    return h @ w + b


def forward(params, X, layout=DEFAULT_LAYOUT, precision="fp32"):
    """Logits of the NCHW batch X on one replica held in `layout`, computed at `precision` (Python values: static
    under jax.jit); at bf16 (fp16) every activation is bf16 (fp16), the logits too."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    if layout == "nchw":                   # canonical dense weights are (out, in)
        w3, w4 = w3.T, w4.T
    h = avg_pool(jax.nn.relu(conv(to_layout(X, layout), w1, b1, layout, precision)), layout)
    h = avg_pool(jax.nn.relu(conv(h, w2, b2, layout, precision)), layout)
    h = h.reshape(h.shape[0], -1)          # C, H, W or H, W, C order: fc1's rows were made to match
    h = jax.nn.relu(dense(h, w3, b3, precision))
    return dense(h, w4, b4, precision)


def loss_sum(logits, y):
    """Cross-entropy summed over the shard, in fp32 whatever the logits' precision (common/precision.py): shards add
    up to the global batch exactly."""
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.sum(jnp.take_along_axis(log_p, y[:, None].astype(jnp.int32), axis=1))


def summed_loss(params, X, y, layout=DEFAULT_LAYOUT, precision="fp32"):
    """One shard's summed loss, as a function of the replica: what its gradients are taken of."""
    return loss_sum(forward(params, X, layout, precision), y)


def scaled(loss, scale):
    """The loss times fp16's loss scale (common/loss_scaling.py: the backward starts from the scale, not 1), and the
    loss itself (value_and_grad's aux: the step returns it unscaled). `scale` is traced under jax.jit, not a constant:
    a new scale compiles nothing; None (no loss scaling) leaves the loss as it is."""
    return (loss if scale is None else loss * scale), loss


def scaled_loss(params, X, y, scale, layout=DEFAULT_LAYOUT, precision="fp32"):
    return scaled(summed_loss(params, X, y, layout, precision), scale)


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
    the forward a function of it. Frozen and hashable, its layout and its precision (common/precision.py) fields:
    jax.jit takes it as a static argument."""
    layout: str = DEFAULT_LAYOUT
    precision: str = "fp32"
    name = "lenet"
    param_names = PARAM_NAMES

    def get_params(self, weights, device):
        return get_params(weights, device, self.layout)

    def get_bn_state(self, state, device):
        return None   # no BatchNorm

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        """Each device's summed loss and gradients, its own work: dispatched asynchronously, the devices work in
        parallel (JAX places each op where its inputs are). `scale`: the loss scale the gradients are taken at (None:
        none); the losses are unscaled."""
        losses, grads = [], []
        for params, X, y in zip(replicas, X_shards, y_shards):
            (_, loss), device_grads = jax.value_and_grad(scaled_loss, has_aux=True)(params, X, y, scale, self.layout,
                                                                                    self.precision)
            losses.append(loss)
            grads.append(device_grads)
        return losses, grads, bn_states

    def to_numpy(self, replica):
        return to_numpy(replica, self.layout)

    def bn_state_to_numpy(self, bn_state):
        return {}

    def evaluate(self, replica, bn_state, X, y):
        return evaluate(replica, X, y, self.layout)


def flax_dtypes(precision="fp32"):
    """Flax's mixed precision, as its modules take it: compute in `dtype` (bf16 at bf16, fp16 at fp16: nnx.Conv and
    nnx.Linear cast their input, kernel and bias to it; None, the default: their inputs' and parameters' fp32) and keep
    the parameters in `param_dtype`, fp32 (the master weights: their gradients come back fp32 through the casts)."""
    return {"dtype": compute_dtype(precision) if is_low(precision) else None, "param_dtype": jnp.float32}


def widened_conv(lhs, rhs, *args, **kwargs):
    """lax.conv_general_dilated of low-precision operands summed in fp32 and rounded once (common/precision.py), as
    XLA's CPU computes a bf16 convolution on its own; an fp16 one it may compute in fp16, rounding its partial sums
    (most outputs a rounding or more off on an Intel Xeon with AVX512-FP16; docs/profiling.md)."""
    wide = [a.astype(jnp.float32) for a in (lhs, rhs)]
    return lax.conv_general_dilated(*wide, *args, **kwargs).astype(lhs.dtype)


def flax_conv(precision="fp32"):
    """nnx.Conv's arguments at `precision`: flax_dtypes', and at fp16 its own hook for the convolution it runs
    (conv_general_dilated) set to widened_conv, so that Flax's fp16 convolutions accumulate in fp32 on the CPU too."""
    return {**flax_dtypes(precision), **({"conv_general_dilated": widened_conv} if precision == "fp16" else {})}


class LeNet(nnx.Module):
    """The same LeNet as an idiomatic Flax NNX module. Flax is channels-last (NHWC inputs, HWIO kernels,
    dense (in, out)): the module takes the canonical NCHW batch and transposes it, like Keras's Permute,
    and its weights are the canonical ones converted by common/layouts.py. At bf16 its layers compute in bf16
    (flax_dtypes): each adds its bias in bf16 to its bf16-rounded products (two roundings, not common/precision.py's
    one) and sums the bias's gradient over the batch in bf16 (XLA rounds a bf16 reduction's partial sums), and
    nnx.avg_pool sums in bf16 (lax.reduce_window in its input's dtype); at fp16 alike, in fp16, its convolutions
    summing in fp32 (flax_conv)."""

    def __init__(self, rngs, precision="fp32"):
        (c1, _, k1, _), (c2, _, k2, _) = LAYERS["conv1"][1], LAYERS["conv2"][1]
        (h1, f1), h2 = LAYERS["fc1"][1], LAYERS["fc2"][1][1]
        dtypes, convs = flax_dtypes(precision), flax_conv(precision)
        self.conv1 = nnx.Conv(1, c1, (k1, k1), padding="VALID", **convs, rngs=rngs)
        self.conv2 = nnx.Conv(c1, c2, (k2, k2), padding="VALID", **convs, rngs=rngs)
        self.fc1 = nnx.Linear(f1, h1, **dtypes, rngs=rngs)
        self.fc2 = nnx.Linear(h2, NUM_CLASSES, **dtypes, rngs=rngs)

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


def build_model(weights, precision="fp32"):
    """The idiomatic Flax model (for the reference loop), holding the canonical weights in Flax's layout, computing at
    `precision` (flax_dtypes; its parameters fp32 either way)."""
    model = LeNet(nnx.Rngs(0), precision)
    for name, param in model.layers():
        param.value = jnp.asarray(to_channels_last(name, weights[name]))
    return model


def model_to_numpy(model):
    """A Flax model's weights in canonical layout (the inverse of build_model)."""
    return {name: np.ascontiguousarray(to_canonical(name, np.asarray(param.value)), dtype=np.float32)
            for name, param in model.layers()}
