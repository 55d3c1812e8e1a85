"""What is not framework-specific about checkpoints (each framework's native format is its folder's
checkpoint.py): file names, telling a file's framework from its name, checking that a file holds the LeNet or a
ResNet (every parameter and running statistic, with its shape) before anything is read into a model, writing atomically, and the two hooks
of a training run: saving every N epochs and resuming from a saved epoch.

A checkpoint is the weights file; a run with a stateful optimizer or a schedule (anything but the recipe's plain
SGD) also writes its optimizer's state beside it, in the framework's native way (its checkpoint.py's
STATE_SUFFIX, save_state, read_state): the momentum buffer or Adam's moments and the step count, which is the
schedule's position. The state is written first: a weights file whose state is missing was cut short.
At fp16 the run also writes its loss scaler beside it (scaler_path: the scale, the finite steps counted towards its
next growth, the steps the run has taken), whatever the framework, before the weights: a resumed run carries on at
the scale and count it stopped at, as the uninterrupted run would.
A checkpoint.py's state functions:
    save_state(state, optimizer, path)   canonical state (common.optim.init_state's form) -> the native file, written
                                         by the framework's own optimizer object configured for `optimizer`
    read_state(path) -> {"step": int, "<slot>.<param name>": array in the file's layout}"""
import functools
import json
import os
import re
import sys
import tempfile

import numpy as np

from common import resnet
from common.interface import RosettaError
from common.loss_scaling import ScalerState
from common.layouts import to_channels_last, to_canonical
from common.lenet import PARAM_NAMES, PARAM_SHAPES
from common.optim import OPTIMIZERS, Optimizer, init_state, of_state
from common.zero import SHARDED_CHECKPOINTS, stage
from common.precision import needs_loss_scaling

from ..files import replaced_atomically, replacing
from ..loader import load_module
from ..spec import default

SUFFIXES = {"pytorch": ".pt", "mxnet": ".params", "tensorflow": ".weights.h5", "jax": ".orbax"}
FORMATS = {"pytorch": "PyTorch state_dict (torch.save, or Distributed Checkpoint)", "mxnet": "Gluon save_parameters",
           "tensorflow": "Keras save_weights", "jax": "Orbax (Flax nnx.state)"}
EPOCH = re.compile(r"-epoch(\d+)\.")
# What lies beside a checkpoint: each framework module's STATE_SUFFIX (the optimizer's state), named here without
# importing the framework (tests/test_checkpoints.py checks that they agree), and the loss scaler's file (SCALER_SUFFIX)
STATE_SUFFIXES = {"pytorch": ".optimizer.pt", "mxnet": ".states", "tensorflow": ".optimizer.ckpt",
                  "jax": ".optimizer.orbax"}


def run_name(spec):
    """framework[-model]-mode[-exec][-layout][-bucketed][-zeroS][-accumulateK][-precision][-bf16wire]-<devices>d-
    <processes>p[-b<batch>][-cores-per-device],
    e.g. mxnet-builtin-2d-1p (the LeNet) or jax-resnet18w8sync-scratch-bf16-2d-1p: a row's files are named so, and rows
    of one command differ in at least one part (the batch where it is not the default: --per-device-batch's rows)."""
    model = "" if spec.model == "lenet" else f"-{spec.model}w{spec.width}{spec.bn}"
    level = "".join(f"-{value}" for value in (spec.exec, spec.layout) if value != "default")
    level += "" if spec.allreduce == "per-tensor" else f"-{spec.allreduce}"
    level += "" if spec.shard == "none" else f"-zero{stage(spec.shard)}"
    level += "" if spec.accumulate == 1 else f"-accumulate{spec.accumulate}"
    level += "" if spec.precision == "fp32" else f"-{spec.precision}"
    level += "" if spec.allreduce_dtype == "fp32" else f"-{spec.allreduce_dtype}wire"
    setting = "" if spec.batch_size == default("batch_size") else f"-b{spec.batch_size}"
    setting += "" if spec.cores == default("cores") else f"-cores-{spec.cores}"
    return f"{spec.framework}{model}-{spec.mode}{level}-{spec.devices}d-{spec.processes}p{setting}"


