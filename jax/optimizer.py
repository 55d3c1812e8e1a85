"""The optimizer in JAX: common/optim.py's update by hand for the scratch step, functional like the recipe's sgd
(new arrays; the replica's and the state's lists re-pointed at them), and built from Optax's own transformations
and schedules for the built-in and idiomatic modes, whose compiled steps take Optax's state in and give it back.
A checkpoint's canonical state goes into Optax's state (the built-in's) or an nnx.Optimizer's (the idiomatic's and
the file's, checkpoint.py) and comes back out of it by Optax's names for the buffers and counts."""
import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from common.layouts import to_channels_last
from common.optim import CLIP_EPS, Optimizer
from common.resnet import PARAM_NAMES as RESNET_PARAMS

from .lenet import LeNet
from .resnet import flax_variables

# The Optimizer is frozen and hashable: JAX takes it as static (part of the compiled update's key, not an input),
# so a state holding it is a pytree that jax.jit accepts whole. Once per process: a second import of this file (a
# copy of the folder, in the tests) finds it registered.
with contextlib.suppress(ValueError):
    jax.tree_util.register_static(Optimizer)


def init_state(replica, optimizer):
    """Zeros like each parameter: on its device, in its layout (the model's held)."""
    return {"optimizer": optimizer, "step": 0,
            **{slot: [jnp.zeros_like(p) for p in replica] for slot in optimizer.slots}}


def state_to_numpy(state, model):
    """The buffers converted as the weights are (model.to_numpy): each has its parameter's shape and layout."""
    slots = {f"{slot}.{name}": a
             for slot in state["optimizer"].slots for name, a in model.to_numpy(state[slot]).items()}
    return {"step": int(state["step"]), **slots}


def state_from_numpy(arrays, replica, optimizer, model):
    """The buffers laid out and placed as model.get_params does the weights, on the replica's device."""
    (device,) = replica[0].devices()
    slots = {slot: model.get_params({name: arrays[f"{slot}.{name}"] for name in model.param_names}, device)
             for slot in optimizer.slots}
    return {"optimizer": optimizer, "step": int(arrays["step"]), **slots}


def apply(params, grads, state, lr, batch_size, unit=None):
    """The scratch step's update of one replica by the all-reduced summed gradients: new arrays written back into
    the replica's list slots, and the state re-pointed at its new buffers and step count. `unit`: update as the
    exec level makes it (execution.compile's "optimizer.update"; None: as written)."""
    params[:], new_state = (unit or update)(params, grads, state, lr, batch_size)
    state.update(new_state)


def update(params, grads, state, lr, batch_size):
    """common/optim.py's update, line for line: new weights and a new state (a unit of the step: jax.jit compiles
    it at the graph level, the Optimizer static, the step count traced)."""
    o, t = state["optimizer"], state["step"]
    grads = [g / batch_size for g in grads]                       # the global batch's mean
    if o.clip_norm is not None:                                   # every replica holds the all-reduced gradient
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
        grads = [g * jnp.minimum(1.0, o.clip_norm / (norm + CLIP_EPS)) for g in grads]
    if o.weight_decay and not o.decoupled:                        # L2: added to the gradient
        grads = [g + o.weight_decay * p for g, p in zip(grads, params)]
    new = {"optimizer": o, "step": t + 1}
    if o.name == "sgd":
        return [p - lr * g for p, g in zip(params, grads)], new
    if o.name in ("momentum", "nesterov"):                        # the buffer starts at 0: v = g on the first step
        buffers = new["momentum_buffer"] = [o.momentum * v + g for v, g in zip(state["momentum_buffer"], grads)]
        directions = [g + o.momentum * v for g, v in zip(grads, buffers)] if o.name == "nesterov" else buffers
        return [p - lr * d for p, d in zip(params, directions)], new   # the rate outside the buffer
    if o.decoupled:                                               # adamw: the weights shrink, not the gradient
        params = [p * (1 - lr * o.weight_decay) for p in params]
    b1, b2 = o.betas
    exp_avg = new["exp_avg"] = [b1 * m + (1 - b1) * g for m, g in zip(state["exp_avg"], grads)]
    exp_avg_sq = new["exp_avg_sq"] = [b2 * s + (1 - b2) * g * g for s, g in zip(state["exp_avg_sq"], grads)]
    correction1, correction2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)   # Adam's bias corrections, from the count
    return [p - lr / correction1 * m / (jnp.sqrt(s / correction2) + o.eps)   # eps outside the square root
            for p, m, s in zip(params, exp_avg, exp_avg_sq)], new


