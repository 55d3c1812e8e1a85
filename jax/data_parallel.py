"""Data parallelism from scratch in JAX: split the batch, forward and backward on every device, sum the
gradients across devices, apply the same update to every replica. One step for every network: the network is
a Functional (lenet.py's, resnet.py's) handed in, and the run's settings (the all-reduce's buckets, the compiled
units of execution.compile, fp16's loss scaler, ZeRO's sharding) come in with it, never through this module. JAX
functions are pure and its arrays immutable: every step makes new arrays, and the lists that hold them are
re-pointed at them.
JAX has no loss scaler: at fp16 the step is common/loss_scaling.py's rule, written here (step_on_shards)."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from common.buckets import plan
from common.interface import RosettaError, StepSettings
from common.sharding import micro_batches, shard_bounds
from common import zero
from common.zero import chunk, groups, owner_index

from . import distributed as dist
from . import optimizer


def device_of(array):
    (device,) = array.devices()
    return device


def split_and_load(array, devices):
    """jax.device_put copies the numpy rows onto the device: a shard never aliases the caller's array."""
    return [jax.device_put(array[a:b], d) for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices)]


def allreduce(tensors, dtype="fp32"):
    """Sum on the first tensor's device, then copy the sum to every device. JAX arrays are immutable: each
    slot of the list gets a new array (device_put copies the sum across).
    In a multi-process run the local sum is also summed across processes by JAX's collectives. With dtype "bf16" (the
    wire's, common.precision.summed_on_the_wire) each tensor is cast to bf16 on its own device, the casts added in
    device order (eager bf16 adds, each rounded to nearest even), summed across processes as bf16 and widened back."""
    if len(tensors) == 1 and not dist.is_initialized():   # one device in one process: already the sum
        return tensors
    if dtype != "fp32":
        widened = allreduce([t.astype(jnp.bfloat16) for t in tensors])
        tensors[:] = [t.astype(jnp.float32) for t in widened]
        return tensors
    total = local_sum(tensors)
    if dist.is_initialized():
        total = dist.all_reduce(total)
    tensors[:] = [jax.device_put(total, device_of(t)) for t in tensors]
    return tensors


def local_sum(tensors):
    """This process's devices' tensors added in device order on the first one's device (the all-reduce's and the
    reduce-scatter's sum before the processes')."""
    first = device_of(tensors[0])
    total = tensors[0]
    for t in tensors[1:]:
        total = total + jax.device_put(t, first)
    return total


def allreduce_gradients(grads, bucket_bytes=None, dtype="fp32"):
    """Every parameter's gradient summed across devices (grads[d]: device d's list): an allreduce per parameter, or
    per bucket of parameters (common/buckets.py), each device's gradients flattened into one buffer and the sum cut
    back into their shapes (flatten, unflatten: compiled, on the device that holds them), as DDP does. `dtype`: the
    wire's (allreduce's; a bucket is cast as one buffer). Returns new lists (arrays are immutable)."""
    if bucket_bytes is None:
        summed = [allreduce(list(per_device), dtype) for per_device in zip(*grads)]   # one parameter on every device
        return [list(device_grads) for device_grads in zip(*summed)]
    grads = [list(device_grads) for device_grads in grads]
    for bucket in plan([g.size for g in grads[0]], bucket_bytes):
        buffers = allreduce([flatten([device_grads[i] for i in bucket]) for device_grads in grads], dtype)
        for device_grads, buffer in zip(grads, buffers):
            for i, piece in zip(bucket, unflatten(buffer, tuple(device_grads[i].shape for i in bucket))):
                device_grads[i] = piece
    return grads


def reduce_scatter(buffers, dtype="fp32"):
    """Each local device's flat padded buffer of one unit -> each device's own slice of their sum over every device
    of every process (common/zero.py's owners): the buffers added in device order on the first device, as allreduce
    adds them (dtype "bf16": the same casts, bf16 adds and bf16 between processes, widened back), across processes
    distributed.reduce_scatter leaving this process the contiguous slices of its devices, then each device's copied
    to it. New arrays (arrays are immutable)."""
    if len(buffers) == 1 and not dist.is_initialized():   # one device in one process: the sum, and its slice
        return list(buffers)
    if dtype != "fp32":
        return [s.astype(jnp.float32) for s in reduce_scatter([b.astype(jnp.bfloat16) for b in buffers])]
    total = local_sum(buffers)
    if dist.is_initialized():
        total = dist.reduce_scatter(total)
    size = len(total) // len(buffers)
    return [jax.device_put(total[i * size:(i + 1) * size], device_of(b)) for i, b in enumerate(buffers)]


