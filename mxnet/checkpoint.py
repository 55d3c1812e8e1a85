"""MXNet checkpoints: Gluon's save_parameters and load_parameters, an NDArray file (mx.nd.load reads it as a
dict). Gluon names a parameter by its block's position in the HybridSequential and its own name: conv1 is
block 0, conv2 block 3, fc1 and fc2 (whose ReLU is inside the Dense) blocks 6 and 7."""
import mxnet as mx

from common.lenet import PARAM_NAMES, init_weights

from .lenet import build_model

KEYS = dict(zip(PARAM_NAMES, (f"{block}.{part}" for block in (0, 3, 6, 7) for part in ("weight", "bias"))))
CHANNELS_LAST = False   # MXNet's layout is the canonical one


def save(weights, path):
    build_model(weights).save_parameters(path)


def load(path):
    """The idiomatic model with the file's weights: nothing but Gluon's own calls."""
    net = build_model(init_weights())   # any weights: load_parameters replaces every one
    net.load_parameters(path, ctx=mx.cpu())
    return net


def read(path):
    """The file's arrays by key, as stored."""
    arrays = mx.nd.load(path)
    if not isinstance(arrays, dict):
        raise ValueError("its arrays have no names (not written by save_parameters)")
    return {key: value.asnumpy() for key, value in arrays.items()}


def logits(model, X):
    return model(mx.nd.array(X)).asnumpy()
