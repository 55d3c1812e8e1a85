"""LeNet in TensorFlow ops. A replica is the list of tf.Variables on one device, in
common.lenet.PARAM_NAMES order, holding the weights in TensorFlow's channels-last layout; common/layouts.py
converts them (the one place where a channels-last layout and the canonical, PyTorch, one meet). The memory
layout of the convolutions is an argument (Functional's field), never a module's setting."""
import dataclasses
import functools

import numpy as np
import tensorflow as tf

from common.interface import Unavailable
from common.layouts import to_canonical, to_channels_last
from common.lenet import IMAGE_SHAPE, LAYERS, NUM_CLASSES, PARAM_NAMES, POOL

# The scratch step's usual layout (execution.py names and chooses the layouts: LAYOUTS, and exports this one): here,
# where resnet.py and the functions below read it without importing execution.py.
DEFAULT_LAYOUT = "nhwc"
# The dtype a convolution or dense layer computes in at each precision (common/precision.py)
COMPUTE_DTYPES = {"fp32": tf.float32, "bf16": tf.bfloat16, "fp16": tf.float16}
# Whether the CPU's gradient of tf.nn.bias_add (BiasAddGrad) sums its low-precision gradient in fp32, at each
# precision: yes for fp16 (its accumulator type for half is float), no for bf16, which it sums in bf16 (a 16x24x24
# batch's sum 9% off; Keras's mixed_bfloat16 Conv2D and Dense, whose bias goes through tf.nn.bias_add, inherit it).
# The broadcast's gradient, tf.reduce_sum, is the other way round: it sums bf16 in fp32 but fp16 in fp16 (0.7% off
# on the same batch, 30 times fp16's rounding; tests/test_fp16_tensorflow.py measures both).
BIAS_SUMS_IN_FP32 = {"fp32": True, "bf16": False, "fp16": True}


def to_layout(X, layout=DEFAULT_LAYOUT):
    """A canonical NCHW batch in the convolutions' layout: NHWC, TensorFlow's usual one on the CPU, is a
    transpose; NCHW runs as it is (data_format="NCHW")."""
    return tf.transpose(X, (0, 2, 3, 1)) if layout == "nhwc" else X


def get_params(weights, device):
    """HWIO kernels in both layouts: a replica does not depend on the layout."""
    with tf.device(device):
        return [tf.Variable(to_channels_last(name, weights[name]), name=name) for name in PARAM_NAMES]


def compute(precision, *tensors):
    """A convolution's or dense layer's input, weight and bias in its compute precision: cast to bf16 at bf16 (fp16
    at fp16), as Keras's mixed_bfloat16 (mixed_float16) policy casts a layer's inputs and variables (the CPU runs
    them in the low dtype, the output rounded to it; tf.cast's gradient widens a weight's low-precision gradient to
    fp32 for its master weight); untouched at fp32."""
    if precision == "fp32":
        return tensors
    return tuple(tf.cast(t, COMPUTE_DTYPES[precision]) for t in tensors)


def bias_add(h, b, data_format=None, precision="fp32"):
    """tf.nn.bias_add, whose gradient sums in fp32 at fp32 and fp16, or where it does not (BIAS_SUMS_IN_FP32) a
    broadcast addition, whose gradient (tf.reduce_sum) then does: a bias gradient is one rounding of its fp32 sum."""
    if BIAS_SUMS_IN_FP32[precision]:
        return tf.nn.bias_add(h, b, data_format)
    return h + (tf.reshape(b, (-1, 1, 1)) if data_format == "NCHW" else b)


def conv_relu_pool(h, w, b, layout=DEFAULT_LAYOUT, precision="fp32"):
    """One convolution, its ReLU and its pooling in `layout`, at `precision` (the ReLU and pooling in the
    convolution's output's); the kernel is HWIO in both data formats."""
    data_format = layout.upper()
    h, w, b = compute(precision, h, w, b)
    h = tf.nn.relu(bias_add(tf.nn.conv2d(h, w, 1, "VALID", data_format=data_format), b, data_format, precision))
    return tf.nn.avg_pool2d(h, POOL, POOL, "VALID", data_format)


def forward(params, X, layout=DEFAULT_LAYOUT, precision="fp32"):
    """X is a canonical NCHW batch, like every framework's; to_layout makes it the convolutions' layout. The logits
    at `precision` (bf16 at bf16, fp16 at fp16: loss_sum takes them to fp32)."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    h = conv_relu_pool(conv_relu_pool(to_layout(X, layout), w1, b1, layout, precision), w2, b2, layout, precision)
    if layout == "nchw":
        h = tf.transpose(h, (0, 2, 3, 1))   # 800 values per image, and the weights are those of NHWC
    h = tf.reshape(h, (-1, w3.shape[0]))   # H, W, C order: fc1's rows were reordered to match
    h, w3, b3 = compute(precision, h, w3, b3)
    h = tf.nn.relu(bias_add(tf.matmul(h, w3), b3, precision=precision))
    h, w4, b4 = compute(precision, h, w4, b4)
    return bias_add(tf.matmul(h, w4), b4, precision=precision)


def loss_sum(logits, y):
    """Cross-entropy summed over the shard, in fp32 whatever the logits' precision (common/precision.py; tf.cast
    leaves fp32 logits as they are): shards add up to the global batch exactly."""
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.cast(logits, tf.float32)))


def scaled(loss, scale=None):
    """The loss the backward starts from: times the loss scale (a tensor) under dynamic loss scaling
    (common/loss_scaling.py), else the loss itself."""
    return loss if scale is None else loss * scale


def device_loss_and_grads(params, X, y, layout=DEFAULT_LAYOUT, precision="fp32", scale=None):
    """One device's part of the step: its shard's summed loss and the gradients (of the loss times `scale`, if
    given: the loss returned is unscaled), the forward at `precision`. The parameters watched: tf.Variables, or
    the tensors ZeRO's stage 3 gathers (data_parallel.gather_params)."""
    with tf.GradientTape() as tape:
        tape.watch(params)
        loss = loss_sum(forward(params, X, layout, precision), y)
        target = scaled(loss, scale)
    return loss, tape.gradient(target, params)


