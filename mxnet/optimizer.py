"""The optimizer in MXNet, twice: by hand for the scratch step (its state a list of NDArrays per slot, one replica's),
and as MXNet's own optimizer and schedule classes under a gluon.Trainer for the built-in and idiomatic modes. MXNet's
conventions are not PyTorch's: the smallest subclasses below make its classes compute common/optim.py, each saying
which line of the stock class differs."""
import dataclasses
import math

import mxnet as mx
import numpy as np
from mxnet import gluon, nd

from common.optim import (CLIP_EPS, STEP_FACTOR, Optimizer, epsilon_hat_gap, how_often, rate_changes,
                          root_epsilon_gap)


def init_state(replica, optimizer):
    """zeros_like keeps each parameter's context."""
    return {"optimizer": optimizer, "step": 0,
            **{slot: [nd.zeros_like(p) for p in replica] for slot in optimizer.slots}}


def state_to_numpy(state, model):
    """Each slot's buffers named as `model` (a Functional) names its parameters: a slot is a replica's shape."""
    arrays = {"step": state["step"]}
    for slot in state["optimizer"].slots:
        arrays.update({f"{slot}.{name}": value for name, value in model.to_numpy(state[slot]).items()})
    return arrays


def state_from_numpy(arrays, replica, optimizer, model):
    state = init_state(replica, optimizer)
    state["step"] = int(arrays["step"])
    for slot in optimizer.slots:
        for buffer, name in zip(state[slot], model.param_names):
            buffer[:] = arrays[f"{slot}.{name}"]   # copies into the buffer, on its context
    return state


def state_bytes(state):
    """The bytes of every slot's buffers on their context: a replica's whole state, or a sharded one's slices."""
    return sum(b.size * np.dtype(b.dtype).itemsize for slot in state["optimizer"].slots for b in state[slot])


def apply(params, grads, state, lr, batch_size, norm=None):
    """common/optim.py's update of one replica, in place, by hand: the gradients are the all-reduced sums, the same
    on every replica, so every replica clips by the same global norm and stays equal to the others. What
    get_trainer's classes compute, written out. Element-wise but for clipping, so it updates a device's flat slices
    under --shard alike: there `norm` (an NDArray) is the mean gradient's global norm, which the slices alone lack."""
    o, t = state["optimizer"], state["step"]
    grads = [g / batch_size for g in grads]   # the global batch's mean
    if o.clip_norm is not None:               # clip_grad_norm_'s: times clip / (norm + 1e-6), at most 1
        norm = (nd.add_n(*[(g * g).sum() for g in grads]).sqrt() if norm is None
                else norm.as_in_context(grads[0].context))
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
        elif o.name == "rmsprop":
            s = state["square_avg"][i]
            s[:] = o.alpha * s + (1 - o.alpha) * g * g
            if o.centered:
                c = state["grad_avg"][i]
                c[:] = o.alpha * c + (1 - o.alpha) * g
                s = s - c * c                 # the gradients' running variance
            scaled = g / (s.sqrt() + o.eps)   # eps outside the square root
            if o.momentum:
                v = state["momentum_buffer"][i]
                v[:] = o.momentum * v + scaled
                scaled = v
            p -= lr * scaled                  # the rate outside the momentum buffer
        elif o.name == "adagrad":
            s = state["sum"][i]
            s[:] += g * g
            p -= lr * g / (s.sqrt() + o.eps)
        else:
            if o.decoupled:
                p *= 1 - lr * o.weight_decay
            (b1, b2), m, s = o.betas, state["exp_avg"][i], state["exp_avg_sq"][i]
            m[:] = b1 * m + (1 - b1) * g
            s[:] = b2 * s + (1 - b2) * g * g
            p -= lr / (1 - b1 ** (t + 1)) * m / ((s / (1 - b2 ** (t + 1))).sqrt() + o.eps)   # eps outside sqrt
    state["step"] = t + 1


class Momentum(mx.optimizer.Optimizer):
    """torch.optim.SGD's momentum in MXNet's optimizer API. MXNet's own keep the rate inside the buffer:
    mx.optimizer.SGD's sgd_mom_update makes v = mu * v - lr * g; w += v, and NAG's nag_mom_update the same v, then
    w += mu * v - lr * g (MXNet 1.9.1's kernel: the NAG class's docstring, the rate outside, is not what it computes).
    That is torch's update while the rate is constant; under a schedule the buffer holds the rates of past steps.
    No stock kernel keeps the rate outside, so the update is written out in create_state and update, the API of
    any custom MXNet optimizer: g (the rescaled mean, plus wd * w as Gluon's wd is); v = mu * v + g; w -= lr * v."""
    nesterov = False

    def __init__(self, momentum, **kwargs):
        super().__init__(**kwargs)
        self.momentum = momentum

    def create_state(self, index, weight):
        return nd.zeros(weight.shape, weight.context, dtype=weight.dtype)

    def update(self, index, weight, grad, state):
        self._update_count(index)             # num_update, which drives the schedule
        lr, wd = self._get_lr(index), self._get_wd(index)
        grad = grad * self.rescale_grad + wd * weight
        state[:] = self.momentum * state + grad
        weight -= lr * (grad + self.momentum * state if self.nesterov else state)


class Nesterov(Momentum):
    """torch's nesterov=True: w -= lr * (g + mu * v), with Momentum's v."""
    nesterov = True


