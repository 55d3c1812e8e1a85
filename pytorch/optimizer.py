"""The optimizer in PyTorch, twice: by hand for the scratch step (its state a list of buffers per slot, one replica's),
and as torch.optim's own classes and schedulers for the built-in and idiomatic modes. common/optim.py is PyTorch's
conventions, so the stock SGD, Adam and AdamW compute it as they are: no subclass."""
import typing

import torch
from torch.optim import lr_scheduler

from common.optim import CLIP_EPS, STEP_FACTOR

from .lenet import PARAM_NAMES, to_numpy


def init_state(replica, optimizer):
    """zeros_like keeps each parameter's device and strides: a conv kernel's buffers are channels-last too."""
    return {"optimizer": optimizer, "step": 0,
            **{slot: [torch.zeros_like(p) for p in replica] for slot in optimizer.slots}}


def state_to_numpy(state):
    arrays = {"step": state["step"]}
    for slot in state["optimizer"].slots:
        arrays.update({f"{slot}.{name}": value for name, value in to_numpy(state[slot]).items()})
    return arrays


def state_from_numpy(arrays, replica, optimizer):
    state = init_state(replica, optimizer)
    state["step"] = int(arrays["step"])
    for slot in optimizer.slots:
        for buffer, name in zip(state[slot], PARAM_NAMES):
            buffer.copy_(torch.from_numpy(arrays[f"{slot}.{name}"]))   # copy_ keeps the buffer's strides
    return state


def apply(params, grads, state, lr, batch_size):
    """common/optim.py's update of one replica, in place, by hand: the gradients are the all-reduced sums, the same
    on every replica, so every replica clips by the same global norm and stays equal to the others. What
    torch.optim.SGD, Adam and AdamW (get_trainer) compute, written out."""
    o, t = state["optimizer"], state["step"]
    with torch.no_grad():
        grads = [g / batch_size for g in grads]   # the global batch's mean
        if o.clip_norm is not None:               # clip_grad_norm_'s: times clip / (norm + 1e-6), at most 1
            norm = torch.sqrt(sum((g * g).sum() for g in grads))
            grads = [g * (o.clip_norm / (norm + CLIP_EPS)).clamp(max=1.0) for g in grads]
        for i, (p, g) in enumerate(zip(params, grads)):
            if o.weight_decay and not o.decoupled:
                g = g + o.weight_decay * p
            if o.name == "sgd":
                p -= lr * g
            elif o.name in ("momentum", "nesterov"):
                v = state["momentum_buffer"][i]
                v.mul_(o.momentum).add_(g)        # the rate stays outside the buffer; v = g on the first step
                p -= lr * (g + o.momentum * v if o.name == "nesterov" else v)
            else:
                if o.decoupled:
                    p.mul_(1 - lr * o.weight_decay)
                b1, b2 = o.betas
                m, s = state["exp_avg"][i], state["exp_avg_sq"][i]
                m.mul_(b1).add_(g, alpha=1 - b1)
                s.mul_(b2).addcmul_(g, g, value=1 - b2)
                p -= lr / (1 - b1 ** (t + 1)) * m / ((s / (1 - b2 ** (t + 1))).sqrt() + o.eps)   # eps outside sqrt
    state["step"] = t + 1


class Trainer(typing.NamedTuple):
    """What a PyTorch user holds beside the model: the optimizer, its learning-rate scheduler and the clipping norm
    (None: no clipping). step() is the three lines after loss.backward() in PyTorch's examples."""
    optimizer: torch.optim.Optimizer
    scheduler: lr_scheduler.LRScheduler
    clip_norm: float | None

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        """Clip the gradients as backward left them (under DistributedDataParallel, already all-reduced), update,
        and move the schedule to the next step's rate."""
        if self.clip_norm is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.clip_norm)
        self.optimizer.step()
        self.scheduler.step()


def get_schedule(torch_optimizer, optimizer):
    """common/optim.py's rates from torch's stock schedulers, one scheduler.step() after each update. LinearLR's
    factor is (t + 1) / W at step t < W; at step W, SequentialLR starts the schedule of the remaining D steps at its
    own step 0, so MultiStepLR counts its milestones from there. T_max is at least 1: when the warm-up is the whole
    run, the scheduler.step() after the last update still starts the cosine (cos(pi * 0 / 0) otherwise)."""
    o, warmup = optimizer, optimizer.warmup_steps
    if o.schedule == "cosine":
        after = lr_scheduler.CosineAnnealingLR(torch_optimizer, T_max=max(o.decay_steps, 1))
    elif o.schedule == "step":
        after = lr_scheduler.MultiStepLR(torch_optimizer, [m - warmup for m in o.milestones], gamma=STEP_FACTOR)
    else:
        after = lr_scheduler.ConstantLR(torch_optimizer, factor=1.0)   # the rate as it is
    if not warmup:
        return after
    linear = lr_scheduler.LinearLR(torch_optimizer, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return lr_scheduler.SequentialLR(torch_optimizer, [linear, after], milestones=[warmup])


def get_trainer(parameters, optimizer):
    """torch.optim's own classes with the spec's hyperparameters and its defaults for the rest (dampening 0, no
    amsgrad): plain sgd is SGD without momentum; weight_decay is L2 in the gradient, except in AdamW."""
    o = optimizer
    if o.name in ("sgd", "momentum", "nesterov"):
        torch_optimizer = torch.optim.SGD(parameters, lr=o.lr, momentum=0.0 if o.name == "sgd" else o.momentum,
                                          nesterov=o.name == "nesterov", weight_decay=o.weight_decay)
    else:
        adam = torch.optim.AdamW if o.decoupled else torch.optim.Adam
        torch_optimizer = adam(parameters, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return Trainer(torch_optimizer, get_schedule(torch_optimizer, o), o.clip_norm)
