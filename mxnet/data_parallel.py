"""Data parallelism from scratch in MXNet: split the batch, forward and backward on every context,
sum the gradients across contexts, apply the same SGD update to every replica (or, with states, the same
update of optimizer.py). One step for every network: `model` is lenet.py's or resnet.py's Functional. With a loss
scaler (--precision fp16) the backward is the scaled loss's, and the summed gradients are unscaled and checked before
the update, which an overflow skips (common/loss_scaling.py). With --allreduce-dtype bf16 the gradients are summed in
bf16 (on_the_wire). With --shard (ZeRO, common/zero.py) each context keeps and updates only the slices it owns
(sharded_update); at stage 3 ('parameters') it keeps only its slices of the parameters too, between steps
(shard_params), and gathers the whole network for a step's forward and backward (gather_params)."""
import numpy as np
from mxnet import nd

from common.buckets import plan
from common.interface import RosettaError, StepSettings, Unavailable
from common.sharding import micro_batches, shard_bounds
from common.zero import bounds, chunk, groups, owner_index

from . import distributed as dist
from . import optimizer
from .lenet import DTYPES


def split_and_load(array, devices):
    """gluon.utils.split_and_load(even_split=False)'s cut, from common.sharding. nd.array copies (a shard
    never aliases the caller's numpy array) and makes every shard float32 unless given the dtype."""
    return [nd.array(array[a:b], ctx=d, dtype=array.dtype)
            for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices)]


def allreduce(tensors, name=("tensor",), dtype="fp32"):
    """Sum on the first tensor's context, then copy the sum back into every tensor, in place.
    In a multi-process run the local sum is also summed across processes by the kvstore, which needs a name for
    each value, the same in every process (distributed.all_reduce turns it and the shape into a key). With dtype
    'bf16' the sum is on_the_wire's."""
    if dtype != "fp32":
        return on_the_wire(tensors, name, dtype)
    for t in tensors[1:]:
        tensors[0] += t.copyto(tensors[0].context)
    if dist.is_initialized():
        dist.all_reduce(tensors[0], name)
    for t in tensors[1:]:
        tensors[0].copyto(t)
    return tensors


def on_the_wire(tensors, name, dtype):
    """allreduce with `dtype` (bf16) on the wire, common.precision.summed_on_the_wire's sum, in place: every tensor
    cast to it by amp_cast, the casts added up on the first tensor's context in context order by elemwise_add, across
    processes by across_processes, the sum widened back into every tensor. amp_cast and elemwise_add round to nearest
    even (their oneDNN kernels, on the CPU); astype and `+` or `+=` (Cast, broadcast_add) would truncate, as mshadow's
    bf16_t keeps a float's upper 16 bits, and so would every kernel of a GPU: GPU contexts are refused."""
    total = wire_sum(tensors, dtype)
    if dist.is_initialized():
        total = across_processes(total, name)
    for t in tensors:
        nd.amp_cast(total.as_in_context(t.context), dtype=np.float32, out=t)
    return tensors


def wire_sum(tensors, dtype):
    """on_the_wire's sum within the process: a new bf16 tensor on the first tensor's context."""
    if any(t.context.device_type == "gpu" for t in tensors):
        raise Unavailable(f"--allreduce-dtype {dtype} on MXNet GPUs: only its oneDNN (CPU) kernels round to bf16, its "
                          f"GPU kernels truncate (mshadow's bf16_t)")
    wire = [nd.amp_cast(t, dtype=DTYPES[dtype]) for t in tensors]
    total = wire[0]
    for w in wire[1:]:
        nd.elemwise_add(total, w.as_in_context(total.context), out=total)
    return total


def across_processes(total, name, collective=None):
    """The sum of every process's bf16 `total`, in bf16 (with `collective` distributed.reduce_scatter, this process's
    chunk of it; None: distributed.all_reduce). The kvstore's server refuses bf16 (its type switch stops on
    "Unknown type enum 12"), so the values travel widened to fp32 (between processes the bytes are fp32's) and their
    sum is rounded to bf16 once: with two processes that is the one fp32 addition elemwise_add makes and rounds, the
    bf16 sum; past two the server's fp32 additions would each skip a rounding, so no other count runs."""
    if dist.process_count() > 2:
        raise Unavailable(f"--allreduce-dtype bf16 across {dist.process_count()} MXNet processes: its kvstore carries "
                          f"no bf16, and its fp32 sum is the bf16 sum for only two processes")
    wide = nd.amp_cast(total, dtype=np.float32)
    return nd.amp_cast((collective or dist.all_reduce)(wide, name), dtype=total.dtype)