def all_gather(slices):
    """Each local device's own slice of one unit -> the whole flat (padded) buffer on every local device: the slices
    joined on the first device, every process's joined in rank order (distributed.all_gather), copied to each."""
    first = device_of(slices[0])
    whole = jnp.concatenate([jax.device_put(s, first) for s in slices])
    if dist.is_initialized():
        whole = dist.all_gather(whole)
    return [jax.device_put(whole, device_of(s)) for s in slices]


def shard_states(states, replicas, bucket_bytes=None):
    """Each device's whole state cut to the slices it owns (common/zero.py): every slot's buffers of a unit flattened
    in JAX's element order (the parameters' own, so a slice of state lines up with its slice of weights), padded and
    cut on the device. New dicts: the whole buffers are left to the caller."""
    rank, world = world_of(replicas)
    parts = units_of(shapes_of(replicas[0]), bucket_bytes)
    sharded = []
    for i, state in enumerate(states):
        owner = owner_index(rank, len(replicas), i)
        sharded.append({"optimizer": state["optimizer"], "step": state["step"], "shard": (owner, world),
                        **{slot: owned(state[slot], parts, world, owner) for slot in state["optimizer"].slots}})
    return sharded


def gather_states(states, replicas, bucket_bytes=None):
    """The sharded states whole again (shard_states' inverse): every slot's slices all_gather'ed, one unit at a time,
    and cut back into the replica's shapes (its layout), on every device: init_state's form."""
    shapes = shapes_of(replicas[0])
    parts = units_of(shapes, bucket_bytes)
    whole = [{"optimizer": state["optimizer"], "step": state["step"]} for state in states]
    for slot in states[0]["optimizer"].slots:
        gathered = zip(*[all_gather([state[slot][k] for state in states]) for k in range(len(parts))])
        for state, buffers in zip(whole, gathered):
            state[slot] = unflat(list(buffers), parts, shapes)
    return whole


def shard_params(replicas, bucket_bytes=None):
    """Each device's whole replica cut to the slices it owns, what stage 3 keeps between steps: every unit flattened
    in JAX's element order, padded and cut on the device, as shard_states cuts a slot (owned), and "like", what
    gather_params rebuilds the replica from: its shapes (the layout is in them: a channels-last kernel's is HWIO),
    hashable for the compiled helpers, and its device (the slices' own, where gather_params' arrays land). New dicts:
    the whole arrays are left to the caller to drop."""
    rank, world = world_of(replicas)
    shapes = shapes_of(replicas[0])
    parts = units_of(shapes, bucket_bytes)
    sharded = []
    for i, replica in enumerate(replicas):
        owner = owner_index(rank, len(replicas), i)
        sharded.append({"shard": (owner, world), "slices": owned(replica, parts, world, owner),
                        "like": {"shapes": shapes, "device": device_of(replica[0])}})
    return sharded


def gather_params(replicas, bucket_bytes=None):
    """shard_params' inverse: every unit's slices all_gather'ed (a collective every process calls) and cut back into
    the replica's shapes on each device, new arrays as get_params makes them, ready for loss_and_grads."""
    shapes = replicas[0]["like"]["shapes"]
    parts = units_of(shapes, bucket_bytes)
    gathered = zip(*[all_gather([replica["slices"][k] for replica in replicas]) for k in range(len(parts))])
    return [unflat(list(buffers), parts, shapes) for buffers in gathered]


def world_of(replicas):
    """(this process's rank, the world's devices): common/zero.py's owners; one process when not initialised."""
    if not dist.is_initialized():
        return 0, len(replicas)
    return jax.process_index(), jax.process_count() * len(replicas)


def units_of(shapes, bucket_bytes):
    """What is sharded, as common.zero.groups gives it (the parameters' indices, one unit each), from the parameters'
    shapes, hashable: the compiled helpers below take it as static."""
    return tuple(tuple(unit) for unit in groups([math.prod(shape) for shape in shapes], bucket_bytes))


