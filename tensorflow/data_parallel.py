"""Data parallelism from scratch in TensorFlow: split the batch, forward and backward on every device,
sum the gradients across devices, apply the same SGD update to every replica (or, with optimizer states,
optimizer.py's update: common/optim.py's). One step for every network: the model (lenet.Functional or
resnet.Functional) says how each device's loss and gradients are computed; the run's settings (the all-reduce's
buckets, the compiled units, the loss scaler of fp16, the gradients' dtype on the wire) come in as arguments."""
import tensorflow as tf

from common.buckets import plan
from common.interface import RosettaError, StepSettings
from common.sharding import micro_batches, shard_bounds
from common.zero import bounds, chunk, groups, owner_index

from . import distributed as dist, optimizer
from .lenet import COMPUTE_DTYPES


def split_and_load(array, devices):
    """Copies (a shard never aliases the caller's numpy array) in the array's layout: images stay NCHW
    here, the model's forward makes them its layout."""
    shards = []
    for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices):
        with tf.device(d):
            shards.append(tf.convert_to_tensor(array[a:b]))
    return shards


def allreduce(tensors, dtype="fp32"):
    """Sum on the first tensor's device, then copy the sum back to every device. TensorFlow tensors are
    immutable: each slot of the list gets a new tensor (a tf.Variable is assigned in place instead).
    In a multi-process run the local sum is also summed across processes by TensorFlow's collectives.
    With dtype 'bf16', common.precision.summed_on_the_wire's sum: on_the_wire's bf16 sum, widened back on each
    device."""
    if dtype == "fp32":
        with tf.device(tensors[0].device):
            total = tf.add_n(tensors)      # add_n copies the other tensors onto this device
    else:
        total = on_the_wire(tensors, dtype)
    if dist.is_initialized():
        total = dist.all_reduce(total)
    for i, t in enumerate(tensors):
        with tf.device(t.device):
            summed = total if dtype == "fp32" else tf.cast(total, t.dtype)
            if isinstance(t, tf.Variable):
                t.assign(summed)
            else:
                tensors[i] = tf.identity(summed)
    return tensors


def on_the_wire(tensors, dtype):
    """The bf16 (`dtype`) sum of `tensors` on the first one's device: each cast on its own device, the casts added in
    device order, every addition rounded (tf.cast and the CPU's bf16 add round to nearest even). A fold of
    tf.math.add, not add_n: add_n takes up to 9 inputs in order, and groups more otherwise (measured in
    tests/test_wire_tensorflow.py). Across processes the strategy's collective sums the bf16 tensors (its CPU kernel
    takes any dtype and adds with the Add kernel, bf16's rounding): two processes of a device each step as two devices
    of one process, to the bit; past two its ring adds in an order of its own, as summed_on_the_wire allows."""
    wire = []
    for t in tensors:
        with tf.device(t.device):
            wire.append(tf.cast(t, COMPUTE_DTYPES[dtype]))
    with tf.device(tensors[0].device):
        total = wire[0]
        for w in wire[1:]:
            total = tf.math.add(total, w)
    return total


def allreduce_gradients(grads, bucket_bytes=None, dtype="fp32"):
    """Every parameter's gradient summed across devices (grads[d]: device d's list): an allreduce per parameter, or
    per bucket of parameters (common/buckets.py), each device's gradients flattened into one buffer (tf.concat) and
    the sum cut back into their shapes (tf.split), as DistributedDataParallel does. `dtype`: the precision on the
    wire (allreduce's; a bucket is cast whole). Returns new lists (tensors are immutable)."""
    if bucket_bytes is None:
        summed = [allreduce(list(per_device), dtype) for per_device in zip(*grads)]   # one parameter on every device
        return [list(device_grads) for device_grads in zip(*summed)]
    grads = [list(device_grads) for device_grads in grads]
    for bucket in plan([g.shape.num_elements() for g in grads[0]], bucket_bytes):
        buffers = []
        for device_grads in grads:
            with tf.device(device_grads[bucket[0]].device):
                buffers.append(tf.concat([tf.reshape(device_grads[i], [-1]) for i in bucket], 0))
        for device_grads, buffer in zip(grads, allreduce(buffers, dtype)):
            with tf.device(buffer.device):
                pieces = tf.split(buffer, [device_grads[i].shape.num_elements() for i in bucket])
                for i, piece in zip(bucket, pieces):
                    device_grads[i] = tf.reshape(piece, device_grads[i].shape)
    return grads


