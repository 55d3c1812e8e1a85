"""JAX checkpoints: Orbax (the checkpoint library of the JAX ecosystem, installed with Flax) saving the Flax
model's state as a plain nested dict (nnx.to_pure_dict, Flax's recipe for Orbax), a directory,
restored into a model of the same structure with nnx.replace_by_pure_dict. The arrays are saved as numpy
arrays: in a multi-process run Orbax refuses host-local jax.Arrays. The built-in engine's sharded run (--shard) writes
the same files from every process (save_sharded): its global jax.Arrays, each process the shards it holds; any file
reads whole on one process (restored). Orbax writes a temporary directory and
renames it when complete. The weights are stored in Flax's channels-last layout.
The optimizer's state is a second Orbax directory, as Flax's checkpointing guide saves an nnx.Optimizer: the pure
dict of its state (nnx.Optimizer's step and the Optax state of optimizer.py's stock port, which stock Optax code
restores into; the buffers in the model's tree, channels-last like the weights), restored without a target.
optax.rmsprop's momentum trace follows its rate (v = mu * v - lr * g / d), so its file holds -lr * the canonical
buffer at the rate of the last update, and continues the state's own run only while the rate stays (rate_inside).
That product is rounded to float32, so the canonical buffers are kept as well, a checkpoint inside the directory
(CANONICAL, which a restore of the directory does not read), for a resumed run to go on bit for bit."""
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from common import resnet
from common.interface import RosettaError
from common.layouts import to_canonical, to_channels_last
from common.lenet import LAYERS, init_weights

from . import resnet as resnet_model
from .lenet import build_model
from .optimizer import at, buffers, canonical_state, fill, flax_paths, get_trainer, load_state

KEYS = {f"{layer}.{part}": f"{layer}/{name}" for layer in LAYERS for part, name in (("weight", "kernel"),
                                                                                    ("bias", "bias"))}
CHANNELS_LAST = True
SUFFIX = ".orbax"
STATE_SUFFIX = ".optimizer.orbax"   # lenet-epoch3.orbax's state: lenet-epoch3.optimizer.orbax
SHARDED_SUFFIX = SUFFIX   # the engine's sharded checkpoints (save_sharded) are the same files, every process writing
CANONICAL = "momentum_buffer"   # in the state directory: the canonical momentum buffers, where the trace has the rate


def rate_inside(optimizer):
    """The stock optimizer that loads the state file as it is and keeps the rate inside its momentum trace
    (optax.rmsprop's: the module docstring says why the file suits it), where `optimizer` (common.optim's) has one: it
    continues the state's own run only while the rate stays (common.optim.rate_changes). optax.sgd traces before
    the rate, as the spec does."""
    return "optax.rmsprop" if optimizer.name == "rmsprop" and optimizer.momentum else None


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
    but Flax's and Orbax's own calls, each file restored as its writer's recipe restores it: Orbax restores only into
    a target of the file's structure. A pure dict (this project's files, nnx.to_pure_dict) into the state's pure dict,
    then nnx.replace_by_pure_dict; the nnx.State itself (Flax's checkpointing guide saves `state` of nnx.split(model):
    each variable a {"value": array}) into the model's nnx.State, as the guide restores it."""
    model = idiomatic(*any_weights(width))   # any weights: restoring into its state replaces every one
    state = nnx.state(model)
    with checkpointer() as restorer:
        if holds_whole_state(getattr(restorer.metadata(os.path.abspath(path)).item_metadata, "tree", None)):
            state = restorer.restore(os.path.abspath(path), state)
        else:
            nnx.replace_by_pure_dict(state, restorer.restore(os.path.abspath(path), nnx.to_pure_dict(state)))
    nnx.update(model, state)
    model.eval()   # BatchNorm by its running statistics (the LeNet has none)
    return model


def holds_whole_state(tree):
    """Whether a saved tree (or its metadata) is an nnx.State saved whole: its variables {"value": array}, where a pure
    dict has the arrays themselves."""
    return isinstance(tree, dict) and any(set(value) == {"value"} if isinstance(value, dict) and "value" in value
                                          else holds_whole_state(value) for value in tree.values())


def any_weights(width=None):
    return (init_weights(),) if width is None else (resnet.init_weights(0, width), resnet.init_bn_state(width))


