"""TensorFlow checkpoints: Keras's save_weights and load_weights, a `.weights.h5` file (HDF5). Keras 3 files a
layer's variables under its class name, numbered by order of appearance (conv2d, conv2d_1, dense, dense_1),
not under the layer's own name: a file loads into any model of the same structure. The weights are stored in
Keras's channels-last layout (HWIO kernels, dense (in, out), fc1's rows in H, W, C order). A whole-model `.keras`
archive (model.save, or ModelCheckpoint without save_weights_only) holds the same file inside, read from it (opened).

The optimizer state is a directory beside the weights holding a TensorFlow checkpoint of the Keras optimizer, as
TensorFlow saves one: tf.train.Checkpoint(optimizer=...).write. Its variables are the step count (`iterations`,
which drives the schedule) and the buffers, in Keras's layout like the weights and in Keras's convention: its SGD
keeps the rate inside the momentum buffer (v = mu * v - lr * g; w += v), so the file holds -lr * the canonical buffer
at the rate of the last update (its RMSprop's, v = mu * v + lr * g / d; w -= v: lr * the canonical buffer), and a
stock keras.optimizers.SGD (RMSprop) that restores it goes on as the run would have while the rate stays
(rate_inside).
That product is rounded to float32, so the canonical buffers are kept beside the optimizer as well (CANONICAL), for
a resumed run to go on bit for bit. A directory, so that the rename that finishes an atomic write
(harness/files.py) moves the checkpoint's index and data files at once."""
import io
import os
import zipfile

import h5py
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf.trackable_object_graph_pb2 import TrackableObjectGraph

from common.interface import RosettaError
from common.layouts import to_channels_last
from common import resnet
from common.lenet import init_weights

from . import resnet as resnet_model
from .lenet import build_model
from .optimizer import buffers, get_trainer, load_state

KEYS = {f"{layer}.{part}": f"layers/{group}/vars/{i}"
        for layer, group in (("conv1", "conv2d"), ("conv2", "conv2d_1"), ("fc1", "dense"), ("fc2", "dense_1"))
        for i, part in enumerate(("weight", "bias"))}
CHANNELS_LAST = True
STATE_SUFFIX = ".optimizer.ckpt"   # lenet-epoch3.weights.h5's state: lenet-epoch3.optimizer.ckpt/optimizer.index, ...
PREFIX = "optimizer"               # the checkpoint's files in that directory: optimizer.index, optimizer.data-*
OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"   # tf.train.Checkpoint's entry naming what every other entry is
# The stock Adam that loads the optimizer file as it is, and adds epsilon to the uncorrected sqrt(v): it continues a
# canonical Adam state only approximately (common.optim.epsilon_hat_gap; optimizer.py's Adam is exact)
STOCK_ADAM_EPSILON_HAT = "keras.optimizers.Adam"
CANONICAL = "momentum_buffer"   # the checkpoint's entry beside the optimizer: the canonical momentum buffers, exactly


def rate_inside(optimizer):
    """The stock optimizer that loads the file as it is and keeps the rate inside its momentum buffer (Keras's SGD,
    or its RMSprop with momentum; the module docstring says why the file suits it), where `optimizer` (common.optim's)
    has one: it continues the state's own run only while the rate stays (common.optim.rate_changes; optimizer.py's
    SGD and RMSprop are exact)."""
    if optimizer.name in ("momentum", "nesterov"):
        return "keras.optimizers.SGD"
    return "keras.optimizers.RMSprop" if optimizer.name == "rmsprop" and optimizer.momentum else None


def rate_held(optimizer, rate):
    """What the stock class's momentum holds for a canonical buffer of 1 at `rate` (rate_inside's class): SGD adds
    its buffer to the weights (-rate), RMSprop subtracts it (rate)."""
    return -rate if rate_inside(optimizer) == "keras.optimizers.SGD" else rate


def idiomatic(weights, bn_state=None):
    """The LeNet, or with a BatchNorm state the ResNet, as the idiomatic modes build it."""
    return build_model(weights) if bn_state is None else resnet_model.build_model(weights, bn_state)


def save(weights, path, bn_state=None):
    """The ResNet's file holds each BatchNormalization's moving mean and variance beside gamma and beta."""
    idiomatic(weights, bn_state).save_weights(path)


def load(path, width=None):
    """The idiomatic model (the ResNet of `width`, else the LeNet) with the file's weights: nothing but Keras's own
    calls."""
    model = idiomatic(*any_weights(width))   # any weights: load_weights replaces every one
    model.load_weights(path)
    return model