def reduce_scatter(buffers, dtype="fp32"):
    """ZeRO's half of an all-reduce (common/zero.py): one flat padded buffer of a unit per local device -> each
    device's own slice of the sum over every device of every process, on its device. Summed on the first device in
    device order, as allreduce sums (with dtype 'bf16' on_the_wire's sum, sent in bf16, widened on each device), then
    across processes by distributed.reduce_scatter: a process's chunk is its devices' slices, contiguous, as the
    owners are numbered."""
    if dtype == "fp32":
        with tf.device(buffers[0].device):
            total = tf.add_n(buffers)
    else:
        total = on_the_wire(buffers, dtype)
    if dist.is_initialized():
        total = dist.reduce_scatter(total)
    with tf.device(buffers[0].device):
        pieces = tf.split(total, len(buffers))
    slices = []
    for b, piece in zip(buffers, pieces):
        with tf.device(b.device):
            slices.append(tf.identity(piece) if dtype == "fp32" else tf.cast(piece, b.dtype))
    return slices


def all_gather(slices):
    """reduce_scatter's inverse: each local device's slice of a unit -> the whole flat (padded) buffer on every local
    device: the local slices concatenated in device order, every process's chunk of them gathered in rank order
    (distributed.all_gather), a copy on each device (new tensors: TensorFlow's are immutable)."""
    with tf.device(slices[0].device):
        whole = tf.concat(slices, 0)
    if dist.is_initialized():
        whole = dist.all_gather(whole)
    buffers = []
    for s in slices:
        with tf.device(s.device):
            buffers.append(tf.identity(whole))
    return buffers


def shard_states(states, replicas, bucket_bytes=None):
    """Each device's whole state cut to the slices it owns (common/zero.py): every slot's buffers of a unit
    flattened in TensorFlow's element order, zero-padded and cut into the world's slices; the owned one a new
    tf.Variable on the device (the step's assigns need one), so that the whole buffers can go. The step count is the
    same tf.Variable."""
    unit_list = groups([p.shape.num_elements() for p in replicas[0]], bucket_bytes)
    device_owners, world = owners(replicas)
    sharded = []
    for state, owner in zip(states, device_owners):
        sliced = {"optimizer": state["optimizer"], "step": state["step"], "shard": (owner, world)}
        for slot in state["optimizer"].slots:
            sliced[slot] = []
            for u, unit in enumerate(unit_list):
                buffers = [state[slot][i] for i in unit]
                with tf.device(buffers[0].device):
                    sliced[slot].append(tf.Variable(owned(buffers, owner, world), name=f"{slot}.unit{u}"))
        sharded.append(sliced)
    return sharded


def gather_states(states, replicas, bucket_bytes=None):
    """shard_states' inverse: every slot's slices of a unit all_gather'ed and cut back into init_state's buffers
    (new tf.Variables, on each replica's device, in its shapes and layout: state_to_numpy reads them), the step count
    copied."""
    unit_list = groups([p.shape.num_elements() for p in replicas[0]], bucket_bytes)
    whole = []
    for replica, state in zip(replicas, states):
        whole.append(optimizer.init_state(replica, state["optimizer"]))
        whole[-1]["step"].assign(state["step"])
    for slot in states[0]["optimizer"].slots:
        for u, unit in enumerate(unit_list):
            for state, buffer in zip(whole, all_gather([s[slot][u] for s in states])):
                buffers = [state[slot][i] for i in unit]
                for b, piece in zip(buffers, unflat(buffer, [b.shape for b in buffers])):
                    b.assign(piece)
    return whole


