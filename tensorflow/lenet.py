"""LeNet in TensorFlow ops. A replica is the list of tf.Variables on one device, in
common.lenet.PARAM_NAMES order, holding the weights in TensorFlow's channels-last layout; common/layouts.py
converts them (the one place where a channels-last layout and the canonical, PyTorch, one meet)."""
import numpy as np
import tensorflow as tf

from common.layouts import to_canonical, to_channels_last
from common.lenet import IMAGE_SHAPE, LAYERS, NUM_CLASSES, PARAM_NAMES, POOL


# execution.py names and chooses the layouts (LAYOUTS, DEFAULT_LAYOUT).
layout = "nhwc"   # the scratch step's: execution.DEFAULT_LAYOUT at import; execution.use_layout replaces it


def to_layout(X):
    """A canonical NCHW batch in the convolutions' layout: NHWC, TensorFlow's usual one on the CPU, is a
    transpose; NCHW runs as it is (data_format="NCHW")."""
    return tf.transpose(X, (0, 2, 3, 1)) if layout == "nhwc" else X


def get_params(weights, device):
    with tf.device(device):
        return [tf.Variable(to_channels_last(name, weights[name]), name=name) for name in PARAM_NAMES]


def conv_relu_pool(h, w, b):
    """One convolution, its ReLU and its pooling in `layout`; the kernel is HWIO in both data formats."""
    data_format = layout.upper()
    h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, w, 1, "VALID", data_format=data_format), b, data_format))
    return tf.nn.avg_pool2d(h, POOL, POOL, "VALID", data_format)


def forward(params, X):
    """X is a canonical NCHW batch, like every framework's; to_layout makes it the convolutions' layout. A unit
    of data_parallel.py's step, which execution.use puts back as written at every level (tf.function compiles
    the step around it)."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    h = conv_relu_pool(conv_relu_pool(to_layout(X), w1, b1), w2, b2)
    if layout == "nchw":
        h = tf.transpose(h, (0, 2, 3, 1))   # 800 values per image, and the weights are those of NHWC
    h = tf.reshape(h, (-1, w3.shape[0]))   # H, W, C order: fc1's rows were reordered to match
    h = tf.nn.relu(tf.nn.bias_add(tf.matmul(h, w3), b3))
    return tf.nn.bias_add(tf.matmul(h, w4), b4)


def loss_sum(logits, y):
    """Cross-entropy summed over the shard: shards add up to the global batch exactly."""
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def to_numpy(params):
    return {name: np.ascontiguousarray(to_canonical(name, p.numpy()), dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


def build_model(weights):
    """The same LeNet as an idiomatic keras.Sequential (for the reference loop). It takes the canonical
    NCHW batch and makes it channels-last with Permute, as forward does; its weights come out in
    PARAM_NAMES order, in TensorFlow's layout."""
    (c1, _, k1, _), (c2, _, k2, _) = LAYERS["conv1"][1], LAYERS["conv2"][1]
    h1 = LAYERS["fc1"][1][0]
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        layers.Input(IMAGE_SHAPE), layers.Permute((2, 3, 1)),
        layers.Conv2D(c1, k1, activation="relu"), layers.AveragePooling2D(POOL),
        layers.Conv2D(c2, k2, activation="relu"), layers.AveragePooling2D(POOL),
        layers.Flatten(), layers.Dense(h1, activation="relu"), layers.Dense(NUM_CLASSES)])
    model.set_weights([to_channels_last(name, weights[name]) for name in PARAM_NAMES])
    return model
