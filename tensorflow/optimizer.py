"""The optimizer in TensorFlow, two ways: common/optim.py's canonical update written by hand for the scratch step
(apply: a replica's state is tf.Variables beside its weights, assigned in place), and Keras's own optimizers and
schedules for the built-in and idiomatic modes (get_trainer), subclassed only where Keras computes another
update; a Keras trainer's state goes in and out in the canonical form (load_state, canonical_state). Either way the
state is the network's: one buffer per slot and parameter, named after the parameter (the LeNet's or the ResNet's)."""
import numpy as np
import tensorflow as tf

from common.interface import RosettaError
from common.layouts import to_canonical, to_channels_last
from common.loss_scaling import LossScaling
from common.optim import CLIP_EPS

keras = tf.keras


def init_state(replica, optimizer):
    """The step count and a zero buffer per slot and parameter, each a tf.Variable on its parameter's device: the
    compiled step assigns them, as it assigns the weights. Named after the parameter's variable; a gathered
    parameter (data_parallel.gather_params) is a tensor, which eagerly has no name: the slot's alone then."""
    with tf.device(replica[0].device):
        state = {"optimizer": optimizer, "step": tf.Variable(0, dtype=tf.int64, name="step")}
    for slot in optimizer.slots:
        state[slot] = []
        for p in replica:
            with tf.device(p.device):
                name = f"{slot}.{p.name.split(':')[0]}" if isinstance(p, tf.Variable) else slot
                state[slot].append(tf.Variable(tf.zeros_like(p), name=name))
    return state


def state_to_numpy(state, model):
    """The buffers have their parameters' shapes and layout: the model's to_numpy converts them as it converts
    weights, and names them after its parameters."""
    arrays = {"step": int(state["step"].numpy())}
    for slot in state["optimizer"].slots:
        arrays.update({f"{slot}.{name}": a for name, a in model.to_numpy(state[slot]).items()})
    return arrays


def state_from_numpy(arrays, replica, optimizer, model):
    """Each buffer made as the model's get_params makes the weight of its name: channels-last, on the replica's
    device."""
    device = replica[0].device
    with tf.device(device):
        state = {"optimizer": optimizer, "step": tf.Variable(arrays["step"], dtype=tf.int64, name="step")}
    for slot in optimizer.slots:
        state[slot] = model.get_params({name: arrays[f"{slot}.{name}"] for name in model.param_names}, device)
    return state


def bias_correction(beta, t):
    """Adam's 1 - beta**t at its t-th step, in float64 as common/optim.py and torch.optim.Adam compute it: in float32
    (as Keras's Adam computes it) 1 - 0.999 is 0.00099998713, 1.3e-5 off, enough to move Adam's weights by ~1e-3
    in this repo's parity runs (tests/test_optimizers.py)."""
    return tf.cast(1 - beta ** tf.cast(t, tf.float64), tf.float32)


def state_bytes(state):
    """The bytes of every slot's buffers, a whole state's or a sharded one's slices (what ZeRO's stage 1 saves); the
    step count is not a buffer."""
    return sum(b.shape.num_elements() * b.dtype.size for slot in state["optimizer"].slots for b in state[slot])


