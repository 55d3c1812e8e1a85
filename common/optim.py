"""The optimizer, written once: the canonical update every framework and mode must compute, step for step.

PyTorch's conventions, the ones docs/migration.md's conventions table measures the others against:
- the gradient is the global batch's mean (the all-reduced sum / global batch), then
- clipped by its global norm over all parameters (torch.nn.utils.clip_grad_norm_: times clip / (norm + 1e-6)
  when that is below 1), on every replica after the all-reduce, never on a replica's own shard, then
- weight decay: L2 added to the gradient (g + wd * w) for sgd, momentum, nesterov and adam; decoupled for adamw
  (w *= 1 - lr * wd, before the update), on every parameter, biases too (torch.optim's default), then
- the update at this step's rate, the learning rate outside the momentum buffer:
    sgd       w -= lr * g
    momentum  v = mu * v + g (v = g on the first step);  w -= lr * v
    nesterov  v as momentum;                            w -= lr * (g + mu * v)
    adam(w)   m = b1 * m + (1 - b1) * g;  s = b2 * s + (1 - b2) * g**2;  t = steps so far + 1
              w -= lr * (m / (1 - b1**t)) / (sqrt(s / (1 - b2**t)) + eps)    eps outside the square root
    rmsprop   s = a * s + (1 - a) * g**2;  d = sqrt(s) + eps, eps outside the square root (centered: c = a * c +
              (1 - a) * g, d = sqrt(s - c**2) + eps);  w -= lr * g / d, or with momentum mu > 0: v = mu * v + g / d
              (from v = 0), w -= lr * v, the rate outside the buffer (torch.optim.RMSprop)
    adagrad   s = s + g**2 (from 0);  w -= lr * g / (sqrt(s) + eps)    (torch.optim.Adagrad)
- the rate per step (0-based: the first update is step 0): a linear warm-up over `warmup_steps`, lr * (step + 1) /
  warmup_steps (torch's LinearLR from 1 / warmup_steps), then the schedule over the remaining D = total - warmup,
  at its k-th step (k = step - warmup):
    constant  lr
    step      lr times decay_factor at each milestone passed (torch's MultiStepLR): by default 0.1 after D // 2
              steps and 0.01 after 3 * D // 4; `decay_at` gives them in steps from the run's start (Gluon's
              MultiFactorScheduler)
    factor    lr * decay_factor ** (k // decay_every) (torch's StepLR; Gluon's FactorScheduler; by default a
              decay every D // 4 steps)
    poly      lr * (1 - k / D) ** power (torch's PolynomialLR; Gluon's PolyScheduler, one update late)
    cosine    final_lr + (lr - final_lr) * (1 + cos(pi * k / D)) / 2 (torch's CosineAnnealingLR, eta_min final_lr)

The recipe's plain SGD (constant rate, no decay, no clipping) is `is_recipe`: the frameworks keep running the
recipe's own `sgd` for it, so the default table does not change by a bit. Every other optimizer, for every network,
runs this update with its state (the built-in rows through the frameworks' own optimizers and schedulers).
"""
import dataclasses
import math

import numpy as np

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "rmsprop", "adagrad")
SCHEDULES = ("constant", "step", "cosine", "factor", "poly")
LR_SCALINGS = ("none", "linear")
# The usual starting rate of each (--lr's default): the recipe's 0.2; momentum 0.9 multiplies the step by ~10.
DEFAULT_LR = {"sgd": 0.2, "momentum": 0.02, "nesterov": 0.02, "adam": 1e-3, "adamw": 1e-3, "rmsprop": 1e-3,
              "adagrad": 1e-2}
REFERENCE_BATCH = 256     # --lr-scaling linear: lr * global batch / this (Goyal et al. 2017)
CLIP_EPS = 1e-6           # torch.nn.utils.clip_grad_norm_'s
STEP_FACTOR = 0.1         # the step and factor schedules' decay, at each milestone (decay_factor's default)