def allreduce_gradients(grads, bucket_bytes=None, dtype="fp32"):
    """Every parameter's gradient summed across contexts, in place (grads[d]: context d's list): an allreduce per
    parameter (named by its index), or per bucket of parameters (common/buckets.py), each context's gradients
    flattened into one buffer (nd.concat) and the sum written back into them, as DDP does. `dtype`: the precision
    on the wire (allreduce's; a bucket is cast whole)."""
    if bucket_bytes is None:
        for i, per_device in enumerate(zip(*grads)):   # one parameter's gradient on every context
            allreduce(list(per_device), ("gradient", i), dtype)
        return grads
    for b, bucket in enumerate(plan([g.size for g in grads[0]], bucket_bytes)):
        buffers = allreduce([nd.concat(*[device_grads[i].reshape(-1) for i in bucket], dim=0)
                             for device_grads in grads], ("bucket", b), dtype)
        for device_grads, buffer in zip(grads, buffers):
            start = 0
            for i in bucket:
                g = device_grads[i]
                g[:] = buffer[start:start + g.size].reshape(g.shape)   # in place: the parameter's .grad
                start += g.size
    return grads


def reduce_scatter(buffers, dtype="fp32", name=("unit",)):
    """Each context's flat padded buffer of one unit (common/zero.py) -> each context's own slice of their sum over
    every context of every process, on its context. The sum on the first context in context order, as allreduce adds
    (with dtype 'bf16' on_the_wire's, in bf16), across processes by distributed.reduce_scatter (this process's chunk:
    its contexts' slices, contiguous), then cut. `name`: the kvstore's, as allreduce's."""
    if dtype == "fp32":
        total = buffers[0].copy()
        for b in buffers[1:]:
            total += b.copyto(total.context)
        if dist.is_initialized():
            total = dist.reduce_scatter(total, name)
    else:
        total = wire_sum(buffers, dtype)
        if dist.is_initialized():
            total = across_processes(total, name, dist.reduce_scatter)
        total = nd.amp_cast(total, dtype=np.float32)
    k = total.shape[0] // len(buffers)
    return [total[d * k:(d + 1) * k].copyto(b.context) for d, b in enumerate(buffers)]


def all_gather(slices, name=("unit",)):
    """Each context's own slice of one unit -> the whole flat (padded) buffer, on every context: the slices
    concatenated on the first context, every process's chunk by distributed.all_gather, copied to every context."""
    whole = nd.concat(*[s.as_in_context(slices[0].context) for s in slices], dim=0)
    if dist.is_initialized():
        whole = dist.all_gather(whole, name)
    return [whole.copyto(s.context) for s in slices]


def shard_states(states, replicas, bucket_bytes=None):
    """Each context's whole state cut to the slices its device owns (common/zero.py): per slot, a list of one flat
    padded slice a unit, each a copy that holds its own memory alone (state_bytes counts it); the step and the
    optimizer kept, and "shard": (owner, world devices)."""
    rank, world = world_of(len(replicas))
    units = groups([p.size for p in replicas[0]], bucket_bytes)
    sharded = []
    for d, state in enumerate(states):
        owner = owner_index(rank, len(replicas), d)
        sharded.append({"optimizer": state["optimizer"], "step": state["step"], "shard": (owner, world),
                        **{slot: [owned([state[slot][i] for i in unit], world, owner) for unit in units]
                           for slot in state["optimizer"].slots}})
    return sharded


def gather_states(states, replicas, bucket_bytes=None):
    """shard_states' inverse: every slot's slices all_gather'ed into whole buffers of the replicas' shapes, on every
    context (init_state's form, which state_to_numpy reads)."""
    units = groups([p.size for p in replicas[0]], bucket_bytes)
    whole = [{"optimizer": s["optimizer"], "step": s["step"],
              **{slot: [nd.zeros_like(p) for p in replica] for slot in s["optimizer"].slots}}
             for s, replica in zip(states, replicas)]
    for slot in states[0]["optimizer"].slots:
        for u, unit in enumerate(units):
            for w, buffer in zip(whole, all_gather([s[slot][u] for s in states], ("state", slot, u))):
                unflat(buffer, [w[slot][i] for i in unit])
    return whole