def shapes_of(arrays):
    """Each array's shape, as a hashable tuple: the compiled helpers' static argument, and shard_params' "like"."""
    return tuple(tuple(a.shape) for a in arrays)


@functools.partial(jax.jit, static_argnums=(1, 2))
def flat(arrays, parts, world):
    """One device's arrays as flat buffers, one a unit of `parts`, each zero-padded to world * chunk elements:
    compiled once for all the units, on the device that holds them."""
    buffers = [jnp.concatenate([arrays[i].ravel() for i in unit]) for unit in parts]
    return [jnp.pad(b, (0, chunk(b.size, world) * world - b.size)) for b in buffers]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def owned(arrays, parts, world, owner):
    """Device `owner`'s slice of every unit's padded buffer (common.zero.bounds)."""
    return [b[owner * (b.size // world):(owner + 1) * (b.size // world)] for b in flat(arrays, parts, world)]


@functools.partial(jax.jit, static_argnums=(1, 2))
def unflat(buffers, parts, shapes):
    """Every unit's whole (padded) buffer cut back into its arrays, in `shapes` (the replica's): a list in parameter
    order."""
    arrays = [None] * len(shapes)
    for unit, buffer in zip(parts, buffers):
        for i, piece in zip(unit, unflatten(buffer, tuple(shapes[i] for i in unit))):
            arrays[i] = piece
    return arrays


def unscale_gradients(grads, scale):
    """fp16's loss scaling: every device's all-reduced gradients, of the loss times `scale`, multiplied by 1/scale in
    fp32 (exact: the scale is a power of two) and re-pointed in their list slots (arrays are immutable); returns
    whether every one is finite. One compiled call per device (unscaled), one read for all their checks."""
    inverse, checks = np.float32(1.0 / scale), []
    for device_grads in grads:
        device_grads[:], finite = unscaled(device_grads, inverse)
        checks.append(finite)
    return bool(all(jax.device_get(checks)))


@jax.jit
def unscaled(grads, inverse):
    """One device's gradients times `inverse` (traced: a new scale compiles nothing), and whether all are finite."""
    grads = [g * inverse for g in grads]
    return grads, jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads]))


@jax.jit
def flatten(arrays):
    return jnp.concatenate([a.ravel() for a in arrays])


# a flat buffer cut back into `shapes` (static): the spec's own cut, common.zero.unflat, compiled
unflatten = jax.jit(zero.unflat, static_argnums=1)


def sgd(params, grads, lr, batch_size, unit=None):
    """A functional update: new arrays, written back into the replica's list slots. `unit`: the step's update as the
    exec level makes it (execution.compile's; None: update as written)."""
    params[:] = (unit or update)(params, grads, lr / batch_size)


def update(params, grads, scale):
    """The SGD update of one replica: new arrays (a unit: jax.jit compiles it at the graph level)."""
    return [p - scale * g for p, g in zip(params, grads)]


def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale=None):
    """Each device's summed loss on its shard, its gradients (of the loss times the loss `scale`, if given) and its
    new BatchNorm state: the network's own (model.loss_and_grads: the LeNet's loop over the devices, the ResNet's
    lock-step forward)."""
    return model.loss_and_grads(replicas, bn_states, X_shards, y_shards, devices, scale)


def accumulated(loss_and_grads, model, replicas, bn_states, X_shards, y_shards, devices, count, scale=None):
    """Gradient accumulation: each device's shard cut into `count` micro-batches (common.sharding.micro_batches), a
    forward and backward each (at the one loss `scale`), their summed losses and gradients added up on the device (new
    arrays); the BatchNorm states go through the micro-batches in turn. Nothing crosses devices here: the all-reduce
    comes once, after it."""
    if count == 1:
        return loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale)
    parts = [micro_batches(len(y), count) for y in y_shards]
    losses = grads = None
    for i in range(count):
        X_micro = [X[part[i][0]:part[i][1]] for X, part in zip(X_shards, parts)]
        y_micro = [y[part[i][0]:part[i][1]] for y, part in zip(y_shards, parts)]
        micro_losses, micro_grads, bn_states = loss_and_grads(model, replicas, bn_states, X_micro, y_micro, devices,
                                                              scale)
        if losses is None:
            losses, grads = list(micro_losses), [list(g) for g in micro_grads]
        else:
            losses = [a + b for a, b in zip(losses, micro_losses)]
            grads = [[a + b for a, b in zip(g, h)] for g, h in zip(grads, micro_grads)]
    return losses, grads, bn_states