def get_schedule(optimizer, port="canonical"):
    """common/optim.py's rates from Optax's stock schedules, as a function of Optax's step count (0 at the first
    update, like the spec's step): the warm-up lr * (count + 1) / W is a line from lr / W to lr over W - 1 counts;
    join_schedules hands the schedule after it count - W. port="stock": Optax's usual warm-up, a line from 0 over
    W counts (what optax.warmup_cosine_decay_schedule(0.0, lr, W, total) computes), a rate of 0 on the first
    update and one step behind the spec's all through the warm-up; and a constant rate as the number itself
    (optax.sgd(0.02, ...)), which keeps no count: a state's structure is what a stock program restores into."""
    o = optimizer
    if port == "stock" and o.schedule == "constant" and not o.warmup_steps:
        return o.lr
    if o.schedule == "cosine":
        after = optax.cosine_decay_schedule(o.lr, max(o.decay_steps, 1), alpha=o.final_lr / o.lr)
    elif o.schedule == "step":   # both milestones may fall on one step in a short run: their factors multiply
        after = optax.piecewise_constant_schedule(o.lr, {m - o.warmup_steps: o.decay_factor ** n
                                                         for m, n in collections.Counter(o.milestones).items()})
    elif o.schedule == "factor":
        after = optax.exponential_decay(o.lr, o.period, o.decay_factor, staircase=True)
    elif o.schedule == "poly":
        after = optax.polynomial_schedule(o.lr, 0.0, o.power, max(o.decay_steps, 1))
    else:
        after = optax.constant_schedule(o.lr)
    if not o.warmup_steps:
        return after
    if port == "stock":
        warmup = optax.linear_schedule(0.0, o.lr, o.warmup_steps)
    else:
        warmup = optax.linear_schedule(o.lr / o.warmup_steps, o.lr, o.warmup_steps - 1)
    return optax.join_schedules([warmup, after], [o.warmup_steps])


def get_trainer(optimizer, port="canonical"):
    """common/optim.py's update as one Optax transformation, in the spec's order: clip by the global norm, the L2
    decay added to the gradient (before the momentum trace: torch's g + wd * w), the update at the schedule's
    rate. Optax's momentum keeps the rate outside the buffer (trace, then scale by -lr) as torch does, and its
    Adam adds eps to the square root of the bias-corrected moment: the stock classes compute the spec.
    optax.adamw's update -lr * (adam + wd * w) is torch's w * (1 - lr * wd) - lr * adam, on every parameter
    (mask=None: biases decay too). clip_by_global_norm scales by clip / norm, torch's by clip / (norm + 1e-6): a
    ~1e-7 relative difference on the steps that clip. Its input must be the global batch's mean gradient.
    port="stock" (idiomatic.py's, for the conventions table): what a straightforward port from torch.optim builds,
    the same hyperparameters in the same stock classes; only Optax's usual warm-up differs (schedule)."""
    o, rate = optimizer, get_schedule(optimizer, port)
    clip = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm is not None else []
    if o.decoupled:
        return optax.chain(*clip, optax.adamw(rate, *o.betas, o.eps, weight_decay=o.weight_decay, mask=None))
    decay = [optax.add_decayed_weights(o.weight_decay)] if o.weight_decay else []
    if o.name == "adam":
        return optax.chain(*clip, *decay, optax.adam(rate, *o.betas, o.eps))
    momentum = None if o.name == "sgd" else o.momentum
    return optax.chain(*clip, *decay, optax.sgd(rate, momentum, nesterov=o.name == "nesterov"))


# A state's buffers by Optax's names (fields of TraceState and ScaleByAdamState) and torch.optim's (the canonical
# slots); every Optax state counts its updates in `count` (the schedule's and Adam's), which is the step.
FIELDS = {"momentum_buffer": "trace", "exp_avg": "mu", "exp_avg_sq": "nu"}