def shard_params(replicas, bucket_bytes=None):
    """Each context's whole parameters cut to the slices its device owns, as shard_states cuts a slot (owned: a
    copy, so the whole replica can be freed), what --shard parameters keeps between steps; "like": what
    gather_params rebuilds them from, their shapes, dtype and context (get_params' NDArrays), no values."""
    rank, world = world_of(len(replicas))
    units = groups([p.size for p in replicas[0]], bucket_bytes)
    sharded = []
    for d, replica in enumerate(replicas):
        owner = owner_index(rank, len(replicas), d)
        sharded.append({"shard": (owner, world),
                        "slices": [owned([replica[i] for i in unit], world, owner) for unit in units],
                        "like": {"shapes": [p.shape for p in replica], "dtype": replica[0].dtype,
                                 "context": replica[0].context}})
    return sharded


def gather_params(replicas, bucket_bytes=None):
    """shard_params' inverse, a collective: each unit's slices all_gather'ed and cut back into new NDArrays of the
    replicas' shapes on each one's context, attach_grad'ed as get_params makes them. The graph level's cached graphs
    take the parameters as inputs (lenet.Traced, resnet.Segment), not as Parameters a CachedOp holds, so arrays new
    every step run the same graphs, nothing traced again."""
    like = [r["like"] for r in replicas]
    units = groups([int(np.prod(shape)) for shape in like[0]["shapes"]], bucket_bytes)
    whole = [[nd.zeros(shape, w["context"], dtype=w["dtype"]) for shape in w["shapes"]] for w in like]
    for u, unit in enumerate(units):
        for params, buffer in zip(whole, all_gather([r["slices"][u] for r in replicas], ("parameter unit", u))):
            unflat(buffer, [params[i] for i in unit])
    for params in whole:
        for p in params:
            p.attach_grad()                # grad_req "write", as get_params
    return whole


def world_of(count):
    """(rank, world): this process's rank (its kvstore's; 0 alone) and the devices of every process, each holding
    `count` (common.zero.owner_index)."""
    return (dist.rank(), dist.process_count() * count) if dist.is_initialized() else (0, count)


def flat(tensors, world):
    """A unit's tensors flattened in NDArray's own (row-major) order into one buffer on the first one's context,
    zero-padded to common.zero.chunk * world elements."""
    size = sum(t.size for t in tensors)
    parts = [t.reshape(-1) for t in tensors]
    if chunk(size, world) * world > size:
        parts.append(nd.zeros((chunk(size, world) * world - size,), tensors[0].context, dtype=tensors[0].dtype))
    return nd.concat(*parts, dim=0)


def owned(tensors, world, owner):
    """Device `owner`'s slice of a unit's tensors (flat, common.zero.bounds): a copy, not a view of the whole."""
    start, stop = bounds(sum(t.size for t in tensors), world, owner)
    return flat(tensors, world)[start:stop].copy()


def unflat(buffer, tensors):
    """A unit's flat buffer written back into its tensors, in place, in their shapes (the padding left out)."""
    start = 0
    for t in tensors:
        t[:] = buffer[start:start + t.size].reshape(t.shape)
        start += t.size


def unscale_gradients(grads, scale):
    """The all-reduced gradients of the scaled loss multiplied by 1/scale in fp32, in place (exact: scale is a power
    of two), and whether every one is finite: multi_all_finite, the check of contrib.amp's LossScaler, on the first
    context's (after the all-reduce every context holds the same sums, as every process does)."""
    inverse = 1.0 / scale
    for device_grads in grads:
        for g in device_grads:
            g *= inverse                   # in place: the parameter's .grad
    finite = nd.multi_all_finite(*grads[0], num_arrays=len(grads[0]))
    return bool(finite.asscalar())


def sgd(params, grads, lr, batch_size):
    """The recipe's update, lr / batch_size times the summed gradient, made in place (update)."""
    update(params, grads, lr / batch_size)


