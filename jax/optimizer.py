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


def state_bytes(state):
    """Every slot's buffers (a replica's whole ones, or a sharded state's slices), as their arrays hold them."""
    return sum(b.nbytes for slot in state["optimizer"].slots for b in state[slot])


def apply(params, grads, state, lr, batch_size, unit=None, norm=None):
    """The scratch step's update of one replica by the all-reduced summed gradients: new arrays written back into
    the replica's list slots, and the state re-pointed at its new buffers and step count. `unit`: update as the
    exec level makes it (execution.compile's "optimizer.update"; None: as written). `norm`: the global norm of the
    mean gradient, for clipping, where `grads` are only this device's slices (--shard); None: theirs."""
    params[:], new_state = (unit or update)(params, grads, state, lr, batch_size, norm)
    state.update(new_state)


def update(params, grads, state, lr, batch_size, norm=None):
    """common/optim.py's update, line for line: new weights and a new state (a unit of the step: jax.jit compiles
    it at the graph level, the Optimizer static, the step count and the norm traced). The clipping norm sums each
    gradient flat, as the sharded step's slices are (data_parallel.global_norm): XLA's sum over a kernel's four axes
    at once strayed ~1e-5 (relative) from the exact sum on a LeNet kernel's gradient, and Adam amplifies that."""
    o, t = state["optimizer"], state["step"]
    grads = [g / batch_size for g in grads]                       # the global batch's mean
    if o.clip_norm is not None:                                   # the all-reduced gradient's, unless given
        if norm is None:
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.ravel())) for g in grads))
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
    if o.name == "rmsprop":
        a = o.alpha
        square_avg = new["square_avg"] = [a * s + (1 - a) * g * g for s, g in zip(state["square_avg"], grads)]
        if o.centered:                                            # the running variance: less the mean's square
            grad_avg = new["grad_avg"] = [a * c + (1 - a) * g for c, g in zip(state["grad_avg"], grads)]
            square_avg = [s - c * c for s, c in zip(square_avg, grad_avg)]
        directions = [g / (jnp.sqrt(s) + o.eps) for g, s in zip(grads, square_avg)]   # eps outside the square root
        if o.momentum:                                            # the buffer starts at 0, the rate outside it
            directions = new["momentum_buffer"] = [o.momentum * v + d
                                                   for v, d in zip(state["momentum_buffer"], directions)]
        return [p - lr * d for p, d in zip(params, directions)], new
    if o.name == "adagrad":                                       # the sum starts at 0
        sums = new["sum"] = [s + g * g for s, g in zip(state["sum"], grads)]
        return [p - lr * g / (jnp.sqrt(s) + o.eps) for p, g, s in zip(params, grads, sums)], new
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
    optax.rmsprop and optax.adagrad do not compute torch's: rmsprop adds eps inside the square root by default and
    traces its momentum after the rate (the rate inside the buffer), adagrad starts its sum at 0.1 and adds eps inside
    the square root. rmsprop is therefore built from Optax's own parts in the spec's order (scale_by_rms, or
    scale_by_stddev when centered, with eps_in_sqrt=False; trace; the rate), adagrad from scale_by_rss_torch.
    port="stock" (idiomatic.py's, for the conventions table): what a straightforward port from torch.optim builds,
    the same hyperparameters in the same stock classes (optax.rmsprop(lr, alpha, eps, centered=, momentum=),
    optax.adagrad(lr, eps=)); Optax's usual warm-up (schedule), and its rmsprop's and adagrad's own arithmetic (the
    rmsprop trace holds the rate: checkpoint.save_state puts -lr * the canonical buffer in it), each optimizer alone
    where nothing is chained before it (stock_chain)."""
    o, rate = optimizer, get_schedule(optimizer, port)
    clip = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm is not None else []
    chain = stock_chain if port == "stock" else optax.chain
    if o.decoupled:
        return chain(*clip, optax.adamw(rate, *o.betas, o.eps, weight_decay=o.weight_decay, mask=None))
    decay = [optax.add_decayed_weights(o.weight_decay)] if o.weight_decay else []
    if o.name == "adam":
        return chain(*clip, *decay, optax.adam(rate, *o.betas, o.eps))
    if port == "stock" and o.name == "rmsprop":   # momentum None, not 0: no trace at all, as torch keeps no buffer
        return chain(*clip, *decay, optax.rmsprop(rate, o.alpha, o.eps, centered=o.centered,
                                                  momentum=o.momentum or None))
    if port == "stock" and o.name == "adagrad":
        return chain(*clip, *decay, optax.adagrad(rate, eps=o.eps))
    if o.name == "rmsprop":
        scale = (optax.scale_by_stddev if o.centered else optax.scale_by_rms)(o.alpha, o.eps, eps_in_sqrt=False)
        trace = [optax.trace(o.momentum)] if o.momentum else []
        return optax.chain(*clip, *decay, scale, *trace, optax.scale_by_learning_rate(rate))
    if o.name == "adagrad":
        return optax.chain(*clip, *decay, scale_by_rss_torch(o.eps), optax.scale_by_learning_rate(rate))
    momentum = None if o.name == "sgd" else o.momentum
    return chain(*clip, *decay, optax.sgd(rate, momentum, nesterov=o.name == "nesterov"))


def stock_chain(*transformations):
    """The stock port's transformation as Optax's tutorials write it: the optimizer alone (optax.sgd(lr,
    momentum=0.9)) where nothing goes before it, a chain where something does (clip_by_global_norm, then
    add_decayed_weights, then the optimizer). Orbax restores a state only into one of the file's structure, and a
    chain's state is a tuple around its members': the state file (checkpoint.save_state) restores into exactly this."""
    return transformations[0] if len(transformations) == 1 else optax.chain(*transformations)


def scale_by_rss_torch(eps):
    """torch.optim.Adagrad's scaling, g / (sqrt(sum of squares) + eps) with the sum from 0, in Optax's own state
    (ScaleByRssState: a file of it restores into stock optax.adagrad code). No stock transformation computes it:
    optax.scale_by_rss can start its sum at 0 (initial_accumulator_value) but adds eps inside the square root,
    rsqrt(sum + eps), and has no eps_in_sqrt switch as scale_by_rms has."""
    def init(params):
        return optax.ScaleByRssState(sum_of_squares=optax.tree.zeros_like(params))

    def update(updates, state, params=None):
        sums = jax.tree.map(lambda g, s: s + g * g, updates, state.sum_of_squares)
        return jax.tree.map(lambda g, s: g / (jnp.sqrt(s) + eps), updates, sums), optax.ScaleByRssState(sums)
    return optax.GradientTransformation(init, update)


# The Optax states that keep buffers, told apart by their fields (a NamedTuple's, or the keys of the dict
# nnx.to_pure_dict makes of one: Adam's and the centered RMSprop's are both "mu" and "nu"), and the canonical slot
# (torch.optim's name) of each buffer. Every Optax state counts its updates in `count` (the schedule's and Adam's),
# which is the step.
SLOTS = {frozenset({"trace"}): {"trace": "momentum_buffer"},                        # TraceState
         frozenset({"count", "mu", "nu"}): {"mu": "exp_avg", "nu": "exp_avg_sq"},    # ScaleByAdamState
         frozenset({"nu"}): {"nu": "square_avg"},                                   # ScaleByRmsState
         frozenset({"mu", "nu"}): {"mu": "grad_avg", "nu": "square_avg"},           # ScaleByRStdDevState
         frozenset({"sum_of_squares"}): {"sum_of_squares": "sum"}}                  # ScaleByRssState


def slots_of(node):
    """{field: canonical slot} of an Optax state that keeps buffers (a NamedTuple, or its pure dict); else {}."""
    fields = node._fields if isinstance(node, tuple) and hasattr(node, "_fields") else \
        node.keys() if isinstance(node, dict) else ()
    return SLOTS.get(frozenset(fields), {})


def buffers(opt_state):
    """(canonical slot, the parameters' tree of its buffers) of every buffer in an Optax state (a chain's, nested, as
    Optax keeps it or as a pure dict), in the chain's order."""
    slots = slots_of(opt_state)
    for field, slot in slots.items():
        yield slot, opt_state[field] if isinstance(opt_state, dict) else getattr(opt_state, field)
    if not slots and isinstance(opt_state, (dict, tuple, list)):
        for value in opt_state.values() if isinstance(opt_state, dict) else opt_state:
            yield from buffers(value)