def default_momentum(name):
    """The momentum an optimizer gets when none is given: 0.9 (momentum's and nesterov's usual value), but none (0)
    for rmsprop, as torch.optim.RMSprop's, Keras's and Optax's default."""
    return 0.0 if name == "rmsprop" else 0.9


def scaled_lr(lr, batch_size, scaling="none", reference=REFERENCE_BATCH):
    """The linear scaling rule: the base rate grows with the global batch (more devices at a fixed per-device
    batch), usually with a warm-up."""
    if scaling not in LR_SCALINGS:
        raise ValueError(f"unknown lr scaling {scaling!r}; choose from {LR_SCALINGS}")
    return lr * batch_size / reference if scaling == "linear" else lr


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """Everything the update needs, the run's length included (the schedule ends with it). Frozen and hashable:
    compiled steps may take it as a static argument."""
    name: str = "sgd"
    lr: float = 0.2                # the base rate (after --lr-scaling)
    momentum: float | None = None  # momentum, nesterov and rmsprop (0: none); None: default_momentum's
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1           # the run's steps: the schedule's length
    clip_norm: float | None = None
    betas: tuple = (0.9, 0.999)    # adam, adamw
    eps: float = 1e-8              # adam, adamw, rmsprop, adagrad
    alpha: float = 0.99            # rmsprop: the squares' running average keeps this much (torch's alpha; Gluon's
                                   # gamma1, Keras's rho, Optax's decay)
    centered: bool = False         # rmsprop: divided by the gradients' running variance, not their second moment
    decay_at: tuple = ()           # step: its milestones, in steps from the run's start (none: D // 2, 3 * D // 4)
    decay_every: int = 0           # factor: a decay every this many steps after the warm-up (0: every D // 4)
    decay_factor: float = STEP_FACTOR   # step, factor: the rate's multiplier at each decay
    power: float = 2.0             # poly
    final_lr: float = 0.0          # cosine: the rate it ends at

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose from {OPTIMIZERS}")
        if self.momentum is None:
            object.__setattr__(self, "momentum", default_momentum(self.name))
        if not 0 <= self.momentum < 1 or not 0 < self.alpha < 1:
            raise ValueError(f"a momentum in [0, 1) and an rmsprop alpha in (0, 1), not {self.momentum:g} and "
                             f"{self.alpha:g}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.schedule!r}; choose from {SCHEDULES}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"{self.warmup_steps} warm-up steps for a run of {self.total_steps}")
        if list(self.decay_at) != sorted(set(self.decay_at)) or any(m < self.warmup_steps for m in self.decay_at):
            raise ValueError(f"milestones {tuple(self.decay_at)}: increasing, none inside the {self.warmup_steps}-step "
                             "warm-up")
        if (self.decay_every < 0 or not 0 < self.decay_factor <= 1 or self.power <= 0
                or not 0 <= self.final_lr <= self.lr):
            raise ValueError("a decay every >= 0 steps by a factor in (0, 1], a power > 0, a final rate in [0, lr]")

    @property
    def is_recipe(self):
        """The recipe's plain SGD: no state, one rate."""
        return (self.name == "sgd" and self.schedule == "constant" and not self.warmup_steps
                and not self.weight_decay and self.clip_norm is None)

    @property
    def decoupled(self):
        """Weight decay applied to the weights (adamw), not added to the gradient."""
        return self.name == "adamw"

    @property
    def slots(self):
        """The state each parameter carries, by torch.optim's names."""
        if self.name == "rmsprop":
            return ("square_avg", *(("grad_avg",) if self.centered else ()),
                    *(("momentum_buffer",) if self.momentum else ()))
        return {"sgd": (), "momentum": ("momentum_buffer",), "nesterov": ("momentum_buffer",),
                "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",)}[self.name]

    @property
    def decay_steps(self):
        return self.total_steps - self.warmup_steps

    @property
    def milestones(self):
        """The step schedule's decays, in steps from the start of the run: decay_at, or two by default."""
        return tuple(self.decay_at) or (self.warmup_steps + self.decay_steps // 2,
                                        self.warmup_steps + 3 * self.decay_steps // 4)

    @property
    def period(self):
        """The factor schedule's steps between decays."""
        return self.decay_every or max(self.decay_steps // 4, 1)

    def learning_rate(self, step):
        """The rate of the update numbered `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        k = step - self.warmup_steps
        if self.schedule == "cosine":
            return self.final_lr + (self.lr - self.final_lr) * (1 + math.cos(math.pi * k / self.decay_steps)) / 2
        if self.schedule == "poly":
            return self.lr * (1 - min(k, self.decay_steps) / max(self.decay_steps, 1)) ** self.power
        if self.schedule == "factor":
            return self.lr * self.decay_factor ** (k // self.period)
        if self.schedule == "step":
            return self.lr * self.decay_factor ** sum(step >= m for m in self.milestones)
        return self.lr

    def clip_coefficient(self, grads):
        """What the gradients are multiplied by: clip / (global norm + 1e-6), at most 1 (1 without clipping)."""
        if self.clip_norm is None:
            return 1.0
        norm = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))
        return min(1.0, self.clip_norm / (norm + CLIP_EPS))


def of_state(slots):
    """The optimizer a state's buffers are from (their slot names; None: no optimizer keeps them), told by them alone:
    momentum's serves nesterov too, adam's adamw, and rmsprop's say whether it was centered and had momentum (the
    hyperparameters are the defaults: a file that names its optimizer says them)."""
    kinds = [Optimizer(name) for name in OPTIMIZERS] + [Optimizer("rmsprop", momentum=momentum, centered=centered)
                                                         for centered, momentum in ((True, 0.0), (False, 0.9), (True, 0.9))]
    return next((o for o in kinds if sorted(o.slots) == sorted(slots)), None)


def init_state(optimizer, weights):
    """The state before the first step: the step count, and a zero array per slot and parameter."""
    return {"step": 0, **{f"{slot}.{name}": np.zeros_like(w) for slot in optimizer.slots for name, w in weights.items()}}


def how_often(optimizer, changes):
    """rate_changes' changes in words: a factor schedule changes the rate for good, at every decay."""
    return f"every {optimizer.period} updates" if optimizer.schedule == "factor" else f"{len(changes)} time(s)"


def rate_changes(optimizer, done):
    """The steps after the `done` updates made (0-based, as learning_rate's) whose rate differs from the update's
    before, with both rates: [(step, before, rate)]. A momentum buffer that holds the rate (MXNet's stock SGD, Keras's:
    v = mu * v - lr * g) and one that does not (torch's, the spec's) give one update only until the first of them."""
    first = max(done - 1, 0)
    end = optimizer.total_steps   # the rate stays after it, but a factor schedule's, which decays on
    if optimizer.schedule == "factor":
        end = max(end, done + optimizer.period + 1)
    rates = [optimizer.learning_rate(t) for t in range(first, end)]
    return [(first + k, rates[k - 1], rates[k]) for k in range(1, len(rates))
            if not math.isclose(rates[k], rates[k - 1], rel_tol=1e-12)]


def epsilon_hat_gap(eps, beta2, step, moments, source="spec"):
    """How far Adam's next update (the step count after `step`, before its gradient) moves between the spec's epsilon,
    added to the bias-corrected sqrt(v) (PyTorch's, Optax's), and the paper's "epsilon hat", added to the uncorrected
    sqrt(v) (MXNet's and Keras's stock Adam): the spec's is m / (sqrt(v) + eps * sqrt(1 - beta2^t)), the other's
    m / (sqrt(v) + eps), both times the same corrected rate. `moments`: (m, v) pairs of the whole model. Returns
    |difference| / |the `source`'s update| ("spec" or "hat"), over the whole model (moments of 0 move neither)."""
    shrink = math.sqrt(1 - beta2 ** (step + 1))
    difference = norm = 0.0
    for m, v in moments:
        m, root = np.asarray(m, np.float64), np.sqrt(np.asarray(v, np.float64))
        spec, hat = m / (root + eps * shrink), m / (root + eps)
        difference += np.sum((spec - hat) ** 2)
        norm += np.sum((spec if source == "spec" else hat) ** 2)
    return math.sqrt(difference / norm) if norm else 0.0


def root_epsilon_gap(eps, pairs):
    """How far an update moves between epsilon inside the square root, g / sqrt(d + eps) (MXNet's RMSProp and AdaGrad,
    Keras's, Optax's), and outside it, g / (sqrt(d) + eps) (torch.optim's, the spec's), for a gradient g the size of
    each element's running RMS. `pairs`: (d, g^2) of each parameter, d what the root is taken of, as saved. Returns
    |difference| / |MXNet's update| over the whole model (elements without a gradient yet move neither)."""
    difference = norm = 0.0
    for d, square in pairs:
        d = np.maximum(np.asarray(d, np.float64), 0.0)   # a centered variance can round below 0
        g = np.sqrt(np.maximum(np.asarray(square, np.float64), 0.0))
        inside, outside = g / np.sqrt(d + eps), g / (np.sqrt(d) + eps)
        difference += np.sum((outside - inside) ** 2)
        norm += np.sum(inside ** 2)
    return math.sqrt(difference / norm) if norm and eps else 0.0


def step(optimizer, weights, grads, state):
    """One canonical update of canonical numpy weights by the global batch's mean gradient; returns the new weights
    and state (float32 like the frameworks; the step count decides the rate and Adam's bias corrections)."""
    o, t = optimizer, state["step"]
    lr = np.float32(o.learning_rate(t))
    coef = np.float32(o.clip_coefficient(grads))
    new_weights, new_state = {}, {"step": t + 1}
    for name, w in weights.items():
        g = grads[name] * coef
        if o.weight_decay and not o.decoupled:
            g = g + np.float32(o.weight_decay) * w
        if o.name == "sgd":
            w = w - lr * g
        elif o.name in ("momentum", "nesterov"):
            v = g if t == 0 else np.float32(o.momentum) * state[f"momentum_buffer.{name}"] + g
            w = w - lr * (g + np.float32(o.momentum) * v if o.name == "nesterov" else v)
            new_state[f"momentum_buffer.{name}"] = v
        elif o.name == "rmsprop":
            a = np.float32(o.alpha)
            s = a * state[f"square_avg.{name}"] + np.float32(1 - o.alpha) * g * g
            new_state[f"square_avg.{name}"] = s
            if o.centered:
                c = a * state[f"grad_avg.{name}"] + np.float32(1 - o.alpha) * g
                s, new_state[f"grad_avg.{name}"] = s - c * c, c
            scaled = g / (np.sqrt(s) + np.float32(o.eps))
            if o.momentum:
                scaled = np.float32(o.momentum) * state[f"momentum_buffer.{name}"] + scaled
                new_state[f"momentum_buffer.{name}"] = scaled
            w = w - lr * scaled
        elif o.name == "adagrad":
            s = state[f"sum.{name}"] + g * g
            w = w - lr * g / (np.sqrt(s) + np.float32(o.eps))
            new_state[f"sum.{name}"] = s
        else:
            if o.decoupled:
                w = w * (1 - lr * np.float32(o.weight_decay))
            b1, b2 = o.betas
            m = np.float32(b1) * state[f"exp_avg.{name}"] + np.float32(1 - b1) * g
            s = np.float32(b2) * state[f"exp_avg_sq.{name}"] + np.float32(1 - b2) * g * g
            denom = np.sqrt(s / np.float32(1 - b2 ** (t + 1))) + np.float32(o.eps)
            w = w - lr / np.float32(1 - b1 ** (t + 1)) * m / denom
            new_state[f"exp_avg.{name}"], new_state[f"exp_avg_sq.{name}"] = m, s
        new_weights[name] = w.astype(np.float32)
    return new_weights, new_state
