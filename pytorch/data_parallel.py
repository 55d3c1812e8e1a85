"""Data parallelism from scratch in PyTorch: split the batch, forward and backward on every device,
sum the gradients across devices, apply the same SGD update to every replica (or, with states, the same
update of optimizer.py). One step for every network: the network (a Functional of lenet.py or resnet.py) brings its
forward, its loss and its BatchNorm state; the run's settings (the all-reduce's buckets, the compiled units, the
gradients' precision on the wire) are the step's arguments."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.buckets import plan
from common.interface import RosettaError, StepSettings
from common.sharding import micro_batches, shard_bounds
from common.zero import chunk, groups, owner_index

from . import distributed, optimizer
from .lenet import DTYPES


def split_and_load(array, devices):
    """torch.tensor copies: a shard never aliases the caller's numpy array, on the CPU as on a GPU. The network lays
    its images out itself (its Functional's layout): PyTorch picks its convolution path from their strides."""
    return [torch.tensor(array[a:b], device=d) for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices)]


def allreduce(tensors, dtype="fp32"):
    """Sum on the first tensor's device, then copy the sum back into every tensor, in place.
    In a multi-process run the local sum is also summed across processes by torch.distributed. With dtype 'bf16'
    (--allreduce-dtype) the sum is common.precision.summed_on_the_wire's: every tensor cast to bf16 (rounded to
    nearest even), the bf16 tensors added in device order (each `+=` rounded), all_reduce'd as bf16 (gloo and NCCL
    sum bf16 tensors), and the sum widened back into every tensor."""
    with torch.no_grad():
        wire = tensors if dtype == "fp32" else [t.to(DTYPES[dtype]) for t in tensors]
        total = wire[0]
        for t in wire[1:]:
            total += t.to(total.device)
        if dist.is_initialized():
            dist.all_reduce(total)
        for t in tensors:
            if t is not total:   # at fp32 the first tensor holds the sum already
                t.copy_(total.to(t.device))
    return tensors


def allreduce_gradients(grads, bucket_bytes=None, dtype="fp32"):
    """Every parameter's gradient summed across devices, in place (grads[d]: device d's list): an allreduce per
    parameter, or per bucket of parameters (common/buckets.py), each device's gradients flattened into one buffer
    (torch.cat) and the sum copied back into them, as DistributedDataParallel does. `dtype`: the precision on the
    wire (allreduce's; a bucket is cast whole, as DDP's bf16_compress_hook casts its bucket)."""
    if bucket_bytes is None:
        for per_device in zip(*grads):     # one parameter's gradient on every device
            allreduce(list(per_device), dtype)
        return grads
    for bucket in plan([g.numel() for g in grads[0]], bucket_bytes):
        buffers = allreduce([torch.cat([device_grads[i].reshape(-1) for i in bucket]) for device_grads in grads],
                            dtype)
        for device_grads, buffer in zip(grads, buffers):
            pieces = buffer.split([device_grads[i].numel() for i in bucket])
            for i, piece in zip(bucket, pieces):
                device_grads[i].copy_(piece.view(device_grads[i].shape))   # into its strides (channels-last too)
    return grads


def reduce_scatter(buffers, dtype="fp32"):
    """ZeRO's half of an all-reduce (common/zero.py): one flat padded buffer of a unit per local device -> each
    device's own slice of the sum over every device of every process, on its device. Summed on the first device in
    device order, as allreduce sums (with dtype 'bf16' cast, added and sent in bf16, as its wire is, then widened),
    then across processes by distributed.reduce_scatter: a process's chunk is its devices' slices, contiguous, as
    the owners are numbered."""
    with torch.no_grad():
        wire = [b.to(DTYPES[dtype]) for b in buffers]   # at fp32 the buffers themselves, left unchanged
        total = wire[0]
        for b in wire[1:]:
            total = total + b.to(total.device)
        if dist.is_initialized():
            total = distributed.reduce_scatter(total)
        return [s.to(b.device, torch.float32) for s, b in zip(total.tensor_split(len(buffers)), buffers)]


