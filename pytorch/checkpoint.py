"""PyTorch checkpoints: the model's state_dict, written with torch.save and read with torch.load +
load_state_dict. weights_only=True: the file is read as plain tensors, and no pickled code in it runs.
build_model names its layers as common.lenet does, so the keys are the canonical names. A model wrapped in
nn.DataParallel or DistributedDataParallel saves every key under its `module.` attribute (`module.conv1.weight`);
such a file is read through PyTorch's own consume_prefix_in_state_dict_if_present, and nothing here writes one.
The optimizer's state is a second file: the optimizer's and the scheduler's state_dicts in one torch.save
(optimizer.py's Trainer.state_dict).
A PyTorch program's own checkpoint is read too: one torch.save of a dict of state_dicts, as PyTorch's "saving and
loading a general checkpoint" tutorial writes it ({"epoch", "model_state_dict", "optimizer_state_dict", "loss"}) and
its AMP recipe ({"model", "optimizer", "scaler"}). Its parts are told by what they hold, whatever their keys (parts):
the model's weights, torch.optim's state (its optimizer told by its param_groups, read_optimizer) and GradScaler's.
A Distributed Checkpoint (DCP) is read the same way: a directory of each rank's shards (.distcp) and their .metadata,
as FSDP2 programs save with dcp.save (PyTorch's "Getting Started with Distributed Checkpoint" recipe: a Stateful
app's {"model", "optim"} from get_state_dict, whose optimizer state is keyed by the parameters' names), read whole on
one process by torch's own dcp_to_torch_save; the FSDP2 engine writes its checkpoints so (save_sharded)."""
import contextlib
import io
import os
import pickle
import zipfile

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from common.interface import RosettaError
from common import resnet
from common.loss_scaling import ScalerState
from common.optim import Optimizer
from common.lenet import PARAM_NAMES, PARAM_SHAPES, init_weights

from . import resnet as resnet_model
from .idiomatic import param_names
from .lenet import build_model
from .optimizer import NAMES_BY_COUNT, canonical_state, get_trainer

KEYS = {name: name for name in PARAM_NAMES}   # canonical name -> key in the file
CHANNELS_LAST = False                          # PyTorch's layout is the canonical one
STATE_SUFFIX = ".optimizer.pt"                 # lenet-epoch3.pt's state: lenet-epoch3.optimizer.pt
WRAPPED = "module."                            # the prefix of a DataParallel or DDP model's keys
SHARDED_SUFFIX = ".dcp"                        # the FSDP2 engine's checkpoints: a DCP directory (save_sharded)


def idiomatic(weights, bn_state=None):
    """The LeNet, or with a BatchNorm state the ResNet, as the idiomatic modes build it."""
    return build_model(weights) if bn_state is None else resnet_model.build_model(weights, bn_state)


def save(weights, path, bn_state=None):
    """The ResNet's state_dict holds its running statistics and each BatchNorm's num_batches_tracked (0 here: it
    counts only the steps of a PyTorch module, and matters only for momentum=None)."""
    torch.save(idiomatic(weights, bn_state).state_dict(), path)


