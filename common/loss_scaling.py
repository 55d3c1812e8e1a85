"""Dynamic loss scaling, written once: what --precision fp16 adds to the step, and what every framework's scaler does.

fp16 keeps 11 significant bits but only 5 of exponent: it holds nothing above 65504 and nothing below 6e-8, so
the small gradients of a backward in fp16 would flush to zero. The step therefore differentiates the loss times a
scale S (a power of two, so scaling is exact), all-reduces the scaled gradients in fp32, multiplies them by 1/S and
checks them:
- every gradient finite: the update runs on the unscaled gradients; after `growth_interval` such steps in a row the
  scale is multiplied by `growth_factor` (the count starts again);
- any gradient inf or nan (an overflow in fp16): the step is skipped (no weight, momentum or step count changes,
  so a learning-rate schedule, whose position is the step count, stays where it was, as every framework's engine
  keeps it), the scale is multiplied by `backoff_factor` and the count starts again.
Every replica sees the same summed gradients, so every replica skips the same steps. bf16 has fp32's exponent and
needs no scale.

The frameworks' scalers are this rule (torch.amp.GradScaler, Keras's LossScaleOptimizer, MXNet's
contrib.amp.LossScaler; JAX has none, the step writes it). They differ in their defaults, which the run overrides
with its own LossScaling, and in what FRAMEWORK_DEFAULTS notes.
"""
import collections
import math

import numpy as np

from .interface import RosettaError

# A run sets the first two (--loss-scale, --loss-scale-interval); `maximum` and `late` are a framework's conventions
# (MXNet's scaler caps the scale, and runs a step at the scale decided two checks back: Scaler says how).
LossScaling = collections.namedtuple("LossScaling", "initial growth_interval growth_factor backoff_factor maximum late",
                                     defaults=(2.0 ** 16, 2000, 2.0, 0.5, math.inf, False))

# Each framework's own scaler as it comes, for the docs and for the test that the run passes its own settings.
FRAMEWORK_DEFAULTS = {
    "pytorch": ("torch.amp.GradScaler", LossScaling(2.0 ** 16, 2000), "no ceiling on the scale"),
    "tensorflow": ("keras.optimizers.LossScaleOptimizer", LossScaling(2.0 ** 15, 2000), "no ceiling on the scale"),
    "mxnet": ("mxnet.contrib.amp.LossScaler", LossScaling(2.0 ** 16, 2000, maximum=2.0 ** 24, late=True),
              "the scale never grows past 2**24; a change of scale reaches the forward one step late"),
    "jax": ("none (written in the step)", LossScaling(2.0 ** 16, 2000), "this module's rule"),
}


# What a scaler holds between steps, and what a checkpoint keeps of it: the scale the next step runs at, the one a
# `late` scaler has decided for the step after (else the same), and the finite steps counted towards the next growth.
# Every framework's scaler holds these three (GradScaler's scale and _growth_tracker; Keras's dynamic_scale and
# step_counter; MXNet's _loss_scale, _next_loss_scale and _unskipped), so a run resumes where it stopped.
ScalerState = collections.namedtuple("ScalerState", "scale decided good_steps")


class Scaler:
    """The scale of one run and its count of finite steps: the state that --precision fp16 adds to the step and to
    its checkpoint (`state`: a ScalerState to start from; None: the first scale). update() is the rule, after each
    step's gradients are checked."""

    def __init__(self, config=LossScaling(), state=None):
        self.config = LossScaling(*config)
        self.scale = self.decided = float(config.initial)   # decided: a `late` scaler's next-but-one scale
        self.good_steps = 0
        self.skipped = 0   # the steps this scaler skipped: the schedule counts only the updates that ran
        if state is not None:
            self.restore(state)

    def state(self):
        return ScalerState(self.scale, self.decided, self.good_steps)

    def restore(self, state):
        """Carry on from a checkpoint's ScalerState."""
        self.scale, self.decided, self.good_steps = float(state.scale), float(state.decided), int(state.good_steps)

    def update(self, finite):
        """The step's gradients were all finite (True) or not: the next scale. Returns whether the update ran.
        A `late` scaler (MXNet's) starts from the scale it decided at the previous check, not the one this step ran
        at, and the next step still runs at that one: after an overflow the step after it runs at the same scale."""
        base = self.decided if self.config.late else self.scale
        if not finite:
            base *= self.config.backoff_factor
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.config.growth_interval:
                base = min(base * self.config.growth_factor, self.config.maximum)
                self.good_steps = 0
        if self.config.late:
            self.scale, self.decided = self.decided, base
        else:
            self.scale = self.decided = base
        return finite


def check(initial, growth_interval):
    """A run's --loss-scale and --loss-scale-interval, or one line saying what is wrong."""
    if not (initial > 0 and math.log2(initial).is_integer()):
        raise RosettaError(f"--loss-scale {initial:g}: the loss scale must be a power of two (scaling is then exact)")
    if growth_interval < 1:
        raise RosettaError(f"--loss-scale-interval {growth_interval}: must be at least 1")


def unscaled(grads, scale):
    """The gradients of the scaled loss multiplied by 1/scale in fp32 (exact: scale is a power of two), and whether
    every one of them is finite."""
    inverse = np.float32(1.0 / scale)
    out = {name: (np.asarray(g, np.float32) * inverse).astype(np.float32) for name, g in grads.items()}
    return out, all(np.all(np.isfinite(g)) for g in out.values())


def scales(config, finite_steps):
    """The scale each step ran at, for a sequence of steps whose gradients were finite or not: the rule's trace."""
    scaler, out = Scaler(config), []
    for finite in finite_steps:
        out.append(scaler.scale)
        scaler.update(finite)
    return out
