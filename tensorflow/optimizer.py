"""The optimizer in TensorFlow: common/optim.py's canonical update written by hand for the scratch step (apply: a
replica's state is tf.Variables beside its weights, assigned in place)."""
import tensorflow as tf

from common.lenet import PARAM_NAMES
from common.optim import CLIP_EPS

from .lenet import get_params, to_numpy


def init_state(replica, optimizer):
    """The step count and a zero buffer per slot and parameter, each a tf.Variable on its parameter's device: the
    compiled step assigns them, as it assigns the weights."""
    with tf.device(replica[0].device):
        state = {"optimizer": optimizer, "step": tf.Variable(0, dtype=tf.int64, name="step")}
    for slot in optimizer.slots:
        state[slot] = []
        for name, p in zip(PARAM_NAMES, replica):
            with tf.device(p.device):
                state[slot].append(tf.Variable(tf.zeros_like(p), name=f"{slot}.{name}"))
    return state


def state_to_numpy(state):
    """The buffers have their parameters' shapes and layout: lenet.to_numpy converts them as it converts weights."""
    arrays = {"step": int(state["step"].numpy())}
    for slot in state["optimizer"].slots:
        arrays.update({f"{slot}.{name}": a for name, a in to_numpy(state[slot]).items()})
    return arrays


def state_from_numpy(arrays, replica, optimizer):
    device = replica[0].device
    with tf.device(device):
        state = {"optimizer": optimizer, "step": tf.Variable(arrays["step"], dtype=tf.int64, name="step")}
    for slot in optimizer.slots:
        state[slot] = get_params({name: arrays[f"{slot}.{name}"] for name in PARAM_NAMES}, device)
    return state


def bias_correction(beta, t):
    """Adam's 1 - beta**t at its t-th step, in float64 as common/optim.py and torch.optim.Adam compute it: in float32
    1 - 0.999 is 0.00099998713, 1.3e-5 off, enough to move Adam's weights by ~1e-3 in this repo's parity runs
    (tests/test_optimizers.py)."""
    return tf.cast(1 - beta ** tf.cast(t, tf.float64), tf.float32)


def apply(params, grads, state, lr, batch_size):
    """common/optim.py's update of one replica by its all-reduced gradient SUMS (the same on every replica), at this
    step's rate lr: the mean, clipped by its global norm, L2 weight decay (decoupled for adamw), the update; then
    the step count advances. Every tf.Variable is assigned on the replica's device."""
    o, step = state["optimizer"], state["step"]
    with tf.device(params[0].device):
        grads = [g / batch_size for g in grads]
        if o.clip_norm is not None:   # torch's factor; in float64, as the spec's, so that it is the same to the bit
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
                v.assign(o.momentum * v + g)   # the buffer starts at zero: v = g on the first step
                w.assign_sub(lr * (g + o.momentum * v if o.name == "nesterov" else v))
            else:
                if o.decoupled:
                    w.assign(w * (1 - lr * o.weight_decay))
                (b1, b2), m, s = o.betas, state["exp_avg"][i], state["exp_avg_sq"][i]
                m.assign(b1 * m + (1 - b1) * g)
                s.assign(b2 * s + (1 - b2) * g * g)
                denom = tf.sqrt(s / bias_correction(b2, t)) + o.eps
                w.assign_sub(lr / bias_correction(b1, t) * m / denom)
        step.assign_add(1)
