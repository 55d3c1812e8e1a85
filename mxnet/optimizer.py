"""The optimizer in MXNet, by hand for the scratch step: its state a list of NDArrays per slot, one replica's, and
common/optim.py's update written out in place, as the recipe's sgd is."""
from mxnet import nd

from common.optim import CLIP_EPS

from .lenet import PARAM_NAMES, to_numpy


def init_state(replica, optimizer):
    """zeros_like keeps each parameter's context."""
    return {"optimizer": optimizer, "step": 0,
            **{slot: [nd.zeros_like(p) for p in replica] for slot in optimizer.slots}}


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
            buffer[:] = arrays[f"{slot}.{name}"]   # copies into the buffer, on its context
    return state


def apply(params, grads, state, lr, batch_size):
    """common/optim.py's update of one replica, in place, by hand: the gradients are the all-reduced sums, the same
    on every replica, so every replica clips by the same global norm and stays equal to the others."""
    o, t = state["optimizer"], state["step"]
    grads = [g / batch_size for g in grads]   # the global batch's mean
    if o.clip_norm is not None:               # clip_grad_norm_'s: times clip / (norm + 1e-6), at most 1
        norm = nd.add_n(*[(g * g).sum() for g in grads]).sqrt()
        grads = [g * nd.minimum(o.clip_norm / (norm + CLIP_EPS), 1.0) for g in grads]
    for i, (p, g) in enumerate(zip(params, grads)):
        if o.weight_decay and not o.decoupled:
            g = g + o.weight_decay * p
        if o.name == "sgd":
            p -= lr * g                       # in place: NDArray's -= writes into p
        elif o.name in ("momentum", "nesterov"):
            v = state["momentum_buffer"][i]
            v[:] = o.momentum * v + g         # the rate stays outside the buffer; v = g on the first step
            p -= lr * (g + o.momentum * v if o.name == "nesterov" else v)
        else:
            if o.decoupled:
                p *= 1 - lr * o.weight_decay
            (b1, b2), m, s = o.betas, state["exp_avg"][i], state["exp_avg_sq"][i]
            m[:] = b1 * m + (1 - b1) * g
            s[:] = b2 * s + (1 - b2) * g * g
            p -= lr / (1 - b1 ** (t + 1)) * m / ((s / (1 - b2 ** (t + 1))).sqrt() + o.eps)   # eps outside sqrt
    state["step"] = t + 1