# The units of the step: execution.compile(level, model) hands train_step (settings.units) each name of UNITS as the
# level makes it, or as written here. MXNet's graph level traces the model's forward with hybridize, inside
# loss_and_grads (the cached graph runs the backward too); update (through sgd) and step_on_shards (with --shard's
# sharded_update) run as written at every level (execution.COMPILERS names no other unit).
def update(params, grads, scale):
    """The SGD update of one replica, in place."""
    for p, g in zip(params, grads):
        p -= scale * g                     # in place: NDArray's -= writes into p


def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale=None):
    """Every context's part of the step: its shard's summed loss, its replica's gradients and new BatchNorm state
    (model.loss_and_grads: the LeNet's contexts each on their own, queued asynchronously so that they work in
    parallel; the ResNet's in lock-step, layer by layer, for its BatchNorm). With a loss scale, the gradients of the
    loss times it (the loss itself unscaled)."""
    return model.loss_and_grads(replicas, bn_states, X_shards, y_shards, devices, scale)


def accumulated(loss_and_grads, model, replicas, bn_states, X_shards, y_shards, devices, count, scale=None):
    """Gradient accumulation: each context's shard cut into `count` micro-batches (common.sharding.micro_batches), a
    forward and backward each (every one from the same loss scale), their summed losses and gradients added up on the
    context (copied out of the parameters' .grad, which the next backward overwrites); the BatchNorm states go through
    the micro-batches in turn. Nothing crosses contexts here: the all-reduce comes once, after it."""
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
            losses, grads = list(micro_losses), [[g.copy() for g in device_grads] for device_grads in micro_grads]
        else:
            losses = [a + b for a, b in zip(losses, micro_losses)]
            grads = [[a + b for a, b in zip(g, h)] for g, h in zip(grads, micro_grads)]
    return losses, grads, bn_states


def sharded_update(replicas, grads, states, lr, batch_size, shard, bucket_bytes=None, scaler=None,
                   allreduce_dtype="fp32"):
    """--shard's half of the step once the gradients exist (common/zero.py), `states` shard_states' (None: the
    recipe's sgd). Each context's slices of the summed gradients: cut from allreduce_gradients' sums ('optimizer'), or
    reduce_scatter'ed unit by unit ('gradients', 'parameters'). With a `scaler` they are unscaled, and an overflow on
    any context of any process skips every update. Each context updates its own slices of its replica's parameters,
    clipping by the norm summed from every context's slices, and all_gather writes the updated units back into every
    replica; at 'parameters' the replicas are shard_params' and their slices are updated in place, nothing gathered:
    the next step's gather_params reads them."""
    if shard not in ("optimizer", "gradients", "parameters"):
        raise RosettaError(f"unknown --shard {shard!r} for the scratch step; choose from none, optimizer, gradients, "
                           f"parameters")
    count = len(replicas)
    rank, world = world_of(count)
    owners = [owner_index(rank, count, d) for d in range(count)]
    units = groups([g.size for g in grads[0]], bucket_bytes)   # the parameters' sizes, whole or sharded
    if shard == "optimizer":
        allreduce_gradients(grads, bucket_bytes, allreduce_dtype)
        slices = [[owned([g[i] for i in unit], world, owner) for unit in units]
                  for g, owner in zip(grads, owners)]
    else:
        scattered = [reduce_scatter([flat([g[i] for i in unit], world) for g in grads], allreduce_dtype,
                                    ("gradient unit", u)) for u, unit in enumerate(units)]
        slices = [list(device_slices) for device_slices in zip(*scattered)]   # slices[d][u]
    if scaler is not None:
        overflows = sum(not unscale_gradients([device_slices], scaler.scale) for device_slices in slices)
        if dist.is_initialized():
            overflows = dist.all_reduce(nd.array([overflows]), ("overflows",)).asscalar()
        if not scaler.update(overflows == 0):
            return
    norm = None
    if states is not None and states[0]["optimizer"].clip_norm is not None:
        squares = [nd.add_n(*[(m * m).sum() for m in (g / batch_size for g in device_slices)])
                   for device_slices in slices]   # the mean gradient's, as apply squares it
        norm = squares[0]
        for s in squares[1:]:
            norm = norm + s.as_in_context(norm.context)
        if dist.is_initialized():
            dist.all_reduce(norm, ("clip norm",))
        norm = norm.sqrt()
    if shard == "parameters":
        params = [r["slices"] for r in replicas]   # each context's own, held between steps
    else:
        params = [[owned([r[i] for i in unit], world, owner) for unit in units]
                  for r, owner in zip(replicas, owners)]
    if states is None:
        for device_params, device_slices in zip(params, slices):
            sgd(device_params, device_slices, lr, batch_size)
    else:
        for device_params, device_slices, state in zip(params, slices, states):
            optimizer.apply(device_params, device_slices, state, lr, batch_size, norm=norm)
    if shard == "parameters":
        return
    for u, unit in enumerate(units):
        for replica, buffer in zip(replicas, all_gather([p[u] for p in params], ("parameter unit", u))):
            unflat(buffer, [replica[i] for i in unit])


