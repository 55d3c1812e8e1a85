"""The optimizer in PyTorch, by hand for the scratch step: its state a list of buffers per slot, one replica's, and
the update torch.optim.SGD, Adam and AdamW make, written out (common/optim.py is PyTorch's conventions)."""
import torch

from common.optim import CLIP_EPS

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
    torch.optim.SGD, Adam and AdamW compute, written out."""
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
                (b1, b2), m, s = o.betas, state["exp_avg"][i], state["exp_avg_sq"][i]
                m.mul_(b1).add_(g, alpha=1 - b1)
                s.mul_(b2).addcmul_(g, g, value=1 - b2)
                p -= lr / (1 - b1 ** (t + 1)) * m / ((s / (1 - b2 ** (t + 1))).sqrt() + o.eps)   # eps outside sqrt
    state["step"] = t + 1