def apply(params, grads, state, lr, batch_size, norm=None):
    """common/optim.py's update of one replica by its all-reduced gradient SUMS (the same on every replica), at this
    step's rate lr: the mean, clipped by its global norm, L2 weight decay (decoupled for adamw), the update; then
    the step count advances. Every tf.Variable is assigned on the replica's device.
    Element-wise but for clipping, so it updates a sharded state's flat slices as they are: `norm` (a float64 tensor)
    is then the mean gradient's global norm over every device's slices, which this device's own cannot give (None:
    computed from `grads`).
    The momentum buffer is updated in two assigns: with decay and clipping, mu * v + (g * c + wd * w) is a chain of
    additions, which Grappler's arithmetic optimizer (AddOpsRewrite) turns into one AddN whose inputs it orders by
    their nodes' names, different on each device: the replicas summed in different orders and drifted apart by
    1e-8 a step. Two assigns add in the spec's order, (mu * v) + g, on every device."""
    o, step = state["optimizer"], state["step"]
    with tf.device(params[0].device):
        grads = [g / batch_size for g in grads]
        if o.clip_norm is not None:   # torch's factor; in float64, as the spec's, so that it is the same to the bit
            if norm is None:
                norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float64))) for g in grads]))
            grads = [g * tf.cast(tf.minimum(o.clip_norm / (norm + CLIP_EPS), 1.0), tf.float32) for g in grads]
        t = step + 1   # Adam's t-th step
        for i, (w, g) in enumerate(zip(params, grads)):
            if o.weight_decay and not o.decoupled:
                g = g + o.weight_decay * w
            if o.name == "sgd":
                w.assign_sub(lr * g)
            elif o.name in ("momentum", "nesterov"):
                v = state["momentum_buffer"][i]
                v.assign(o.momentum * v)   # the buffer starts at zero: v = g on the first step
                v.assign_add(g)   # not v.assign(mu * v + g): see below
                w.assign_sub(lr * (g + o.momentum * v if o.name == "nesterov" else v))
            elif o.name == "rmsprop":
                s = state["square_avg"][i]
                s.assign(o.alpha * s + (1 - o.alpha) * g * g)
                second = s
                if o.centered:
                    c = state["grad_avg"][i]
                    c.assign(o.alpha * c + (1 - o.alpha) * g)
                    second = s - c * c
                scaled = g / (tf.sqrt(second) + o.eps)   # eps outside the square root
                if o.momentum:   # the rate outside the buffer, which starts at zero
                    v = state["momentum_buffer"][i]
                    v.assign(o.momentum * v + scaled)
                    scaled = v
                w.assign_sub(lr * scaled)
            elif o.name == "adagrad":
                s = state["sum"][i]
                s.assign_add(g * g)   # from zero
                w.assign_sub(lr * g / (tf.sqrt(s) + o.eps))
            else:
                if o.decoupled:
                    w.assign(w * (1 - lr * o.weight_decay))
                (b1, b2), m, s = o.betas, state["exp_avg"][i], state["exp_avg_sq"][i]
                m.assign(b1 * m + (1 - b1) * g)
                s.assign(b2 * s + (1 - b2) * g * g)
                denom = tf.sqrt(s / bias_correction(b2, t)) + o.eps
                w.assign_sub(lr / bias_correction(b1, t) * m / denom)
        step.assign_add(1)


# ---- Keras's own optimizers, for the built-in and idiomatic modes ----

class Canonical:
    """What the canonical Keras optimizers here share. L2 weight decay added to the gradient (`l2`): Keras's
    `weight_decay` is decoupled (w -= lr * wd * w) on every optimizer. And the gradients taken as they come: Keras 3
    sums them across replicas inside apply, AFTER clipping them, so global_clipnorm clips each replica's own shard
    (base_optimizer.py's _clip_gradients, then TFOptimizer._all_reduce_sum_gradients, in keras/src/backend/tensorflow/
    optimizer.py), with no public switch to skip that sum (Keras 2's skip_gradients_aggregation is gone:
    keras-team/keras#19308). builtin.py's step sums them itself, before apply; this override keeps Keras from summing
    them again."""

    def __init__(self, l2=0.0, **kwargs):
        super().__init__(**kwargs)
        self.l2 = l2

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return grads_and_vars


class SGD(Canonical, keras.optimizers.SGD):
    """PyTorch's momentum, the rate outside the buffer: v = mu * v + g; w -= lr * v (nesterov: w -= lr * (g + mu * v)).
    Keras's update_step keeps it inside (v = mu * v - lr * g; w += v): the same while the rate is constant, not
    under a schedule or a warm-up."""

    def update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        g = gradient + self.l2 * variable
        if self.momentum:
            v = self.momentums[self._get_variable_index(variable)]
            self.assign(v, self.momentum * v + g)
            g = g + self.momentum * v if self.nesterov else v
        self.assign_sub(variable, lr * g)


class Adam(Canonical, keras.optimizers.Adam):
    """PyTorch's epsilon, added to the bias-corrected sqrt(s): w -= lr * m_hat / (sqrt(s_hat) + eps). Keras's
    update_step folds both corrections into the rate and adds epsilon to the uncorrected sqrt(s) (the paper's
    "epsilon hat"), an epsilon 1 / sqrt(1 - b2**t) times larger: ~30x on the first step."""

    def update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        g = gradient + self.l2 * variable
        t = self.iterations + 1
        i = self._get_variable_index(variable)
        m, s = self._momentums[i], self._velocities[i]
        self.assign(m, self.beta_1 * m + (1 - self.beta_1) * g)
        self.assign(s, self.beta_2 * s + (1 - self.beta_2) * g * g)
        denom = tf.sqrt(s / bias_correction(self.beta_2, t)) + self.epsilon
        self.assign_sub(variable, lr / bias_correction(self.beta_1, t) * m / denom)


