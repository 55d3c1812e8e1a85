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
    """[(layer path, {role: (the variable's path, numpy array)})], in traversal order. A ConvTranspose's kernel is
    given as transpose_kernel=True holds it, (*spatial, out, in): Keras's, and Gluon's and PyTorch's channels-last;
    by default Flax holds it with its spatial axes flipped and in, out swapped (jax.lax.conv_transpose)."""
    found, flipped = {}, unflipped_kernels(model)
    for key, v in variables(model).items():
        layer, _, name = key.rpartition("/")
        value = np.asarray(v.value)
        found.setdefault(layer, {})[name] = (key, flip(value) if key in flipped else value)
    for layer, tensors in found.items():
        names = BATCHNORM_NAMES if "mean" in tensors else NAMES
        for name in tensors:
            if name not in names:
                raise ValueError(f"{layer}/{name}: a Flax {name} is none of the variables moved here "
                                 f"({', '.join([*NAMES, *BATCHNORM_NAMES])})")
    return [(layer, ordered({(BATCHNORM_NAMES if "mean" in tensors else NAMES)[n]: v for n, v in tensors.items()}))
            for layer, tensors in found.items()]


def unflipped_kernels(model):
    """The paths of the kernels of the module's ConvTransposes without transpose_kernel."""
    return {"/".join(map(str, path)) + "/kernel" for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.ConvTranspose) and not node.transpose_kernel}


def flip(kernel):
    """A ConvTranspose's kernel between transpose_kernel's layout and the default one (the change is its own
    inverse): spatial axes flipped, the last two swapped."""
    return np.flip(kernel, tuple(range(kernel.ndim - 2))).swapaxes(-1, -2)


def assign(model, arrays):
    """Sets the module's variables from {path: numpy array} (a ConvTranspose's kernel as layers gives it), each of
    its variable's shape."""
    flipped = unflipped_kernels(model)
    for key, v in variables(model).items():
        if key in arrays:
            value = flip(arrays[key]) if key in flipped else arrays[key]
            if value.shape != v.value.shape:
                raise ValueError(f"{key}: {value.shape}, not {v.value.shape}")
            v.value = jnp.asarray(np.ascontiguousarray(value))


def save(model, path):
    """As Flax's checkpointing guide saves a module: the pure dict of its state, with Orbax (a directory)."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(path), nnx.to_pure_dict(nnx.state(model)))