def all_gather(slices):
    """reduce_scatter's inverse: each local device's slice of a unit -> the whole flat (padded) buffer on every local
    device: the local slices concatenated in device order, every process's chunk of them gathered in rank order
    (distributed.all_gather), a copy on each other device."""
    with torch.no_grad():
        whole = torch.cat([s.to(slices[0].device) for s in slices])
        if dist.is_initialized():
            whole = distributed.all_gather(whole)
        return [whole] + [whole.to(s.device, copy=True) for s in slices[1:]]


def shard_states(states, replicas, bucket_bytes=None):
    """Each device's whole state cut to the slices it owns (common/zero.py): every slot's buffers of a unit
    flattened in PyTorch's element order (reshape's: the shape's, whatever the strides), zero-padded and cut into
    the world's slices; the owned one copied, so that the whole buffers can go."""
    rank, world = world_of(replicas)
    units = groups([p.numel() for p in replicas[0]], bucket_bytes)
    sharded = []
    for device, state in enumerate(states):
        owner = owner_index(rank, len(replicas), device)
        sliced = {"optimizer": state["optimizer"], "step": state["step"], "shard": (owner, world)}
        for slot in state["optimizer"].slots:
            sliced[slot] = [owned(state[slot], unit, world, owner).clone() for unit in units]
        sharded.append(sliced)
    return sharded


def gather_states(states, replicas, bucket_bytes=None):
    """shard_states' inverse: every slot's slices of a unit all_gather'ed and cut back into init_state's buffers, in
    each replica's shapes and strides (a channels-last kernel's buffer is channels-last), the step count kept."""
    sizes = [p.numel() for p in replicas[0]]
    whole = [{**optimizer.init_state(replica, state["optimizer"]), "step": state["step"]}
             for replica, state in zip(replicas, states)]
    with torch.no_grad():
        for slot in states[0]["optimizer"].slots:
            for u, unit in enumerate(groups(sizes, bucket_bytes)):
                for state, replica, buffer in zip(whole, replicas, all_gather([s[slot][u] for s in states])):
                    for i, piece in zip(unit, unflat(buffer, unit, sizes)):
                        state[slot][i].copy_(piece.view(replica[i].shape))
    return whole


def shard_params(replicas, bucket_bytes=None):
    """ZeRO stage 3: each device's whole parameters cut to the slices it owns, as shard_states cuts a slot, the owned
    slice copied (a plain tensor, no gradient: the update's) so that nothing keeps the whole ones alive, as FSDP
    frees a parameter's storage between steps. "like" keeps what gather_params makes them again from, no values:
    each one's torch.empty_strided arguments (shape, strides: a channels-last kernel's, dtype, device,
    requires_grad)."""
    rank, world = world_of(replicas)
    units = groups([p.numel() for p in replicas[0]], bucket_bytes)
    sharded = []
    with torch.no_grad():
        for device, replica in enumerate(replicas):
            owner = owner_index(rank, len(replicas), device)
            sharded.append({"shard": (owner, world),
                            "slices": [owned(replica, unit, world, owner).clone() for unit in units],
                            "like": [{"size": p.shape, "stride": p.stride(), "dtype": p.dtype, "device": p.device,
                                      "requires_grad": p.requires_grad} for p in replica]})
    return sharded