def optax_state(state, opt_state, params, names):
    """The Optax state `opt_state` (tx.init's, the built-in mode's) holding the canonical `state` of the parameters
    `names`: its buffers as params(canonical arrays) lays them out (the parameters' own pytree), every count at the
    step."""
    def filled(node):
        slots = slots_of(node)
        return node._replace(**{field: params({name: state[f"{slot}.{name}"] for name in names})
                                for field, slot in slots.items()}) if slots else node
    opt_state = jax.tree.map(filled, opt_state, is_leaf=lambda node: bool(slots_of(node)))
    return optax.tree_utils.tree_set(opt_state, count=jnp.int32(state["step"]))


def optax_canonical(opt_state, to_canonical):
    """The canonical state an Optax state holds: to_canonical(the parameters' pytree) -> arrays by name."""
    (step,) = {int(count) for _, count in optax.tree_utils.tree_get_all_with_path(opt_state, "count")}
    state = {"step": step}
    for slot, kept in buffers(opt_state):
        state.update({f"{slot}.{name}": a for name, a in to_canonical(kept).items()})
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
    for slot, kept in buffers(opt_state):
        state.update({f"{slot}.{name}": np.asarray(at(kept, path)) for name, path in paths.items()})
    return state


def load_state(trainer, state, paths):
    """Put the canonical `state` into an nnx.Optimizer: its pure dict with the buffers at `paths` (flax_paths' of its
    module; channels-last, as the weights are: to_channels_last) and every count replaced, then replace_by_pure_dict
    (Flax's own restore). Buffers go in as given, a wrong shape too (for the harness's read_state to name)."""
    pure = nnx.to_pure_dict(nnx.state(trainer))
    pure["step"] = jnp.asarray(state["step"], pure["step"].dtype)
    fill(pure.get("opt_state", {}), state, paths)   # none at all for plain SGD at a constant rate: nothing kept
    saved = nnx.state(trainer)
    nnx.replace_by_pure_dict(saved, pure)
    nnx.update(trainer, saved)


def fill(tree, state, paths, laid_out=False):
    """The buffers of `state` ("<slot>.<name>") into an Optax state's pure dict, at their parameters' `paths`, and its
    every count at state["step"] where it has one. `laid_out`: the buffers are in Flax's layout already (global
    arrays, placed as they are)."""
    slots = slots_of(tree)
    for key, value in tree.items():
        if key in slots:
            for name, path in paths.items():
                buffer = state[f"{slots[key]}.{name}"]
                at(value, path[:-1])[path[-1]] = buffer if laid_out else jnp.asarray(to_channels_last(name, buffer))
        elif key == "count" and "step" in state:
            tree[key] = jnp.asarray(state["step"], value.dtype)
        elif isinstance(value, dict):
            fill(value, state, paths, laid_out)


def find(tree, key):
    """Every value under `key` in a nested dict."""
    for k, value in tree.items():
        if k == key:
            yield value
        elif isinstance(value, dict):
            yield from find(value, key)
