"""d2l's ResNet-18 (common/resnet.py) in jax.lax ops. A replica is the list of jax arrays on one device, in
common.resnet.PARAM_NAMES order, and its BatchNorm state the list of running statistics in BN_STATE_NAMES order.
lax convolutions take any layout they are told: in NCHW/OIHW the weights are canonical; in NHWC/HWIO
common/layouts.py converts them (global average pooling leaves no flatten order to fix). JAX arrays are
immutable: forward returns the new state, and jax.jit compiles it as a pure function. Functional is the network
data_parallel.train_step trains, local or synchronised BatchNorm (its field sync)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from common.layouts import to_canonical, to_channels_last
from common.resnet import (BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, PARAM_NAMES, by_canonical_name, has_projection,
                           layer_arguments, layers)

from . import distributed as dist
from .lenet import (DEFAULT_LAYOUT, DIMENSIONS, convolution, dense, flax_conv, flax_dtypes, held, loss_sum, scaled,
                    to_layout)


def get_params(weights, device, layout=DEFAULT_LAYOUT):
    return [jax.device_put(held(name, weights[name], layout), device) for name in PARAM_NAMES]


def get_bn_state(state, device):
    return [jax.device_put(state[name], device) for name in BN_STATE_NAMES]


def conv(p, name, h, layout, precision="fp32"):
    """Explicit symmetric padding: "SAME" with stride 2 on an even input pads bottom/right only."""
    _, stride, pad = CONVS[name]
    return convolution(h, p[f"{name}.weight"], p[f"{name}.bias"], (stride, stride), ((pad, pad), (pad, pad)),
                       DIMENSIONS[layout], precision)


def axes_and_shape(layout):
    """The axes a BatchNorm reduces over and the shape its per-channel vectors broadcast in, in `layout`."""
    return ((0, 1, 2), (1, 1, 1, -1)) if layout == "nhwc" else ((0, 2, 3), (1, -1, 1, 1))


def batch_statistics(hs, devices, sync, layout, axis=None, masks=None):
    """Each shard's per-channel (mean, biased variance, count) for training: its own (local BatchNorm), or the global
    batch's (sync), in two all-reduces as a one-device variance is taken in two passes: the shards' sums and counts
    give the mean, their squared deviations from it the variance. Summed across this process's devices by
    device_put (which JAX differentiates: its transpose copies the gradient back) and across processes by
    process_sum, so every shard's gradient includes what flows through the statistics, as if one device held the
    whole batch. JAX places an op where its inputs are; `devices` says where each shard's are. Under shard_map
    (`axis`: the compiled form, execution.py) the one shard's sums are psum'd over the mesh instead."""
    axes, shape = axes_and_shape(layout)
    if not sync:
        return [(h.mean(axis=axes), jnp.square(h - h.mean(axis=axes).reshape(shape)).mean(axis=axes),
                 h.size // h.shape[shape.index(-1)]) for h in hs]
    if axis is not None:
        return [psum_statistics(h, mask, layout, axis) for h, mask in zip(hs, masks)]
    count = sum(h.size for h in hs) // hs[0].shape[shape.index(-1)]   # shapes are static in JAX
    mean = all_sum([h.sum(axis=axes) for h in hs], devices)
    count = process_sum(jnp.float32(count)) if dist.is_initialized() else count
    mean = mean / count
    var = all_sum([jnp.square(h - jax.device_put(mean, d).reshape(shape)).sum(axis=axes) for h, d in zip(hs, devices)],
                  devices) / count
    return [(jax.device_put(mean, d), jax.device_put(var, d), count) for d in devices]


def psum_statistics(h, mask, layout, axis):
    """The synchronised statistics inside shard_map, on this device's shard: its sums and its count lax.psum'd over
    the mesh axis `axis`, the padding rows (mask False: the compiled step pads the shards to one shape) left out.
    psum's transpose sums the gradient over the devices, as device_put's does op by op."""
    axes, shape = axes_and_shape(layout)
    kept = mask.astype(h.dtype).reshape(-1, 1, 1, 1)
    count = lax.psum(kept.sum(), axis) * (h.size // h.shape[0] // h.shape[shape.index(-1)])
    mean = lax.psum((h * kept).sum(axis=axes), axis) / count
    var = lax.psum((jnp.square(h - mean.reshape(shape)) * kept).sum(axis=axes), axis) / count
    return mean, var, count


def all_sum(parts, devices):
    """The sum of one array per device, on the first device, over every process: differentiable."""
    total = parts[0]
    for part in parts[1:]:
        total = total + jax.device_put(part, devices[0])
    return process_sum(total) if dist.is_initialized() else total


@jax.custom_vjp
def process_sum(x):
    """The sum over processes (distributed.all_reduce, a compiled collective over the process mesh) with its
    gradient: the gradient of a sum reaches every term, so each process's gradient is the sum of every process's.
    Called eagerly (the synchronised step runs op by op: execution.py), so the collective sees concrete arrays."""
    return dist.all_reduce(x)


process_sum.defvjp(lambda x: (dist.all_reduce(x), None), lambda _, g: (dist.all_reduce(g),))


def batch_norm(ps, ss, name, hs, devices, training, bn, sync, layout, new_states, axis=None, masks=None):
    """common.resnet.batch_norm written out in jnp, on every shard at once. In fp32 whatever the input's precision
    (statistics, normalisation, running statistics), the output in the input's (common/precision.py)."""
    _, shape = axes_and_shape(layout)
    dtype = hs[0].dtype
    hs = [h.astype(jnp.float32) for h in hs]
    running = [(s[f"{name}.running_mean"], s[f"{name}.running_var"]) for s in ss]
    if training:
        statistics = batch_statistics(hs, devices, sync, layout, axis, masks)
        for new, (mean, var), (batch_mean, batch_var, count) in zip(new_states, running, statistics):
            unbiased = batch_var * count / (count - 1) if bn.unbiased else batch_var
            new[f"{name}.running_mean"] = (1 - bn.momentum) * mean + bn.momentum * lax.stop_gradient(batch_mean)
            new[f"{name}.running_var"] = (1 - bn.momentum) * var + bn.momentum * lax.stop_gradient(unbiased)
        running = [(batch_mean, batch_var) for batch_mean, batch_var, _ in statistics]
    return [((h - mean.reshape(shape)) * lax.rsqrt(var.reshape(shape) + bn.eps) * p[f"{name}.weight"].reshape(shape)
             + p[f"{name}.bias"].reshape(shape)).astype(dtype) for p, h, (mean, var) in zip(ps, hs, running)]