def gather_params(replicas, bucket_bytes=None):
    """shard_params' inverse, the all-gather before stage 3's forward: every unit's slices all_gather'ed (every
    device's and process's) and copied into new leaf tensors of each parameter's shape and strides on its device,
    requiring gradients as get_params makes them: fresh inputs for loss_and_grads (a compiled forward takes the
    parameters as arguments: nothing recompiles), dropped by the caller when its step is done."""
    sizes = [like["size"].numel() for like in replicas[0]["like"]]
    whole = [[None] * len(sizes) for _ in replicas]
    with torch.no_grad():
        for u, unit in enumerate(groups(sizes, bucket_bytes)):
            for params, replica, buffer in zip(whole, replicas, all_gather([r["slices"][u] for r in replicas])):
                for i, piece in zip(unit, unflat(buffer, unit, sizes)):
                    like = replica["like"][i]
                    params[i] = torch.empty_strided(**like).copy_(piece.view(like["size"]))
    return whole


def world_of(replicas):
    """(this process's rank, the world's devices: every process's count of local `replicas`)."""
    rank, processes = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return rank, processes * len(replicas)


def flat(tensors, unit, world):
    """A unit's tensors in one new buffer, in PyTorch's element order (reshape's: the shape's, whatever the strides),
    zero-padded to `world` equal slices (common.zero.flat)."""
    buffer = torch.cat([tensors[i].reshape(-1) for i in unit])
    return F.pad(buffer, (0, chunk(buffer.numel(), world) * world - buffer.numel()))


def owned(tensors, unit, world, owner):
    """Device `owner`'s slice of flat's buffer (common.zero.bounds): a view of it."""
    return flat(tensors, unit, world).tensor_split(world)[owner]


def unflat(buffer, unit, sizes):
    """A unit's whole flat (padded) buffer cut back into its tensors' flat pieces (views), the padding dropped."""
    return buffer[:sum(sizes[i] for i in unit)].split([sizes[i] for i in unit])


def unscale_gradients(grads, scale):
    """fp16's loss scaling (common/loss_scaling.py): every device's all-reduced gradients of the scaled loss times
    1/scale, in place, in fp32 (exact: the scale is a power of two), and whether every one is finite. One call per
    device of torch.amp.GradScaler's own kernel (its unscale_'s), which unscales and looks for an inf or nan at once:
    a Python bool, read once per device."""
    found = []
    for device_grads in grads:
        device = device_grads[0].device
        found.append(torch.zeros((), dtype=torch.float32, device=device))
        torch._amp_foreach_non_finite_check_and_unscale_(list(device_grads), found[-1],
                                                         torch.tensor(1.0 / scale, dtype=torch.float32, device=device))
    return not any(f.item() for f in found)


def sgd(params, grads, lr, batch_size, units=None):
    """The recipe's update, lr / batch_size times the summed gradient, made in place by the unit `update` (of
    `units`, a level's; None: as written)."""
    (units or UNITS)["update"](params, grads, lr / batch_size)


# The units of the step: a compiled level (execution.compile) hands train_step its own form of each name of UNITS,
# or the function as written here. PyTorch compiles the network's forward inside loss_and_grads (torch.compile;
# AOTAutograd compiles its backward).
def update(params, grads, scale):
    """The SGD update of one replica, in place."""
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(g, alpha=scale)


def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, compiled_forward=None, scale=1.0):
    """Every device's part of the step: its shard's summed loss, its replica's gradients (of that loss times `scale`,
    fp16's loss scale) and new BatchNorm state (model.loss_and_grads; compiled_forward: the network's forward where a
    level compiles it)."""
    return model.loss_and_grads(replicas, bn_states, X_shards, y_shards, devices, compiled_forward, scale)