class AdamW(Adam, keras.optimizers.AdamW):
    """Keras's decoupled weight_decay is the spec's (w -= lr * wd * w, before the update): only Adam's epsilon
    differs."""


class RMSprop(Canonical, keras.optimizers.RMSprop):
    """PyTorch's RMSprop: epsilon outside the square root, d = sqrt(s) + eps (centered: sqrt(s - c**2) + eps), and the
    rate outside the momentum buffer, v = mu * v + g / d; w -= lr * v. Keras's update_step adds epsilon inside it
    (sqrt(s + eps): a larger denominator wherever s is not far above eps) and keeps the rate inside its momentum
    (v = mu * v + lr * g / d; w -= v): the same only while the rate is constant."""

    def update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        g = gradient + self.l2 * variable
        i = self._get_variable_index(variable)
        s = self._velocities[i]
        self.assign(s, self.rho * s + (1 - self.rho) * g * g)
        second = s
        if self.centered:
            c = self._average_gradients[i]
            self.assign(c, self.rho * c + (1 - self.rho) * g)
            second = s - c * c
        scaled = g / (tf.sqrt(second) + self.epsilon)
        if self.momentum > 0:
            v = self._momentums[i]
            self.assign(v, self.momentum * v + scaled)
            scaled = v
        self.assign_sub(variable, lr * scaled)


class Adagrad(Canonical, keras.optimizers.Adagrad):
    """PyTorch's epsilon, outside the square root: w -= lr * g / (sqrt(sum) + eps). Keras's update_step adds it inside
    (sqrt(sum + eps)). PyTorch's sum from 0 is only Keras's argument (initial_accumulator_value=0; its default is
    0.1): canonical passes it."""

    def update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        g = gradient + self.l2 * variable
        s = self._accumulators[self._get_variable_index(variable)]
        self.assign_add(s, g * g)
        self.assign_sub(variable, lr * g / (tf.sqrt(s) + self.epsilon))


class WarmUp(keras.optimizers.schedules.LearningRateSchedule):
    """common/optim.py's linear warm-up, lr * (step + 1) / warmup_steps (PyTorch's LinearLR from 1 / warmup_steps),
    then `after` (a stock schedule, or the constant rate) counted from the warm-up's end. Keras's own warm-up,
    CosineDecay(warmup_target=, warmup_steps=), rises from initial_learning_rate at step 0 and reaches the target
    only at its end (the spec's is at lr on the warm-up's last step and on the cosine's first), for cosine only."""

    def __init__(self, lr, warmup_steps, after):
        self.lr, self.warmup_steps, self.after = lr, warmup_steps, after

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        after = self.after(step - self.warmup_steps) if callable(self.after) else self.after
        return tf.where(step < self.warmup_steps, self.lr * (step + 1) / self.warmup_steps, after)


def get_schedule(o):
    """The spec's rate as a Keras schedule: CosineDecay (alpha final_lr / lr: torch's CosineAnnealingLR to eta_min),
    PiecewiseConstantDecay (which moves on AFTER a boundary step: the boundaries are the milestones - 1),
    ExponentialDecay with staircase (torch's StepLR) or PolynomialDecay to 0 over the steps after the warm-up, behind
    WarmUp. The optimizer's own step count (its `iterations`) drives it."""
    after, schedules = o.lr, keras.optimizers.schedules
    if o.schedule == "cosine":   # Keras refuses 0 steps
        after = schedules.CosineDecay(o.lr, max(o.decay_steps, 1), alpha=o.final_lr / o.lr)
    elif o.schedule == "step":
        after = schedules.PiecewiseConstantDecay([m - o.warmup_steps - 1 for m in o.milestones],
                                                 [o.lr * o.decay_factor ** i for i in range(len(o.milestones) + 1)])
    elif o.schedule == "factor":
        after = schedules.ExponentialDecay(o.lr, o.period, o.decay_factor, staircase=True)
    elif o.schedule == "poly":
        after = schedules.PolynomialDecay(o.lr, max(o.decay_steps, 1), 0.0, power=o.power)
    return WarmUp(o.lr, o.warmup_steps, after) if o.warmup_steps else after