def checkpoint_name(spec, epoch):
    """run_name-epoch<k><suffix>, e.g. mxnet-builtin-2d-1p-epoch30.params; a sharded checkpoint's suffix is its own
    (pytorch-builtin-zero3-2d-2p-epoch2.dcp)."""
    suffix = load_module(spec.framework, "checkpoint").SHARDED_SUFFIX if writes_shards(spec) else \
        SUFFIXES[spec.framework]
    return f"{run_name(spec)}-epoch{epoch}{suffix}"


def writes_shards(spec):
    """Whether each rank of the run writes its own shard of a checkpoint, the framework's way (SHARDED_CHECKPOINTS)."""
    return spec.mode == "builtin" and spec.shard in SHARDED_CHECKPOINTS.get(spec.framework, ())


def framework_of(path, hint=""):
    """The framework whose native checkpoint `path` is, from its suffix; a directory holding DCP's .metadata is
    PyTorch's Distributed Checkpoint, whatever its name. A file that lies beside a checkpoint (the optimizer's state,
    the loss scaler's) is refused with the checkpoint's name: PyTorch's and JAX's states end as checkpoints do."""
    given = path.rstrip("/")
    for name, suffix in STATE_SUFFIXES.items():
        if given.endswith(suffix):
            checkpoint = os.path.basename(given[:-len(suffix)] + SUFFIXES[name])
            raise RosettaError(f"{path}: {name}'s optimizer state, read beside its checkpoint: give the checkpoint, "
                               f"{checkpoint}")
    if given.endswith(SCALER_SUFFIX):
        raise RosettaError(f"{path}: the loss scaler's state, read beside its checkpoint: give the checkpoint")
    for name, suffix in SUFFIXES.items():
        if given.endswith(suffix):
            return name
    for name in SHARDED_CHECKPOINTS:
        checkpoint = load_module(name, "checkpoint")
        distributed = getattr(checkpoint, "is_distributed", lambda path: False)
        if given.endswith(checkpoint.SHARDED_SUFFIX) or distributed(path):
            return name
    known = ", ".join(f"{suffix} {name}" for name, suffix in SUFFIXES.items())
    raise RosettaError(f"{path}: cannot tell its framework from the name ({known}){hint}")


def epoch_of(path):
    """The number of epochs a checkpoint written by a training run has done (from its name)."""
    match = EPOCH.search(os.path.basename(path.rstrip("/")))
    if not match:
        raise RosettaError(f"{path}: no -epoch<k> in the name, so the epoch to resume from is unknown "
                           "(names are as --checkpoint-dir writes them, e.g. mxnet-builtin-2d-1p-epoch10.params)")
    return int(match.group(1))


def reason(err):
    """A framework's error in one short line: the first sentence of its first line that is not a traceback
    (MXNet puts the C++ traceback first)."""
    lines = [line.strip() for line in str(err).splitlines()
             if line.strip() and not line.strip().startswith(("Traceback", "File "))]
    return (lines or [type(err).__name__])[0].split(". ")[0].rstrip(".")


def native_shape(framework, name, shape=None):
    """The shape parameter `name` (canonical `shape`, the LeNet's by default) has in the framework's file."""
    shape = PARAM_SHAPES[name] if shape is None else shape
    if load_module(framework, "checkpoint").CHANNELS_LAST:
        return to_channels_last(name, np.zeros(shape, np.float32)).shape
    return shape