class Adam(mx.optimizer.Adam):
    """mx.optimizer.Adam folds the bias corrections into the rate, lr * sqrt(1 - b2^t) / (1 - b1^t), and adds
    epsilon to the uncorrected sqrt(v): torch's update with epsilon * sqrt(1 - b2^t) for epsilon (smaller in early
    steps). The stock update with that one argument changed: epsilon * sqrt(1 - b2^t), so that it is torch's eps.
    (Its kernel also rounds: it computes 1 - beta2 in float32 from a float32 beta2, 0.000999987 for 0.999.)"""

    def update(self, index, weight, grad, state):
        self._update_count(index)
        t = self._index_update_count[index]   # this parameter's updates on this context, this one included
        c1, c2 = 1 - self.beta1 ** t, 1 - self.beta2 ** t
        mean, var = state
        nd.adam_update(weight, grad, mean, var, out=weight, lr=self._get_lr(index) * math.sqrt(c2) / c1,
                       wd=self._get_wd(index), beta1=self.beta1, beta2=self.beta2,
                       epsilon=self.epsilon * math.sqrt(c2), rescale_grad=self.rescale_grad)


class AdamW(Adam):
    """MXNet 1.9.1 has no AdamW class, only its kernel, nd.contrib.adamw_update (GluonNLP's BERTAdam calls it):
    w -= eta * (lr * m / (sqrt(v) + epsilon) + wd * w), decoupled and without bias corrections. With eta the
    schedule's rate and lr the corrections it is torch's AdamW: w *= 1 - lr * wd, then Adam's step above."""

    def update(self, index, weight, grad, state):
        self._update_count(index)
        t = self._index_update_count[index]
        c1, c2 = 1 - self.beta1 ** t, 1 - self.beta2 ** t
        mean, var = state
        nd.contrib.adamw_update(weight, grad, mean, var, out=weight, rescale_grad=self.rescale_grad,
                                lr=math.sqrt(c2) / c1, eta=self._get_lr(index), wd=self._get_wd(index),
                                beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon * math.sqrt(c2))


class RMSProp(mx.optimizer.RMSProp):
    """torch.optim.RMSprop with mx.optimizer.RMSProp's parameters: gamma1 is torch's alpha, gamma2 its momentum (here
    centered or not). The stock kernels add epsilon inside the square root, g / sqrt(n + eps), torch's outside,
    g / (sqrt(n) + eps); the plain one (rmsprop_update) has no momentum, and the centered one (rmspropalex_update) keeps
    the rate inside it: delta = gamma2 * delta - lr * g / sqrt(n - g_avg^2 + eps); w += delta. No stock kernel computes
    torch's, so the update is written out, as Momentum's: g (the rescaled mean, plus wd * w); n = gamma1 * n +
    (1 - gamma1) * g^2 (centered: g_avg likewise, and n - g_avg^2 for n); g / (sqrt(n) + eps), through
    v = gamma2 * v + that if gamma2; w -= lr * it."""

    def create_state(self, index, weight):
        """common.optim's slots, in its order (a tuple, as the stock class's)."""
        return tuple(nd.zeros(weight.shape, weight.context, dtype=weight.dtype) for _ in slots(self))

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        grad = grad * self.rescale_grad + wd * weight
        square_avg, *others = state
        square_avg[:] = self.gamma1 * square_avg + (1 - self.gamma1) * grad * grad
        variance = square_avg
        if self.centered:
            grad_avg = others.pop(0)
            grad_avg[:] = self.gamma1 * grad_avg + (1 - self.gamma1) * grad
            variance = square_avg - grad_avg * grad_avg
        scaled = grad / (variance.sqrt() + self.epsilon)
        if self.gamma2:
            (buffer,) = others
            buffer[:] = self.gamma2 * buffer + scaled
            scaled = buffer
        weight -= lr * scaled


class AdaGrad(mx.optimizer.AdaGrad):
    """torch.optim.Adagrad. mx.optimizer.AdaGrad adds its eps (float_stable_eps) inside the square root and decays
    the weights outside the accumulation: history += g^2; w -= lr * (g / sqrt(history + eps) + wd * w), g without the
    decay. torch's decay is L2, added to the gradient that is accumulated and divided, and its eps is outside the root:
    the stock update with those two lines changed."""

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        grad = grad * self.rescale_grad + wd * weight
        state[:] += grad * grad
        weight -= lr * grad / (state.sqrt() + self.float_stable_eps)


class OneUpdateLate:
    """The optimizer asks the schedule for the rate of num_update, which counts the update being made (the first is
    1): the stock warm-up, lr * num_update / W, is torch's LinearLR from 1 / W, and num_update = W is the warm-up's
    last, lr. MXNet's cosine and polynomial start there, at W; torch's CosineAnnealingLR and PolynomialLR start one
    update later, at W + 1 (SequentialLR restarts them after the warm-up's W updates). So after the warm-up, the
    stock curve one update late."""

    def __call__(self, num_update):
        return super().__call__(num_update if num_update <= self.warmup_steps else num_update - 1)


class CosineScheduler(OneUpdateLate, mx.lr_scheduler.CosineScheduler):
    """MXNet's cosine, one update late (OneUpdateLate): torch's CosineAnnealingLR."""


class PolyScheduler(OneUpdateLate, mx.lr_scheduler.PolyScheduler):
    """MXNet's polynomial, one update late (OneUpdateLate): torch's PolynomialLR."""