def accumulated(loss_and_grads, model, replicas, bn_states, X_shards, y_shards, devices, count, scale=1.0):
    """Gradient accumulation: each device's shard cut into `count` micro-batches (common.sharding.micro_batches), a
    forward and backward each (all from the same loss `scale`), their summed losses and gradients added up on the
    device; the BatchNorm states go through the micro-batches in turn. Nothing crosses devices here: the all-reduce
    comes once, after it."""
    if count == 1:
        return loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale=scale)
    parts = [micro_batches(len(y), count) for y in y_shards]
    losses = grads = None
    for i in range(count):
        X_micro = [X[part[i][0]:part[i][1]] for X, part in zip(X_shards, parts)]
        y_micro = [y[part[i][0]:part[i][1]] for y, part in zip(y_shards, parts)]
        micro_losses, micro_grads, bn_states = loss_and_grads(model, replicas, bn_states, X_micro, y_micro, devices,
                                                              scale=scale)
        if losses is None:
            losses, grads = list(micro_losses), [list(g) for g in micro_grads]
        else:
            losses = [a + b for a, b in zip(losses, micro_losses)]
            grads = [[a + b for a, b in zip(g, h)] for g, h in zip(grads, micro_grads)]
    return losses, grads, bn_states


def sharded_update(replicas, grads, states, lr, batch_size, shard, bucket_bytes=None, scaler=None,
                   allreduce_dtype="fp32", units=None):
    """ZeRO's half of the step once every device has its gradients (common/zero.py), `shard` its stage: each
    device's slices of the summed gradients, a cut of allreduce_gradients' sums ('optimizer': the replicated step's
    all-reduce) or reduce_scatter's ('gradients', 'parameters': no device holds a whole sum); fp16's unscaling of the
    slices, an overflow on any device of any process skipping every device's update; the clipping norm summed from
    every device's slices (an all-reduce of one number a device); each device's update of the parameter slices it
    owns (optimizer.apply with its sharded state, or the recipe's sgd); the updated slices all_gather'ed back into
    every replica, in place. At 'parameters' the replicas are shard_params' and their own slices are what is
    updated, in place: nothing is gathered after, the next step's gather_params does it."""
    if shard not in ("optimizer", "gradients", "parameters"):
        raise RosettaError(f"the scratch step shards 'optimizer', 'gradients' or 'parameters', not {shard!r}")
    rank, world = world_of(replicas)
    sizes = [g.numel() for g in grads[0]]   # the parameters': a sharded replica holds none whole
    owners = [owner_index(rank, len(replicas), device) for device in range(len(replicas))]
    unit_list = groups(sizes, bucket_bytes)
    with torch.no_grad():
        if shard == "optimizer":
            allreduce_gradients(grads, bucket_bytes, allreduce_dtype)
            slices = [[owned(device_grads, unit, world, owner) for unit in unit_list]
                      for device_grads, owner in zip(grads, owners)]
        else:
            scattered = [reduce_scatter([flat(device_grads, unit, world) for device_grads in grads], allreduce_dtype)
                         for unit in unit_list]
            slices = [list(device_slices) for device_slices in zip(*scattered)]
        if scaler is not None:
            finite = unscale_gradients(slices, scaler.scale)
            if dist.is_initialized():   # each process checked its own slices only
                finite = distributed.sum_count(int(not finite)) == 0
            if not scaler.update(finite):
                return
        norms = [None] * len(replicas)
        if states is not None and states[0]["optimizer"].clip_norm is not None:
            means = [[g / batch_size for g in device_slices] for device_slices in slices]
            norms = [total.sqrt() for total in allreduce([sum((g * g).sum() for g in mean) for mean in means])]
        if shard == "parameters":
            params = [replica["slices"] for replica in replicas]   # each device's own, kept between steps
        else:
            params = [[owned(replica, unit, world, owner) for unit in unit_list]
                      for replica, owner in zip(replicas, owners)]
        for device, (device_params, device_slices) in enumerate(zip(params, slices)):
            if states is None:
                sgd(device_params, device_slices, lr, batch_size, units)
            else:
                optimizer.apply(device_params, device_slices, states[device], lr, batch_size, norm=norms[device])
        if shard == "parameters":
            return
        for u, unit in enumerate(unit_list):
            for replica, buffer in zip(replicas, all_gather([device_params[u] for device_params in params])):
                for i, piece in zip(unit, unflat(buffer, unit, sizes)):
                    replica[i].copy_(piece.view(replica[i].shape))   # into its strides (channels-last too)


