"""PyTorch checkpoints: the model's state_dict, written with torch.save and read with torch.load +
load_state_dict. weights_only=True: the file is read as plain tensors, and no pickled code in it runs.
build_model names its layers as common.lenet does, so the keys are the canonical names. A model wrapped in
nn.DataParallel or DistributedDataParallel saves every key under its `module.` attribute (`module.conv1.weight`);
such a file is read through PyTorch's own consume_prefix_in_state_dict_if_present, and nothing here writes one.
The optimizer's state is a second file, as PyTorch's "saving and loading a general checkpoint" writes it: the
optimizer's and the scheduler's state_dicts in one torch.save (optimizer.py's Trainer.state_dict)."""
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from common.interface import RosettaError
from common import resnet
from common.lenet import PARAM_NAMES, init_weights

from . import resnet as resnet_model
from .idiomatic import param_names
from .lenet import build_model
from .optimizer import canonical_state, get_trainer

KEYS = {name: name for name in PARAM_NAMES}   # canonical name -> key in the file
CHANNELS_LAST = False                          # PyTorch's layout is the canonical one
STATE_SUFFIX = ".optimizer.pt"                 # lenet-epoch3.pt's state: lenet-epoch3.optimizer.pt
WRAPPED = "module."                            # the prefix of a DataParallel or DDP model's keys


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
    state = torch.load(path, map_location="cpu", weights_only=True)
    consume_prefix_in_state_dict_if_present(state, WRAPPED)
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
    state = torch.load(path, map_location="cpu", weights_only=True)
    consume_prefix_in_state_dict_if_present(state, WRAPPED)
    return {key: value.numpy() for key, value in state.items()}


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
    by the network with as many parameters (the LeNet's or the ResNet's names)."""
    return canonical_state(torch.load(path, map_location="cpu", weights_only=True))


def logits(model, X):
    with torch.no_grad():
        return model(torch.from_numpy(X)).numpy()