class FactorScheduler(mx.lr_scheduler.FactorScheduler):
    """MXNet's FactorScheduler counts its decays from update 0, through the warm-up; torch's StepLR (after
    SequentialLR's warm-up) and Keras's and Optax's joined schedules count them from the warm-up's end, as the spec.
    Update num_update >= W is the spec's step num_update - 1, its k-th after the warm-up (W itself, the warm-up's
    last, is lr). No floor (the stock stop_factor_lr)."""

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        return self.warmup_final_lr * self.factor ** (max(num_update - 1 - self.warmup_steps, 0) // self.step)


# The schedules each port builds (CLASSES below says what a port is): this module's classes compute common/optim.py's
# rates, MXNet's stock ones decay one update early (cosine, polynomial) or count a factor's decays through the warm-up
SCHEDULERS = {"canonical": {"cosine": CosineScheduler, "poly": PolyScheduler, "factor": FactorScheduler},
              "stock": {"cosine": mx.lr_scheduler.CosineScheduler, "poly": mx.lr_scheduler.PolyScheduler,
                        "factor": mx.lr_scheduler.FactorScheduler}}


def get_schedule(optimizer, port="canonical"):
    """common/optim.py's rates from MXNet's schedules, driven by the optimizer's num_update (once per step: with
    several contexts each has its own update counts, and num_update is their maximum). The warm-up is every
    scheduler's own (warmup_steps, from warmup_begin_lr 0). MultiFactorScheduler decays once num_update passes a
    step, as MultiStepLR at a milestone; a FactorScheduler that never decays (factor 1) is the constant rate, and
    the whole schedule when the warm-up is the whole run (MXNet's cosine would divide by its 0 decay steps)."""
    o, warmup, own = optimizer, optimizer.warmup_steps, SCHEDULERS[port]
    if o.schedule == "cosine" and o.decay_steps:
        return own["cosine"](max_update=o.total_steps, base_lr=o.lr, final_lr=o.final_lr, warmup_steps=warmup)
    if o.schedule == "poly" and o.decay_steps:
        return own["poly"](max_update=o.total_steps, base_lr=o.lr, pwr=o.power, warmup_steps=warmup)
    if o.schedule == "step" and o.decay_steps:
        return mx.lr_scheduler.MultiFactorScheduler(step=list(o.milestones), factor=o.decay_factor, base_lr=o.lr,
                                                    warmup_steps=warmup)
    if o.schedule == "factor":
        return own["factor"](step=o.period, factor=o.decay_factor, base_lr=o.lr, warmup_steps=warmup)
    return mx.lr_scheduler.FactorScheduler(step=o.total_steps, factor=1.0, base_lr=o.lr, warmup_steps=warmup)


# The classes each optimizer is built with: "canonical" computes common/optim.py; "stock" is a straightforward port,
# MXNet's own classes given the same hyperparameters (its momentum and NAG with the rate in the buffer, its Adam's
# epsilon, no AdamW: Adam whose wd is L2 in the gradient; RMSProp's and AdaGrad's epsilon inside the root, RMSProp's
# momentum only when centered, AdaGrad's decay outside its accumulation) and its stock schedules. Both clip by global
# norm (Trainer, below): no stock class does, and clip_gradient, which clips each element, is another operation.
CLASSES = {"canonical": {"sgd": mx.optimizer.SGD, "momentum": Momentum, "nesterov": Nesterov, "adam": Adam,
                         "adamw": AdamW, "rmsprop": RMSProp, "adagrad": AdaGrad},
           "stock": {"sgd": mx.optimizer.SGD, "momentum": mx.optimizer.SGD, "nesterov": mx.optimizer.NAG,
                     "adam": mx.optimizer.Adam, "adamw": mx.optimizer.Adam, "rmsprop": mx.optimizer.RMSProp,
                     "adagrad": mx.optimizer.AdaGrad}}


def get_optimizer(optimizer, port="canonical", step=0):
    """An mx.optimizer for common/optim.py's `optimizer`: its wd is L2 in the gradient (but AdamW's), on every
    parameter, biases too (wd_mult 1), as torch's weight_decay. `step`: the updates already made, MXNet's
    begin_num_update (its way to resume): each parameter's count starts there on every context, so the next update
    is num_update step + 1, the schedule's rate of step `step` and Adam's t = step + 1."""
    o = optimizer
    if o.name in ("adam", "adamw"):
        hyper = {"beta1": o.betas[0], "beta2": o.betas[1], "epsilon": o.eps}
    elif o.name == "rmsprop":
        hyper = {"gamma1": o.alpha, "gamma2": o.momentum, "epsilon": o.eps, "centered": o.centered}
    elif o.name == "adagrad":
        hyper = {"eps": o.eps}
    else:
        hyper = {"momentum": 0.0 if o.name == "sgd" else o.momentum}
    return CLASSES[port][o.name](learning_rate=o.lr, wd=o.weight_decay, begin_num_update=step,
                                 lr_scheduler=get_schedule(o, port), **hyper)


def slots(mx_optimizer):
    """common.optim's names of the buffers an MXNet optimizer keeps per parameter, in the order of its state: Adam's
    is (mean, var); momentum's, Nesterov's (and the stock SGD's and NAG's with momentum) one buffer; SGD's None;
    AdaGrad's its history (torch's sum); RMSProp's common.optim's, but the stock one's: (n,), or centered
    (n, g_avg, delta) whatever gamma2, delta None where gamma2 is 0 (a buffer the canonical state has no slot for:
    with no momentum it holds the last update alone)."""
    o = mx_optimizer
    if type(o) is mx.optimizer.RMSProp:
        return ("square_avg", "grad_avg", "momentum_buffer" if o.gamma2 else None) if o.centered else ("square_avg",)
    if isinstance(o, RMSProp):
        return Optimizer("rmsprop", momentum=o.gamma2, centered=o.centered).slots
    if isinstance(o, mx.optimizer.AdaGrad):
        return ("sum",)
    if isinstance(o, mx.optimizer.Adam):
        return ("exp_avg", "exp_avg_sq")
    if isinstance(o, Momentum) or getattr(o, "momentum", 0.0):
        return ("momentum_buffer",)
    return ()


# MXNet's stock classes that keep the rate inside the momentum buffer (v = mu * v - lr * g; w += v, and NAG's
# w += mu * v - lr * g; a centered RMSProp's delta = gamma2 * delta - lr * g / sqrt(n - g_avg^2 + eps); w += delta):
# torch's buffer, the canonical one, keeps it outside (w -= lr * buf), so buf = -v / lr at the rate of the last update
# made. Exact while the rate stays there; after a change of rate the stock trajectory and torch's part, each by its
# own definition.
RATE_INSIDE = (mx.optimizer.SGD, mx.optimizer.NAG, mx.optimizer.RMSProp)


def momentum_inside(mx_optimizer):
    """The momentum of a stock class that keeps the rate inside its buffer (RATE_INSIDE), else 0: SGD's and NAG's,
    a centered RMSProp's gamma2 (a plain one has none)."""
    o = mx_optimizer
    if type(o) not in RATE_INSIDE:
        return 0.0
    return (o.gamma2 if o.centered else 0.0) if type(o) is mx.optimizer.RMSProp else o.momentum


def canonical_buffer(mx_optimizer, slot, array):
    """A parameter's buffer of `slot` (numpy) in common.optim's convention: a stock momentum buffer that holds the rate
    (momentum_inside) divided by minus the last update's rate (learning_rate: the schedule's rate of num_update, the
    updates made); the classes above keep the canonical convention already, and the other slots hold no rate."""
    if slot == "momentum_buffer" and momentum_inside(mx_optimizer) and mx_optimizer.learning_rate:   # 0 before a
        return array / -mx_optimizer.learning_rate   # warm-up's first update, when the buffer is 0 anyway
    return array


def stock_buffer(mx_optimizer, slot, array):
    """The inverse of canonical_buffer: a canonical buffer (numpy) in `mx_optimizer`'s convention."""
    if slot == "momentum_buffer" and momentum_inside(mx_optimizer):
        return array * -mx_optimizer.learning_rate
    return array


def adam_gap(mx_optimizer, states):
    """What MXNet's stock Adam differs by from torch's (and Optax's): it adds epsilon to the uncorrected sqrt(v),
    which is torch's epsilon times sqrt(1 - beta2^t). On the next update (t = num_update + 1) of the moments in
    `states` (the Updater's: index -> (mean, var)), before the new gradient: |torch's step - MXNet's| / |MXNet's|
    over the whole model, m / (sqrt(v) + eps * sqrt(1 - beta2^t)) against m / (sqrt(v) + eps) (the elements whose
    moments are 0 move neither)."""
    o = mx_optimizer
    return epsilon_hat_gap(o.epsilon, o.beta2, o.num_update,
                            [(mean.asnumpy(), var.asnumpy()) for mean, var in states.values()], source="hat")


def told(mx_optimizer, accept_gap=False, states=None):
    """The common.optim.Optimizer a pickled MXNet optimizer is (Trainer.save_states pickles it beside the states),
    told from its class and fields, never guessed from its buffers: this module's classes, or MXNet's stock SGD (with
    momentum: the canonical momentum, its buffer converted by canonical_buffer), NAG, RMSProp (centered: gamma2 the
    momentum, its delta converted likewise) and AdaGrad; with no schedule or this module's (get_schedule's). What has
    no exact canonical equivalent is a ValueError that says what differs (stock_gap, measured on the Updater's
    `states` where given); with `accept_gap`, MXNet's stock Adam is read as torch's (its moments are the same; its
    epsilon is not: adam_gap), and its RMSProp and AdaGrad too (their buffers are torch's, their epsilon is not).
    A file this project wrote is the canonical optimizer it carries (exact_optimizer), as long as that is current."""
    exact = exact_optimizer(mx_optimizer)
    if exact is not None:
        return exact
    o, kind = mx_optimizer, type(mx_optimizer)
    names = {Momentum: "momentum", Nesterov: "nesterov", Adam: "adam", AdamW: "adamw", mx.optimizer.NAG: "nesterov",
             mx.optimizer.SGD: "momentum" if getattr(o, "momentum", 0.0) else "sgd", mx.optimizer.Adam: "adam",
             RMSProp: "rmsprop", mx.optimizer.RMSProp: "rmsprop", AdaGrad: "adagrad", mx.optimizer.AdaGrad: "adagrad"}
    if kind not in names:
        raise ValueError(f"MXNet's {kind.__name__} is not one the converter carries (sgd, sgd with momentum, nag, "
                         "rmsprop, adagrad, and this project's momentum, nesterov, adam, adamw, rmsprop, adagrad)")
    if getattr(o, "clip_weights", None):
        raise ValueError(f"its RMSProp clips the weights to +-{o.clip_weights:g} at every update (clip_weights), which "
                         "no other framework's optimizer does")
    if names[kind] in ("adam", "adamw"):
        hyper = {"betas": (o.beta1, o.beta2), "eps": o.epsilon}
    elif names[kind] == "rmsprop":   # the stock plain RMSProp ignores gamma2
        hyper = {"alpha": float(o.gamma1), "eps": float(o.epsilon), "centered": bool(o.centered),
                 "momentum": float(o.gamma2 if kind is RMSProp else momentum_inside(o))}
    elif names[kind] == "adagrad":
        hyper = {"eps": float(o.float_stable_eps)}
    else:
        hyper = {"momentum": o.momentum} if names[kind] != "sgd" else {}
    schedule = told_schedule(o.lr_scheduler, int(o.num_update))
    optimizer = Optimizer(names[kind], lr=float(o.lr), weight_decay=float(o.wd), **hyper, **schedule)
    gap = stock_gap(o, optimizer, states)
    if gap and not accept_gap:
        raise ValueError(f"{gap} (--accept-gap converts it anyway)")
    return optimizer


def stock_gap(mx_optimizer, optimizer, states=None):
    """What MXNet's stock class `mx_optimizer` computes otherwise than common.optim's `optimizer` from where the
    Updater's `states` (index -> a parameter's state) leave it, one clause each, or None: the class itself where it has
    no equivalent of the optimizer's (port_gaps), Adam's epsilon (adam_gap), RMSProp's and AdaGrad's
    (convention_gaps), the schedule (schedule_gap) and the rate inside a momentum buffer (rate_change_gap). The gaps
    told() refuses without accept_gap, and the note of a file written for stock Gluon code to continue."""
    o, gaps = mx_optimizer, port_gaps(mx_optimizer, optimizer)
    if type(o) is mx.optimizer.Adam:
        size = f" by {adam_gap(o, states):.1e} of its size" if states else ""
        gaps.append("MXNet's stock Adam adds epsilon to the uncorrected sqrt(v) (torch's epsilon times "
                    f"sqrt(1 - beta2^t), smaller in early steps): continued by torch's or Optax's Adam, the next "
                    f"update differs{size} (Keras's Adam computes MXNet's)")
    if getattr(o, "clip_gradient", None) is not None:   # Trainer(..., {"clip_gradient": c}): GluonNLP's usual option
        gaps.append(f"MXNet's {type(o).__name__} clips every gradient element to +-{o.clip_gradient:g} after its "
                    "rescale (clip_gradient), which the converted optimizer does not: continue it with "
                    "torch.nn.utils.clip_grad_value_, optax.clip or Keras's clipvalue")
    gaps += [*convention_gaps(o, states), schedule_gap(o, optimizer), rate_change_gap(o, optimizer)]
    return "; ".join(gap for gap in gaps if gap) or None


def port_gaps(mx_optimizer, optimizer):
    """Where MXNet has no stock class for `optimizer` and the stock port (get_optimizer's "stock") is another: AdamW
    (MXNet 1.9.1 has its kernel, no class) is Adam with wd as L2, and RMSProp has momentum only when centered."""
    o, gaps = mx_optimizer, []
    if optimizer.name == "adamw" and type(o) is mx.optimizer.Adam:
        gaps.append(f"MXNet 1.9.1 has no AdamW class: its stock Adam adds the decay ({o.wd:g}) to the gradient (L2), "
                    "where AdamW decays the weights apart, w *= 1 - lr * wd")
    if optimizer.name == "rmsprop" and optimizer.momentum and type(o) is mx.optimizer.RMSProp and not o.centered:
        gaps.append(f"MXNet's stock RMSProp has momentum only when centered: its plain one drops the momentum "
                    f"({optimizer.momentum:g}) and its buffer")
    return gaps


def convention_gaps(mx_optimizer, states=None):
    """Where MXNet's stock RMSProp and AdaGrad compute otherwise than torch.optim's (the spec's), one line each: their
    epsilon inside the square root, and AdaGrad's decay outside its accumulation ([] for the other classes). Measured
    on the Updater's `states` (index -> a parameter's state) where given: root_epsilon_gap for epsilon; for the decay,
    the factor torch's decay term is of MXNet's, 1 / (sqrt(sum) + eps), in the state's median element."""
    o, kind = mx_optimizer, type(mx_optimizer)
    if kind not in (mx.optimizer.RMSProp, mx.optimizer.AdaGrad):
        return []
    arrays = [[a.asnumpy() for a in buffers(state)] for state in (states or {}).values()]
    continued = ": continued by torch's, the next update differs"
    if kind is mx.optimizer.RMSProp:
        root = "n - g_avg^2" if o.centered else "n"
        pairs = [(own[0] - own[1] ** 2 if o.centered else own[0], own[0]) for own in arrays]   # (n, g_avg, delta)
        if arrays:
            continued += (f" by {root_epsilon_gap(o.epsilon, pairs):.1e} of its size for a gradient the size of each "
                          "element's running RMS")
        return [f"MXNet's stock RMSProp adds epsilon ({o.epsilon:g}) inside the square root, sqrt({root} + eps) "
                f"(torch.optim's RMSprop outside: sqrt({root}) + eps){continued} (Keras's and Optax's RMSprop compute "
                "MXNet's)"]
    eps, done = o.float_stable_eps, max(int(o.num_update), 1)
    histories = [own[0] for own in arrays]
    if arrays:
        continued += (f" by {root_epsilon_gap(eps, [(h, h / done) for h in histories]):.1e} of its size for a "
                      "gradient the size of each element's running RMS")
    gaps = [f"MXNet's stock AdaGrad adds eps ({eps:g}) inside the square root, sqrt(history + eps) (torch.optim's "
            f"Adagrad outside: sqrt(sum) + eps){continued} (Keras's and Optax's Adagrad compute MXNet's)"]
    if o.wd:
        factor = (f": {np.median(1 / (np.sqrt(np.concatenate([h.ravel() for h in histories])) + eps)):.3g} in this "
                  "state's median element" if arrays else "")
        gaps.append(f"MXNet's stock AdaGrad decays the weights outside its accumulation, w -= lr * (g / sqrt(history + "
                    f"eps) + wd * w), wd {o.wd:g} (torch.optim's Adagrad adds wd * w to the gradient it accumulates, "
                    "L2): continued by torch's, the decay's term of the update is 1 / (sqrt(sum) + eps) times MXNet's"
                    f"{factor} (Keras's decoupled weight_decay and Optax's add_decayed_weights after scale_by_rss "
                    "compute MXNet's)")
    return gaps


def told_schedule(s, done):
    """common.optim.Optimizer's schedule fields for an MXNet lr_scheduler (None: a constant rate) after `done`
    updates: this module's classes (get_schedule's) and MXNet's stock ones, whose parameters each map onto the spec's
    (schedule_gap says where the stock ones compute another rate). A warm-up other than linear from 0, a
    polynomial that ends above 0 (torch's PolynomialLR cannot) or a milestone inside the warm-up: a ValueError."""
    if s is None:
        return {"total_steps": max(done, 1)}
    kind, w = type(s), s.warmup_steps
    if s.warmup_begin_lr != 0 or s.warmup_mode != "linear":
        raise ValueError(f"its {kind.__name__}'s warm-up ({s.warmup_mode} from {s.warmup_begin_lr:g}) is not carried: "
                         "only a linear one from 0 has an equivalent in every framework")
    if kind in (CosineScheduler, mx.lr_scheduler.CosineScheduler):
        return {"schedule": "cosine", "final_lr": float(s.final_lr), "total_steps": s.max_update, "warmup_steps": w}
    if kind in (PolyScheduler, mx.lr_scheduler.PolyScheduler):
        if s.final_lr:
            raise ValueError(f"its PolyScheduler ends at {s.final_lr:g}, and torch.optim's PolynomialLR at 0")
        return {"schedule": "poly", "power": float(s.power), "total_steps": s.max_update, "warmup_steps": w}
    if kind in (FactorScheduler, mx.lr_scheduler.FactorScheduler) and s.factor == 1.0:
        return {"total_steps": max(s.step, w), "warmup_steps": w}
    if kind in (FactorScheduler, mx.lr_scheduler.FactorScheduler):
        return {"schedule": "factor", "decay_every": s.step, "decay_factor": float(s.factor),
                "total_steps": max(done, w, 1), "warmup_steps": w}
    if kind is mx.lr_scheduler.MultiFactorScheduler:
        if s.step[0] < w:
            raise ValueError(f"its MultiFactorScheduler decays at update {s.step[0] + 1}, inside its {w}-update "
                             "warm-up, which no other framework's schedule does")
        length = w + 2 * (s.step[0] - w)   # the run whose default milestones these are (get_schedule's): D // 2
        fits = [n for n in (length, length + 1) if Optimizer(schedule="step", total_steps=n, warmup_steps=w).milestones
                == tuple(s.step)] if s.factor == STEP_FACTOR else []
        if fits:
            return {"schedule": "step", "total_steps": fits[0], "warmup_steps": w}
        return {"schedule": "step", "decay_at": tuple(s.step), "decay_factor": float(s.factor),
                "total_steps": max(s.step[-1] + 1, done, w), "warmup_steps": w}
    raise ValueError(f"its schedule, MXNet's {kind.__name__}, is not one the converter carries (FactorScheduler, "
                     "MultiFactorScheduler, PolyScheduler, CosineScheduler)")


def schedule_gap(mx_optimizer, optimizer):
    """Where MXNet's stock schedule computes another rate than the spec's (torch's, Keras's and Optax's stock
    schedules) after the updates made, what differs and by how much, or None. Its cosine and polynomial
    run one update ahead after the warm-up (OneUpdateLate); its FactorScheduler counts its decays from update 0,
    through the warm-up, theirs from the warm-up's end."""
    s, done = mx_optimizer.lr_scheduler, int(mx_optimizer.num_update)
    kind, o = type(s), optimizer
    if kind in (mx.lr_scheduler.CosineScheduler, mx.lr_scheduler.PolyScheduler):
        ahead = [abs(o.learning_rate(t) - (o.learning_rate(t + 1) if t >= o.warmup_steps else o.learning_rate(t)))
                 for t in range(done, o.total_steps)]   # the spec's step t is MXNet's update t + 1
        if ahead and max(ahead):
            after = " after its warm-up" if o.warmup_steps else ""
            return (f"MXNet's stock {kind.__name__} is one update ahead of torch's, Keras's and Optax's{after} (its "
                    "update n has their rate of update n + 1): continued by them, the rate differs by up to "
                    f"{max(ahead) / o.lr:.1%} of the base rate over the {len(ahead)} updates left")
    if kind is mx.lr_scheduler.FactorScheduler and s.factor != 1.0 and s.warmup_steps:
        return (f"MXNet's stock FactorScheduler counts its decays from update 0, through its {s.warmup_steps}-update "
                "warm-up; torch's StepLR, Keras's ExponentialDecay and Optax's exponential_decay after a warm-up count "
                f"them from its end: continued by them, each decay comes {s.warmup_steps} updates later")
    return None


def rate_change_gap(mx_optimizer, optimizer):
    """What a stock SGD's or NAG's momentum (RATE_INSIDE: v = mu * v - lr * g), or a centered RMSProp's delta,
    continued with the rate outside the buffer (torch.optim's, Optax's SGD, the canonical buf = mu * buf + g;
    w -= lr * buf) differs by, or None: the two are one update only while the rate stays. At the first change after
    the updates made, from r to r', the momentum's share of the update is r' / r times MXNet's in the other, and the
    trajectories part there. Keras's SGD keeps the rate inside too, and Keras's and Optax's RMSprop: they compute
    MXNet's."""
    if not momentum_inside(mx_optimizer):
        return None
    done, changes = int(mx_optimizer.num_update), rate_changes(optimizer, int(mx_optimizer.num_update))
    if not changes:
        return None
    step, before, rate = changes[0]
    outside, same = (("torch.optim's RMSprop", "Keras's and Optax's RMSprop compute")
                     if type(mx_optimizer) is mx.optimizer.RMSProp else
                     ("torch.optim's and Optax's SGD", "Keras's SGD computes"))
    return (f"MXNet's stock {type(mx_optimizer).__name__} keeps the rate inside its momentum buffer ({outside} "
            "outside): the two are one update only while the rate stays, and this schedule changes "
            f"it {how_often(optimizer, changes)} after the {done} updates made, first at update {step + 1} "
            f"({before:.4g} to {rate:.4g}: their momentum term {rate / before:.4g} times MXNet's); {same} "
            "MXNet's")


def buffers(mx_state):
    """One parameter's state as the Updater keeps it (None, an NDArray or a tuple of them) as a tuple."""
    return () if mx_state is None else (mx_state,) if isinstance(mx_state, nd.NDArray) else tuple(mx_state)


def trainer_order(params, names):
    """The canonical name of each parameter in the order a gluon.Trainer numbers the model's ParameterDict `params`:
    by their sorted names (Trainer.__init__ sorts the keys), conv0_bias before conv0_weight. `names`: Gluon name ->
    canonical name of every trained parameter (the network file's canonical_names); the rest (a BatchNorm's running
    statistics, grad_req 'null': the Trainer numbers them but never updates them) get None. The updaters' states and
    update counts go by that number, so a states file fits any Trainer(net.collect_params()) of the same network."""
    return [names.get(key) for key in sorted(params.keys())]


def updater_state(updater, names):
    """The canonical state (common.optim.init_state's form) of an Updater, what Trainer.save_states writes: its
    states by the Trainer's index i, parameter names[i] (None: not trained, no state), and its optimizer's
    num_update, the updates made (the largest count of any parameter on any context: one a step); the exact copy
    where the optimizer carries one that is still the file's (exact_state)."""
    slot_names = slots(updater.optimizer)
    trained = [i for i, name in enumerate(names) if name is not None]
    if sorted(updater.states) != trained:
        raise ValueError(f"states for {len(updater.states)} parameters, not the network's {len(trained)}")
    state = {"step": int(updater.optimizer.num_update)}
    for i in trained:
        arrays = buffers(updater.states[i])
        if len(arrays) != len(slot_names):
            raise ValueError(f"{len(arrays)} buffers for parameter {i}; {type(updater.optimizer).__name__} keeps "
                             f"{len(slot_names)}")
        for slot, array in zip(slot_names, arrays):
            if slot is not None:   # None: a stock centered RMSProp's delta without momentum
                state[f"{slot}.{names[i]}"] = canonical_buffer(updater.optimizer, slot, array.asnumpy())
    return exact_state(updater.optimizer, state) or state


# A file this project writes pickles MXNet's stock class (get_optimizer's "stock" port), so that stock Gluon code
# loads it alone; but a stock buffer is the canonical one times the rate, rounded, and a stock class may have no slot
# for a canonical buffer, or no equivalent of the optimizer (AdamW, RMSProp with momentum but not centered, a cosine one
# update later). So the pickled optimizer carries the canonical state and optimizer too, as plain Python (any pickled
# object may carry attributes; stock MXNet never reads them): reading the file back is exact, and a resumed run goes on
# bit for bit.
EXACT = "canonical_state"           # {"step": int, "<slot>.<name>": numpy array}
EXACT_OPTIMIZER = "canonical_optimizer"   # common.optim.Optimizer's fields


def carry_exact(mx_optimizer, state, optimizer):
    """Attach the canonical `state` and `optimizer` to the optimizer a Trainer will pickle (EXACT)."""
    setattr(mx_optimizer, EXACT, {key: a if key == "step" else np.asarray(a) for key, a in state.items()})
    setattr(mx_optimizer, EXACT_OPTIMIZER, dataclasses.asdict(optimizer))


def is_current(mx_optimizer):
    """Whether the optimizer's exact copy is still its own: at its num_update, with its rate and decay (a file
    written before the copy carried the optimizer has the state alone). Stock code that loaded such a file, trained
    and saved it again pickles the stale copy too: then the file's states and classes are the truth."""
    exact, fields = getattr(mx_optimizer, EXACT, None), getattr(mx_optimizer, EXACT_OPTIMIZER, None)
    return bool(exact) and exact["step"] == mx_optimizer.num_update and (fields is None or (
        math.isclose(fields["lr"], mx_optimizer.lr) and math.isclose(fields["weight_decay"], mx_optimizer.wd)))


def exact_optimizer(mx_optimizer):
    """The canonical optimizer the pickled one carries where it is current (is_current), else None."""
    fields = getattr(mx_optimizer, EXACT_OPTIMIZER, None)
    return Optimizer(**fields) if fields is not None and is_current(mx_optimizer) else None


def exact_state(mx_optimizer, converted):
    """The canonical state the optimizer carries where it is current and still the file's: each buffer read from
    the states (`converted`, canonical) within float32's rounding of the copy's; else None."""
    if not is_current(mx_optimizer):
        return None
    exact = getattr(mx_optimizer, EXACT)
    if any(key not in exact or not np.allclose(exact[key], a, rtol=1e-5, atol=1e-7)
           for key, a in converted.items() if key != "step"):
        return None
    return dict(exact)


class Trainer(gluon.Trainer):
    """A gluon.Trainer that clips by global norm: its optimizer's clip_gradient clips each element. step() is
    Trainer.step's own two halves with the clipping between them, as its docstring advises for clipping: the
    gradients summed across contexts (and processes) by allreduce_grads, then clipped on every context, then the
    update. Clipping each context's gradients before the sum would clip a shard's norm, not the batch's."""

    def __init__(self, params, optimizer, names, clip_norm=None, **kwargs):
        super().__init__(params, optimizer, **kwargs)
        self.clip_norm = clip_norm
        self.names = trainer_order(params, names)   # the canonical name of each index (None: not trained)

    def step(self, batch_size, ignore_stale_grad=False):
        """The gradients are sums until update() rescales them by _scale / batch_size: the norm is clipped at
        clip * batch_size / _scale (_scale is 1, or 1 / the loss scale, which amp.scale_loss sets: the scaled sum's
        norm is clipped where the unscaled one's would be; an overflowing gradient stays inf or nan through it, and the
        loss scaler skips the update). clip_global_norm adds 1e-8 to the summed norm where torch adds 1e-6 to the mean's
        (1e-6 * batch_size to the sum): the coefficients differ by ~1e-6 / norm, relative."""
        self.allreduce_grads()
        if self.clip_norm is not None:
            trained = [p for p in self._params if p.grad_req != "null"]   # running statistics have no gradient
            for grads in zip(*(p.list_grad() for p in trained)):   # one context's gradients
                gluon.utils.clip_global_norm(list(grads), self.clip_norm * batch_size / self._scale,
                                             check_isfinite=False)
        self.update(batch_size, ignore_stale_grad)


def get_trainer(params, optimizer, names, port="canonical", state=None, **kwargs):
    """The gluon.Trainer of a stateful optimizer: its own schedule sets the rate, not set_learning_rate. `names`: the
    network's Gluon name -> canonical name of each trained parameter (lenet.canonical_names, resnet.canonical_names).
    kwargs: the kvstore's, as for any gluon.Trainer. Every context's updater (one each, sharing the optimizer) gets
    its state now rather than at its first update, as Trainer.load_states leaves them: zeros, or with a canonical
    `state` (a checkpoint's) its buffers, the optimizer's count of updates starting at its step; a parameter that is
    not trained (grad_req 'null') gets none."""
    trainer = Trainer(params, get_optimizer(optimizer, port, 0 if state is None else state["step"]), names,
                      optimizer.clip_norm, **kwargs)
    for context, updater in enumerate(trainer._updaters):
        for i, (name, param) in enumerate(zip(trainer.names, trainer._params)):
            if name is None:
                continue
            weight = param.list_data()[context]
            updater.states[i] = (updater.optimizer.create_state_multi_precision(i, weight) if state is None
                                 else mx_state(state, optimizer, name, weight.context, updater.optimizer))
            updater.states_synced[i] = True
    return trainer


def canonical_state(trainer):
    """The canonical state of a Trainer: its first context's updater's (each context has one, with update_on_kvstore
    False; all hold the same buffers). _updaters is what save_states itself reads."""
    return updater_state(trainer._updaters[0], trainer.names)


def mx_state(state, optimizer, name, context, mx_optimizer=None):
    """Parameter `name`'s buffers in the canonical `state` as MXNet's optimizers keep them (create_state's form):
    None, the momentum buffer, AdaGrad's history, Adam's (mean, var) or RMSProp's tuple; copies on `context`, as they
    are (harness/training/checkpoints.py checks a checkpoint's shapes), in `mx_optimizer`'s convention (stock_buffer),
    its slots (a stock centered RMSProp without momentum gets a delta of zeros, which its first update overwrites; a
    stock plain one, which has no momentum, no momentum buffer)."""
    own = optimizer.slots if mx_optimizer is None else slots(mx_optimizer)
    like = next((state[f"{slot}.{name}"] for slot in own if slot), None)
    arrays = tuple(nd.array(np.zeros_like(like) if slot is None else
                            stock_buffer(mx_optimizer, slot, state[f"{slot}.{name}"]), ctx=context) for slot in own)
    if isinstance(mx_optimizer, mx.optimizer.RMSProp):
        return arrays
    return arrays if len(arrays) > 1 else arrays[0] if arrays else None