def step_on_shards(model, replicas, bn_states, X_shards, y_shards, devices, lr, batch_size, states=None,
                   bucket_bytes=None, units=None, accumulate=1, scaler=None, allreduce_dtype="fp32", shard="none"):
    """The step on shards already on their devices: each device's loss and gradients, the gradients summed across
    devices (allreduce_gradients: per parameter, or by buckets of bucket_bytes; allreduce_dtype on the wire), the
    same update on every replica (the recipe's sgd, or optimizer.apply with each replica's state). `units`: a level's,
    None as written. With a `scaler` (common.loss_scaling.Scaler) the gradients are the loss's times its scale,
    unscaled after the all-reduce, and the update is skipped where one is not finite (every replica sees the same
    sums, so every one skips). With `shard` other than 'none' (ZeRO, common/zero.py) whole states are cut to their
    owned slices on the first call (shard_states, into the caller's list) and sharded_update makes the rest of the
    step. At 'parameters' (stage 3) the replicas are cut too on the first call (shard_params, into the caller's list,
    so the whole ones are freed) and every step gathers them (gather_params) for its forward and backward, dropped
    once the step returns: between steps a device holds its slices alone. Returns each device's summed loss and each
    replica's new BatchNorm state (kept when the update is skipped; replicated at every stage, as FSDP keeps
    buffers)."""
    units = units or UNITS
    scale = 1.0 if scaler is None else scaler.scale
    whole = replicas
    if shard == "parameters":
        if not isinstance(replicas[0], dict):
            replicas[:] = shard_params(replicas, bucket_bytes)
        whole = gather_params(replicas, bucket_bytes)
    losses, grads, new_bn_states = accumulated(units["loss_and_grads"], model, whole, bn_states, X_shards,
                                               y_shards, devices, accumulate, scale)
    if shard != "none":
        if states is not None and "shard" not in states[0]:
            states[:] = shard_states(states, whole, bucket_bytes)
        del whole   # stage 3: the gathered parameters go before the update; the gradients are all it needs
        sharded_update(replicas, grads, states, lr, batch_size, shard, bucket_bytes, scaler, allreduce_dtype, units)
        return losses, new_bn_states
    allreduce_gradients(grads, bucket_bytes, allreduce_dtype)
    if scaler is not None and not scaler.update(unscale_gradients(grads, scale)):
        return losses, new_bn_states
    if states is None:
        for params, device_grads in zip(replicas, grads):
            sgd(params, device_grads, lr, batch_size, units)
    else:
        for params, device_grads, state in zip(replicas, grads, states):
            optimizer.apply(params, device_grads, state, lr, batch_size)
    return losses, new_bn_states


UNITS = {"update": update, "loss_and_grads": loss_and_grads, "step_on_shards": step_on_shards}


def train_step(model, replicas, bn_states, X, y, devices, lr, batch_size=None, states=None, settings=StepSettings()):
    """One step of the network `model` on a numpy batch (common.interface.CONTRACT): the replicas and states in place
    (under settings.shard the list holds shard_states' states from the first step on, and at 'parameters' the
    replicas' list shard_params' slices), the new running statistics into bn_states' slots, settings.scaler's scale
    moved on. Returns the mean loss (unscaled)."""
    units = settings.units or UNITS
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses, bn_states[:] = units["step_on_shards"](model, replicas, bn_states, X_shards, y_shards, devices, lr,
                                                   batch_size or len(X), states, settings.bucket_bytes, units,
                                                   settings.accumulate, settings.scaler, settings.allreduce_dtype,
                                                   settings.shard)
    return sum(loss.item() for loss in losses) / len(X)


def evaluate(model, replica, bn_state, X, y):
    """Accuracy of one replica, in inference mode (the ResNet's BatchNorm by its running statistics)."""
    return model.evaluate(replica, bn_state, X, y)
