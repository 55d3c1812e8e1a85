"""A user's own torch.nn.Module, layer by layer (common/transfer.py): its state_dict in registration order, a
layer's tensors named by role. A BatchNorm's weight and bias are its gamma and beta; num_batches_tracked is not
moved (no other framework keeps it)."""
import torch

from common.transfer import ordered

CHANNELS_LAST = False
BATCHNORM_NAMES = {"weight": "gamma", "bias": "beta", "running_mean": "running_mean", "running_var": "running_var"}


def layers(model):
    """[(layer name, {role: (the state_dict's key, numpy array)})], in the state_dict's order."""
    found = {}
    for key, tensor in model.state_dict().items():
        layer, _, name = key.rpartition(".")
        if name != "num_batches_tracked":
            found.setdefault(layer, {})[name] = (key, tensor.detach().cpu().numpy())
    return [(layer, ordered({BATCHNORM_NAMES[n] if "running_mean" in tensors else n: v for n, v in tensors.items()}))
            for layer, tensors in found.items()]


def assign(model, arrays):
    """Sets the model's tensors from {state_dict key: numpy array}: load_state_dict, which checks every shape."""
    state = model.state_dict()
    state.update({key: torch.from_numpy(a) for key, a in arrays.items()})
    model.load_state_dict(state)


def save(model, path):
    """As PyTorch saves a model: its state_dict, torch.save."""
    torch.save(model.state_dict(), path)