def shard_params(replicas, bucket_bytes=None):
    """Each device's whole replica cut to the slices it owns, as shard_states cuts a slot: a unit's variables
    flattened in TensorFlow's element order, padded and cut; the owned slice a new tf.Variable on the device (the
    step's update assigns it in place, as it assigns a weight), so that the whole variables can go. "like" holds
    their shapes (tuples: a traced step keys on it) and their device. Made eagerly (train_step): a traced step cannot
    make variables."""
    unit_list = groups([p.shape.num_elements() for p in replicas[0]], bucket_bytes)
    device_owners, world = owners(replicas)
    sharded = []
    for replica, owner in zip(replicas, device_owners):
        with tf.device(replica[0].device):
            slices = [tf.Variable(owned([replica[i] for i in unit], owner, world), name=f"unit{u}")
                      for u, unit in enumerate(unit_list)]
        like = {"shapes": tuple(tuple(p.shape.as_list()) for p in replica), "device": replica[0].device}
        sharded.append({"shard": (owner, world), "slices": slices, "like": like})
    return sharded


def gather_params(replicas, bucket_bytes=None):
    """shard_params' inverse: every unit's slices all_gather'ed and cut back into the parameters' shapes on each
    device. Tensors, not tf.Variables: the traced step gathers them at every step and can make no variable there
    (nor should any hold the whole parameters between steps); the networks' tapes watch them (lenet.py, resnet.py),
    and to_numpy and evaluate read them as a replica's variables. A collective across processes."""
    shapes = [tf.TensorShape(shape) for shape in replicas[0]["like"]["shapes"]]
    whole = [[None] * len(shapes) for _ in replicas]
    for u, unit in enumerate(groups([shape.num_elements() for shape in shapes], bucket_bytes)):
        for params, buffer in zip(whole, all_gather([replica["slices"][u] for replica in replicas])):
            for i, piece in zip(unit, unflat(buffer, [shapes[i] for i in unit])):
                params[i] = piece
    return whole


def world_of(replicas):
    """(this process's rank, the strategy's task; the world's devices: every process's count of local `replicas`)."""
    rank, processes = dist.task()
    return rank, processes * len(replicas)


def owners(replicas):
    """The slices this process's devices own (common.zero.owner_index) and the world's device count."""
    rank, world = world_of(replicas)
    return [owner_index(rank, len(replicas), d) for d in range(len(replicas))], world


def flat(tensors, world):
    """A unit's tensors in one buffer on the first one's device, in TensorFlow's element order (tf.reshape's: a
    kernel's HWIO), zero-padded to world * common.zero.chunk elements."""
    with tf.device(tensors[0].device):
        buffer = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
        size = buffer.shape.num_elements()
        return tf.pad(buffer, [[0, chunk(size, world) * world - size]])


def owned(tensors, owner, world):
    """Device `owner`'s slice of a unit's flat padded buffer (common.zero.bounds)."""
    buffer = flat(tensors, world)
    start, stop = bounds(buffer.shape.num_elements(), world, owner)
    with tf.device(tensors[0].device):
        return buffer[start:stop]


def unflat(buffer, shapes):
    """A unit's flat (padded) buffer cut back into its tensors' `shapes` (tf.TensorShapes), on the buffer's device."""
    sizes = [shape.num_elements() for shape in shapes]
    with tf.device(buffer.device):
        pieces = tf.split(buffer[:sum(sizes)], sizes)
        return [tf.reshape(piece, shape) for piece, shape in zip(pieces, shapes)]


def unscale_gradients(grads, scale):
    """The all-reduced gradients of the scaled loss (grads[d]: device d's list) multiplied by 1/scale in fp32 (exact:
    the scale is a power of two), each on its device, put back in their slots of the lists (tensors are immutable);
    and whether every one is finite (common/loss_scaling.py). That is a boolean tensor, not a Python bool: in the
    traced step the graph decides the update by it (a Python bool would need a host read inside the graph), and
    train_step reads it once after; eagerly it is a concrete value that bool() reads."""
    inverse = 1.0 / scale
    finite = []
    for device_grads in grads:
        for i, g in enumerate(device_grads):
            with tf.device(g.device):
                device_grads[i] = g * inverse
                finite.append(tf.reduce_all(tf.math.is_finite(device_grads[i])))
    return tf.reduce_all(tf.stack(finite))