def forward_shards(replicas, bn_states, X_shards, devices, training, bn=CANONICAL_BN, sync=False,
                   layout=DEFAULT_LAYOUT, axis=None, masks=None, precision="fp32"):
    """Every replica on its own shard, in lock-step, layer by layer: a synchronised BatchNorm needs every shard's
    moments before any shard is normalised. Logits per shard; in training mode also each replica's new BatchNorm
    state (a list in BN_STATE_NAMES order). Pure: `training`, `bn`, `sync`, `layout`, `axis` (the mesh axis of
    the compiled form, its padded rows marked by `masks`) and `precision` are static under jax.jit. At bf16 (fp16)
    the activations are bf16 (fp16; the residual add too), the global average pooling accumulating in fp32 (jnp.mean
    of bf16 or fp16 sums in fp32 and rounds once)."""
    ps, ss = [dict(zip(PARAM_NAMES, r)) for r in replicas], [dict(zip(BN_STATE_NAMES, s)) for s in bn_states]
    new_states = [{} for _ in replicas]
    convs = lambda name, hs: [conv(p, name, h, layout, precision) for p, h in zip(ps, hs)]   # noqa: E731
    norms = lambda name, hs: batch_norm(ps, ss, name, hs, devices, training, bn, sync, layout, new_states,  # noqa: E731
                                        axis, masks)
    relus = lambda hs: [jax.nn.relu(h) for h in hs]   # noqa: E731
    hs = relus(norms("stem.bn", convs("stem.conv", [to_layout(X, layout) for X in X_shards])))
    for block, stride in BLOCKS:
        ys = relus(norms(f"{block}.bn1", convs(f"{block}.conv1", hs)))
        ys = norms(f"{block}.bn2", convs(f"{block}.conv2", ys))
        shortcuts = convs(f"{block}.conv3", hs) if has_projection(stride) else hs
        hs = relus([y + shortcut for y, shortcut in zip(ys, shortcuts)])
    pool = (1, 2) if layout == "nhwc" else (2, 3)
    # canonical dense weights are (out, in); channels-last ones (in, out)
    logits = [dense(h.mean(axis=pool), p["fc.weight"] if layout == "nhwc" else p["fc.weight"].T, p["fc.bias"],
                    precision) for p, h in zip(ps, hs)]   # global average pooling, fc
    if not training:
        return logits
    return logits, [[new[name] for name in BN_STATE_NAMES] for new in new_states]