def any_weights(width=None):
    return (init_weights(),) if width is None else (resnet.init_weights(0, width), resnet.init_bn_state(width))


def read(path):
    """The model's arrays by their HDF5 path, as stored (h5py, which Keras itself writes them with): all but the
    compiled optimizer's variables that Keras 3's save_weights adds under OPTIMIZER (not_carried says so)."""
    arrays = {}
    with opened(path) as f:
        f.visititems(lambda key, item: arrays.update({key: np.asarray(item)}) if isinstance(item, h5py.Dataset)
                     and not key.startswith(f"{OPTIMIZER}/") else None)
    return arrays


OPTIMIZER = "optimizer"   # Keras 3's save_weights of a compiled model: its optimizer's variables, optimizer/vars/<i>
WHOLE_MODEL_WEIGHTS = "model.weights.h5"   # in a .keras archive (model.save): the same file as save_weights writes
STOCK_CHECKPOINT = ("a stock tf.train.Checkpoint (its save, or a CheckpointManager's), which the converter does not "
                    "read: restore it into the Keras model and give model.save_weights('x.weights.h5') (a stock Keras "
                    "optimizer's state is not carried)")


def opened(path):
    """The weights file as h5py opens it: a .weights.h5, or the one inside a whole-model .keras archive (a zip of
    the model's config and WHOLE_MODEL_WEIGHTS, which Keras's own load_weights reads too). A tf.train.Checkpoint, a
    directory or the prefix its save returns, is one line."""
    if is_stock_checkpoint(path):
        raise RosettaError(STOCK_CHECKPOINT)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if WHOLE_MODEL_WEIGHTS not in archive.namelist():
                raise RosettaError(f"a zip archive without {WHOLE_MODEL_WEIGHTS}: not a Keras model.save file")
            return h5py.File(io.BytesIO(archive.read(WHOLE_MODEL_WEIGHTS)), "r")
    return h5py.File(path, "r")


def is_stock_checkpoint(path):
    """Whether `path` is a tf.train.Checkpoint's: a directory a CheckpointManager keeps (its `checkpoint` index of
    prefixes) or a prefix (ckpt-1, beside its ckpt-1.index), not this project's optimizer directory."""
    path = os.fspath(path).rstrip("/")
    return os.path.isfile(os.path.join(path, "checkpoint")) or os.path.isfile(path + ".index")


def not_carried(path):
    """A line naming the compiled optimizer's variables that a stock program's save_weights put into the weights
    file (Keras 3 does once model.fit has built them), which the converter does not carry, or None. The file keys them
    by position only (optimizer/vars/0: the step count, then the rate, then the buffers in Keras's order, each
    optimizer its own) and keeps no hyperparameter: nothing says whose parameter or which slot a buffer is. The
    optimizer state is read from a tf.train.Checkpoint of the optimizer (STATE_SUFFIX, or --state), which names them."""
    with opened(path) as f:
        group = f.get(f"{OPTIMIZER}/vars")
        if not isinstance(group, h5py.Group) or not len(group):
            return None
        name = group.attrs.get("name", "")
        return (f"{len(group)} variables of its compiled optimizer{f' ({name})' if name else ''}, which Keras's "
                "save_weights keys by position only")


def save_state(state, optimizer, path):
    """Keras's optimizer for `optimizer`, as the built-in and idiomatic modes make it (get_trainer), started from
    the canonical `state` and written as TensorFlow writes it. Keras builds it over the model's variables, making
    each buffer in the shape of its variable, named after it: here over stand-ins named after the state's parameters
    (the LeNet's or a ResNet's of any width: its keys say, `<slot>.<name>`), zeros in the buffers' shapes as given (a
    wrong one included: the harness's read_state names it; but a parameter's buffers are alike in Keras, so Adam's two
    moments of different shapes raise ValueError). A state without buffers is its step count alone, over no
    stand-in. Keras 3's TensorFlow optimizer tracks the variables it is built over, so the stand-ins are in the file
    too, and a native restore of it into a model's optimizer, tf.train.Checkpoint(optimizer=model.optimizer).read,
    restores the buffers and the step count (on every replica, under a strategy) and zeroes the model's weights:
    load_weights after it."""
    trainer = get_trainer(optimizer)
    first = f"{optimizer.slots[0]}." if optimizer.slots else None
    shapes = {key[len(first):]: np.shape(a) for key, a in state.items() if first and key.startswith(first)}
    stand_ins = {name: tf.keras.Variable(to_channels_last(name, np.zeros(shape, np.float32)), name=name)
                 for name, shape in shapes.items()}
    trainer.build(list(stand_ins.values()))
    load_state(trainer, state, stand_ins)
    held = rate_held(optimizer, optimizer.learning_rate(max(state["step"] - 1, 0)))   # no steps: zero buffers
    canonical = {}
    if "momentum_buffer" in optimizer.slots:
        for name, variable in buffers(trainer, "momentum_buffer", stand_ins).items():
            canonical[name] = tf.Variable(variable.numpy())
            variable.assign((held * variable.numpy().astype(np.float64)).astype(np.float32))
    os.makedirs(path)
    tf.train.Checkpoint(optimizer=trainer, **({CANONICAL: canonical} if canonical else {})).write(
        os.path.join(path, PREFIX))