@functools.cache
def resnet_keys(framework):
    """(canonical name -> key, the format's own extra keys) of the ResNet's native file, read off a file the
    framework itself writes (or, for a format with `stored`, the tree its file holds): a width-1 ResNet whose every
    parameter and running statistic holds its own number (PyTorch's num_batches_tracked, which no other framework
    keeps, is the one extra)."""
    checkpoint = load_module(framework, "checkpoint")
    shapes = {**resnet.param_shapes(1), **resnet.bn_state_shapes(1)}
    marked = {name: np.full(shape, i + 1, np.float32) for i, (name, shape) in enumerate(shapes.items())}
    weights, bn_state = {n: marked[n] for n in resnet.PARAM_NAMES}, {n: marked[n] for n in resnet.BN_STATE_NAMES}
    if hasattr(checkpoint, "stored"):   # a format that not every process can write (JAX's Orbax)
        stored = dict(checkpoint.flatten(checkpoint.stored(weights, bn_state)))
    else:
        with tempfile.TemporaryDirectory(prefix="rosetta-keys-") as folder:
            probe = os.path.join(folder, "probe" + SUFFIXES[framework])
            checkpoint.save(weights, probe, bn_state)
            stored = checkpoint.read(probe)
    by_marker = {float(a.flat[0]): key for key, a in stored.items() if a.size and np.all(a == a.flat[0])}
    keys = {name: by_marker[i + 1.0] for i, name in enumerate(shapes)}
    return keys, frozenset(stored) - set(keys.values())


def read_model(framework, path):
    """(weights, BatchNorm state) a native checkpoint holds, canonical: the LeNet's (state None) or a ResNet's of
    any width, after checking every parameter and running statistic with its shape: one line naming the file and
    the first offending entry otherwise."""
    checkpoint = load_module(framework, "checkpoint")
    if not os.path.exists(path):
        raise RosettaError(f"{path}: {stock_checkpoint(framework, path) or 'no such file or directory'}")
    try:
        arrays = checkpoint.read(path)
    except RosettaError as err:   # a readable file of another kind: the reader says what it is and what to give
        raise RosettaError(f"{path}: {err}") from None
    except Exception as err:   # every framework fails in its own words
        raise RosettaError(f"{path}: not a readable {FORMATS[framework]} file, or truncated ({reason(err)})")
    keys, extras = resnet_keys(framework)
    if not set(arrays) & (set(keys.values()) - set(checkpoint.KEYS.values())):   # Keras names the first layers alike
        return checked(framework, path, arrays, checkpoint.KEYS, PARAM_SHAPES, "LeNet", frozenset()), None
    stem = arrays[keys["stem.conv.weight"]]
    width = (to_canonical("stem.conv.weight", stem) if checkpoint.CHANNELS_LAST else stem).shape[0]
    found = checked(framework, path, arrays, keys, {**resnet.param_shapes(width), **resnet.bn_state_shapes(width)},
                    f"ResNet-18 (width {width})", extras)
    return {n: found[n] for n in resnet.PARAM_NAMES}, {n: found[n] for n in resnet.BN_STATE_NAMES}


def stock_checkpoint(framework, path):
    """What a path that names no file of its own is, where it is a stock checkpoint this converter does not read (a
    tf.train.Checkpoint's prefix, ckpt-1 beside ckpt-1.index: tensorflow/checkpoint.is_stock_checkpoint), or None."""
    checkpoint = load_module(framework, "checkpoint")
    stock = getattr(checkpoint, "is_stock_checkpoint", None)
    return checkpoint.STOCK_CHECKPOINT if stock is not None and stock(path) else None


def checked(framework, path, arrays, keys, shapes, model, extras):
    """The canonical arrays of `keys` (canonical name -> key in the file), each of its canonical shape; nothing in the
    file beyond them but the format's own `extras`."""
    checkpoint = load_module(framework, "checkpoint")
    found = {}
    for name, key in keys.items():
        if key not in arrays:
            raise RosettaError(f"{path}: not this {model}'s checkpoint: parameter {name} ({key!r} in the file) "
                               "is missing")
        array, shape = arrays[key], native_shape(framework, name, shapes[name])
        if array.shape != shape or not np.issubdtype(array.dtype, np.floating):
            raise RosettaError(f"{path}: parameter {name} ({key!r} in the file) is {array.dtype} {array.shape}; "
                               f"this {model} needs float {shape}")
        array = array.astype(np.float32)
        found[name] = np.ascontiguousarray(to_canonical(name, array) if checkpoint.CHANNELS_LAST else array)
    extra = sorted(set(arrays) - set(keys.values()) - extras)
    if extra:
        raise RosettaError(f"{path}: not this {model}'s checkpoint: unexpected parameter {extra[0]!r}")
    return found


