"""PyTorch checkpoints: the model's state_dict, written with torch.save and read with torch.load +
load_state_dict. weights_only=True: the file is read as plain tensors, and no pickled code in it runs.
build_model names its layers as common.lenet does, so the keys are the canonical names."""
import torch

from common.lenet import PARAM_NAMES, init_weights

from .lenet import build_model

KEYS = {name: name for name in PARAM_NAMES}   # canonical name -> key in the file
CHANNELS_LAST = False                          # PyTorch's layout is the canonical one


def save(weights, path):
    torch.save(build_model(weights).state_dict(), path)


def load(path):
    """The idiomatic model with the file's weights: nothing but PyTorch's own calls."""
    model = build_model(init_weights())   # any weights: load_state_dict replaces every one (strict)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def read(path):
    """The file's arrays by key, as stored."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {key: value.numpy() for key, value in state.items()}


def logits(model, X):
    with torch.no_grad():
        return model(torch.from_numpy(X)).numpy()