def sgd(params, grads, lr, batch_size):
    """The recipe's update, lr / batch_size times the summed gradient, made in place (update)."""
    update(params, grads, lr / batch_size)


# The units of the step (UNITS): execution.compile(level, model) hands train_step each one as the level makes it.
# TensorFlow compiles the whole step (tf.function), and XLA each device's loss and gradients (jit_compile=True);
# no level compiles `update` alone (it runs inside the step's graph, as sharded_update does under --shard).
def update(params, grads, scale):
    """The SGD update of one replica, in place: each tf.Variable is assigned on its own device."""
    for p, g in zip(params, grads):
        with tf.device(p.device):
            p.assign_sub(g * scale)


def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale=None):
    """Each device's summed loss on its shard, each replica's gradients (of the loss times `scale`, a tensor, under
    loss scaling) and new BatchNorm state: the network's own (model.loss_and_grads). The unit XLA compiles device by
    device: an XLA cluster runs on one device, so it cannot hold the whole multi-device step."""
    return model.loss_and_grads(replicas, bn_states, X_shards, y_shards, devices, scale)


def micro_bounds(y, count):
    """common.sharding.micro_batches of a shard: in Python integers where its size is known, else the same arithmetic
    in the graph's (a retraced step's shards have no static size)."""
    if y.shape[0] is not None:
        return micro_batches(y.shape[0], count)
    n = tf.shape(y)[0]
    base, extra = n // count, n % count
    edges = [i * base + tf.minimum(i, extra) for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def accumulated(loss_and_grads, model, replicas, bn_states, X_shards, y_shards, devices, count, scale=None):
    """Gradient accumulation: each device's shard cut into `count` micro-batches (common.sharding.micro_batches, in
    the graph's integers where a traced step's shard sizes are unknown until it runs), a forward and backward each
    (every one from the same loss scale), their summed losses and gradients added up on the device (in the step's
    graph, the loop unrolled); the BatchNorm states go through the micro-batches in turn. Nothing crosses devices
    here: the all-reduce comes once, after it."""
    if count == 1:
        return loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale)
    parts = [micro_bounds(y, count) for y in y_shards]
    losses = grads = None
    for i in range(count):
        X_micro = [X[part[i][0]:part[i][1]] for X, part in zip(X_shards, parts)]
        y_micro = [y[part[i][0]:part[i][1]] for y, part in zip(y_shards, parts)]
        micro_losses, micro_grads, bn_states = loss_and_grads(model, replicas, bn_states, X_micro, y_micro, devices,
                                                              scale)
        if losses is None:
            losses, grads = list(micro_losses), [list(g) for g in micro_grads]
            continue
        for d, device in enumerate(devices):   # each sum placed on its device: a collective across processes
            with tf.device(device):            # takes its destination from the tensor's device
                losses[d] = losses[d] + micro_losses[d]
                grads[d] = [a + b for a, b in zip(grads[d], micro_grads[d])]
    return losses, grads, bn_states


def update_replicas(replicas, grads, lr, batch_size, states=None):
    """The same update on every replica by its all-reduced gradients: the recipe's sgd, or with `states` (one per
    replica) optimizer.apply, which advances their step counts."""
    for i, (params, device_grads) in enumerate(zip(replicas, grads)):
        if states is None:
            sgd(params, device_grads, lr, batch_size)
        else:
            optimizer.apply(params, device_grads, states[i], lr, batch_size)


class Slice:
    """A device's slice of a unit's parameters as optimizer.apply and update write it: a tensor that assign and
    assign_sub replace (and that apply's products read). The slice of a replica's variables is a new tensor, not a
    variable, and a traced step cannot make one to hold it; the updated slices reach the replicas' variables through
    the all-gather (stages 1 and 2: at stage 3 the slices a device holds are variables, shard_params')."""

    def __init__(self, value, device):
        self.value, self.device = value, device

    def assign(self, value):
        self.value = value

    def assign_sub(self, delta):
        self.value = self.value - delta

    def __mul__(self, other):
        return self.value * other

    __rmul__ = __mul__