def not_carried(framework, path):
    """What the native checkpoint `path` holds beside the model that the converter does not carry (a stock Keras
    weights file's compiled optimizer's variables: tensorflow/checkpoint.not_carried), in a few words, or None."""
    found = getattr(load_module(framework, "checkpoint"), "not_carried", None)
    try:
        return found(path) if found is not None and os.path.isfile(path) else None
    except Exception:   # read_model has read the file: nothing more to say about it
        return None


def read_weights(framework, path):
    """The canonical weights of a native checkpoint (read_model)."""
    return read_model(framework, path)[0]


def write_weights(framework, weights, path, bn_state=None):
    """Write `path` completely or not at all: the weights, and a ResNet's running statistics. The name must end in
    the framework's suffix (Keras insists on .weights.h5; the others, so that the file's framework can be told from
    its name later)."""
    checkpoint = load_module(framework, "checkpoint")
    with replacing_checkpoint(framework, path, SUFFIXES[framework]) as temporary:
        checkpoint.save(weights, temporary, bn_state)


def replacing_checkpoint(framework, path, suffix):
    """files.replacing for a checkpoint, whose name must end in its framework's `suffix`: the framework writes a
    temporary file (or directory) beside `path`, which replaces `path` only once written."""
    name = os.path.basename(path.rstrip("/"))
    if not name.endswith(suffix) or name == suffix:
        raise RosettaError(f"{os.path.abspath(path.rstrip('/'))}: a {framework} checkpoint's name must end in {suffix}")
    return replacing(path, suffix, f"{framework} checkpoint file")


def state_path(framework, path):
    """Where the optimizer state of the weights file `path` is: the same name with the state's suffix (.states
    beside a .params file, as Gluon's save_states names it)."""
    return stem(framework, path) + load_module(framework, "checkpoint").STATE_SUFFIX


def stem(framework, path):
    """The checkpoint's name without its suffix (the weights file's, or a sharded checkpoint's)."""
    path = path.rstrip("/")
    for suffix in (SUFFIXES[framework], getattr(load_module(framework, "checkpoint"), "SHARDED_SUFFIX", None)):
        if suffix and path.endswith(suffix):
            return path[:-len(suffix)]
    return path


def write_state(framework, state, optimizer, path):
    """Write the optimizer state of the weights file `path`, completely or not at all."""
    checkpoint = load_module(framework, "checkpoint")
    with replacing_checkpoint(framework, state_path(framework, path), checkpoint.STATE_SUFFIX) as temporary:
        checkpoint.save_state(state, optimizer, temporary)


def state_file(framework, path, given=None):
    """Where the optimizer state of the weights file `path` is read from: `given` (a state saved under another name),
    beside it (state_path), or the file itself where its format keeps the state inside (a PyTorch program's general
    checkpoint: its checkpoint.holds_state)."""
    if given is not None:
        return given
    beside = state_path(framework, path)
    holds = getattr(load_module(framework, "checkpoint"), "holds_state", None)
    if not os.path.exists(beside) and holds is not None and os.path.exists(path) and holds(path):
        return path
    return beside


def has_state(framework, path, given=None):
    return os.path.exists(state_file(framework, path, given))


def other_states(framework, path):
    """Optimizer states of other names beside the weights file `path` (a Gluon program's trainer.states beside its
    net.params), where none has the name state_path gives: the converter says so rather than leave them behind."""
    folder = os.path.dirname(os.path.abspath(path.rstrip("/")))
    suffix = load_module(framework, "checkpoint").STATE_SUFFIX
    if has_state(framework, path) or not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if f.endswith(suffix) and f != suffix)