def read(path):
    """The file's arrays by key (module/parameter, e.g. conv1/kernel), as stored."""
    said = manager_directory(path)
    if said:
        raise RosettaError(said)
    with checkpointer() as restorer:
        return dict(flatten(restored(restorer, os.path.abspath(path))))


def manager_directory(path):
    """A line saying what to give where `path` is an Orbax CheckpointManager's directory or one of its steps (mgr, or
    mgr/5, whose items are mgr/5/default, or mgr/5/model and mgr/5/optimizer for a Composite), not an item; else
    None."""
    path = os.fspath(path).rstrip("/")
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "_METADATA")):
        return None
    steps = sorted((int(name) for name in os.listdir(path) if name.isdigit()), reverse=True)
    step = os.path.join(path, str(steps[0])) if steps else path
    items = sorted(name for name in os.listdir(step) if os.path.isfile(os.path.join(step, name, "_METADATA")))
    if not items:
        return None
    what = "an Orbax CheckpointManager's directory" if steps else "an Orbax CheckpointManager's step"
    given = " or ".join(os.path.join(step, name) for name in items)
    return f"{what}, not one of its items: give {given}" + (" (an optimizer's with --state)" if len(items) > 1 else "")


def restored(restorer, path):
    """The tree saved at `path`, each array whole on this process as numpy: restored into a target of the file's own
    shapes (Orbax's metadata). A checkpoint that the processes of a multi-process run wrote together, each its shards
    of sharded jax.Arrays, reads so too: without a target Orbax would place them on the saving run's devices."""
    saved = restorer.metadata(path).item_metadata
    return restorer.restore(path, jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), saved))


def unwrapped(tree):
    """A restored tree as its pure dict (nnx.to_pure_dict's): an nnx.State saved whole (Flax's checkpointing guide
    saves nnx.state(model) and nnx.state(optimizer) so) holds each variable as {"value": array}, here the array."""
    if not isinstance(tree, dict):
        return tree
    if set(tree) == {"value"}:
        return tree["value"]
    return {key: unwrapped(value) for key, value in tree.items()}


def flatten(tree, prefix=""):
    """(key, array) of a restored tree, a pure dict or an nnx.State saved whole (unwrapped)."""
    for key, value in unwrapped(tree).items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", np.asarray(value)


def save_state(state, optimizer, path):
    """The idiomatic mode's nnx.Optimizer for `optimizer` (over a Flax model: its buffers in the module's tree),
    started from the canonical `state` and saved as save() saves the model. Its transformation is the stock port's
    (optimizer.get_trainer): Orbax restores only into a state of the file's structure, and a stock program's constant
    rate is a number, whose optax.scale keeps no count (nnx.Optimizer's step keeps it). Where its trace holds the rate
    (rate_inside) the trace is -lr * the buffer at the last update's rate, and the canonical buffers are saved too
    (CANONICAL). The network is the state's: its buffers' names (`<slot>.<name>`) are the LeNet's or the ResNet's,
    whose width their stem's shape gives (a state without buffers, plain SGD's, is the same for both: the LeNet's)."""
    tree, kept = state_trees(state, optimizer)
    with checkpointer() as saver:
        saver.save(os.path.abspath(path), tree)
        if kept is not None:
            saver.save(os.path.join(os.path.abspath(path), CANONICAL), kept)


def state_trees(state, optimizer, held=None):
    """(the stock nnx.Optimizer's pure dict holding the canonical `state`, the CANONICAL tree or None): save_state's
    trees. `held`: the buffers as a run's processes hold them ("<slot>.<name>" -> a global jax.Array in Flax's layout,
    sliced or whole), put in the trees in place of `state`'s (which then gives their shapes only)."""
    names = {key.split(".", 1)[1]: a for key, a in state.items() if key != "step"}
    width = resnet.width_of(names) if "stem.conv.weight" in names else None
    module = idiomatic(*any_weights(width))
    trainer = nnx.Optimizer(module, get_trainer(optimizer, port="stock"), wrt=nnx.Param)
    paths, stock, inside = flax_paths(module), state, rate_inside(optimizer)
    rate = optimizer.learning_rate(max(state["step"] - 1, 0)) if inside else None   # a state of no steps: zeros
    if inside:
        stock = {key: (-rate * np.asarray(a, np.float64)).astype(np.float32) if key.startswith("momentum_buffer.")
                 else a for key, a in state.items()}
    load_state(trainer, stock, paths)
    tree = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer)))   # numpy: Orbax's multi-process save
    if held is not None:                                                    # refuses a process's own jax.Arrays
        placed = {key: -rate * a if inside and key.startswith("momentum_buffer.") else a for key, a in held.items()}
        fill(tree.get("opt_state", {}), placed, paths, laid_out=True)
    if not inside:
        return tree, None
    kept = state if held is None else held
    return tree, module_tree({name: kept[f"momentum_buffer.{name}"] for name in paths}, paths, laid_out=held is not None)