def canonical(o):
    """The spec's update through Keras's optimizer API: the subclasses above, on the spec's schedule."""
    options = {"learning_rate": get_schedule(o), "global_clipnorm": o.clip_norm}
    if o.name == "adamw":
        return AdamW(weight_decay=o.weight_decay, beta_1=o.betas[0], beta_2=o.betas[1], epsilon=o.eps, **options)
    if o.name == "adam":
        return Adam(l2=o.weight_decay, beta_1=o.betas[0], beta_2=o.betas[1], epsilon=o.eps, **options)
    if o.name == "rmsprop":
        return RMSprop(l2=o.weight_decay, rho=o.alpha, momentum=o.momentum, epsilon=o.eps, centered=o.centered,
                       **options)
    if o.name == "adagrad":
        return Adagrad(l2=o.weight_decay, initial_accumulator_value=0.0, epsilon=o.eps, **options)
    return SGD(l2=o.weight_decay, momentum=0.0 if o.name == "sgd" else o.momentum, nesterov=o.name == "nesterov",
               **options)


def stock(o):
    """What a straightforward port gets: the run's hyperparameters given to Keras's stock classes (the rate,
    momentum, Adam's betas, rmsprop's alpha as rho and centered, weight decay, the clipping norm), Keras's defaults
    and meanings for the rest, as for an epsilon (no option of a run): the rate inside the momentum buffer (SGD's,
    RMSprop's), weight_decay decoupled on every optimizer, epsilon 1e-7 on Adam's uncorrected moments and inside
    RMSprop's and Adagrad's square root, Adagrad's sum from 0.1 (initial_accumulator_value's default; torch's is 0),
    CosineDecay's warm-up from 0 (as its documentation shows), the milestones as PiecewiseConstantDecay's boundaries,
    and no warm-up where Keras has none (step, factor, poly, constant)."""
    rate = o.lr
    if o.schedule == "cosine" and o.warmup_steps:
        rate = keras.optimizers.schedules.CosineDecay(0.0, max(o.decay_steps, 1), warmup_target=o.lr,
                                                      warmup_steps=o.warmup_steps)
    elif o.schedule == "cosine":
        rate = keras.optimizers.schedules.CosineDecay(o.lr, o.decay_steps)
    elif o.schedule == "step":
        rate = keras.optimizers.schedules.PiecewiseConstantDecay(
            list(o.milestones), [o.lr * o.decay_factor ** i for i in range(len(o.milestones) + 1)])
    elif o.schedule == "factor":
        rate = keras.optimizers.schedules.ExponentialDecay(o.lr, o.period, o.decay_factor, staircase=True)
    elif o.schedule == "poly":
        rate = keras.optimizers.schedules.PolynomialDecay(o.lr, max(o.decay_steps, 1), 0.0, power=o.power)
    options = {"learning_rate": rate, "weight_decay": o.weight_decay, "global_clipnorm": o.clip_norm}
    if o.name == "adamw":
        return keras.optimizers.AdamW(beta_1=o.betas[0], beta_2=o.betas[1], **options)
    if o.name == "adam":
        return keras.optimizers.Adam(beta_1=o.betas[0], beta_2=o.betas[1], **options)
    if o.name == "rmsprop":
        return keras.optimizers.RMSprop(rho=o.alpha, momentum=o.momentum, centered=o.centered, **options)
    if o.name == "adagrad":
        return keras.optimizers.Adagrad(**options)
    return keras.optimizers.SGD(momentum=0.0 if o.name == "sgd" else o.momentum, nesterov=o.name == "nesterov",
                                **options)


PORTS = {"canonical": canonical, "stock": stock}


def get_trainer(optimizer, port="canonical"):
    """Keras's optimizer and schedule for a common.optim.Optimizer, as `port` makes them (PORTS). The trainer keeps
    the optimizer as `spec`: the steps feed such a trainer the global batch's mean gradient and let its schedule
    set the rate."""
    trainer = PORTS[port](optimizer)
    trainer.spec = optimizer
    return trainer