def read_optimizer(framework, path, accept_gap=False, given=None):
    """(optimizer, gap): the optimizer (common.optim's, its hyperparameters and schedule) that the state beside `path`
    names itself, where the file holds one: Gluon's save_states pickles it (mxnet/checkpoint.read_optimizer), a
    PyTorch program's checkpoint keeps torch.optim's param_groups (pytorch/checkpoint.read_optimizer). None
    where a file holds buffers only: they tell the optimizer, and --optimizer the rest. One line where it has no exact
    equivalent; with `accept_gap`, that line as `gap` where the reader can carry it anyway. `given`: the state's
    file where it is not beside `path` under its name."""
    checkpoint, file = load_module(framework, "checkpoint"), state_file(framework, path, given)
    reader = getattr(checkpoint, "read_optimizer", None)   # only a file that keeps the optimizer's settings says
    if reader is None or not os.path.exists(file):
        return None, None
    try:
        return reader(file, accept_gap)
    except ValueError as err:   # what it is and why it cannot be carried
        raise RosettaError(f"{file}: {err}")
    except Exception as err:
        raise RosettaError(f"{file}: not a readable {framework} optimizer state, or truncated ({reason(err)})")


def read_state(framework, path, optimizer=None, weights=None, given=None):
    """The canonical optimizer state saved beside the weights file `path` (or in `given`), after checking it: one line
    naming the file and what is wrong otherwise. With `optimizer`, the state must be one that optimizer keeps. Its
    buffers are the network's: one per slot and parameter of `weights` (canonical, the file's own: read_model), each of
    its parameter's shape."""
    checkpoint, file = load_module(framework, "checkpoint"), state_file(framework, path, given)
    if not os.path.exists(file):
        needs = f": {optimizer.name} needs one" if optimizer else ""
        raise RosettaError(f"{path}: no optimizer state beside it ({os.path.basename(file)}){needs}; it was saved by "
                           "a run of the recipe's plain SGD, or without its state")
    try:
        arrays = checkpoint.read_state(file)
    except RosettaError as err:   # a readable file the reader cannot carry: it says why and what to do
        raise RosettaError(f"{file}: {err}") from None
    except Exception as err:
        raise RosettaError(f"{file}: not a readable {framework} optimizer state, or truncated ({reason(err)})")
    step = arrays.pop("step", None)
    if not isinstance(step, int) or step < 0:
        raise RosettaError(f"{file}: no step count in the optimizer state")
    slots = sorted({key.split(".", 1)[0] for key in arrays})
    kind = of_state(slots)   # momentum's buffer is nesterov's too, adam's moments adamw's
    if kind is None:
        raise RosettaError(f"{file}: an optimizer state with {', '.join(slots)} is none of {', '.join(OPTIMIZERS)}'s")
    weights = read_model(framework, path)[0] if weights is None else weights
    if optimizer and not slots and step == 0:   # no update yet (torch.optim makes its buffers at the first one)
        return init_state(optimizer, weights)
    if optimizer and tuple(slots) != tuple(sorted(optimizer.slots)) and not optimizer.name == kind.name == "rmsprop":
        holds = ", ".join(slots) or "no buffers"   # (rmsprop's buffers say whether it was centered, had momentum)
        raise RosettaError(f"{file}: holds {kind.name}-style state ({holds}); {optimizer.name} keeps "
                           f"{', '.join(optimizer.slots) or 'no buffers'}")
    model = "LeNet" if set(weights) == set(PARAM_NAMES) else f"ResNet-18 (width {resnet.width_of(weights)})"
    state = {"step": step}
    for slot in slots:
        for name in weights:
            key, shape = f"{slot}.{name}", native_shape(framework, name, weights[name].shape)
            if key not in arrays or arrays[key].shape != shape:
                found = f"is {arrays[key].shape}" if key in arrays else "is missing"
                raise RosettaError(f"{file}: {key} {found}; this {model} needs {shape}")
            array = arrays.pop(key).astype(np.float32)
            state[key] = np.ascontiguousarray(to_canonical(name, array) if checkpoint.CHANNELS_LAST else array)
    if arrays:
        raise RosettaError(f"{file}: unexpected entry {sorted(arrays)[0]!r} in the optimizer state")
    negative = next((key for key in state if key.split(".")[0] in SQUARES and np.any(state[key] < 0)), None)
    if negative:   # a mean or sum of squares: no optimizer makes one below 0
        raise RosettaError(f"{file}: {negative} has negative entries; {SQUARES[negative.split('.')[0]]} has none")
    return state


# The buffers that are averages or sums of squares, which no optimizer makes negative
SQUARES = {"exp_avg_sq": "Adam's second moment", "square_avg": "RMSprop's average of squares",
           "sum": "Adagrad's sum of squares"}
