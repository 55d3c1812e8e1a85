"""PyTorch's own data parallelism: DistributedDataParallel, one process per device. PyTorch has no
working in-process data parallelism on the CPU (nn.DataParallel silently does nothing there), so the
built-in mode always runs processes, even for a run that asks for one."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.interface import Model, RosettaError

from .data_parallel import evaluate as evaluate_params
from .execution import DEFAULT_LAYOUT, LAYOUTS
from .lenet import build_model, loss_sum, to_numpy as params_to_numpy
from .optimizer import Trainer, canonical_state, get_trainer

EXEC = "eager"
COMPILES = "nothing"
LAYOUT = LAYOUTS[DEFAULT_LAYOUT]   # build_model's kernels, pipeline.py's batches


def get_model(weights, devices, optimizer=None, state=None):
    """The recipe's plain SGD (optimizer None or is_recipe) is torch.optim.SGD at the harness's rate; any other
    optimizer is optimizer.py's Trainer: torch.optim's class, its scheduler and the clipping norm, over the
    parameters of the module DistributedDataParallel wraps, going on from a checkpoint's canonical `state` if
    given (every process loads the same one)."""
    if not dist.is_initialized() or len(devices) != 1:
        raise RosettaError("DistributedDataParallel runs one process per device: start it through compare.py "
                           "or torchrun (README)")
    device = devices[0]
    net = DistributedDataParallel(build_model(weights).to(device),
                                  device_ids=[device.index] if device.type == "cuda" else None)
    if optimizer is None or optimizer.is_recipe:
        return Model(net, torch.optim.SGD(net.parameters(), lr=0.0), device)
    return Model(net, get_trainer(net.parameters(), optimizer, state), device)


def train_step(model, batch, lr, batch_size):
    """DDP averages gradients over processes; scaling each summed loss by world / global batch makes that
    average the recipe's sum / global batch, exactly, even when the shards differ in size. The batch is
    this process's part, on its device, from pipeline.py's DataLoader. DDP all-reduces the gradients during
    backward, so a Trainer clips the global batch's mean gradient, the same on every process. A Trainer's
    scheduler sets the rate; the recipe's SGD takes the harness's `lr`."""
    net, trainer, _ = model
    X, y = batch
    loss = loss_sum(net(X), y)
    trainer.zero_grad()
    (loss * dist.get_world_size() / batch_size).backward()
    if not isinstance(trainer, Trainer):
        for group in trainer.param_groups:
            group["lr"] = lr
    trainer.step()
    return loss.item() / len(X)


def to_numpy(model):
    return params_to_numpy(list(model.net.module.parameters()))   # the module DistributedDataParallel wraps


def optimizer_state(model):
    return canonical_state(model.trainer.state_dict())


def evaluate(model, X, y):
    return evaluate_params(list(model.net.module.parameters()), X, y)