# What keras.optimizers.LossScaleOptimizer fixes where common.loss_scaling.LossScaling has fields: its factors (2
# and 0.5, in its code), no ceiling on the scale and no delay (LossScaling's defaults)
KERAS_FIXES = ("growth_factor", "backoff_factor", "maximum", "late")


def with_loss_scaling(trainer, scaling, variables):
    """`trainer`, built over `variables`, inside Keras's dynamic loss scaler (keras.optimizers.LossScaleOptimizer)
    set to `scaling` (a common.loss_scaling.LossScaling; None: the trainer as it is), built too (the inner trainer's
    build returns at once: its state stays). A skipped step calls no inner apply: the weights, the buffers and the
    inner trainer's `iterations`, which the LossScaleOptimizer hands on as its own and the schedules count by, stay
    as they were, as common/loss_scaling.py says (tests/test_fp16_tensorflow.py)."""
    if scaling is None:
        return trainer
    if any(getattr(scaling, name) != getattr(LossScaling(), name) for name in KERAS_FIXES):
        raise RosettaError("Keras's LossScaleOptimizer fixes its factors at 2 and 0.5, with no ceiling and no delay: "
                           f"it cannot run {scaling}")
    scaled = keras.optimizers.LossScaleOptimizer(trainer, initial_scale=scaling.initial,
                                                 dynamic_growth_steps=scaling.growth_interval)
    scaled.build(variables)
    return scaled


def unwrapped(trainer):
    """The trainer that computes the update: a LossScaleOptimizer's inner optimizer, or the trainer itself."""
    return getattr(trainer, "inner_optimizer", trainer)


def follows_its_schedule(trainer):
    """True for get_trainer's trainers (loss-scaled or not); False for the recipe's SGD, whose rate the step sets
    (lr / batch size on the summed gradient)."""
    return hasattr(unwrapped(trainer), "spec")


# Each Keras optimizer's attribute holding a canonical slot's variables, one per trainable variable it was built
# over: SGD's "momentum" buffers, Adam's (and AdamW's) first and second moments, RMSprop's average of the squares
# ("velocity"), of the gradients and its momentum, Adagrad's sum of the squares ("accumulator").
SLOTS = {keras.optimizers.SGD: {"momentum_buffer": "momentums"},
         keras.optimizers.Adam: {"exp_avg": "_momentums", "exp_avg_sq": "_velocities"},
         keras.optimizers.RMSprop: {"square_avg": "_velocities", "grad_avg": "_average_gradients",
                                    "momentum_buffer": "_momentums"},
         keras.optimizers.Adagrad: {"sum": "_accumulators"}}


def buffers(trainer, slot, parameters):
    """canonical parameter name -> the trainer's buffer of `slot` for it; `parameters`: canonical name -> the Keras
    variable the trainer was built over (idiomatic.parameters). Found by the variable, not by position: a Keras
    model's order of variables is its own."""
    attribute = next(slots[slot] for kind, slots in SLOTS.items() if isinstance(trainer, kind))
    found = getattr(trainer, attribute)
    return {name: found[trainer._get_variable_index(variable)] for name, variable in parameters.items()}


def load_state(trainer, state, parameters):
    """Starts a built get_trainer trainer from a canonical state: its iterations at the state's step count, so
    that its schedule gives the rate of step state["step"] next and Adam's bias corrections use t = step + 1, and
    its buffers in Keras's layout, as the weights are. `parameters`: canonical name -> the Keras variable it was built
    over. Under a strategy each assign sets every replica's copy."""
    trainer.iterations.assign(state["step"])
    for slot in trainer.spec.slots:
        for name, variable in buffers(trainer, slot, parameters).items():
            variable.assign(to_channels_last(name, state[f"{slot}.{name}"]))


def canonical_state(trainer, parameters):
    """A get_trainer trainer's state, canonical (common.optim.init_state's form): the step count is its
    iterations; the buffers of `parameters` (canonical name -> Keras variable) converted as the weights are."""
    state = {"step": int(trainer.iterations.numpy())}
    for slot in trainer.spec.slots:
        state.update({f"{slot}.{name}": np.ascontiguousarray(to_canonical(name, variable.numpy()), dtype=np.float32)
                      for name, variable in buffers(trainer, slot, parameters).items()})
    return state
