"""Sharded data parallelism, written once: ZeRO's stages (Rajbhandari et al. 2020) as PyTorch's
ZeroRedundancyOptimizer and FSDP, DeepSpeed and a JAX state placed with NamedSharding run them.

The recipe replicates everything: every device holds the parameters, the summed gradients and the optimizer state,
and the all-reduce leaves the same sum on every one. ZeRO cuts that all-reduce in two, a reduce-scatter (each device
gets the sum of its own slice) and an all-gather (each device gets every slice), and keeps on a device only what its
slice needs (--shard):
    none         stage 0, the recipe: all-reduce; every device updates everything.
    optimizer    stage 1 (ZeroRedundancyOptimizer under DDP): all-reduce; each device updates its slice of the
                 parameters with its slice of the optimizer state, the only state it keeps; all-gather of the
                 updated slices.
    gradients    stage 2: reduce-scatter, each device keeping its slice of the summed gradients alone; the update of
                 the slice; all-gather of the parameters.
    parameters   stage 3 (FSDP's full sharding): each device keeps its slice of the parameters too, between steps;
                 an all-gather before the forward (FSDP gathers again for the backward, having freed them between),
                 reduce-scatter, the update of the slice, nothing gathered after. The scratch step gathers the whole
                 network once for its forward and backward (autograd keeps the weights the backward needs) and drops
                 it after the update; FSDP gathers a layer at a time, so that at most a layer is whole at once.
The unit is the all-reduce's: one parameter (--allreduce per-tensor) or one flat bucket of parameters
(common.buckets.plan, --allreduce bucketed), flattened, padded with zeros to a multiple of the world's device count N
and cut into N equal contiguous slices. Device g (g = the process's rank * its devices + the device's index in it)
owns slice g: torch.distributed.reduce_scatter_tensor and all_gather_into_tensor cut theirs so, and FSDP pads its flat
parameters so. A padding element has a zero gradient, so its state and weight stay 0 under every optimizer here.

The update is element-wise but for clipping, whose global norm is summed from every device's slice (an all-reduce of
one number): every stage computes the replicated step's numbers (step, below, proves it in numpy), the norm summed in
another order aside.
"""
import dataclasses

import numpy as np

from .buckets import plan
from .interface import RosettaError
from .optim import step as replicated_step

SHARDS = ("none", "optimizer", "gradients", "parameters")   # ZeRO's stages 0 to 3
# The built-in engines that shard, and their stages: PyTorch's ZeroRedundancyOptimizer under DDP (1) and FSDP2's
# fully_shard (2: its reshard_after_forward=False, 3); JAX's jitted step with the state, or the parameters and the
# state, placed by NamedSharding over the data axis (1, 3: XLA picks the collectives; 2: shard_map's psum_scatter,
# the reduce-scatter XLA's CPU compiler does not make). TensorFlow and MXNet have no engine that shards.
SHARD_ENGINES = {"pytorch": SHARDS[1:], "jax": SHARDS[1:]}
# The engines whose checkpoints each rank writes its own shard of, the framework's way: FSDP2's, PyTorch's Distributed
# Checkpoint (pytorch/checkpoint.save_sharded); JAX's jitted step, Orbax saving its sharded global arrays from every
# process (jax/checkpoint.save_sharded). The others gather the state and one rank writes the whole: the scratch steps'
# slices are cuts of flat padded buffers, no tensor's shards; ZeroRedundancyOptimizer's own is a state_dict
# consolidated on rank 0.
SHARDED_CHECKPOINTS = {"pytorch": ("gradients", "parameters"), "jax": SHARDS[1:]}
ITEMSIZE = 4   # float32: parameters, gradients and optimizer state


def check(shard):
    if shard not in SHARDS:
        raise RosettaError(f"unknown --shard {shard!r}; choose from {', '.join(SHARDS)}")
    return shard


def stage(shard):
    """ZeRO's stage number of a --shard value (0 to 3)."""
    return SHARDS.index(check(shard))


def groups(sizes, bucket_bytes=None):
    """The units the parameters are sharded by, as lists of their indices (`sizes`: each parameter's elements): one
    parameter each (bucket_bytes None, the per-tensor all-reduce's), or the bucketed all-reduce's buckets."""
    return [[i] for i in range(len(sizes))] if bucket_bytes is None else plan(sizes, bucket_bytes)


def chunk(size, world):
    """The elements of each of the `world` slices of a flat unit of `size` elements (the last slices hold padding)."""
    return -(-size // world)


def bounds(size, world, owner):
    """(start, stop) of device `owner`'s slice of a unit of `size` elements, in the padded flat buffer."""
    c = chunk(size, world)
    return owner * c, (owner + 1) * c


def owner_index(rank, devices, device):
    """The global index of a process's `device`-th device, `devices` a process, the slice it owns."""
    return rank * devices + device


def flat(arrays, world):
    """A unit's arrays flattened into one buffer, zero-padded to world * chunk elements."""
    buffer = np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])
    return np.concatenate([buffer, np.zeros(chunk(buffer.size, world) * world - buffer.size, np.float32)])