def sharded_update(replicas, grads, states, lr, batch_size, shard, bucket_bytes=None, scale=None,
                   allreduce_dtype="fp32"):
    """ZeRO's half of the step once every device has its gradients (common/zero.py), `shard` its stage: each
    device's slices of the summed gradients, a cut of allreduce_gradients' sums ('optimizer': the replicated step's
    all-reduce) or reduce_scatter's ('gradients', 'parameters': no device holds a whole sum); under a loss `scale` the
    slices unscaled, an overflow on any device of any process skipping every device's update (a tf.cond, as the
    replicated step's); the clipping norm summed from every device's slices (an all-reduce of one number a device);
    each device's update of the parameter slices it owns (optimizer.apply with its sharded state, or the recipe's
    sgd); the updated slices all_gather'ed back into every replica's variables, or at 'parameters' (the replicas
    shard_params') the slices a device holds updated in place and nothing gathered: the next step gathers them
    before its forward. Returns whether the gradients were finite (None without a scale)."""
    if shard not in ("optimizer", "gradients", "parameters"):
        raise RosettaError(f"the scratch step shards 'optimizer', 'gradients' or 'parameters', not {shard!r}")
    device_owners, world = owners(replicas)
    unit_list = groups([g.shape.num_elements() for g in grads[0]], bucket_bytes)   # the parameters' own sizes
    if shard == "optimizer":
        grads = allreduce_gradients(grads, bucket_bytes, allreduce_dtype)
        slices = [[owned([device_grads[i] for i in unit], owner, world) for unit in unit_list]
                  for device_grads, owner in zip(grads, device_owners)]
    else:
        scattered = [reduce_scatter([flat([device_grads[i] for i in unit], world) for device_grads in grads],
                                    allreduce_dtype) for unit in unit_list]
        slices = [list(device_slices) for device_slices in zip(*scattered)]
    finite = None
    if scale is not None:
        finite = unscale_gradients(slices, scale)
        if dist.is_initialized():   # each process checked its own slices only
            finite = dist.all_reduce(tf.reshape(tf.cast(tf.logical_not(finite), tf.int64), [1]))[0] == 0
    norms = [None] * len(replicas)
    if states is not None and states[0]["optimizer"].clip_norm is not None:   # apply's sum, over the slices
        squares = []
        for device_slices in slices:
            with tf.device(device_slices[0].device):
                squares.append(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g / batch_size, tf.float64)))
                                         for g in device_slices]))
        norms = [tf.sqrt(total) for total in allreduce(squares)]

    def apply_to(held):
        """Each device's update of the parameter slices it holds (held[d]), in place."""
        for d, (device_held, device_slices) in enumerate(zip(held, slices)):
            if states is None:
                sgd(device_held, device_slices, lr, batch_size)
            else:
                optimizer.apply(device_held, device_slices, states[d], lr, batch_size, norm=norms[d])

    if shard == "parameters":   # the slices are the device's own variables: assigned, and that is all
        held = [replica["slices"] for replica in replicas]
        if scale is None:
            apply_to(held)
        else:
            tf.cond(finite, lambda: apply_to(held), lambda: None)
        return finite
    params = [[owned([replica[i] for i in unit], owner, world) for unit in unit_list]
              for replica, owner in zip(replicas, device_owners)]

    def update_slices():
        held = [[Slice(p, replica[0].device) for p in device_params]
                for replica, device_params in zip(replicas, params)]
        apply_to(held)
        return [[h.value for h in device_held] for device_held in held]

    updated = update_slices() if scale is None else tf.cond(finite, update_slices, lambda: params)
    for u, unit in enumerate(unit_list):
        for replica, buffer in zip(replicas, all_gather([device_params[u] for device_params in updated])):
            variables = [replica[i] for i in unit]
            for v, piece in zip(variables, unflat(buffer, [v.shape for v in variables])):
                with tf.device(v.device):
                    v.assign(piece)
    return finite