def sharded_update(replicas, grads, states, lr, batch_size, shard, bucket_bytes=None, scaler=None,
                   allreduce_dtype="fp32", units=None):
    """ZeRO's half of the step once the gradients exist (common/zero.py): each device's own slice of every unit's
    summed gradient, by allreduce_gradients and a cut (shard "optimizer") or reduce_scatter (shard "gradients"); at
    fp16 the slices unscaled and every device of every process skipping if any saw an overflow; each device's
    parameter slices updated with its sharded state (`states`: shard_states'; None: the recipe's sgd), clipping by
    the norm summed from every device's slices; the slices all_gather'ed and every replica's list re-pointed at its
    new arrays. Shard "parameters" (stage 3): `replicas` are shard_params' and each device's held slices are what it
    updates (their list re-pointed), and nothing is gathered after: the next step's gather_params does it."""
    if shard not in ("optimizer", "gradients", "parameters"):
        raise RosettaError(f"the scratch step shards the optimizer, the gradients or the parameters, not {shard!r}")
    units = units or UNITS
    rank, world = world_of(replicas)
    owners = [owner_index(rank, len(replicas), i) for i in range(len(replicas))]
    shapes = shapes_of(grads[0])   # the parameters' (a stage 3 replica holds slices)
    parts = units_of(shapes, bucket_bytes)
    if shard == "optimizer":
        grads = allreduce_gradients(grads, bucket_bytes, allreduce_dtype)
        grads = [owned(device_grads, parts, world, owner) for device_grads, owner in zip(grads, owners)]
    else:
        buffers = [flat(device_grads, parts, world) for device_grads in grads]
        grads = [list(slices) for slices in zip(*[reduce_scatter([b[k] for b in buffers], allreduce_dtype)
                                                  for k in range(len(parts))])]
    if scaler is not None:
        finite = unscale_gradients(grads, np.float32(scaler.scale))
        if dist.is_initialized():   # each process saw its slices only
            finite = dist.sum_count(int(not finite)) == 0
        if not scaler.update(finite):
            return   # an overflow somewhere: skipped everywhere
    norm = None
    if states is not None and states[0]["optimizer"].clip_norm is not None:
        norm = global_norm(grads, batch_size)
    if shard == "parameters":
        params = [replica["slices"] for replica in replicas]
    else:
        params = [owned(replica, parts, world, owner) for replica, owner in zip(replicas, owners)]
    for i, (device_params, device_grads) in enumerate(zip(params, grads)):
        if states is None:
            sgd(device_params, device_grads, lr, batch_size, units["update"])
        else:
            optimizer.apply(device_params, device_grads, states[i], lr, batch_size, units["optimizer.update"],
                            norm=None if norm is None else jax.device_put(norm, device_of(device_params[0])))
    if shard == "parameters":
        return
    gathered = zip(*[all_gather([device_params[k] for device_params in params]) for k in range(len(parts))])
    for replica, buffers in zip(replicas, gathered):
        replica[:] = unflat(list(buffers), parts, shapes)


def global_norm(grads, batch_size):
    """Clipping's norm of the mean gradient from every device's slices (grads[d]: device d's): each device's sum of
    squares, added in device order on the first, across processes by distributed.all_reduce, its square root."""
    partial = [squares(device_grads, batch_size) for device_grads in grads]
    total = partial[0]
    for p in partial[1:]:
        total = total + jax.device_put(p, device_of(partial[0]))
    if dist.is_initialized():
        total = dist.all_reduce(total)
    return jnp.sqrt(total)


@jax.jit
def squares(grads, batch_size):
    """One device's sum of the squares of its slices of the mean gradient (optimizer.update's g / batch_size)."""
    grads = [g / batch_size for g in grads]
    return sum(jnp.sum(g * g) for g in grads)