def unflat(buffer, shapes):
    """A unit's flat (padded) buffer cut back into its arrays' shapes."""
    arrays, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        arrays.append(buffer[start:start + size].reshape(shape))
        start += size
    return arrays


def reduce_scatter(buffers):
    """Each device's flat padded buffer of one unit -> each device's slice of their sum: the all-reduce's sum (added
    in device order, as every framework's allreduce adds), cut."""
    total = buffers[0].copy()
    for b in buffers[1:]:
        total = total + b
    return cut(total, len(buffers))


def all_gather(slices):
    """Every device's slice of one unit -> the whole flat (padded) buffer, on every device."""
    return np.concatenate(slices)


def step(optimizer, weights, grads, state, shard, bucket_bytes=None):
    """The sharded step in numpy, for `shard`'s stage: the canonical `weights` (name -> array, every device's the same
    at stages 0-2), each device's summed gradients `grads` (a list of name -> array), the canonical `state`. Returns
    the new weights and state, as common.optim.step gives them on the all-reduced mean (its `grads` divided by the
    global batch beforehand: here they are the mean's per-device shares). Every stage is reduce-scatter or all-reduce,
    the owned slice's update, and all-gather: the same numbers as the replicated step, which it is tested against."""
    check(shard)
    world, names = len(grads), list(weights)
    units = groups([weights[n].size for n in names], bucket_bytes)
    coefficient = optimizer.clip_coefficient({n: sum(g[n] for g in grads) for n in names})
    unclipped = dataclasses.replace(optimizer, clip_norm=None)
    new_weights, new_state = {}, {"step": state["step"] + 1}
    for unit in units:
        unit_names = [names[i] for i in unit]
        shapes = [weights[n].shape for n in unit_names]
        summed = reduce_scatter([flat([g[n] for n in unit_names], world) for g in grads])
        w_slices = cut(flat([weights[n] for n in unit_names], world), world)
        slots = {slot: cut(flat([state[f"{slot}.{n}"] for n in unit_names], world), world) for slot in optimizer.slots}
        updated, kept = [], {slot: [] for slot in optimizer.slots}
        for g in range(world):   # each device updates its own slice with its own slice of the state
            w, s = replicated_step(unclipped, {"slice": w_slices[g]}, {"slice": summed[g] * np.float32(coefficient)},
                                   {"step": state["step"], **{f"{slot}.slice": slots[slot][g] for slot in slots}})
            updated.append(w["slice"])
            for slot in slots:
                kept[slot].append(s[f"{slot}.slice"])
        new_weights.update(zip(unit_names, unflat(all_gather(updated), shapes)))
        for slot in kept:
            new_state.update((f"{slot}.{n}", a) for n, a in zip(unit_names, unflat(all_gather(kept[slot]), shapes)))
    return new_weights, new_state


def cut(buffer, world):
    """A flat padded buffer's `world` equal slices."""
    return np.split(buffer, world)


def memory(sizes, slots, world, shard):
    """The bytes one device holds between steps, by what: {"parameters", "gradients", "optimizer state"}, for units
    of `sizes` elements (groups': a slice's padding counts), `slots` optimizer buffers a parameter (the length of
    common.optim.Optimizer.slots), `world` devices. The gradients are counted as held after the reduction: all of
    them at stages 0-1, the owned slice at 2-3."""
    s = stage(shard)
    full = sum(sizes) * ITEMSIZE
    sliced = sum(chunk(size, world) for size in sizes) * ITEMSIZE
    return {"parameters": sliced if s >= 3 else full, "gradients": sliced if s >= 2 else full,
            "optimizer state": slots * (sliced if s >= 1 else full)}


def volume(sizes, world, shard):
    """The bytes one device sends a step (`sizes`: the units', as memory's) under a ring's collectives (each of N devices sends (N - 1) / N of a
    buffer in a reduce-scatter or an all-gather, twice that in an all-reduce): stage 0 one all-reduce; stage 1 an
    all-reduce and an all-gather of the parameters (ZeroRedundancyOptimizer's); stage 2 a reduce-scatter and an
    all-gather, the all-reduce's volume; stage 3 two all-gathers (forward, backward) and a reduce-scatter."""
    if world == 1:
        return 0
    padded = sum(chunk(size, world) * world for size in sizes) * ITEMSIZE
    one = padded * (world - 1) // world
    return one * (2, 3, 2, 3)[stage(shard)]
