"""d2l's ResNet-18 (common/resnet.py) in TensorFlow ops. A replica is the list of tf.Variables on one device, in
common.resnet.PARAM_NAMES order, holding the weights in TensorFlow's layout (HWIO kernels, dense (in, out):
common/layouts.py converts them; global average pooling leaves no flatten order to fix), and its BatchNorm state
the list of running statistics in BN_STATE_NAMES order. The memory layout and the BatchNorm mode are arguments
(Functional's fields), never a module's settings."""
import dataclasses

import numpy as np
import tensorflow as tf

from common.layouts import to_canonical, to_channels_last
from common.resnet import (BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, IMAGE_SHAPE, PARAM_NAMES, has_projection,
                           layer_arguments, layers)

from . import distributed as dist
from .lenet import DEFAULT_LAYOUT, accuracy, bias_add, check_layout, compute, loss_sum, scaled, to_layout


def get_params(weights, device):
    with tf.device(device):
        return [tf.Variable(to_channels_last(name, weights[name]), name=name) for name in PARAM_NAMES]


def get_bn_state(state, device):
    """The running statistics, on the device: constants, not Variables; forward returns new ones."""
    with tf.device(device):
        return [tf.constant(state[name]) for name in BN_STATE_NAMES]


def conv(p, name, h, layout=DEFAULT_LAYOUT, precision="fp32"):
    """At `precision` (lenet.compute). Explicit symmetric padding: padding="SAME" with stride 2 on an even input
    pads bottom/right only. In NCHW, and at bf16 and fp16, it is a tf.pad before a "VALID" convolution: the CPU runs
    the backward of an explicitly padded convolution outside oneDNN, in Eigen's kernel, which is 50 times slower in
    bf16 and refuses NCHW ("Conv2DCustomBackpropInputOp only supports NHWC"); NHWC at fp32 keeps it, bit for bit as
    before. Its 1x1 stride-2 projections are then oneDNN's too, whose backward corrupts the heap (subsampled)."""
    kernel, stride, pad = CONVS[name]
    padding = [[0, 0], [pad, pad], [pad, pad], [0, 0]] if layout == "nhwc" else [[0, 0], [0, 0], [pad, pad], [pad, pad]]
    h, w, b = compute(precision, h, p[f"{name}.weight"], p[f"{name}.bias"])
    if precision != "fp32" or layout == "nchw":
        h, padding = tf.pad(h, padding), "VALID"
        if kernel == 1 and stride > 1:
            h, stride = subsampled(h, stride, layout), 1
    h = tf.nn.conv2d(h, w, stride, padding, data_format=layout.upper())
    return bias_add(h, b, layout.upper(), precision)


def subsampled(h, stride, layout=DEFAULT_LAYOUT):
    """Every stride-th row and column: a 1x1 convolution's stride taken before it, the same numbers. TensorFlow 2.21's
    oneDNN backward of a 1x1 stride-2 Conv2D corrupts the heap (uxlfoundation/oneDNN#6035): the Keras model's
    projections with an odd batch ("free(): invalid size"), the scratch step's at bf16 on the AMD EPYC after a few
    steps on digits (abort or segfault in each of a dozen runs; TF_ENABLE_ONEDNN_OPTS=0, one thread, or this slice
    do not). pytorch/resnet.py meets the same bug in channels-last memory."""
    return h[:, ::stride, ::stride, :] if layout == "nhwc" else h[:, :, ::stride, ::stride]


def axes_and_shape(layout=DEFAULT_LAYOUT):
    """The axes a BatchNorm reduces over and the shape its per-channel vectors broadcast in, in `layout`."""
    return ([0, 1, 2], (1, 1, 1, -1)) if layout == "nhwc" else ([0, 2, 3], (1, -1, 1, 1))


def on_devices(devices, fn, *per_shard):
    """fn on every shard's arguments, each under its own device: TensorFlow places an op by tf.device, not by
    where its inputs are."""
    out = []
    for device, args in zip(devices, zip(*per_shard)):
        with tf.device(device):
            out.append(fn(*args))
    return out