def save_sharded(weights, bn_state, state, optimizer, path):
    """A checkpoint written as a multi-process run holds it, nothing gathered: `weights` (canonical name -> a global
    jax.Array in Flax's layout, sliced over the processes' devices or whole) and the optimizer's `state` ("step", and
    "<slot>.<name>" global arrays so laid out; None for the recipe's plain SGD), saved by every process with Orbax in
    the trees save and save_state write, each process writing the shards it holds (a whole array once). `bn_state`:
    the ResNet's running statistics, this process's (numpy: process 0's are written). The state first; Orbax renames
    each directory once every process has written (its own atomic commit)."""
    shapes = {name: to_canonical(name, np.zeros(a.shape, np.float32)) for name, a in weights.items()}
    module = idiomatic(*((shapes,) if bn_state is None else (shapes, bn_state)))
    tree = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module)))
    load_weights(tree, weights, flax_paths(module))
    with ocp.StandardCheckpointer() as saver:   # every process: each writes its shards
        if state is not None:
            zeros = {key: value if key == "step" else shapes[key.split(".", 1)[1]] for key, value in state.items()}
            trees = state_trees(zeros, optimizer, held={key: a for key, a in state.items() if key != "step"})
            where = os.path.abspath(path)[:-len(SUFFIX)] + STATE_SUFFIX
            saver.save(where, trees[0], force=True)
            if trees[1] is not None:
                saver.wait_until_finished()
                saver.save(os.path.join(where, CANONICAL), trees[1], force=True)
            saver.wait_until_finished()
        saver.save(os.path.abspath(path), tree, force=True)


def load_weights(tree, weights, paths):
    """Each weight into a pure dict of the module's state, at its path."""
    for name, path in paths.items():
        at(tree, path[:-1])[path[-1]] = weights[name]


def module_tree(arrays, paths, laid_out=False):
    """Canonical arrays by name as nested dicts at their parameters' `paths` in the Flax module, channels-last: how
    an nnx.Optimizer's pure dict keeps a buffer. `laid_out`: the arrays are channels-last already (global arrays)."""
    tree = {}
    for name, path in paths.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = arrays[name] if laid_out else to_channels_last(name, np.asarray(arrays[name]))
    return tree


def read_state(path):
    """The canonical state's entries as stored: the step count, the buffers by canonical name in Flax's layout, the
    momentum buffers from CANONICAL where the trace holds the rate (without it, a stock optax.rmsprop's own file, the
    rate is unknown: refused). The network is the file's: the ResNet's tree has its residual blocks (the paths do
    not depend on the width)."""
    said = manager_directory(path)
    if said:
        raise RosettaError(said)
    path = os.path.abspath(path)
    with checkpointer() as restorer:
        tree = unwrapped(restored(restorer, path))   # the guide's nnx.state(optimizer) too, each leaf {"value": x}
        kept = restored(restorer, os.path.join(path, CANONICAL)) if os.path.isdir(os.path.join(path, CANONICAL)) \
            else None
    opt_state = tree.get("opt_state", {}) if isinstance(tree, dict) else {}
    first = next((b for _, b in buffers(opt_state)), {})
    paths = flax_paths(idiomatic(*any_weights(1 if "blocks" in first else None)))
    state = canonical_state(tree, paths)
    slots = {key.split(".", 1)[0] for key in state if key != "step"}
    if kept is not None:
        state.update({f"momentum_buffer.{name}": np.asarray(at(kept, p)) for name, p in paths.items()})
    elif {"square_avg", "momentum_buffer"} <= slots:
        raise ValueError("an RMSprop momentum trace without the canonical buffers this project keeps beside it: "
                         "optax.rmsprop's trace holds the rate, which its file does not say (a file stock Optax "
                         "code wrote), so the converter does not read it")
    return state


def logits(model, X):
    return np.asarray(model(X))