def optax_state(state, opt_state, params, names):
    """The Optax state `opt_state` (tx.init's, the built-in mode's) holding the canonical `state` of the parameters
    `names`: its buffers as params(canonical arrays) lays them out (the parameters' own pytree), every count at the
    step."""
    buffers = {FIELDS[slot]: params({name: state[f"{slot}.{name}"] for name in names})
               for slot in FIELDS if f"{slot}.{names[0]}" in state}
    return optax.tree_utils.tree_set(opt_state, count=jnp.int32(state["step"]), **buffers)


def optax_canonical(opt_state, to_canonical):
    """The canonical state an Optax state holds: to_canonical(the parameters' pytree) -> arrays by name."""
    (step,) = {int(count) for _, count in optax.tree_utils.tree_get_all_with_path(opt_state, "count")}
    state = {"step": step}
    for slot, field in FIELDS.items():
        for _, buffers in optax.tree_utils.tree_get_all_with_path(opt_state, field):
            state.update({f"{slot}.{name}": a for name, a in to_canonical(buffers).items()})
    return state


# The idiomatic mode's nnx.Optimizer and its file, as the plain nested dict nnx.to_pure_dict makes of its state:
# {"step": n, "opt_state": {<chain position>: {"count": n, "mu": <the module's tree of parameters>, ...}}}, a buffer
# where its parameter is in the module: ("conv1", "kernel") in the LeNet, ("blocks", 0, "bn1", "scale") in the ResNet.
def flax_paths(module):
    """canonical parameter name -> the path of its nnx.Param in the Flax module's tree (nnx.iter_graph's), in the
    network's parameter order: where an nnx.Optimizer's state keeps its buffers."""
    named = dict(module.layers()) if isinstance(module, LeNet) else {
        name: v for name, v in flax_variables(module).items() if name in RESNET_PARAMS}
    found = {id(v): path for path, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)}
    return {name: found[id(v)] for name, v in named.items()}


def at(tree, path):
    """The value at a module path in a pure dict; a restored file may key a list's items by str."""
    for key in path:
        tree = tree[key] if key in tree else tree[str(key)]
    return tree


def canonical_state(tree, paths):
    """The canonical state's entries in a pure dict of an nnx.Optimizer's state, arrays as stored (Flax's layout), the
    buffers found at `paths` (flax_paths'). Its counts (nnx.Optimizer's step and Optax's) must agree."""
    if not isinstance(tree, dict) or "step" not in tree:
        raise ValueError("not an nnx.Optimizer's state (no step): a model's weights, perhaps")
    opt_state = tree.get("opt_state", {})   # none for plain SGD at a constant rate
    counts = {int(tree["step"]), *(int(c) for c in find(opt_state, "count"))}
    if len(counts) != 1:
        raise ValueError(f"step counts {sorted(counts)} disagree")
    state = {"step": counts.pop()}
    for slot, field in FIELDS.items():
        for buffers in find(opt_state, field):
            state.update({f"{slot}.{name}": np.asarray(at(buffers, path)) for name, path in paths.items()})
    return state


def load_state(trainer, state, paths):
    """Put the canonical `state` into an nnx.Optimizer: its pure dict with the buffers at `paths` (flax_paths' of its
    module; channels-last, as the weights are: to_channels_last) and every count replaced, then replace_by_pure_dict
    (Flax's own restore). Buffers go in as given, a wrong shape too (for the harness's read_state to name)."""
    slots = {field: slot for slot, field in FIELDS.items()}

    def replace(tree):
        for key, value in tree.items():
            if key in slots:
                for name, path in paths.items():
                    at(value, path[:-1])[path[-1]] = jnp.asarray(to_channels_last(name, state[f"{slots[key]}.{name}"]))
            elif key == "count":
                tree[key] = jnp.asarray(state["step"], value.dtype)
            elif isinstance(value, dict):
                replace(value)

    pure = nnx.to_pure_dict(nnx.state(trainer))
    pure["step"] = jnp.asarray(state["step"], pure["step"].dtype)
    replace(pure.get("opt_state", {}))   # none at all for plain SGD at a constant rate: every part keeps nothing
    saved = nnx.state(trainer)
    nnx.replace_by_pure_dict(saved, pure)
    nnx.update(trainer, saved)


def find(tree, key):
    """Every value under `key` in a nested dict."""
    for k, value in tree.items():
        if k == key:
            yield value
        elif isinstance(value, dict):
            yield from find(value, key)