def forward(params, bn_state, X, training, bn=CANONICAL_BN, layout=DEFAULT_LAYOUT):
    """Logits of the NCHW batch X on one replica; in training mode (batch statistics) also its new BatchNorm state.
    `training`, `bn` and `layout` are static under jax.jit."""
    out = forward_shards([params], [bn_state], [X], [None], training, bn, layout=layout)
    return (out[0][0], out[1][0]) if training else out[0]


def to_numpy(params, layout=DEFAULT_LAYOUT):
    return {name: np.ascontiguousarray(to_canonical(name, np.asarray(p)) if layout == "nhwc" else p, dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: np.asarray(t, dtype=np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


def shard_loss(replicas, bn_states, X_shards, y_shards, devices, sync, layout, axis=None, precision="fp32",
               scale=None):
    """The shards' summed loss through the lock-step forward at `precision` (times the loss `scale`, lenet.scaled),
    and each shard's loss (unscaled) with the new BatchNorm states (value_and_grad's aux). Under shard_map (`axis`)
    rows labelled -1 are padding: out of the statistics and the loss."""
    masks = [y >= 0 for y in y_shards] if axis else None
    logits, new_states = forward_shards(replicas, bn_states, X_shards, devices, True, CANONICAL_BN, sync, layout,
                                        axis, masks, precision)
    losses = [loss_sum(out, y) if axis is None else kept_loss_sum(out, y) for out, y in zip(logits, y_shards)]
    return scaled(sum(jax.device_put(loss, devices[0]) for loss in losses), scale)[0], (losses, new_states)


def kept_loss_sum(logits, y):
    """loss_sum over the rows that are not padding (label -1), in fp32 as loss_sum."""
    rows = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                                jnp.maximum(y, 0)[:, None].astype(jnp.int32), axis=1)
    return jnp.sum(jnp.where(y >= 0, rows[:, 0], 0.0))


@functools.partial(jax.jit, static_argnames="layout")
def predict(params, bn_state, X, layout=DEFAULT_LAYOUT):
    return forward(params, bn_state, X, False, layout=layout).argmax(1)


def evaluate(params, bn_state, X, y, layout=DEFAULT_LAYOUT, batch_size=1000):
    """Inference mode: every image normalised by the running statistics."""
    (device,) = params[0].devices()
    correct = 0
    for i in range(0, len(X), batch_size):
        X_batch = jax.device_put(X[i:i + batch_size], device)
        correct += (jax.device_get(predict(params, bn_state, X_batch, layout)) == y[i:i + batch_size]).sum()
    return float(correct) / len(X)


@dataclasses.dataclass(frozen=True)
class Functional:
    """The ResNet as the recipe writes it (common.interface.FUNCTIONAL): replicas and BatchNorm states are lists of
    arrays, one per device, and one forward runs every shard in lock-step. Frozen and hashable, its layout and its
    BatchNorm mode (sync: --bn sync) fields: jax.jit takes it as a static argument. `axis`: set by execution.py's
    compiled synchronised step, the mesh axis whose devices the BatchNorm moments are psum'd over (None: op by op).
    `precision`: what the step computes in (common/precision.py)."""
    layout: str = DEFAULT_LAYOUT
    sync: bool = False
    axis: str | None = None
    precision: str = "fp32"
    name = "resnet18"
    param_names = PARAM_NAMES

    def get_params(self, weights, device):
        return get_params(weights, device, self.layout)

    def get_bn_state(self, state, device):
        return get_bn_state(state, device)

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        """Each device's summed loss, each replica's gradients (of the loss times `scale`, fp16's loss scale, if given)
        and new BatchNorm state: one jax.value_and_grad through the whole lock-step forward. Local BatchNorm: each
        replica's gradient is its own shard's (execution.py may compile each device's part on its own). Sync: a
        replica's gradient includes what reaches it through the other shards' statistics: written op by op across the
        devices' arrays, compiled under shard_map (execution.py)."""
        (_, (losses, new_states)), grads = jax.value_and_grad(shard_loss, has_aux=True)(
            replicas, bn_states, X_shards, y_shards, devices, self.sync, self.layout, self.axis, self.precision, scale)
        return losses, grads, new_states

    def to_numpy(self, replica):
        return to_numpy(replica, self.layout)

    def bn_state_to_numpy(self, bn_state):
        return bn_state_to_numpy(bn_state)

    def evaluate(self, replica, bn_state, X, y):
        return evaluate(replica, bn_state, X, y, self.layout)


class BatchNorm(nnx.BatchNorm):
    """nnx.BatchNorm, but given an axis_name its training statistics are the global batch's under shard_map: each
    device's masked sums and count psum'd over the axis (psum_statistics), in fp32 whatever the input's dtype, the
    variance in two passes, then Flax's own update of the running statistics and its normalisation. Flax's
    axis_name pmeans each device's masked mean instead, which is not the global batch's mean where the devices hold
    unequal real rows (97 = 49 + 48). Without an axis_name, or with the running statistics, it is nnx.BatchNorm."""

    def __call__(self, x, use_running_average=None, *, mask=None):
        running = self.use_running_average if use_running_average is None else use_running_average
        if self.axis_name is None or running:
            return super().__call__(x, use_running_average, mask=mask)
        kept = jnp.ones(x.shape[0], bool) if mask is None else mask
        mean, var, _ = psum_statistics(x.astype(jnp.promote_types(x.dtype, jnp.float32)), kept, "nhwc",
                                       self.axis_name)
        self.mean.value = self.momentum * self.mean.value + (1 - self.momentum) * mean
        self.var.value = self.momentum * self.var.value + (1 - self.momentum) * var
        y = (x - mean) * (lax.rsqrt(var + self.epsilon) * self.scale.value) + self.bias.value   # Flax's order
        return y.astype(self.dtype or y.dtype)


class Residual(nnx.Module):
    """d2l's Residual in Flax NNX: channels-last, explicit ((1, 1), (1, 1)) padding (Conv's default is 'SAME').
    `precision`: every layer's (the ResNet's docstring)."""

    def __init__(self, c_in, c, stride, bn_args, rngs, precision):
        pad, dtypes, convs = ((1, 1), (1, 1)), flax_dtypes(precision), flax_conv(precision)
        self.conv1 = nnx.Conv(c_in, c, (3, 3), strides=stride, padding=pad, **convs, rngs=rngs)
        self.bn1 = BatchNorm(c, **bn_args, **dtypes, rngs=rngs)
        self.conv2 = nnx.Conv(c, c, (3, 3), padding=pad, **convs, rngs=rngs)
        self.bn2 = BatchNorm(c, **bn_args, **dtypes, rngs=rngs)
        self.conv3 = nnx.Conv(c_in, c, (1, 1), strides=stride, padding="VALID", **convs, rngs=rngs) \
            if has_projection(stride) else None

    def __call__(self, X, mask=None):
        Y = nnx.relu(self.bn1(self.conv1(X), mask=mask))
        Y = self.bn2(self.conv2(Y), mask=mask)
        return nnx.relu(Y + (self.conv3(X) if self.conv3 is not None else X))


class ResNet(nnx.Module):
    """The same ResNet-18 as an idiomatic Flax NNX module: it takes the canonical NCHW batch and transposes it, like
    Keras's Permute. model.train() / model.eval() switch its BatchNorm layers (use_running_average). `mask`, one
    value per image (0: padding), keeps padded rows out of the batch statistics (builtin.py's padded shards).
    At bf16 (`precision`; fp16 alike) every layer is built with Flax's dtype=bf16, param_dtype=fp32 (flax_dtypes): the
    convolutions and fc compute in bf16 (their bias added in bf16 after the products are rounded, two roundings, and
    the bias's gradient summed over the batch in bf16); nnx.BatchNorm takes its statistics in fp32 whatever its dtype
    (normalization.py's _compute_stats promotes to at least fp32), normalises in fp32 (its fp32 mean and scale promote
    the bf16 input) and rounds its output to bf16; the residual add and ReLU run on bf16 values; the global average
    pooling (jnp.mean) sums bf16 in fp32 and rounds once. At fp16 the same in fp16, the convolutions summing in fp32
    (lenet.flax_conv: XLA's CPU may sum an fp16 convolution in fp16) and the bias's gradient summed over the batch
    in fp16 (XLA's CPU may round an fp16 reduction's partial sums)."""

    def __init__(self, width, bn_args, rngs, precision="fp32"):
        dtypes = flax_dtypes(precision)
        self.conv = nnx.Conv(1, width, (3, 3), padding=((1, 1), (1, 1)), **flax_conv(precision), rngs=rngs)
        self.bn = BatchNorm(width, **bn_args, **dtypes, rngs=rngs)
        blocks, c_in = [], width
        for block, stride in BLOCKS:
            c = layers(width)[f"{block}.conv1"][1][0]
            blocks.append(Residual(c_in, c, stride, bn_args, rngs, precision))
            c_in = c
        self.blocks = nnx.List(blocks)
        self.fc = nnx.Linear(c_in, layers(width)["fc"][1][0], **dtypes, rngs=rngs)

    def __call__(self, X, mask=None):
        mask = None if mask is None else mask.reshape(-1, 1, 1, 1).astype(bool)   # broadcast over NHWC
        h = nnx.relu(self.bn(self.conv(X.transpose(0, 2, 3, 1)), mask=mask))   # NCHW -> NHWC
        for residual in self.blocks:
            h = residual(h, mask)
        return self.fc(h.mean(axis=(1, 2)))   # global average pooling


# canonical suffix -> the Flax variable's attribute (Param, or BatchStat for the running statistics)
FLAX_NAMES = {"weight": ("kernel", "scale"), "bias": ("bias",), "running_mean": ("mean",), "running_var": ("var",)}


def flax_variables(model):
    """canonical name -> nnx.Variable, for parameters and BatchNorm state alike."""
    return by_canonical_name(model, FLAX_NAMES)


def build_model(weights, bn_state, bn=CANONICAL_BN, precision="fp32", axis_name=None):
    """The idiomatic Flax model holding the canonical weights and state in Flax's layout, its nnx.BatchNorm set to
    `bn`'s momentum (Flax's weighs the running value: 0.9, not PyTorch's 0.1) and epsilon; in training mode. Its
    batch variance two-pass, the mean subtracted first (use_fast_variance=False), as the scratch forward's: Flax's
    default E[x^2] - E[x]^2 cancels in float32 where |mean| >> std, as after the stem on digits (a stem gradient 2%
    off the two-pass one there). Computing at `precision` (ResNet's docstring; the parameters fp32 either way).
    `axis_name`: the shard_map axis whose devices' statistics BatchNorm synchronises (BatchNorm's docstring)."""
    bn_args = {**layer_arguments("jax", bn), "use_fast_variance": False, "axis_name": axis_name}
    model = ResNet(weights["stem.conv.weight"].shape[0], bn_args, nnx.Rngs(0), precision)
    for name, variable in flax_variables(model).items():
        variable.value = jnp.asarray(to_channels_last(name, {**weights, **bn_state}[name]))
    return model


def model_to_numpy(model):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse."""
    found = {name: np.ascontiguousarray(to_canonical(name, np.asarray(v.value)), dtype=np.float32)
             for name, v in flax_variables(model).items()}
    return {name: found[name] for name in PARAM_NAMES}, {name: found[name] for name in BN_STATE_NAMES}
