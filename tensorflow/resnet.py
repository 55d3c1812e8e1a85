"""d2l's ResNet-18 (common/resnet.py) in TensorFlow ops. A replica is the list of tf.Variables on one device, in
common.resnet.PARAM_NAMES order, holding the weights in TensorFlow's layout (HWIO kernels, dense (in, out):
common/layouts.py converts them; global average pooling leaves no flatten order to fix), and its BatchNorm state
the list of running statistics in BN_STATE_NAMES order."""
import numpy as np
import tensorflow as tf

from common.layouts import to_canonical, to_channels_last
from common.resnet import (BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, IMAGE_SHAPE, PARAM_NAMES, has_projection,
                           layer_arguments, layers)

layout = "nhwc"   # as lenet.layout: execution.DEFAULT_LAYOUT


def to_layout(X):
    """A canonical NCHW batch in the convolutions' layout: NHWC is a transpose; NCHW runs as it is."""
    return tf.transpose(X, (0, 2, 3, 1)) if layout == "nhwc" else X


def get_params(weights, device):
    with tf.device(device):
        return [tf.Variable(to_channels_last(name, weights[name]), name=name) for name in PARAM_NAMES]


def get_bn_state(state, device):
    """The running statistics, on the device: constants, not Variables; forward returns new ones."""
    with tf.device(device):
        return [tf.constant(state[name]) for name in BN_STATE_NAMES]


def conv(p, name, h):
    """Explicit symmetric padding: padding="SAME" with stride 2 on an even input pads bottom/right only."""
    _, stride, pad = CONVS[name]
    padding = [[0, 0], [pad, pad], [pad, pad], [0, 0]] if layout == "nhwc" else [[0, 0], [0, 0], [pad, pad], [pad, pad]]
    h = tf.nn.conv2d(h, p[f"{name}.weight"], stride, padding, data_format=layout.upper())
    return tf.nn.bias_add(h, p[f"{name}.bias"], data_format=layout.upper())


def batch_norm(p, s, name, h, training, bn, new_state):
    """common.resnet.batch_norm written out with tf.nn.moments (biased) and tf.nn.batch_normalization. The batch
    statistics are those of this tensor; a synchronised BatchNorm would all-reduce common.resnet.moments of each
    shard here."""
    axes, shape = ([0, 1, 2], (1, 1, 1, -1)) if layout == "nhwc" else ([0, 2, 3], (1, -1, 1, 1))
    gamma, beta = p[f"{name}.weight"], p[f"{name}.bias"]
    mean, var = s[f"{name}.running_mean"], s[f"{name}.running_var"]
    if training:
        count = int(np.prod([h.shape[a] for a in axes]))
        batch_mean, batch_var = tf.nn.moments(h, axes)
        running_var = batch_var * count / (count - 1) if bn.unbiased else batch_var
        new_state[f"{name}.running_mean"] = (1 - bn.momentum) * mean + bn.momentum * tf.stop_gradient(batch_mean)
        new_state[f"{name}.running_var"] = (1 - bn.momentum) * var + bn.momentum * tf.stop_gradient(running_var)
        mean, var = batch_mean, batch_var
    reshape = lambda v: tf.reshape(v, shape)   # noqa: E731
    return tf.nn.batch_normalization(h, reshape(mean), reshape(var), reshape(beta), reshape(gamma), bn.eps)


def forward(params, bn_state, X, training, bn=CANONICAL_BN):
    """Logits of the NCHW batch X; in training mode (batch statistics) also the new BatchNorm state, a list in
    BN_STATE_NAMES order. Nothing is updated in place: the caller keeps or drops the new state."""
    p, s, new_state = dict(zip(PARAM_NAMES, params)), dict(zip(BN_STATE_NAMES, bn_state)), {}
    norm = lambda name, h: batch_norm(p, s, name, h, training, bn, new_state)   # noqa: E731
    h = tf.nn.relu(norm("stem.bn", conv(p, "stem.conv", to_layout(X))))
    for block, stride in BLOCKS:
        y = tf.nn.relu(norm(f"{block}.bn1", conv(p, f"{block}.conv1", h)))
        y = norm(f"{block}.bn2", conv(p, f"{block}.conv2", y))
        h = tf.nn.relu(y + (conv(p, f"{block}.conv3", h) if has_projection(stride) else h))
    h = tf.reduce_mean(h, [1, 2] if layout == "nhwc" else [2, 3])   # global average pooling
    logits = tf.nn.bias_add(tf.matmul(h, p["fc.weight"]), p["fc.bias"])
    return (logits, [new_state[name] for name in BN_STATE_NAMES]) if training else logits


def to_numpy(params):
    return {name: np.ascontiguousarray(to_canonical(name, p.numpy()), dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: t.numpy().astype(np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


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


def build_model(weights, bn_state, bn=CANONICAL_BN):
    """The same ResNet-18 as an idiomatic Keras functional model: it takes the canonical NCHW batch and Permutes it
    channels-last, as forward does; ZeroPadding2D before each "valid" convolution gives the symmetric padding;
    BatchNormalization gets `bn`'s momentum (Keras's weighs the running value: 0.9, not PyTorch's 0.1) and epsilon
    (Keras's default is 1e-3). model(X, training=True) updates the moving statistics."""
    keras = tf.keras
    L = keras.layers
    shapes = layers(weights["stem.conv.weight"].shape[0])
    bn_args = layer_arguments("tensorflow", bn)

    def conv(name, h):
        kernel, stride, pad = CONVS[name]
        if pad:
            h = L.ZeroPadding2D(pad, name=f"{name}.pad")(h)
        return L.Conv2D(shapes[name][1][0], kernel, stride, "valid", name=name)(h)

    def norm(name, h):
        return L.BatchNormalization(name=name, **bn_args)(h)

    X = L.Input(IMAGE_SHAPE)
    h = L.ReLU()(norm("stem.bn", conv("stem.conv", L.Permute((2, 3, 1))(X))))
    for block, stride in BLOCKS:
        y = L.ReLU()(norm(f"{block}.bn1", conv(f"{block}.conv1", h)))
        y = norm(f"{block}.bn2", conv(f"{block}.conv2", y))
        h = L.ReLU()(L.Add()([y, conv(f"{block}.conv3", h) if has_projection(stride) else h]))
    logits = L.Dense(shapes["fc"][1][0], name="fc")(L.GlobalAveragePooling2D()(h))
    model = keras.Model(X, logits)
    for name, variable in keras_variables(model).items():
        variable.assign(to_channels_last(name, {**weights, **bn_state}[name]))
    return model


def model_to_numpy(model):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse."""
    found = {name: np.ascontiguousarray(to_canonical(name, v.numpy()), dtype=np.float32)
             for name, v in keras_variables(model).items()}
    return {name: found[name] for name in PARAM_NAMES}, {name: found[name] for name in BN_STATE_NAMES}
