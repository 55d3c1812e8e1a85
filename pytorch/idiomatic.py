"""PyTorch's minimal training loop, as in its tutorials: an nn.Module, torch.optim.SGD and
F.cross_entropy on one device, no harness. The benchmark times it beside the scratch step to show
what the from-scratch recipe costs."""

import torch
import torch.nn.functional as F

from common import lenet as lenet_spec, resnet as resnet_spec
from common.interface import Model, Network, RosettaError, Unavailable
from common.loss_scaling import LossScaling, ScalerState
from common.precision import is_low
from common.sharding import micro_batches

from . import resnet
from .execution import DEFAULT_LAYOUT, LAYOUTS
from .lenet import DTYPES, build_model, to_layout, to_numpy as params_to_numpy
from .optimizer import Trainer, canonical_state, get_trainer

EXEC = "eager"
COMPILES = "nothing"
LAYOUT = LAYOUTS[DEFAULT_LAYOUT]   # build_model's kernels, to_layout's batches
# How the optimizer is ported: "canonical" computes common/optim.py, "stock" is a straightforward port (the stock
# classes, the framework's defaults). common/optim.py is PyTorch's conventions: both are the same stock classes.
PORTS = ("canonical", "stock")


def get_model(weights, devices, optimizer=None, state=None, port="canonical", network=Network()):
    """The recipe's plain SGD (optimizer None or is_recipe) is torch.optim.SGD at the harness's rate; any other
    optimizer is optimizer.py's Trainer, as in builtin.py, from a checkpoint's canonical `state` if given. The
    network is the LeNet, or the ResNet with nn.BatchNorm2d (network.sync changes nothing on one device); the
    Trainer knows its parameters by the network's names (its state's). The model's `mixed` is the AMP recipe's
    torch.amp.GradScaler, set to network.loss_scaling and enabled only with it (fp16's dynamic loss scaling)."""
    if len(devices) != 1:
        raise Unavailable("the idiomatic loop is the single-device reference: run it with 1 device")
    if port not in PORTS:
        raise RosettaError(f"unknown port {port!r}; choose from {', '.join(PORTS)}")
    net = build(weights, network).to(devices[0])
    scaler = grad_scaler(devices[0].type, network.loss_scaling)
    if optimizer is None or optimizer.is_recipe:
        return Model(net, torch.optim.SGD(net.parameters(), lr=0.0), precision=network.precision, mixed=scaler)
    return Model(net, get_trainer(net.parameters(), optimizer, state, param_names(net)), precision=network.precision,
                 mixed=scaler)


def build(weights, network):
    """The idiomatic network: the LeNet, or the ResNet holding network.bn_state, in training mode."""
    return build_model(weights) if network.bn_state is None else resnet.build_model(weights, network.bn_state)


def is_resnet(net):
    return isinstance(net, resnet.ResNet)


def param_names(net):
    """The canonical names of the network's parameters(), in their order: build_model names its layers canonically
    and registers them in forward order, PARAM_NAMES' order."""
    return resnet_spec.PARAM_NAMES if is_resnet(net) else lenet_spec.PARAM_NAMES


def train_step(model, X, y, devices, lr, batch_size=None, accumulate=1):
    """The tutorial's step, with the loss summed rather than averaged and a learning rate of
    lr / batch_size: the recipe's update, whatever part of the batch is here. A Trainer gets the global batch's
    mean gradient instead (Trainer.step divides) and its scheduler sets the rate. accumulate: the batch in that many
    micro-batches (common.sharding.micro_batches), each backward adding into the parameters' .grad, one step after
    them. At bf16 and fp16 the tutorial's torch.autocast wraps the forward and the loss (cross_entropy is on
    autocast's fp32 list), and the AMP recipe's GradScaler (model.mixed) scales each micro-batch's summed loss by the
    same scale, unscales the gradients once, skips the update where one is not finite and moves the scale; disabled
    (no loss scaling), it passes everything through."""
    net, trainer, scaler = model.net, model.trainer, model.mixed
    X, y = to_layout(torch.tensor(X, device=devices[0])), torch.tensor(y, device=devices[0])   # as split_and_load
    batch_size = batch_size or len(X)
    trainer.zero_grad()
    loss = 0.0
    for start, stop in micro_batches(len(y), accumulate):
        with torch.autocast(devices[0].type, dtype=DTYPES[model.precision], enabled=is_low(model.precision)):
            micro = F.cross_entropy(net(X[start:stop]), y[start:stop], reduction="sum")
        scaler.scale(micro).backward()
        loss += micro.item()
    if isinstance(trainer, Trainer):
        trainer.step(scaler, 1 / batch_size)
    else:
        for group in trainer.param_groups:
            group["lr"] = lr / batch_size
        scaler.step(trainer)
        scaler.update()
    return loss / len(X)


def grad_scaler(device_type, loss_scaling):
    """The AMP recipe's torch.amp.GradScaler set to `loss_scaling` (common.loss_scaling.LossScaling), enabled only
    with one (GradScaler(enabled=...)): one step for every precision."""
    scaling = loss_scaling or LossScaling()
    return torch.amp.GradScaler(device_type, scaling.initial, scaling.growth_factor, scaling.backoff_factor,
                                scaling.growth_interval, enabled=loss_scaling is not None)


def scaler_state(model):
    """The GradScaler between steps (common.loss_scaling.ScalerState; None when it is disabled), read from its
    state_dict, what PyTorch's AMP recipe saves in a checkpoint: its scale and its count of finite steps."""
    saved = model.mixed.state_dict()   # {} when disabled
    return ScalerState(saved["scale"], saved["scale"], saved["_growth_tracker"]) if saved else None


def restore_scaler(model, state):
    """The GradScaler carries on from a checkpoint's ScalerState, through its own load_state_dict."""
    model.mixed.load_state_dict({**model.mixed.state_dict(), "scale": state.scale, "_growth_tracker": state.good_steps})


def to_numpy(model):
    if is_resnet(model.net):
        return resnet.model_to_numpy(model.net)[0]
    return params_to_numpy(list(model.net.parameters()))


def bn_state(model):
    return resnet.model_to_numpy(model.net)[1]


def replica_bn_states(model):
    return [bn_state(model)]   # one device


def optimizer_state(model):
    return canonical_state(model.trainer.state_dict(), model.trainer.names)


def evaluate(model, X, y, batch_size=1000):
    """In inference mode: the ResNet's BatchNorm by its running statistics (then back to training mode)."""
    net = model.net
    layout = (lambda x: x) if is_resnet(net) else to_layout   # the ResNet lays its input out itself
    device = next(net.parameters()).device
    correct = 0
    net.eval()
    with torch.no_grad():
        for i in range(0, len(X), batch_size):
            logits = net(layout(torch.from_numpy(X[i:i + batch_size]).to(device)))
            correct += (logits.argmax(1).cpu().numpy() == y[i:i + batch_size]).sum()
    net.train()
    return float(correct) / len(X)
