"""TensorFlow checkpoints: Keras's save_weights and load_weights, a `.weights.h5` file (HDF5). Keras 3 files a
layer's variables under its class name, numbered by order of appearance (conv2d, conv2d_1, dense, dense_1),
not under the layer's own name: a file loads into any model of the same structure. The weights are stored in
Keras's channels-last layout (HWIO kernels, dense (in, out), fc1's rows in H, W, C order)."""
import h5py
import numpy as np

from common.lenet import init_weights

from .lenet import build_model

KEYS = {f"{layer}.{part}": f"layers/{group}/vars/{i}"
        for layer, group in (("conv1", "conv2d"), ("conv2", "conv2d_1"), ("fc1", "dense"), ("fc2", "dense_1"))
        for i, part in enumerate(("weight", "bias"))}
CHANNELS_LAST = True


def save(weights, path):
    build_model(weights).save_weights(path)


def load(path):
    """The idiomatic model with the file's weights: nothing but Keras's own calls."""
    model = build_model(init_weights())   # any weights: load_weights replaces every one
    model.load_weights(path)
    return model


def read(path):
    """The file's arrays by their HDF5 path, as stored (h5py, which Keras itself writes them with)."""
    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda key, item: arrays.update({key: np.asarray(item)}) if isinstance(item, h5py.Dataset)
                     else None)
    return arrays


def logits(model, X):
    return model(X, training=False).numpy()
