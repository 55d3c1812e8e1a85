"""A user's own Flax NNX module, layer by layer (common/transfer.py): its nnx.Param and nnx.BatchStat variables in
NNX's traversal order (nnx.iter_graph: a module's attributes by name, a list's items by index), a layer's
variables named by role: kernel is the weight; a BatchNorm's scale and bias are its gamma and beta, its mean and
var the running statistics."""
import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from common.transfer import ordered

CHANNELS_LAST = True
NAMES = {"kernel": "weight", "bias": "bias"}
BATCHNORM_NAMES = {"scale": "gamma", "bias": "beta", "mean": "running_mean", "var": "running_var"}


def variables(model):
    """{path joined by '/': the nnx.Param or nnx.BatchStat}, in traversal order."""
    return {"/".join(map(str, path)): v for path, v in nnx.iter_graph(model)
            if isinstance(v, (nnx.Param, nnx.BatchStat))}


def layers(model):
    """[(layer path, {role: (the variable's path, numpy array)})], in traversal order."""
    found = {}
    for key, v in variables(model).items():
        layer, _, name = key.rpartition("/")
        found.setdefault(layer, {})[name] = (key, np.asarray(v.value))
    return [(layer, ordered({(BATCHNORM_NAMES if "mean" in tensors else NAMES)[n]: v for n, v in tensors.items()}))
            for layer, tensors in found.items()]


def assign(model, arrays):
    """Sets the module's variables from {path: numpy array}, each of its variable's shape."""
    for key, v in variables(model).items():
        if key in arrays:
            if arrays[key].shape != v.value.shape:
                raise ValueError(f"{key}: {arrays[key].shape}, not {v.value.shape}")
            v.value = jnp.asarray(arrays[key])


def save(model, path):
    """As Flax's checkpointing guide saves a module: the pure dict of its state, with Orbax (a directory)."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(path), nnx.to_pure_dict(nnx.state(model)))