def step_on_shards(model, replicas, bn_states, X_shards, y_shards, devices, lr, batch_size, states=None,
                   bucket_bytes=None, units=None, accumulate=1, scaler=None, allreduce_dtype="fp32", shard="none"):
    """The step on shards already on their contexts: each context's loss and gradients, the gradients summed across
    contexts (allreduce_gradients: per parameter, or by buckets of bucket_bytes; allreduce_dtype on the wire), the
    same update on every replica (the recipe's sgd, or optimizer.apply with each replica's state). `units`: the
    step's units (None: UNITS). With a `scaler` (common.loss_scaling.Scaler) the gradients are the loss's times its
    scale, unscaled after the sum; where one is not finite no replica updates (nor its optimizer state), and the
    scaler takes the verdict. With `shard` other than 'none' whole states are cut to their owned slices on the first
    call (shard_states, into the caller's list) and sharded_update makes the rest of the step. At 'parameters' the
    replicas too are cut on the first call (shard_params, into the caller's list, so the whole ones can be freed) and
    gathered whole for this step's forward and backward alone (gather_params), as FSDP does. Returns each context's
    summed loss and each replica's new BatchNorm state (kept when the update is skipped)."""
    units = units or UNITS
    scale = None if scaler is None else scaler.scale
    whole = replicas
    if shard == "parameters":
        if not isinstance(replicas[0], dict):
            replicas[:] = shard_params(replicas, bucket_bytes)   # in place: the caller keeps the slices
        whole = gather_params(replicas, bucket_bytes)           # dropped when the step returns
    losses, grads, bn_states = accumulated(units["loss_and_grads"], model, whole, bn_states, X_shards,
                                           y_shards, devices, accumulate, scale)
    if shard != "none":
        if states is not None and "shard" not in states[0]:
            states[:] = shard_states(states, whole, bucket_bytes)   # in place: the caller keeps the slices
        sharded_update(replicas, grads, states, lr, batch_size, shard, bucket_bytes, scaler, allreduce_dtype)
        return losses, bn_states
    allreduce_gradients(grads, bucket_bytes, allreduce_dtype)
    if scaler is not None and not scaler.update(unscale_gradients(grads, scale)):
        return losses, bn_states
    if states is None:
        for params, device_grads in zip(replicas, grads):
            sgd(params, device_grads, lr, batch_size)
    else:
        for params, device_grads, state in zip(replicas, grads, states):
            optimizer.apply(params, device_grads, state, lr, batch_size)
    return losses, bn_states


UNITS = {"update": update, "loss_and_grads": loss_and_grads, "step_on_shards": step_on_shards}


def train_step(model, replicas, bn_states, X, y, devices, lr, batch_size=None, states=None, settings=StepSettings()):
    """One synchronous step of `model` (common.interface.CONTRACT): split_and_load, then step_on_shards with the run's
    settings (its all-reduce's buckets, its compiled units, its loss scaler, its dtype on the wire, its shard). The
    replicas' new running statistics go into bn_states; under --shard parameters the list holds shard_params'
    slices from the first step on."""
    units = settings.units or UNITS
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses, bn_states[:] = units["step_on_shards"](model, replicas, bn_states, X_shards, y_shards, devices, lr,
                                                   batch_size or len(X), states, settings.bucket_bytes, units,
                                                   settings.accumulate, settings.scaler,
                                                   settings.allreduce_dtype, settings.shard)
    return sum(loss.asscalar() for loss in losses) / len(X)


def evaluate(model, replica, bn_state, X, y):
    """Accuracy of one replica, in inference mode (the ResNet's BatchNorm by its running statistics)."""
    return model.evaluate(replica, bn_state, X, y)