def load(path, width=None):
    """The idiomatic model (the ResNet of `width`, else the LeNet) with the file's weights, in inference mode:
    nothing but PyTorch's own calls. Keys missing or left over are one line (load_state_dict's strict error is a
    paragraph)."""
    model = idiomatic(*any_weights(width))   # any weights: load_state_dict replaces every one
    state = model_state(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        wrong = [f"{what} {', '.join(repr(key) for key in keys)}"
                 for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        network = "LeNet" if width is None else "ResNet"
        raise RosettaError(f"{path}: not this {network}'s state_dict: {'; '.join(wrong)}")
    return model.eval()


def any_weights(width=None):
    return (init_weights(),) if width is None else (resnet.init_weights(0, width), resnet.init_bn_state(width))


def read(path):
    """The file's arrays by key, as stored but for a wrapped model's prefix."""
    return {key: value.numpy() for key, value in model_state(path).items()}


def model_state(path):
    """The model's state_dict in the file (the file itself, or a general checkpoint's model part), without a wrapped
    model's prefix."""
    state = parts(loaded(path))["model"]
    if state is None:
        raise RosettaError("a torch.optim state_dict alone (optimizer.state_dict()), not a model's: convert the "
                           "model's state_dict file and give this one with --state PATH")
    consume_prefix_in_state_dict_if_present(state, WRAPPED)
    return state


def is_distributed(path):
    """Whether `path` is a Distributed Checkpoint: a directory with DCP's .metadata (written last, so a directory
    without it was cut short)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def loaded(path):
    """What torch.save saved in the file, or what dcp.save saved in the directory, gathered whole on this process
    (dcp_to_torch_save's own reading, DTensor shards put together into plain tensors)."""
    if not is_distributed(path):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:   # weights_only refuses any class but torch's tensors' and containers'
            if pickled_module(path):
                raise RosettaError("a whole pickled model (torch.save(model)), which is read only by running its "
                                   "code: save model.state_dict() and convert that") from None
            raise
    whole = io.BytesIO()
    try:
        dcp_to_torch_save(path, whole)
    except CheckpointException as err:   # a BaseException, holding each rank's (exception, traceback)
        failure = next(iter(err.failures.values()))
        failure = failure[0] if isinstance(failure, tuple) else failure
        raise ValueError(f"{type(failure).__name__}: {failure}") from None
    whole.seek(0)
    return torch.load(whole, weights_only=True)


def pickled_module(path):
    """Whether torch.save pickled an nn.Module whole into `path` (torch.save(model)): its pickle names torch.nn's
    layer classes, which no state_dict holds."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(b"torch.nn.modules" in archive.read(name) for name in archive.namelist()
                       if name.endswith("data.pkl"))
    except (OSError, zipfile.BadZipFile):
        return False


def save_sharded(net, trainer, replacing):
    """The FSDP2 engine's checkpoint, as PyTorch's Distributed Checkpoint recipe writes one: every rank calls dcp.save
    with get_state_dict's state_dicts, whose DTensors are its own shards (each rank writes what it holds: its slice of
    every parameter and optimizer buffer), and the scheduler's state (the steps done). FSDP2 leaves each rank its own
    BatchNorm statistics: rank 0's are saved, as DDP keeps rank 0's. `replacing()`: the temporary directory that
    replaces the checkpoint once written (harness/files.replacing), entered on rank 0, its name sent to the others."""
    holds_state = hasattr(trainer, "scheduler")   # the recipe's plain SGD keeps none
    model_state, optimizer_state = get_state_dict(net, trainer.optimizer) if holds_state else \
        (get_model_state_dict(net), None)
    for name, value in model_state.items():
        if not isinstance(value, DTensor):   # a buffer, the same on every rank once rank 0's is sent
            model_state[name] = value.detach().clone()
            dist.broadcast(model_state[name], src=0)
    saved = {"model": model_state}
    if holds_state:
        saved.update(optimizer=optimizer_state, scheduler=trainer.scheduler.state_dict())
    with replacing() if dist.get_rank() == 0 else contextlib.nullcontext() as temporary:
        name = [temporary]
        dist.broadcast_object_list(name, src=0)
        dcp.save(saved, checkpoint_id=name[0])
        dist.barrier()   # every rank's shard written before rank 0 renames the directory
    dist.barrier()


def parts(saved):
    """{"model", "optimizer", "scheduler", "scaler"} of what torch.save or dcp.save saved: a state_dict alone is the
    model's (the others None); a dict of state_dicts is a general checkpoint, whose parts are told by their contents:
    the model's holds tensors only, torch.optim's "state" and "param_groups", GradScaler's "scale" and
    "_growth_tracker", a scheduler's "last_epoch". A dict that is none of these but holds them is a Stateful app's
    state_dict (DCP's recipe saves {"app": AppState}), looked into. Anything else (an epoch, a loss) is the program's
    own. An optimizer's state keyed by its parameters' names (get_state_dict's) comes back numbered, as
    optimizer.state_dict() numbers it, with the names in its "names"."""
    if not isinstance(saved, dict) or not saved:
        raise ValueError(f"holds a {type(saved).__name__}, not a state_dict")
    if all(isinstance(value, torch.Tensor) for value in saved.values()):
        return {"model": saved, "optimizer": None, "scheduler": None, "scaler": None}
    if {"state", "param_groups"} <= set(saved):   # optimizer.state_dict() alone, as the tutorials save it beside
        return {"model": None, "optimizer": numbered(saved), "scheduler": None, "scaler": None}   # the model's
    found = {"model": [], "optimizer": [], "scheduler": [], "scaler": []}
    for key, value in entries(saved):
        if all(isinstance(v, torch.Tensor) for v in value.values()):
            found["model"].append(key)
        elif {"state", "param_groups"} <= set(value):
            found["optimizer"].append(key)
        elif {"scale", "_growth_tracker"} <= set(value):
            found["scaler"].append(key)
        elif "last_epoch" in value:
            found["scheduler"].append(key)
    for part, keys in found.items():
        if len(keys) > 1:
            named = ", ".join(repr(".".join(map(str, key))) for key in keys)
            raise ValueError(f"a general checkpoint with {len(keys)} {part} state_dicts ({named})")
    if not found["model"]:
        raise ValueError(f"no model state_dict in it (its entries: {', '.join(map(repr, saved))})")
    whole = {part: entry(saved, keys[0]) if keys else None for part, keys in found.items()}
    if whole["optimizer"] is not None:
        whole["optimizer"] = numbered(whole["optimizer"])
    return whole


def entries(saved, path=()):
    """(key path, dict) of a general checkpoint's dict entries, and of those of a dict that is no part itself."""
    for key, value in saved.items():
        if not isinstance(value, dict) or not value:
            continue
        is_part = all(isinstance(v, torch.Tensor) for v in value.values()) or {"state", "param_groups"} <= set(value) \
            or {"scale", "_growth_tracker"} <= set(value) or "last_epoch" in value
        if is_part:
            yield (*path, key), value
        else:
            yield from entries(value, (*path, key))


def entry(saved, path):
    """The value at a key path (entries') in nested dicts."""
    for key in path:
        saved = saved[key]
    return saved


def numbered(optimizer_state):
    """torch.optim's state_dict from one keyed by parameter names (get_state_dict's, as FSDP2 programs save it): the
    buffers numbered in the param_groups' order, the names kept in "names" without a wrapped model's prefix. An
    optimizer given named_parameters() (torch 2.6+) keeps each group's "param_names": its buffers' names too, which
    tell the parameter of each number whatever order the groups put them in."""
    groups = optimizer_state["param_groups"]
    names = [name for group in groups for name in group["params"]]
    if not all(isinstance(name, str) for name in names):
        if all("param_names" in group for group in groups):
            named = [name for group in groups for name in group["param_names"]]
            return {**optimizer_state, "names": [name.removeprefix(WRAPPED) for name in named]}
        return optimizer_state
    number = {name: i for i, name in enumerate(names)}
    return {"state": {number[name]: buffers for name, buffers in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [number[name] for name in group["params"]]} for group in groups],
            "names": [name.removeprefix(WRAPPED) for name in names]}


def general_parts(path):
    """A general checkpoint's parts (parts), None for a file that is a state_dict alone or none at all."""
    try:
        found = parts(loaded(path))
    except Exception:   # not this reader's to explain: read_model says what is wrong with it
        return None
    return found if any(found[part] is not None for part in ("optimizer", "scheduler", "scaler")) else None


def holds_state(path):
    """Whether the weights file `path` keeps its optimizer's state inside it (a general checkpoint's)."""
    found = general_parts(path)
    return found is not None and found["optimizer"] is not None


def save_state(state, optimizer, path):
    """torch.optim's own optimizer and scheduler for `optimizer`, as the built-in and idiomatic modes build them
    (over a model's parameters(): the buffers' numbers are its parameters' order), started from the canonical
    `state` and saved as they are. The network is the one the state's names are of (`<slot>.<param name>`): the
    LeNet, or the ResNet of the width of its stem's buffers (a state with no buffers, plain SGD's, is the LeNet's)."""
    model = idiomatic(*any_weights(width_of_state(state)))
    trainer = get_trainer(model.parameters(), optimizer, state, param_names(model))
    torch.save(trainer.state_dict(), path)


def width_of_state(state):
    """The ResNet's width read off a canonical state's buffers (common.resnet.width_of, on any slot's); None for a
    state of the LeNet's parameters, or one with no buffers."""
    stem = next((value for key, value in state.items() if key.endswith(".stem.conv.weight")), None)
    return None if stem is None else resnet.width_of({"stem.conv.weight": stem})


def read_state(path):
    """The canonical state's entries as stored: the scheduler's step count, the buffers by parameter number, named
    by the network with as many parameters (the LeNet's or the ResNet's names). A general checkpoint's optimizer
    counts its steps itself where it keeps a count (every torch.optim class's but SGD's), else they are 0: SGD at a
    constant rate needs none."""
    found = general_parts(path)
    if found is None:
        return canonical_state(loaded(path))
    optimizer = {key: found["optimizer"][key] for key in ("state", "param_groups")}
    canonical = canonical_names(found["optimizer"].get("names")) or given_names(optimizer)
    state = canonical_state({"optimizer": optimizer, "scheduler": {"last_epoch": steps_of(found)}}, canonical)
    return with_frozen(state)


def canonical_names(names):
    """The buffers' own names where they are the network's canonical ones (the LeNet's or the ResNet's, or some of
    them: an optimizer given the trainable parameters alone), else None."""
    return names if names and any(set(names) <= {*network} for network in (PARAM_NAMES, resnet.PARAM_NAMES)) else None


FINE_TUNING = ("a fine-tuning state (parameters frozen, with requires_grad=False): ")


def given_names(optimizer):
    """The LeNet's parameters a torch.optim optimizer was given, in order, where it was given fewer than all (the
    trainable ones of a fine-tuning run: filter(lambda p: p.requires_grad, model.parameters())) and its buffers'
    shapes tell which, one way only (the LeNet's parameters all differ in shape); None where it was given all of
    them. One line where the file cannot say."""
    count = sum(len(group["params"]) for group in optimizer["param_groups"])
    if count in NAMES_BY_COUNT or count > len(resnet.PARAM_NAMES):   # all, or no network's (canonical_state says)
        return None
    shapes = [(name, PARAM_SHAPES[name]) for name in PARAM_NAMES]   # in the network's order
    if count < len(shapes):
        held = [optimizer["state"].get(i) for i in range(count)]
        shape = [None if not buffers else next(tuple(v.shape) for k, v in buffers.items() if k != "step")
                 for buffers in held]
        ways = list(embeddings(shape, shapes))
        if len(ways) == 1:
            return [shapes[j][0] for j in ways[0]]
    raise RosettaError(f"{FINE_TUNING}its optimizer was given {count} parameters, and which of the network's the "
                       "file does not say: give the optimizer model.named_parameters() (torch 2.6+ saves their "
                       "names), or all of model.parameters() (a frozen one gets no buffer)")


def embeddings(shape, shapes, start=0):
    """Every increasing choice of positions in `shapes` ((name, shape) in the network's order) whose shapes are
    `shape`'s in order (None: any)."""
    if not shape:
        yield ()
        return
    for j in range(start, len(shapes) - len(shape) + 1):
        if shape[0] is None or tuple(shapes[j][1]) == shape[0]:
            for rest in embeddings(shape[1:], shapes, j + 1):
                yield (j, *rest)


def with_frozen(state):
    """The canonical state with a zero momentum buffer for every parameter that has none (torch.optim's SGD makes a
    parameter's buffer at its first gradient, buf = grad, and so never for a frozen one): the same as torch's next
    update, mu * 0 + grad = grad, whether the parameter stays frozen or not (dampening is refused elsewhere). Other
    optimizers count each parameter's steps, which the target's one count cannot: one line."""
    slots = {key.split(".", 1)[0] for key in state if key != "step"}
    held = {key.split(".", 1)[1] for key in state if key != "step"}
    if not slots:
        return state
    network = resnet.PARAM_NAMES if held - set(PARAM_NAMES) else PARAM_NAMES
    missing = [name for name in network if name not in held]
    if not missing:
        return state
    if slots != {"momentum_buffer"}:
        raise RosettaError(f"{FINE_TUNING}no {', '.join(sorted(slots))} for {len(missing)} of the network's "
                           f"parameters ({missing[0]}, ...), whose steps torch.optim counts apart and the target's "
                           "one count cannot: convert the model's state_dict alone (the weights)")
    if network is PARAM_NAMES:
        shapes = PARAM_SHAPES
    else:
        name = next(iter(held))
        width = state[f"momentum_buffer.{name}"].shape[0] // resnet.param_shapes(1)[name][0]
        shapes = resnet.param_shapes(width)
    dtype = next(a.dtype for key, a in state.items() if key != "step")
    return {**state, **{f"momentum_buffer.{name}": np.zeros(shapes[name], dtype) for name in missing}}


def steps_of(found):
    """The updates a general checkpoint's optimizer has made, where it counts them (its scheduler's last_epoch, the
    per-parameter step of Adam, AdamW, RMSprop and Adagrad)."""
    if found["scheduler"] is not None:
        return int(found["scheduler"]["last_epoch"])
    counts = {float(buffers["step"]) for buffers in found["optimizer"]["state"].values() if "step" in buffers}
    return int(counts.pop()) if len(counts) == 1 else 0


def read_optimizer(path, accept_gap=False):
    """The optimizer of a general checkpoint, told by torch.optim's param_groups (common.optim's; the rate constant,
    since a scheduler's state is refused), with no convention gap (torch.optim's conventions are the canonical ones)
    but a note where the file cannot say everything (SGD's step count). (None, None) for this project's own optimizer
    file, whose buffers tell (Trainer.state_dict)."""
    found = general_parts(path)
    if found is None or found["optimizer"] is None:
        return None, None
    if found["scheduler"] is not None and not keeps_rate(found["scheduler"]):
        raise ValueError("its learning-rate scheduler's state is not carried (a general checkpoint converts at a "
                         "constant rate); save it without the scheduler and set the schedule again in the target")
    groups = found["optimizer"]["param_groups"]
    settings = [{k: v for k, v in group.items() if k not in ("params", "param_names")} for group in groups]
    if any(s != settings[0] for s in settings):
        raise ValueError(f"{len(groups)} parameter groups with different settings (as no weight decay on the biases "
                         "makes); the target's stock optimizer is converted with one: save the state of one group, or "
                         "the model's state_dict alone to convert the weights")
    if len(groups) > 1 and canonical_names(found["optimizer"].get("names")) is None:
        raise ValueError(f"{len(groups)} parameter groups: torch numbers the buffers in the groups' order, which the "
                         "file does not tie to the model's parameters; give the optimizer model.named_parameters() "
                         "(torch 2.6+ saves their names) or one group")
    group = settings[0]
    for key, fine in (("maximize", False), ("dampening", 0), ("amsgrad", False)):
        if group.get(key, fine) != fine:
            raise ValueError(f"a torch.optim optimizer with {key}={group[key]!r}, which no target's stock "
                             "optimizer computes the same way")
    if "betas" in group and "amsgrad" not in group:   # Adam's and AdamW's keys have it; the other Adams' not
        raise ValueError("a torch.optim optimizer with betas that is not Adam or AdamW (Adamax, NAdam or RAdam: "
                         f"param_groups with {', '.join(sorted(group))}), which no target's stock optimizer computes")
    if "betas" in group:
        name = "adamw" if group.get("decoupled_weight_decay") else "adam"
        return Optimizer(name, group["lr"], weight_decay=group["weight_decay"], betas=tuple(group["betas"]),
                         eps=group["eps"]), None
    if {"alpha", "centered"} <= set(group):   # RMSprop's (capturable and differentiable change no number)
        return Optimizer("rmsprop", group["lr"], group["momentum"], group["weight_decay"], eps=group["eps"],
                         alpha=group["alpha"], centered=group["centered"]), None
    if "initial_accumulator_value" in group:   # Adagrad's
        if group["lr_decay"] or group["initial_accumulator_value"]:
            raise ValueError(f"a torch.optim.Adagrad with lr_decay={group['lr_decay']!r} and initial_accumulator_value="
                             f"{group['initial_accumulator_value']!r}; the spec's adagrad has neither (its rate is the "
                             "schedule's, its sum starts at 0)")
        return Optimizer("adagrad", group["lr"], weight_decay=group["weight_decay"], eps=group["eps"]), None
    if "momentum" not in group:
        raise ValueError("a torch.optim optimizer other than SGD, Adam, AdamW, RMSprop or Adagrad (param_groups with "
                         f"{', '.join(sorted(group))})")
    name = "sgd" if not group["momentum"] else "nesterov" if group["nesterov"] else "momentum"
    counted = found["scheduler"] is not None   # its scheduler's last_epoch counts them
    return Optimizer(name, group["lr"], group["momentum"] or 0.9, group["weight_decay"]), None if counted else \
        "torch.optim's SGD counts no steps: the target's count starts at 0 (a constant rate needs none)"


def keeps_rate(scheduler):
    """Whether a scheduler's state_dict is of one that leaves the rate as it is (ConstantLR with factor 1, the FSDP2
    engine's at a constant rate): its position is the step count, and nothing else to carry."""
    return scheduler.get("factor") == 1.0 and "start_factor" not in scheduler and "_schedulers" not in scheduler


def read_scaler(path):
    """(ScalerState, steps) of a general checkpoint's GradScaler, as PyTorch's AMP recipe saves it
    (scaler.state_dict()): its scale and its count of finite steps towards the next growth; None without one."""
    found = general_parts(path)
    if found is None or found["scaler"] is None:
        return None
    saved = found["scaler"]
    return ScalerState(float(saved["scale"]), float(saved["scale"]), int(saved["_growth_tracker"])), \
        steps_of(found) if found["optimizer"] is not None else 0


def logits(model, X):
    with torch.no_grad():
        return model(torch.from_numpy(X)).numpy()