def to_numpy(params):
    return {name: np.ascontiguousarray(to_canonical(name, p.numpy()), dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


def accuracy(predict, X, y, device, batch_size=1000):
    """The share of X whose predicted class (predict: a batch on `device` -> class indices) is y, batch by batch."""
    correct = 0
    for i in range(0, len(X), batch_size):
        with tf.device(device):
            correct += (np.asarray(predict(tf.convert_to_tensor(X[i:i + batch_size]))) == y[i:i + batch_size]).sum()
    return float(correct) / len(X)


@functools.cache
def runs_fp16_in_nchw():
    """Whether TensorFlow here convolves fp16 in NCHW. On a CPU only oneDNN runs NCHW, and its fp16 kernels need a CPU
    with AVX512-FP16: the AMD EPYC (Zen 4) has none, and the plain kernel refuses NCHW. Asked of the device once."""
    try:
        tf.nn.conv2d(tf.zeros((1, 1, 2, 2), tf.float16), tf.zeros((1, 1, 1, 1), tf.float16), 1, "VALID",
                     data_format="NCHW")
        return True
    except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError):
        return False


def check_layout(layout, precision):
    """A Functional's layout and precision together: one line where this machine's TensorFlow cannot run them."""
    if layout == "nchw" and precision == "fp16" and not runs_fp16_in_nchw():
        raise Unavailable("TensorFlow has no fp16 convolution in NCHW on this CPU (oneDNN's fp16 kernels need "
                          "AVX512-FP16): run fp16 with --layout nhwc")


@dataclasses.dataclass(frozen=True, slots=True)
class Functional:
    """The LeNet as the recipe's step trains it (common.interface.FUNCTIONAL), in `layout` ('nhwc' or 'nchw'),
    computing at `precision` (common/precision.py). Frozen and hashable, and with slots (no weak reference):
    tf.function then keys its traces by the Functional's value, so an equal Functional made anew reuses them (a
    weakly referenced object is keyed by its identity)."""
    layout: str = DEFAULT_LAYOUT
    precision: str = "fp32"
    name = "lenet"
    param_names = PARAM_NAMES

    def __post_init__(self):
        check_layout(self.layout, self.precision)

    def get_params(self, weights, device):
        return get_params(weights, device)

    def get_bn_state(self, state, device):
        return None   # no BatchNorm

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        """Each device's own loss and gradients (of its loss times `scale`, if given), each under its tf.device: in
        a graph the devices' parts depend on nothing of each other's and run in parallel."""
        losses, grads = [], []
        for params, X, y, device in zip(replicas, X_shards, y_shards, devices):
            with tf.device(device):
                loss, device_grads = device_loss_and_grads(params, X, y, self.layout, self.precision, scale)
            losses.append(loss)
            grads.append(device_grads)
        return losses, grads, bn_states

    def to_numpy(self, replica):
        return to_numpy(replica)

    def bn_state_to_numpy(self, bn_state):
        return {}

    def evaluate(self, replica, bn_state, X, y):
        return accuracy(lambda X: tf.argmax(forward(replica, X, self.layout), 1), X, y, replica[0].device)


def build_model(weights, dtype=None):
    """The same LeNet as an idiomatic keras.Sequential (for the reference loop). It takes the canonical
    NCHW batch and makes it channels-last with Permute, as forward does; its weights come out in
    PARAM_NAMES order, in TensorFlow's layout. `dtype`: every layer's dtype policy (None: Keras's default, float32;
    "mixed_bfloat16" at bf16, "mixed_float16" at fp16: fp32 variables, each layer computing in the low dtype)."""
    (c1, _, k1, _), (c2, _, k2, _) = LAYERS["conv1"][1], LAYERS["conv2"][1]
    h1 = LAYERS["fc1"][1][0]
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        layers.Input(IMAGE_SHAPE), layers.Permute((2, 3, 1), dtype=dtype),
        layers.Conv2D(c1, k1, activation="relu", dtype=dtype), layers.AveragePooling2D(POOL, dtype=dtype),
        layers.Conv2D(c2, k2, activation="relu", dtype=dtype), layers.AveragePooling2D(POOL, dtype=dtype),
        layers.Flatten(dtype=dtype), layers.Dense(h1, activation="relu", dtype=dtype),
        layers.Dense(NUM_CLASSES, dtype=dtype)])
    model.set_weights([to_channels_last(name, weights[name]) for name in PARAM_NAMES])
    return model