def step_on_shards(model, replicas, bn_states, X_shards, y_shards, devices, lr, batch_size, states=None,
                   bucket_bytes=None, units=None, accumulate=1, scaler=None, allreduce_dtype="fp32", shard="none"):
    """The step on shards already on their devices: each device's loss and gradients, the gradients summed across
    devices (allreduce_gradients: per parameter, or by buckets of bucket_bytes), the same update on every replica (with
    states, optimizer.py's, each replica's state advancing); bn_states[:] gets the new running statistics. `units`:
    execution.compile's (None: UNITS, as written). With `scaler` (fp16's common.loss_scaling.Scaler) the gradients are
    the loss's times scaler.scale (an argument of the compiled loss_and_grads, not a constant), unscaled after the
    all-reduce, and the update runs only where scaler.update(finite) says so: a skipped step moves no weight and no
    optimizer state, and keeps the running statistics its forward made. `allreduce_dtype`: the wire's (allreduce; the
    all-reduce runs op by op at every exec level, so no compiled unit bakes it). `shard` (ZeRO's, common/zero.py):
    other than "none", whole states are cut by shard_states on the first call (the list's slots re-pointed) and
    sharded_update runs the rest, its compiled units taking the slices as they take whole arrays. At "parameters"
    (stage 3) the replicas too are cut, by shard_params on the first call, and the list holds only the slices between
    steps: each step gathers the whole parameters (gather_params) for the forward and backward, of the same shapes
    every step (no compiled unit traces again), and drops them when it returns; the BatchNorm running statistics stay
    replicated, as FSDP keeps its buffers. Returns each device's summed loss."""
    units = units or UNITS
    scale = None if scaler is None else np.float32(scaler.scale)
    whole = replicas
    if shard == "parameters":
        if not isinstance(replicas[0], dict):   # the first stage 3 step: whole replicas, cut
            replicas[:] = shard_params(replicas, bucket_bytes)
        whole = gather_params(replicas, bucket_bytes)
    losses, grads, bn_states[:] = accumulated(units["loss_and_grads"], model, whole, bn_states, X_shards,
                                              y_shards, devices, accumulate, scale)
    if shard != "none":
        if states is not None and "shard" not in states[0]:   # the first sharded step: whole states, cut
            states[:] = shard_states(states, whole, bucket_bytes)
        sharded_update(replicas, grads, states, lr, batch_size, shard, bucket_bytes, scaler, allreduce_dtype, units)
        return losses
    grads = allreduce_gradients(grads, bucket_bytes, allreduce_dtype)
    if scaler is not None and not scaler.update(unscale_gradients(grads, scale)):
        return losses   # an overflow: skipped
    for i, (params, device_grads) in enumerate(zip(replicas, grads)):
        if states is None:
            sgd(params, device_grads, lr, batch_size, units["update"])
        else:
            optimizer.apply(params, device_grads, states[i], lr, batch_size, units["optimizer.update"])
    return losses


# The units of the step, as written: execution.compile(level, model) returns this dict with each name as the level
# makes it (jax.jit: loss_and_grads one device's part at a time, the updates whole; the all-reduce between them runs
# op by op), and train_step takes it through its settings.
UNITS = {"update": update, "optimizer.update": optimizer.update, "loss_and_grads": loss_and_grads,
         "step_on_shards": step_on_shards}


def train_step(model, replicas, bn_states, X, y, devices, lr, batch_size=None, states=None, settings=StepSettings()):
    """One step of the network `model` (lenet.Functional or resnet.Functional) with the run's settings (bucket_bytes,
    units, accumulate, scaler, allreduce_dtype, shard): split_and_load, the step on the shards, the mean loss over X."""
    units = settings.units or UNITS
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses = units["step_on_shards"](model, replicas, bn_states, X_shards, y_shards, devices, lr, batch_size or len(X),
                                     states, settings.bucket_bytes, units, settings.accumulate, settings.scaler,
                                     settings.allreduce_dtype, settings.shard)
    return sum(float(loss) for loss in jax.device_get(losses)) / len(X)   # one wait for every device's loss


def evaluate(model, replica, bn_state, X, y):
    """One replica's accuracy in inference mode (the ResNet by its running statistics bn_state)."""
    return model.evaluate(replica, bn_state, X, y)