def read_state(path):
    """The step count and the buffers (canonical names and convention, Keras's layout), read with TensorFlow's
    CheckpointReader: no model, no optimizer. Keras names its variables, not the checkpoint's keys (which say only
    where a variable hangs: optimizer/_variables/3/...): the checkpoint's object graph has both. Keras names a buffer
    after its parameter and slot: <parameter>_momentum (SGD's buffer, Adam's first moment, RMSprop's momentum),
    <parameter>_velocity (Adam's second moment, RMSprop's average of the squares), <parameter>_average_gradient
    (centered RMSprop's average of the gradients) and <parameter>_accumulator (Adagrad's sum), so the parameters'
    names, the LeNet's or the ResNet's, come from the file. Adam's and RMSprop's (with momentum) have the same two
    suffixes: Keras's RMSprop makes all its velocities first, its Adam each parameter's momentum then its velocity.
    SGD's and RMSprop's momentum buffers are the canonical ones kept beside them (Keras's hold the rate, rounded)."""
    if is_stock_checkpoint(path):
        raise RosettaError(STOCK_CHECKPOINT)
    reader = tf.train.load_checkpoint(os.path.join(path, PREFIX))
    variables = optimizer_variables(reader)
    state = {"step": int(reader.get_tensor(key)) for name, key in variables if name.endswith("/iteration")}
    suffixes = ("momentum", "velocity", "average_gradient", "accumulator")
    kinds = {kind: {name.split("/")[-1][:-len(f"_{kind}")]: key for name, key in variables
                    if name.endswith(f"_{kind}")} for kind in suffixes}
    first = next((kind for name, _ in variables for kind in suffixes if name.endswith(f"_{kind}")), None)
    if first == "velocity":   # RMSprop's
        as_they_are = {"square_avg": "velocity", "grad_avg": "average_gradient"}
    elif kinds["velocity"]:   # Adam's moments
        as_they_are = {"exp_avg": "momentum", "exp_avg_sq": "velocity"}
    else:   # Adagrad's sum, or SGD's momentum alone
        as_they_are = {"sum": "accumulator"}
    state.update({f"{slot}.{name}": reader.get_tensor(key) for slot, kind in as_they_are.items()
                  for name, key in kinds[kind].items()})
    if kinds["momentum"] and "momentum" not in as_they_are.values():   # SGD's or RMSprop's: the rate inside
        kept = {key.split("/")[1].replace("..", "."): key for key in reader.get_variable_to_shape_map()
                if key.startswith(f"{CANONICAL}/")}
        if not kept:
            raise ValueError("momentum buffers without the canonical ones this project writes beside them: a "
                             "checkpoint stock Keras code wrote (or this project before 2026-11-26), which the "
                             "converter does not read")
        state.update({f"momentum_buffer.{name}": reader.get_tensor(kept[name]) for name in kinds["momentum"]})
    return state


def optimizer_variables(reader):
    """(Keras's name, the checkpoint's key) of each of the optimizer's variables, in its order (Keras's
    optimizer.variables: the step count, the rate's variable if any, then the buffers), from the object graph."""
    graph = TrackableObjectGraph.FromString(reader.get_tensor(OBJECT_GRAPH))

    def child(node, name):
        return graph.nodes[next(c.node_id for c in node.children if c.local_name == name)]
    listed = child(child(graph.nodes[0], "optimizer"), "_variables")
    nodes = [graph.nodes[c.node_id] for c in sorted(listed.children, key=lambda c: int(c.local_name))]
    return [(a.full_name, a.checkpoint_key) for node in nodes for a in node.attributes]


def logits(model, X):
    return model(X, training=False).numpy()
