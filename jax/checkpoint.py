"""JAX checkpoints: Orbax (the checkpoint library of the JAX ecosystem, installed with Flax) saving the Flax
model's state as a plain nested dict (nnx.to_pure_dict, Flax's recipe for Orbax), a directory,
restored into a model of the same structure with nnx.replace_by_pure_dict. The arrays are saved as numpy
arrays: in a multi-process run Orbax refuses host-local jax.Arrays. Orbax writes a temporary directory and
renames it when complete. The weights are stored in Flax's channels-last layout.
The optimizer's state is a second Orbax directory, as Flax's checkpointing guide saves an nnx.Optimizer: the pure
dict of its state (nnx.Optimizer's step and the Optax state of optimizer.py's transformation, the buffers in the
model's tree, channels-last like the weights), restored without a target."""
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from common import resnet
from common.lenet import LAYERS, init_weights

from . import resnet as resnet_model
from .lenet import build_model
from .optimizer import canonical_state, find, flax_paths, get_trainer, load_state

KEYS = {f"{layer}.{part}": f"{layer}/{name}" for layer in LAYERS for part, name in (("weight", "kernel"),
                                                                                    ("bias", "bias"))}
CHANNELS_LAST = True
STATE_SUFFIX = ".optimizer.orbax"   # lenet-epoch3.orbax's state: lenet-epoch3.optimizer.orbax


def checkpointer():
    """This process alone: in a multi-process run only rank 0 writes, and Orbax would otherwise wait for
    every process at its barriers."""
    me = jax.process_index()
    return ocp.StandardCheckpointer(multiprocessing_options=ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me}))


def idiomatic(weights, bn_state=None):
    """The LeNet, or with a BatchNorm state the ResNet, as the idiomatic modes build it."""
    return build_model(weights) if bn_state is None else resnet_model.build_model(weights, bn_state)


def save(weights, path, bn_state=None):
    """The ResNet's state holds its running statistics (nnx.BatchStat) beside the parameters."""
    with checkpointer() as saver:
        saver.save(os.path.abspath(path), stored(weights, bn_state))   # Orbax takes absolute paths only


def stored(weights, bn_state=None):
    """The tree save() writes. Orbax writes numpy arrays from process 0 only, so in a multi-process run the others
    learn a file's keys from this (harness/training/checkpoints.py), not from a file they write."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(idiomatic(weights, bn_state))))


def load(path, width=None):
    """The idiomatic model (the ResNet of `width`, else the LeNet) with the file's weights, in inference mode: nothing
    but Flax's and Orbax's own calls."""
    model = idiomatic(*any_weights(width))   # any weights: restoring into its state replaces every one
    state = nnx.state(model)
    with checkpointer() as restorer:
        nnx.replace_by_pure_dict(state, restorer.restore(os.path.abspath(path), nnx.to_pure_dict(state)))
    nnx.update(model, state)
    model.eval()   # BatchNorm by its running statistics (the LeNet has none)
    return model


def any_weights(width=None):
    return (init_weights(),) if width is None else (resnet.init_weights(0, width), resnet.init_bn_state(width))


def read(path):
    """The file's arrays by key (module/parameter, e.g. conv1/kernel), as stored."""
    with checkpointer() as restorer:
        return dict(flatten(restorer.restore(os.path.abspath(path))))


def flatten(tree, prefix=""):
    """(key, array) of a restored tree (an nnx.State saved whole holds each Param as {"value": array})."""
    for key, value in tree.items():
        if isinstance(value, dict) and set(value) == {"value"}:
            value = value["value"]
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", np.asarray(value)


def save_state(state, optimizer, path):
    """The idiomatic mode's nnx.Optimizer for `optimizer` (over a Flax model: its buffers in the module's tree),
    started from the canonical `state` and saved as save() saves the model. Its transformation is the stock port's
    (optimizer.get_trainer): Orbax restores only into a state of the file's structure, and a stock program's constant
    rate is a number, whose optax.scale keeps no count (nnx.Optimizer's step keeps it). The network is the state's:
    its buffers' names (`<slot>.<name>`) are the LeNet's or the ResNet's, whose width their stem's shape gives (a
    state without buffers, plain SGD's, is the same for both: the LeNet's)."""
    names = {key.split(".", 1)[1]: a for key, a in state.items() if key != "step"}
    width = resnet.width_of(names) if "stem.conv.weight" in names else None
    module = idiomatic(*any_weights(width))
    trainer = nnx.Optimizer(module, get_trainer(optimizer, port="stock"), wrt=nnx.Param)
    load_state(trainer, state, flax_paths(module))
    with checkpointer() as saver:
        saver.save(os.path.abspath(path), jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer))))


def read_state(path):
    """The canonical state's entries as stored: the step count, the buffers by canonical name in Flax's layout. The
    network is the file's: the ResNet's tree has its residual blocks (the paths do not depend on the width)."""
    with checkpointer() as restorer:
        tree = restorer.restore(os.path.abspath(path))
    opt_state = tree.get("opt_state", {}) if isinstance(tree, dict) else {}
    buffers = next((b for field in ("trace", "mu") for b in find(opt_state, field)), {})
    return canonical_state(tree, flax_paths(idiomatic(*any_weights(1 if "blocks" in buffers else None))))


def logits(model, X):
    return np.asarray(model(X))