SCALER_SUFFIX = ".loss-scale.json"   # lenet-epoch3.pt's loss scaler: lenet-epoch3.loss-scale.json


def scaler_path(framework, path):
    """Where the loss scaler of the weights file `path` is kept: the same name with SCALER_SUFFIX."""
    return stem(framework, path) + SCALER_SUFFIX


def write_scaler(framework, scaler, steps, path):
    """Write the loss scaler (a common.loss_scaling.ScalerState) of the weights file `path`, after `steps` steps of
    its run (skipped ones too), completely or not at all."""
    with replaced_atomically(scaler_path(framework, path)) as f:
        json.dump({**scaler._asdict(), "steps": steps}, f)
        f.write("\n")


def read_scaler(framework, path):
    """(ScalerState, steps) of the loss scaler saved beside the weights file `path`, after checking it, or inside it
    where its format keeps one there (GradScaler's, in a PyTorch program's checkpoint); None where there is none (a run
    at fp32 or bf16 saved it). One line naming the file where it is unreadable."""
    file = scaler_path(framework, path)
    if not os.path.exists(file):
        inside = getattr(load_module(framework, "checkpoint"), "read_scaler", None)   # a PyTorch general checkpoint's
        return inside(path) if inside is not None and os.path.exists(path) else None
    try:
        with open(file) as f:
            saved = json.load(f)
        state = ScalerState(float(saved["scale"]), float(saved["decided"]), int(saved["good_steps"]))
        steps = saved["steps"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RosettaError(f"{file}: not a readable loss scaler, or truncated ({reason(err)})")
    if not (state.scale > 0 and state.decided > 0 and state.good_steps >= 0 and isinstance(steps, int) and steps >= 0):
        raise RosettaError(f"{file}: a loss scaler needs scales above 0 and step counts of at least 0, not {saved}")
    return state, steps


def keeps_optimizer_state(optimizer):
    """Whether a run's checkpoints carry its optimizer's state: for anything but the recipe's stateless SGD (a
    schedule's position is the state's step count), whatever the network."""
    return not optimizer.is_recipe


def saver(spec, rank, optimizer, steps_per_epoch):
    """The after-epoch hook of a run with a checkpoint_dir: rank 0 writes the weights (and first the optimizer's
    state, unless it is the recipe's stateless SGD, and fp16's loss scaler) every checkpoint_every epochs (if given)
    and after the last. A sharded state (--shard) is gathered from every rank, so every rank reads it, and the weights
    too at --shard parameters; where the framework has a sharded checkpoint of its own (writes_shards), every rank
    writes its shard of the weights and the state into it instead (after rank 0 the loss scaler)."""
    folder, every = spec.checkpoint_dir, spec.checkpoint_every
    if not folder or (rank != 0 and spec.shard == "none"):
        return None

    def save(epoch, runner):
        if epoch == spec.epochs or (every and epoch % every == 0):
            path = os.path.join(folder, checkpoint_name(spec, epoch))
            if writes_shards(spec):   # every rank its own shard, the framework's way
                scaler = runner.scaler_state()
                if scaler is not None and rank == 0:
                    write_scaler(spec.framework, scaler, epoch * steps_per_epoch, path)
                suffix = load_module(spec.framework, "checkpoint").SHARDED_SUFFIX
                runner.save_shards(path, optimizer if keeps_optimizer_state(optimizer) else None,
                                   lambda: replacing_checkpoint(spec.framework, path, suffix))
                return
            state = runner.optimizer_state() if keeps_optimizer_state(optimizer) else None
            weights = runner.weights()   # gathered from every rank's slices at --shard parameters
            if rank != 0:
                return
            if state is not None:
                write_state(spec.framework, state, optimizer, path)
            scaler = runner.scaler_state()
            if scaler is not None:
                write_scaler(spec.framework, scaler, epoch * steps_per_epoch, path)
            write_weights(spec.framework, weights, path, runner.bn_state())
    return save


def resume_point(spec, optimizer, steps_per_epoch):
    """(weights, BatchNorm state or None, optimizer state or None, loss scaler or None, epochs done) of the checkpoint
    a run resumes from, or (None, None, None, None, 0) for a fresh run. The file must hold the run's network, after
    the epoch's step count of this run; a stateful optimizer needs the state saved with the weights. A run at fp16
    carries on with the loss scaler saved beside them (a common.loss_scaling.ScalerState; from the first scale where
    the checkpoint was not trained at fp16)."""
    path = spec.resume_from
    if path == LATEST:
        path = latest_checkpoint(spec, lambda line: print(line, file=sys.stderr, flush=True))
    if not path:
        return None, None, None, None, 0
    framework, epoch = framework_of(path), epoch_of(path)
    weights, bn_state = read_model(framework, path)
    holds = "lenet" if bn_state is None else f"resnet18 of width {resnet.width_of(weights)}"
    wants = "lenet" if spec.model == "lenet" else f"{spec.model} of width {spec.width}"
    if holds != wants:
        raise RosettaError(f"{path}: holds the {holds}; this run trains the {wants}")
    steps, scaled = epoch * steps_per_epoch, read_scaler(framework, path)
    scaler = scaled[0] if scaled and needs_loss_scaling(spec.precision) else None
    if scaled and scaled[1] != steps:
        raise RosettaError(f"{path}: its run has taken {scaled[1]} steps, not the {epoch} epochs x {steps_per_epoch} "
                           "steps of this run: another batch size or data set")
    if not keeps_optimizer_state(optimizer):
        return weights, bn_state, None, scaler, epoch
    state = read_state(framework, path, optimizer, weights)
    # an update that fp16's loss scaler skipped is no step of the optimizer's: its count may be short of the run's
    if state["step"] > steps or (state["step"] < steps and not scaled):
        raise RosettaError(f"{path}: its optimizer state has done {state['step']} steps, not the {epoch} epochs x "
                           f"{steps_per_epoch} steps of this run: another batch size or data set")
    return weights, bn_state, state, scaler, epoch


LATEST = "latest"   # resume_from: the newest complete checkpoint in checkpoint_dir, if any (a group restarted by torchrun)


def latest_checkpoint(spec, warn, written_since=None):
    """The newest checkpoint of this run in its checkpoint_dir that is complete and reads back (weights, and the
    optimizer's state for anything but the recipe's SGD), or the run's own resume_from if none is newer, or None:
    where a restarted run starts again. One that is incomplete or corrupt is never chosen: `warn` gets a line
    naming it, and the one before it is tried. `written_since` (a time.time()): only files written since count, the
    run's own; a name says the row, not its rate, seed or data, and another run's file of the same name is older."""
    given = None if spec.resume_from == LATEST else spec.resume_from
    start = epoch_of(given) if given else 0
    optimizer = Optimizer(spec.optimizer)
    for epoch in range(spec.epochs - 1, start, -1):
        path = os.path.join(spec.checkpoint_dir, checkpoint_name(spec, epoch))
        if not os.path.exists(path) or (written_since is not None and os.path.getmtime(path) < written_since):
            continue
        try:
            weights = read_weights(spec.framework, path)
            if optimizer.slots or has_state(spec.framework, path):   # a state is written first, then its weights
                read_state(spec.framework, path, optimizer, weights)
            if needs_loss_scaling(spec.precision) and not read_scaler(spec.framework, path):
                raise RosettaError(f"no loss scaler beside it ({os.path.basename(scaler_path(spec.framework, path))})")
            return path
        except RosettaError as err:
            warn(f"warning: not resuming from {os.path.basename(path)}: {err}; trying the one before it")
    return given


def check_resume(path, frameworks, epochs):
    """compare.py's check of --resume-from, before any run starts."""
    framework, epoch = framework_of(path), epoch_of(path)
    if not os.path.exists(path):
        raise RosettaError(f"{path}: no such file or directory")
    if list(frameworks) != [framework]:
        raise RosettaError(f"{path}: the checkpoint is {framework}'s: resume {framework} runs only "
                           f"(--frameworks {framework})")
    if epoch >= epochs:
        raise RosettaError(f"{path} has done {epoch} epochs; --epochs {epochs} leaves nothing to train")