def step_on_shards(model, replicas, bn_states, X_shards, y_shards, devices, lr, batch_size, states=None,
                   bucket_bytes=None, units=None, accumulate=1, scale=None, allreduce_dtype="fp32", shard="none"):
    """The step on shards already on their devices: each device's loss and gradients (units' loss_and_grads), the
    gradients summed across devices (allreduce_gradients: per parameter, or by buckets of bucket_bytes; in
    allreduce_dtype on the wire), the same update on every replica (update_replicas). With a loss `scale` (a tensor)
    the gradients are of the losses times it, unscaled after the all-reduce (unscale_gradients), and the update runs
    only where every one is finite: a tf.cond, so a skipped step assigns no weight, buffer or step count (the
    BatchNorm states the forward made are kept). Returns each device's summed loss (unscaled), the replicas' new
    BatchNorm states and whether the gradients were finite (None without a scale). As one graph (the default level),
    it is traced per model, device list, optimizer, bucket size, units and dtype on the wire (Python values), and
    whether it scales; lr, batch_size and the scale are tensors, and reduce_retracing turns the shard shapes into
    None after the first new shape. With `shard` other than 'none' (ZeRO, common/zero.py) the states are
    shard_states' and sharded_update makes the rest of the step (traced per shard too); at 'parameters' the
    replicas are shard_params', gathered (gather_params) into whole parameters for the forward and backward alone:
    in a graph they are its intermediate tensors, gone when the step returns, and the held slices it takes are the
    same variables every step (one trace)."""
    units = units or UNITS
    whole = gather_params(replicas, bucket_bytes) if shard == "parameters" else replicas
    losses, grads, bn_states = accumulated(units["loss_and_grads"], model, whole, bn_states, X_shards,
                                           y_shards, devices, accumulate, scale)
    if shard != "none":
        return losses, bn_states, sharded_update(replicas, grads, states, lr, batch_size, shard, bucket_bytes, scale,
                                                 allreduce_dtype)
    grads = allreduce_gradients(grads, bucket_bytes, allreduce_dtype)
    if scale is None:
        update_replicas(replicas, grads, lr, batch_size, states)
        return losses, bn_states, None
    finite = unscale_gradients(grads, scale)
    tf.cond(finite, lambda: update_replicas(replicas, grads, lr, batch_size, states), lambda: None)
    return losses, bn_states, finite


UNITS = {"update": update, "loss_and_grads": loss_and_grads, "step_on_shards": step_on_shards}


def train_step(model, replicas, bn_states, X, y, devices, lr, batch_size=None, states=None, settings=StepSettings()):
    """One synchronous step of `model` on a numpy batch (common.interface.CONTRACT): split_and_load, step_on_shards
    (settings.units' or, without them, as written; settings.allreduce_dtype on the wire), the mean loss; bn_states
    get the new running statistics. With settings.scaler the step runs at its scale and the scaler takes the step's
    check (one host read): the step has already skipped its update where scaler.update(finite) says so, since that
    returns `finite` itself. Under settings.shard whole states are cut to their owned slices (shard_states, into
    the caller's list) before the first step, and at 'parameters' the whole replicas too (shard_params: the list
    then holds the slices alone, the whole variables free to go): eagerly, since a traced step cannot make their
    variables."""
    units = settings.units or UNITS
    scaler = settings.scaler
    if settings.shard != "none" and states is not None and "shard" not in states[0]:
        whole = gather_params(replicas, settings.bucket_bytes) if isinstance(replicas[0], dict) else replicas
        states[:] = shard_states(states, whole, settings.bucket_bytes)
    if settings.shard == "parameters" and not isinstance(replicas[0], dict):
        replicas[:] = shard_params(replicas, settings.bucket_bytes)
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses, new_states, finite = units["step_on_shards"](
        model, replicas, list(bn_states), X_shards, y_shards, tuple(devices),
        tf.constant(lr, tf.float32), tf.constant(batch_size or len(X), tf.float32),   # tensors: no retrace per value
        states, settings.bucket_bytes, units, settings.accumulate,
        None if scaler is None else tf.constant(scaler.scale, tf.float32), settings.allreduce_dtype, settings.shard)
    bn_states[:] = new_states
    if scaler is not None:
        scaler.update(bool(finite))
    return sum(float(loss) for loss in losses) / len(X)


def evaluate(model, replica, bn_state, X, y):
    """Accuracy of one replica in inference mode: the network's own (its running statistics, if any)."""
    return model.evaluate(replica, bn_state, X, y)