def batch_statistics(hs, devices, sync, layout=DEFAULT_LAYOUT):
    """Each shard's per-channel (mean, biased variance, count) for training: its own (local BatchNorm), or the global
    batch's (sync), in two all-reduces as a one-device variance is taken in two passes: the shards' sums and counts
    give the mean, their squared deviations from it the variance. Summed across this process's devices by add_n and
    across processes by process_sum, both differentiated by the tape: every shard's gradient includes what flows
    through the statistics, as if one device held the whole batch."""
    axes, shape = axes_and_shape(layout)
    channel = -1 if layout == "nhwc" else 1
    count = lambda h: tf.cast(tf.size(h) // tf.shape(h)[channel], h.dtype)   # noqa: E731
    if not sync:
        return on_devices(devices, lambda h: (*tf.nn.moments(h, axes), count(h)), hs)
    total = all_sum(on_devices(devices, lambda h: tf.concat([tf.reduce_sum(h, axes), [count(h)]], 0), hs), devices[0])
    n = total[-1]
    mean = total[:-1] / n
    squares = on_devices(devices, lambda h: tf.reduce_sum(tf.square(h - tf.reshape(mean, shape)), axes), hs)
    var = all_sum(squares, devices[0]) / n
    return [(mean, var, n)] * len(hs)   # each device's ops copy them over


def all_sum(parts, device):
    """The sum of one tensor per device, on `device`, over every process: differentiable."""
    with tf.device(device):
        total = tf.add_n(parts)
        return process_sum(total) if dist.is_initialized() else total


@tf.custom_gradient
def process_sum(x):
    """The sum over processes (the strategy's all-reduce) with its gradient: the gradient of a sum reaches every
    term, so each process's gradient is the sum of every process's (the tape builds it outside every tf.device
    scope: dist.all_reduce places it)."""
    def grad(dy):
        return dist.all_reduce(dy)
    return dist.all_reduce(x), grad


def batch_norm(ps, ss, name, hs, devices, training, bn, sync, new_states, layout=DEFAULT_LAYOUT):
    """common.resnet.batch_norm written out on every shard at once, with tf.nn.batch_normalization (Keras's
    BatchNormalization would keep its own moving statistics by its own convention). In fp32 whatever the input's
    precision, the output in the input's (common/precision.py: Keras's BatchNormalization does the same under
    mixed_bfloat16); tf.cast leaves fp32 as it is."""
    _, shape = axes_and_shape(layout)
    reshape = lambda v: tf.reshape(v, shape)   # noqa: E731
    dtype = hs[0].dtype
    hs = on_devices(devices, lambda h: tf.cast(h, tf.float32), hs)
    running = [(s[f"{name}.running_mean"], s[f"{name}.running_var"]) for s in ss]
    if training:
        statistics = batch_statistics(hs, devices, sync, layout)
        for new, (mean, var), (batch_mean, batch_var, count), device in zip(new_states, running, statistics, devices):
            with tf.device(device):
                unbiased = batch_var * count / (count - 1) if bn.unbiased else batch_var
                new[f"{name}.running_mean"] = (1 - bn.momentum) * mean + bn.momentum * tf.stop_gradient(batch_mean)
                new[f"{name}.running_var"] = (1 - bn.momentum) * var + bn.momentum * tf.stop_gradient(unbiased)
        running = [(batch_mean, batch_var) for batch_mean, batch_var, _ in statistics]
    return on_devices(devices, lambda p, h, mv: tf.cast(tf.nn.batch_normalization(
        h, reshape(mv[0]), reshape(mv[1]), reshape(p[f"{name}.bias"]), reshape(p[f"{name}.weight"]), bn.eps), dtype),
        ps, hs, running)


def forward_shards(replicas, bn_states, X_shards, devices, training, bn=CANONICAL_BN, sync=False,
                   layout=DEFAULT_LAYOUT, precision="fp32"):
    """Every replica on its own shard, in lock-step, layer by layer: a synchronised BatchNorm needs every shard's
    moments before any shard is normalised. Logits per shard (at `precision`: the ReLUs, the additions and the
    pooling in the convolutions' output's); in training mode also each replica's new BatchNorm state (a list in
    BN_STATE_NAMES order). Nothing is updated in place."""
    ps, ss = [dict(zip(PARAM_NAMES, r)) for r in replicas], [dict(zip(BN_STATE_NAMES, s)) for s in bn_states]
    new_states = [{} for _ in replicas]
    convs = lambda name, hs: on_devices(devices, lambda p, h: conv(p, name, h, layout, precision),   # noqa: E731
                                        ps, hs)
    norms = lambda name, hs: batch_norm(ps, ss, name, hs, devices, training, bn, sync, new_states,   # noqa: E731
                                        layout)
    relus = lambda hs: on_devices(devices, tf.nn.relu, hs)   # noqa: E731
    hs = relus(norms("stem.bn", convs("stem.conv", on_devices(devices, lambda X: to_layout(X, layout), X_shards))))
    for block, stride in BLOCKS:
        ys = relus(norms(f"{block}.bn1", convs(f"{block}.conv1", hs)))
        ys = norms(f"{block}.bn2", convs(f"{block}.conv2", ys))
        shortcuts = convs(f"{block}.conv3", hs) if has_projection(stride) else hs
        hs = relus(on_devices(devices, tf.add, ys, shortcuts))
    logits = on_devices(devices, lambda p, h: dense(p, global_pool(h, layout), precision), ps, hs)
    if not training:
        return logits
    return logits, [[new[name] for name in BN_STATE_NAMES] for new in new_states]


def global_pool(h, layout=DEFAULT_LAYOUT):
    """The global average pooling, its mean taken in fp32 and rounded once to h's precision, as Keras's
    GlobalAveragePooling2D takes it (ops.mean casts to float32: keras/src/backend/tensorflow/numpy.py): the CPU's
    tf.reduce_mean of fp16 sums in fp16 (twice fp16's rounding on 16 values). No-op casts at fp32."""
    return tf.cast(tf.reduce_mean(tf.cast(h, tf.float32), [1, 2] if layout == "nhwc" else [2, 3]), h.dtype)


def dense(p, h, precision="fp32"):
    """The fc layer on the global average pooling's output, at `precision` (lenet.compute)."""
    h, w, b = compute(precision, h, p["fc.weight"], p["fc.bias"])
    return bias_add(tf.matmul(h, w), b, precision=precision)


def forward(params, bn_state, X, training, bn=CANONICAL_BN, layout=DEFAULT_LAYOUT):
    """Logits of the NCHW batch X on one replica; in training mode (batch statistics) also its new BatchNorm state."""
    out = forward_shards([params], [bn_state], [X], [params[0].device], training, bn, layout=layout)
    return (out[0][0], out[1][0]) if training else out[0]


def to_numpy(params):
    return {name: np.ascontiguousarray(to_canonical(name, p.numpy()), dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: t.numpy().astype(np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


def loss_and_grads(replicas, bn_states, X_shards, y_shards, devices, sync=False, layout=DEFAULT_LAYOUT,
                   precision="fp32", scale=None):
    """The devices' summed losses and each replica's gradients, on its device, from one tape over the whole lock-step
    forward at `precision`: with sync, a replica's gradient includes what reaches it through the other shards'
    statistics; with `scale` (a tensor), the gradients of every loss times it (the losses returned are unscaled).
    Also the replicas' new BatchNorm states. The parameters watched: tf.Variables, or the tensors ZeRO's stage 3
    gathers (data_parallel.gather_params)."""
    params = [p for device_params in replicas for p in device_params]
    with tf.GradientTape() as tape:
        tape.watch(params)
        logits, new_states = forward_shards(replicas, bn_states, X_shards, devices, True, CANONICAL_BN, sync, layout,
                                            precision)
        losses = on_devices(devices, loss_sum, logits, y_shards)
        targets = on_devices(devices, lambda loss: scaled(loss, scale), losses)
    grads = tape.gradient(targets, params)   # of the losses' sum
    n = len(PARAM_NAMES)
    # on their devices: the tape builds them outside every tf.device scope, and a cross-process all-reduce needs it
    return losses, [on_devices([d] * n, tf.identity, grads[i * n:(i + 1) * n]) for i, d in enumerate(devices)], \
        new_states


@tf.function(reduce_retracing=True, autograph=False)
def predict(params, bn_state, X, layout=DEFAULT_LAYOUT):
    """Class indices in inference mode (the running statistics); traced per layout."""
    return tf.argmax(forward(params, bn_state, X, training=False, layout=layout), 1)


@dataclasses.dataclass(frozen=True, slots=True)
class Functional:
    """The ResNet-18 as the recipe's step trains it (common.interface.FUNCTIONAL), in `layout` ('nhwc' or 'nchw'),
    with local BatchNorm or, `sync` (--bn sync), BatchNorm synchronised across devices and processes, computing at
    `precision` (common/precision.py). Frozen, hashable, with slots: a tf.function trace key by value, as
    lenet.Functional."""
    layout: str = DEFAULT_LAYOUT
    sync: bool = False
    precision: str = "fp32"
    name = "resnet18"
    param_names = PARAM_NAMES

    def __post_init__(self):
        check_layout(self.layout, self.precision)

    def get_params(self, weights, device):
        return get_params(weights, device)

    def get_bn_state(self, state, device):
        return get_bn_state(state, device)

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        """The lock-step forward of every replica on its shard, local or synchronised BatchNorm, one tape (the
        gradients of the losses times `scale`, if given)."""
        return loss_and_grads(replicas, bn_states, X_shards, y_shards, devices, self.sync, self.layout, self.precision,
                              scale)

    def to_numpy(self, replica):
        return to_numpy(replica)

    def bn_state_to_numpy(self, bn_state):
        return bn_state_to_numpy(bn_state)

    def evaluate(self, replica, bn_state, X, y):
        """Inference mode: every image normalised by the running statistics."""
        return accuracy(lambda X: predict(replica, bn_state, X, self.layout), X, y, replica[0].device)


# canonical suffix -> the Keras variable's name in each kind of layer
KERAS_NAMES = {"conv": {"weight": "kernel", "bias": "bias"}, "dense": {"weight": "kernel", "bias": "bias"},
               "bn": {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean",
                      "running_var": "moving_variance"}}


def keras_variables(model):
    """canonical name -> Keras variable, for parameters and BatchNorm state alike: the layers bear the canonical
    layer names."""
    found = {}
    for layer, (kind, _) in layers(model.get_layer("stem.conv").filters).items():
        variables = {v.name: v for v in model.get_layer(layer).weights}
        for suffix, keras_name in KERAS_NAMES[kind].items():
            found[f"{layer}.{suffix}"] = variables[keras_name]
    return found


def build_model(weights, bn_state, bn=CANONICAL_BN, synchronized=False, dtype=None):
    """The same ResNet-18 as an idiomatic Keras functional model: it takes the canonical NCHW batch and Permutes it
    channels-last, as forward does; ZeroPadding2D before each "valid" convolution gives the symmetric padding;
    BatchNormalization gets `bn`'s momentum (Keras's weighs the running value: 0.9, not PyTorch's 0.1) and epsilon
    (Keras's default is 1e-3), and `synchronized` (the moments summed over a tf.distribute strategy's replicas).
    model(X, training=True) updates the moving statistics. The projections' 1x1 stride-2 convolutions take every
    other row and column, then convolve with stride 1 (subsampled: with 97 images and fewer than 16 input channels
    the stride-2 backward corrupted the heap; 96 and TF_ENABLE_ONEDNN_OPTS=0 did not). `dtype`: every layer's dtype
    policy (None: Keras's default, float32; "mixed_bfloat16" at bf16, "mixed_float16" at fp16: fp32 variables, the
    layers computing in the low dtype, BatchNormalization in fp32 on its low-precision input and its output rounded to
    it, as Keras's BatchNormalization.call casts)."""
    keras = tf.keras
    L = keras.layers
    shapes = layers(weights["stem.conv.weight"].shape[0])
    bn_args = {**layer_arguments("tensorflow", bn), "synchronized": synchronized}

    def conv(name, h):
        kernel, stride, pad = CONVS[name]
        if pad:
            h = L.ZeroPadding2D(pad, name=f"{name}.pad", dtype=dtype)(h)
        if kernel == 1 and stride > 1:   # the same numbers, without oneDNN's stride-2 1x1 backward
            h, stride = subsampled(h, stride, "nhwc"), 1
        return L.Conv2D(shapes[name][1][0], kernel, stride, "valid", name=name, dtype=dtype)(h)

    def norm(name, h):
        return L.BatchNormalization(name=name, dtype=dtype, **bn_args)(h)

    X = L.Input(IMAGE_SHAPE)
    h = L.ReLU(dtype=dtype)(norm("stem.bn", conv("stem.conv", L.Permute((2, 3, 1), dtype=dtype)(X))))
    for block, stride in BLOCKS:
        y = L.ReLU(dtype=dtype)(norm(f"{block}.bn1", conv(f"{block}.conv1", h)))
        y = norm(f"{block}.bn2", conv(f"{block}.conv2", y))
        h = L.ReLU(dtype=dtype)(L.Add(dtype=dtype)([y, conv(f"{block}.conv3", h) if has_projection(stride) else h]))
    logits = L.Dense(shapes["fc"][1][0], name="fc", dtype=dtype)(L.GlobalAveragePooling2D(dtype=dtype)(h))
    model = keras.Model(X, logits)
    for name, variable in keras_variables(model).items():
        variable.assign(to_channels_last(name, {**weights, **bn_state}[name]))
    return model


def model_to_numpy(model):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse."""
    found = {name: np.ascontiguousarray(to_canonical(name, v.numpy()), dtype=np.float32)
             for name, v in keras_variables(model).items()}
    return {name: found[name] for name in PARAM_NAMES}, {name: found[name] for name in BN_STATE_NAMES}
