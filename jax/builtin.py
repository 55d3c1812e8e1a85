"""JAX's own data parallelism: one compiled step over a global batch sharded across a device mesh.

The recommended form (the one this mode runs by default) is jax.jit with NamedSharding: the batch is sharded along
the mesh's "devices" axis, the parameters are replicated, and XLA inserts the all-reduce of the gradients itself.
The explicit form, jax.shard_map, writes the per-device step and its lax.psum by hand, which is the recipe
compiled as one program; it is here too, and computes the same step. (jax.pmap, the legacy form, is in
maintenance mode upstream.) Across processes the mesh spans every process's devices (distributed.py joined
them) and each process contributes its own rows of the global batch (pipeline.py).
A stateful optimizer is Optax's (optimizer.py): its state, a pytree like the parameters and replicated like them,
goes into the compiled step and comes back new; it sees the gradient once it is all-reduced, in both forms.
The ResNet is the Flax module (resnet.py), split into its parameters and BatchNorm statistics (nnx.split). Its two
BatchNorm modes are the two forms: under jit the batch axis is global, so nnx.BatchNorm's statistics are the global
batch's (synchronised BatchNorm, XLA inserting the collectives); under shard_map each device normalises by its own
shard's and keeps its own running statistics, stacked along the mesh axis (local BatchNorm). The padded rows are
masked out of both (nnx.BatchNorm's mask). Flax's own synchronisation, BatchNorm(axis_name=...) under shard_map,
pmeans each device's masked mean: with unequal real rows per device (97 = 49 + 48) that is not the global mean. Where
the synchronised step must be shard_map's (bucketed, or bf16 on the wire: no cast or bucket reaches the all-reduces
XLA places under jit; or --shard gradients, whose reduce-scatter XLA does not make), its BatchNorm is
resnet.BatchNorm, which psums the devices' sums and counts instead.
The all-reduce: XLA's CPU compiler has no pass that combines collectives, so both forms all-reduce one gradient at a
time (a psum of the gradients' pytree lowers to an all-reduce per tensor), each a gloo call across processes (43% of
the ResNet's step on 2 processes). With `--allreduce bucketed` (get_model's bucket_bytes) the step is shard_map's with
the psum written as an expert does on CPU: the gradients flattened into buckets (common/buckets.py), one psum each.
The ResNet trains with every optimizer as the LeNet does: Optax's transformation over its parameters' pytree (the
running statistics are no parameters: no optimizer state, no decay), after the all-reduce in both forms.
--precision bf16 (get_model's network.precision; JAX has no automatic mixed precision): the parameters, the Optax state
and the update stay fp32 global arrays, and the compiled step computes in bf16 where common/precision.py says: the
LeNet through the scratch forward's own casts (lenet.forward), the ResNet as a Flax module built with dtype=bf16 and
fp32 parameters (resnet.build_model: Flax's mixed precision, the idiomatic loop's), the loss in fp32 from the bf16
logits (rows_of); compiled without XLA's excess precision (execution.compiler_options), which would drop the bf16
roundings of the weight gradients. Under shard_map each device's gradients are the fp32 parameters' (the casts'
transposes widen them), summed by an fp32 psum, as common/precision.py's step (the LeNet's per-device gradients are
the scratch step's to the bit; the ResNet's are Flax's: resnet.ResNet's docstring). Under jit the program is one
device's over the global batch, and XLA's partitioner puts the all-reduce inside a gradient's sum over the batch, in
the type that sum has: the LeNet's are fp32 (the scratch's convolution sums its weight gradient in fp32 before the one
rounding, lenet.accumulated_conv_backward; its dense layers sum in fp32 too), so its bf16 step on N devices is its
step on one, the global batch's gradients rounded once (to fp32's order of summation). A Flax layer at bf16 makes its
kernel's and bias's gradients bf16 tensors: the all-reduces XLA puts in their batch sums under jit (42 of the 178 in
the ResNet's --bn sync step) are typed bf16, which XLA's CPU compiler sums in fp32 (its all-reduce-promotion pass) and
rounds back to bf16, one rounding more than the fp32 sum; BatchNorm's moments and parameters are all-reduced fp32.
--precision fp16 computes in fp16 in the same places (Flax's dtype=fp16), and JAX has no loss scaler of its own: the
compiled step is common/loss_scaling.py's rule, written here (update_if_finite). It differentiates the loss times the
scale, an argument of the compiled step (traced: no new program per scale), unscales the all-reduced gradients in
fp32 and updates only where every one is finite (lax.cond: a skipped step keeps the parameters and the Optax state;
the BatchNorm statistics its forward made are kept); the trainer reads `finite` back with the loss and moves its
scale on the host (common.loss_scaling.Scaler, the trainer's own state beside the Optax state: loss_scale). The LeNet
then steps in shard_map's form: each device's backward rounds its own gradients to fp16, as the rule's step does, and
the psum adds them in fp32 (get_model). The ResNet's --bn sync step stays jit's (unless bucketed or bf16 on the
wire): a Flax layer's fp16 weight gradient is then all-reduced inside its batch sum and rounded once, so it overflows
where the global batch's gradient does.
--shard (common/zero.py's stages; get_model's shard) places arrays with NamedSharding over the mesh's one axis, each
along its largest axis that the device count divides (whole on every device where none does): "optimizer" (stage 1) and
"gradients" (stage 2) the Optax state, the parameters replicated; "parameters" (stage 3) the parameters too. The jitted
step's out_shardings keep them so between steps, and its sharding constraints (Layout) say where each array goes, XLA
picking the collectives: the parameters whole before the forward (stage 3: an all-gather), the gradients summed as the
replicated step sums them (XLA's CPU compiler makes no reduce-scatter: an all-reduce, then each device's slice), each
device's update of its slices with its state, and at stage 1 an all-gather of the updated parameters. The LeNet's
compiled step: stage 1 8 all-reduces and 8 all-gathers, stage 2 8 reduce-scatters and 8 all-gathers, stage 3 8
all-gathers and 8 all-reduces (clipping adds 8 scalar all-reduces: the norm summed from the slices, in another order).
Under shard_map a device sees only its block of a sliced array, which Optax's clipping would take for the whole: that
form computes and reduces each device's gradients under shard_map (at stages 2 and 3 lax.psum_scatter along each one's
sliced axis, a reduce-scatter) and updates after it under jit, as above. Stage 2 is that form's alone: its
reduce-scatter is the one thing it does otherwise than stage 1, and under jit XLA would make an all-reduce of it
(get_model picks shard_map for it).
JAX's slices are an axis of each array, not common/zero.py's flat padded units: a device holds the same bytes
wherever the device count divides an axis (every parameter of the LeNet and the ResNet on 2 devices)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.buckets import plan
from common.interface import Model, Network, Unavailable
from common.lenet import PARAM_NAMES
from common.loss_scaling import Scaler
from common.resnet import PARAM_NAMES as RESNET_PARAMS

from . import resnet
from .data_parallel import flatten, unflatten
from .execution import DEFAULT_LAYOUT, LAYOUTS, compiler_options
from .idiomatic import evaluate as evaluate_flax
from .lenet import evaluate as evaluate_params, forward, held, scaled, to_numpy as params_to_numpy
from .checkpoint import save_sharded as save_checkpoint
from .optimizer import at, buffers, flax_paths, optax_canonical, optax_state, get_trainer


def EXEC(model):
    """The form the steps ran in: shard_map's for a bucketed psum, bf16 on the wire, fp16's loss scaling, ZeRO stage 2's
    reduce-scatter, the local BatchNorm or the LeNet's accumulation, else jit's."""
    return "jax.jit+shard_map" if model.trainer.form == "shard_map" else "jax.jit+NamedSharding"


COMPILES = "whole step"
# Its gradients' reduction (harness/studies/split.py): XLA's CPU compiler leaves one all-reduce per parameter in the compiled
# step (its HLO, read here: 8 for the LeNet, none combined), each a gloo collective across processes.
ALLREDUCE = "per-tensor"
LAYOUT = LAYOUTS[DEFAULT_LAYOUT]   # the scratch forward's, whose weights lenet.held lays out
FORMS = ("jit", "shard_map")


def mesh_of(devices):
    """A one-axis mesh over every process's devices, in process order (each process names its own)."""
    if jax.process_count() == 1:
        return Mesh(np.array(devices), ("devices",))
    ids = multihost_utils.process_allgather(np.array([d.id for d in devices])).reshape(-1)
    by_id = {d.id: d for d in jax.devices()}
    return Mesh(np.array([by_id[int(i)] for i in ids]), ("devices",))


def spec_of(shape, size):
    """How --shard slices an array of `shape` over `size` devices: along its largest axis that `size` divides (the
    first of equals); P(), a whole copy on every device, where none does (a bias of 6 on 4 devices, Optax's count)."""
    axes = [i for i, n in enumerate(shape) if n % size == 0]
    if not axes:
        return P()
    return P(*[None] * max(axes, key=lambda i: shape[i]), "devices")


class Layout:
    """Where --shard keeps the step's arrays between steps: `params` and `state`, the NamedShardings the compiled step
    gives back its parameters and Optax state in (its out_shardings), so the next step takes them as they are. The
    state is sliced over the data axis at every stage (spec_of), the parameters at stage 3 only, whole on every
    device at stages 1 and 2. In the step, sharding constraints say where each array goes and XLA picks the collectives:
    `gathered` the whole parameters before the forward (stage 3: an all-gather), `owned` each device's slice of the
    gradients and parameters, which the update reads (each device updates its own slice with its own state)."""

    def __init__(self, mesh, shard, params, tx=None):
        self.mesh, self.shard = mesh, shard
        self.params = self.sliced(params) if shard == "parameters" else NamedSharding(mesh, P())
        self.state = None if tx is None else self.sliced(jax.eval_shape(tx.init, params))

    def sliced(self, tree):
        return jax.tree.map(lambda a: NamedSharding(self.mesh, spec_of(a.shape, self.mesh.size)), tree)

    def gathered(self, params):
        if self.shard != "parameters":
            return params
        return lax.with_sharding_constraint(params, NamedSharding(self.mesh, P()))

    def owned(self, tree):
        return lax.with_sharding_constraint(tree, self.sliced(tree))

    def summed(self, grads):
        """The jit step's gradients whole, as the replicated step's all-reduce leaves them, before owned cuts them:
        else XLA's sharding propagation carries the slices back into the backward and repartitions it (the ResNet's
        BatchNorm by channel, all-gathering the batch's mask and the moments: 85 more all-gathers on 2 devices)."""
        return lax.with_sharding_constraint(grads, NamedSharding(self.mesh, P()))

    def reduced_specs(self, params, bucket_bytes):
        """The shard_map specs of the gradients as reduced (reduced): each one's slice at stages 2 and 3, else whole."""
        if self.shard == "optimizer" or bucket_bytes:
            return P()
        return jax.tree.map(lambda a: spec_of(a.shape, self.mesh.size), params)


def gathered(layout, params):
    """The parameters the forward takes: at stage 3 every device's slices gathered (layout.gathered)."""
    return params if layout is None else layout.gathered(params)


def owned(layout, tree):
    """What the update reads of a tree like the parameters: each device's slice under --shard."""
    return tree if layout is None else layout.owned(tree)


def owned_sum(layout, grads):
    """The jit step's gradients as the update reads them: each device's slice of their sum (Layout.summed)."""
    return grads if layout is None else layout.owned(layout.summed(grads))


def summed_loss(params, X, y, mask, precision="fp32", loss_scale=None):
    """The summed cross-entropy (times fp16's `loss_scale`, if given: lenet.scaled), and each row's, unscaled (padding
    rows, mask 0, count nothing). The forward at `precision` (lenet.forward's casts: at bf16 its convolutions and dense
    layers in bf16 on the fp32 parameters), the loss in fp32 from its logits (rows_of)."""
    total, rows = rows_of(forward(params, X, precision=precision), y, mask)
    return scaled(total, loss_scale)[0], rows


def rows_of(logits, y, mask):
    """The summed cross-entropy and each row's, in fp32 whatever the logits' precision (common/precision.py)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    rows = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0] * mask
    return rows.sum(), rows


loss_rows_and_grads = jax.value_and_grad(summed_loss, has_aux=True)


def psum_gradients(grads, bucket_bytes, dtype="fp32"):
    """The all-reduce of one device's gradients under shard_map: a psum per tensor, or per bucket (each bucket's
    gradients concatenated into one buffer, psummed once, cut back into their shapes), as DDP's buckets. With `dtype`
    "bf16" on the wire each tensor (or bucket) is cast to bf16 before its psum and the sum widened back to fp32
    (compiled without excess precision, execution.compiler_options, or XLA drops the casts)."""
    if bucket_bytes is None:
        return jax.tree.map(lambda g: psum_on_the_wire(g, dtype), grads)
    leaves, tree = jax.tree.flatten(grads)
    summed = list(leaves)
    for bucket in plan([g.size for g in leaves], bucket_bytes):   # the scratch step's flatten and unflatten
        total = psum_on_the_wire(flatten([leaves[i] for i in bucket]), dtype)
        for i, piece in zip(bucket, unflatten(total, tuple(leaves[i].shape for i in bucket))):
            summed[i] = piece
    return jax.tree.unflatten(tree, summed)


def psum_on_the_wire(x, dtype):
    """lax.psum of x over the mesh with `dtype` on the wire (fp32: x's own, as it always ran)."""
    if dtype == "fp32":
        return lax.psum(x, "devices")
    return lax.psum(x.astype(jnp.bfloat16), "devices").astype(x.dtype)


def micro_batch(arrays, mask, i, count):
    """The i-th of `count` micro-batches of one device's shard under --accumulate: common.sharding.micro_batches of
    its real rows (the mask counts them; pipeline.py puts them first, the padding after), as a window of a static
    ceil(shard / count) rows whose mask keeps the micro-batch's own. A compiled step's shapes are static and a
    device's real rows are not (97 rows: 49 and 48), so the cut is computed from the mask, not from the shape."""
    size = -(-mask.shape[0] // count)
    n = jnp.sum(mask).astype(jnp.int32)
    base, extra = n // count, n % count
    start, rows = i * base + jnp.minimum(i, extra), base + (i < extra)

    def window(a):
        return lax.dynamic_slice_in_dim(jnp.pad(a, [(0, size)] + [(0, 0)] * (a.ndim - 1)), start, size)
    return [window(a) for a in arrays], window(mask) * (jnp.arange(size) < rows)


def accumulated(loss_and_grads, X, y, mask, count, stats=None, cut=micro_batch):
    """Gradient accumulation on one device (--accumulate): loss_and_grads(X, y, mask, stats) -> (rows, grads, stats)
    for each of its shard's `count` micro-batches in turn (`cut` cuts them; the loop unrolled in the compiled step),
    the gradients added up here and the BatchNorm statistics carried from one micro-batch to the next. No collective:
    the caller all-reduces the sum once. Optax's MultiSteps accumulates across calls of the step instead, and under
    jit each call's gradient is a global array that XLA all-reduces: once per micro-batch (docs/migration.md)."""
    if count == 1:
        return loss_and_grads(X, y, mask, stats)
    rows, grads = [], None
    for i in range(count):
        (X_micro, y_micro), mask_micro = cut((X, y), mask, i, count)
        micro_rows, micro_grads, stats = loss_and_grads(X_micro, y_micro, mask_micro, stats)
        rows.append(micro_rows)
        grads = micro_grads if grads is None else jax.tree.map(jnp.add, grads, micro_grads)
    return jnp.concatenate(rows), grads, stats


def jit_step(precision, layout, params, X, y, mask, scale, loss_scale):
    """Written for one device; the shardings of its inputs make it data-parallel (and `layout`'s constraints, under
    --shard, sharded)."""
    (_, rows), grads = loss_rows_and_grads(gathered(layout, params), X, y, mask, precision, loss_scale)
    params, _, finite = update_if_finite(None, owned(layout, params), None, owned_sum(layout, grads), scale,
                                         loss_scale)
    return params, rows, finite


def update_if_finite(tx, params, opt_state, grads, scale, loss_scale):
    """descend's update of the all-reduced gradients; at fp16 (a `loss_scale`) the gradients of the scaled loss are
    multiplied by 1/loss_scale in fp32 (exact: a power of two) and the update runs only where every one is finite
    (lax.cond: else the parameters and the Optax state come back as they were). Returns (params, opt_state, finite).
    optax.apply_if_finite skips a non-finite update alike, but is not the rule: it keeps no scale (the gradients
    come to it scaled, and nothing unscales them, halves or grows the scale), and after max_consecutive_errors skips
    in a row it applies the non-finite update, where the rule skips every overflow."""
    if loss_scale is None:
        return *descend(tx, params, opt_state, grads, scale), jnp.array(True)
    grads = jax.tree.map(lambda g: g * (1 / loss_scale), grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    params, opt_state = lax.cond(finite, lambda: descend(tx, params, opt_state, grads, scale),
                                 lambda: (params, opt_state))
    return params, opt_state, finite


def device_grads(params, X, y, mask, count, precision="fp32", loss_scale=None):
    """This device's rows' losses and their gradients' sum, over `count` micro-batches. lax.pvary marks the
    parameters as this device's copy: without it shard_map's gradient of a replicated input comes back already
    summed over the mesh, and the psum after would count it twice (the shard_map gradient trap). The gradients are
    the fp32 parameters' (a cast's transpose widens a bf16 op's gradient): the micro-batches add up, and the psum
    sums, in fp32. At fp16 every micro-batch's loss is scaled by the one `loss_scale`."""
    def loss_and_grads(X, y, mask, _):
        (_, rows), grads = loss_rows_and_grads(lax.pvary(params, "devices"), X, y, mask, precision, loss_scale)
        return rows, grads, None
    return accumulated(loss_and_grads, X, y, mask, count)[:2]


def shard_map_step(bucket_bytes, wire, count, precision, params, X, y, mask, scale, loss_scale):
    """Runs on every device with its own rows (in `count` micro-batches), then the all-reduce."""
    rows, grads = device_grads(params, X, y, mask, count, precision, loss_scale)
    grads = psum_gradients(grads, bucket_bytes, wire)     # the all-reduce, said explicitly
    params, _, finite = update_if_finite(None, params, None, grads, scale, loss_scale)
    return params, rows, finite


def optax_update(tx, params, opt_state, grads, scale):
    """Optax's update of the global batch's mean gradient (the loss is summed: scale is 1 / global batch)."""
    updates, opt_state = tx.update(jax.tree.map(lambda g: g * scale, grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def jit_optax_step(tx, precision, layout, params, opt_state, X, y, mask, scale, loss_scale):
    """jit_step with Optax's update: its gradient is the global one (XLA all-reduces it before the clipping; under
    --shard the global norm of the slices, XLA summing it across devices)."""
    (_, rows), grads = loss_rows_and_grads(gathered(layout, params), X, y, mask, precision, loss_scale)
    params, opt_state, finite = update_if_finite(tx, owned(layout, params), opt_state, owned_sum(layout, grads),
                                                 scale, loss_scale)
    return params, opt_state, rows, finite


def shard_map_optax_step(tx, bucket_bytes, wire, count, precision, params, opt_state, X, y, mask, scale, loss_scale):
    """shard_map_step with Optax's update, after the psum: clipping by the global norm sees the all-reduced
    gradient, never this device's own."""
    rows, grads = device_grads(params, X, y, mask, count, precision, loss_scale)
    summed = psum_gradients(grads, bucket_bytes, wire)
    params, opt_state, finite = update_if_finite(tx, params, opt_state, summed, scale,
                                                 loss_scale)
    return params, opt_state, rows, finite


def reduced(layout, grads, bucket_bytes, wire):
    """One device's gradients summed over the mesh under shard_map, as --shard keeps them: at stages 2 and 3 a
    reduce-scatter (lax.psum_scatter) along each one's sliced axis, each device getting the sum of its own slice alone,
    and a psum where none is sliced; at stage 1, or bucketed (a flat bucket is cut otherwise than its arrays' axes), the
    all-reduce, of which the update reads its slice (owned)."""
    if layout.shard == "optimizer" or bucket_bytes:
        return psum_gradients(grads, bucket_bytes, wire)
    return jax.tree.map(lambda g: psum_scatter_on_the_wire(g, spec_of(g.shape, layout.mesh.size), wire), grads)


def psum_scatter_on_the_wire(x, spec, dtype):
    """lax.psum_scatter of x along its axis of `spec` (a psum if none), with `dtype` on the wire (psum_on_the_wire)."""
    if not len(spec):
        return psum_on_the_wire(x, dtype)
    wired = x if dtype == "fp32" else x.astype(jnp.bfloat16)
    return lax.psum_scatter(wired, "devices", scatter_dimension=len(spec) - 1, tiled=True).astype(x.dtype)


def shard_map_sharded_step(tx, layout, bucket_bytes, wire, count, precision, params, opt_state, X, y, mask, scale,
                           loss_scale):
    """--shard's shard_map form: each device's gradients and their reduction under shard_map (shard_map_optax_step's,
    then reduced), the update outside it, under jit, on the slices (jit_optax_step's): a device under shard_map sees
    its block of a sliced array, which Optax's clipping would take for the whole."""
    def per_device(params, X, y, mask, loss_scale):
        rows, grads = device_grads(params, X, y, mask, count, precision, loss_scale)
        return rows, reduced(layout, grads, bucket_bytes, wire)
    rows, grads = jax.shard_map(per_device, mesh=layout.mesh,
                                in_specs=(P(), P("devices"), P("devices"), P("devices"), P()),
                                out_specs=(P("devices"), layout.reduced_specs(params, bucket_bytes)))(
        gathered(layout, params), X, y, mask, loss_scale)
    params, opt_state, finite = update_if_finite(tx, owned(layout, params), opt_state, owned(layout, grads), scale,
                                                 loss_scale)
    return params, opt_state, rows, finite


def stateless(step, params, X, y, mask, scale, loss_scale):
    """An Optax step's signature as the recipe's SGD has it (no state)."""
    params, _, rows, finite = step(params, None, X, y, mask, scale, loss_scale)
    return params, rows, finite


# Every step is compiled for the network's precision (`network`: get_model's), at bf16 and fp16 without XLA's excess
# precision (execution.compiler_options: each rounding the step writes stays, the weight gradients' too, and at fp16
# an overflow with it). Its last argument is the loss scale (None: none), its last output whether the update ran.
def compile_step(mesh, form, bucket_bytes=None, count=1, network=Network(), wire="fp32", layout=None):
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("devices"))
    options = compiler_options(network, wire)
    held = replicated if layout is None else layout.params   # where the parameters stay between steps
    if form == "jit":
        return jax.jit(functools.partial(jit_step, network.precision, layout), out_shardings=(held, rows, replicated),
                       compiler_options=options)
    if layout is not None:
        return jax.jit(functools.partial(stateless, functools.partial(
            shard_map_sharded_step, None, layout, bucket_bytes, wire, count, network.precision)),
                       out_shardings=(held, rows, replicated), compiler_options=options)
    return jax.jit(jax.shard_map(functools.partial(shard_map_step, bucket_bytes, wire, count, network.precision),
                                 mesh=mesh,
                                 in_specs=(P(), P("devices"), P("devices"), P("devices"), P(), P()),
                                 out_specs=(P(), P("devices"), P())), compiler_options=options)


def compile_optax_step(mesh, form, tx, bucket_bytes=None, count=1, network=Network(), wire="fp32", layout=None):
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("devices"))
    options = compiler_options(network, wire)
    held, state = (replicated, replicated) if layout is None else (layout.params, layout.state)
    if form == "jit":
        return jax.jit(functools.partial(jit_optax_step, tx, network.precision, layout),
                       out_shardings=(held, state, rows, replicated), compiler_options=options)
    if layout is not None:
        return jax.jit(functools.partial(shard_map_sharded_step, tx, layout, bucket_bytes, wire, count,
                                         network.precision),
                       out_shardings=(held, state, rows, replicated), compiler_options=options)
    return jax.jit(jax.shard_map(functools.partial(shard_map_optax_step, tx, bucket_bytes, wire, count,
                                                   network.precision),
                                 mesh=mesh, in_specs=(P(), P(), P("devices"), P("devices"), P("devices"), P(), P()),
                                 out_specs=(P(), P(), P("devices"), P())), compiler_options=options)


def batchnorm_loss(graphdef, params, stats, X, y, mask, loss_scale=None):
    """The Flax ResNet's summed loss in training mode (times fp16's `loss_scale`, if given), each row's (unscaled),
    and its new BatchNorm statistics. copy: fresh Variables at this trace level, which the forward may update. The
    module computes at the precision it was built with (resnet.build_model: Flax's dtype), the loss in fp32 from its
    logits (rows_of)."""
    model = nnx.merge(graphdef, params, stats, copy=True)
    total, rows = rows_of(model(X, mask), y, mask)
    return scaled(total, loss_scale)[0], (rows, nnx.state(model, nnx.BatchStat))


def descend(tx, params, opt_state, grads, scale):
    """The ResNet's update: the recipe's, scale (lr / global batch) times the summed gradient (tx None), or Optax's
    of the mean gradient (scale 1 / global batch), every parameter (BatchNorm's scale and bias too) in both."""
    if tx is None:
        return jax.tree.map(lambda p, g: p - scale * g, params, grads), opt_state
    return optax_update(tx, params, opt_state, grads, scale)


def micro_batch_of_every_device(devices, arrays, mask, i, count):
    """micro_batch of each device's block of global arrays (jit's view: every device's rows back to back), the
    blocks back to back again: the i-th micro-batch of every device, one global micro-batch, whose statistics a
    synchronised BatchNorm takes."""
    def blocks(a):
        return a.reshape(devices, -1, *a.shape[1:])

    def joined(a):
        return a.reshape(-1, *a.shape[2:])
    arrays, mask = jax.vmap(lambda arrays, mask: micro_batch(arrays, mask, i, count))(
        [blocks(a) for a in arrays], blocks(mask))
    return [joined(a) for a in arrays], joined(mask)


def batchnorm_grads(graphdef, params, stats, X, y, mask, count, cut=micro_batch, loss_scale=None):
    """The ResNet's rows' losses, their gradients' sum (of the loss times `loss_scale`, if given) and the new
    statistics, over `count` micro-batches."""
    def loss_and_grads(X, y, mask, stats):
        (_, (rows, stats)), grads = jax.value_and_grad(batchnorm_loss, argnums=1, has_aux=True)(
            graphdef, params, stats, X, y, mask, loss_scale)
        return rows, grads, stats
    return accumulated(loss_and_grads, X, y, mask, count, stats, cut)


def jit_batchnorm_step(graphdef, tx, devices, count, layout, params, stats, opt_state, X, y, mask, scale, loss_scale):
    """Written for one device: the global batch's statistics (each micro-batch's, every device's rows of it),
    whatever the shardings. Accumulating, each micro-batch's gradient is a global array that XLA all-reduces: the
    synchronised BatchNorm pays one all-reduce per micro-batch (its statistics need them anyway). The new statistics
    are kept whether the update runs or not."""
    rows, grads, stats = batchnorm_grads(graphdef, gathered(layout, params), stats, X, y, mask, count,
                                         functools.partial(micro_batch_of_every_device, devices), loss_scale)
    params, opt_state, finite = update_if_finite(tx, owned(layout, params), opt_state, owned_sum(layout, grads),
                                                 scale, loss_scale)
    return params, opt_state, stats, rows, finite


def own_statistics(stacked, stats):
    """This device's running statistics inside shard_map: its block of the stacked ones (local BatchNorm), or the
    replicated ones every device updates alike (synchronised: the global batch's statistics, resnet.BatchNorm)."""
    return jax.tree.map(lambda s: s[0], stats) if stacked else stats


def as_held(stacked, stats):
    """own_statistics' inverse: the block a device gives back to the stacked statistics, or the replicated ones."""
    return jax.tree.map(lambda s: s[None], stats) if stacked else stats


def shard_map_batchnorm_step(graphdef, tx, bucket_bytes, wire, count, stacked, params, stats, opt_state, X, y, mask,
                             scale, loss_scale):
    """Each device's shard, statistics and running statistics (own_statistics), then the psum and the update of the
    all-reduced gradient."""
    rows, grads, own = batchnorm_grads(graphdef, lax.pvary(params, "devices"), own_statistics(stacked, stats), X, y,
                                       mask, count, loss_scale=loss_scale)
    summed = psum_gradients(grads, bucket_bytes, wire)
    params, opt_state, finite = update_if_finite(tx, params, opt_state, summed, scale,
                                                 loss_scale)
    return params, opt_state, as_held(stacked, own), rows, finite


def shard_map_sharded_batchnorm_step(graphdef, tx, layout, bucket_bytes, wire, count, stacked, params, stats, opt_state,
                                     X, y, mask, scale, loss_scale):
    """shard_map_batchnorm_step under --shard: the gradients reduced as layout keeps them (reduced), the update
    outside shard_map on the slices (shard_map_sharded_step's)."""
    def per_device(params, stats, X, y, mask, loss_scale):
        rows, grads, own = batchnorm_grads(graphdef, lax.pvary(params, "devices"), own_statistics(stacked, stats), X,
                                           y, mask, count, loss_scale=loss_scale)
        return rows, reduced(layout, grads, bucket_bytes, wire), as_held(stacked, own)
    held = P("devices") if stacked else P()
    rows, grads, stats = jax.shard_map(
        per_device, mesh=layout.mesh, in_specs=(P(), held, P("devices"), P("devices"), P("devices"), P()),
        out_specs=(P("devices"), layout.reduced_specs(params, bucket_bytes), held))(
        gathered(layout, params), stats, X, y, mask, loss_scale)
    params, opt_state, finite = update_if_finite(tx, owned(layout, params), opt_state, owned(layout, grads), scale,
                                                 loss_scale)
    return params, opt_state, stats, rows, finite


def compile_batchnorm_step(mesh, graphdef, sync, tx=None, bucket_bytes=None, count=1, network=Network(), wire="fp32",
                           layout=None, form="shard_map"):
    """The ResNet's step in `form`: jit's (synchronised BatchNorm only: the batch axis global), or shard_map's, whose
    running statistics are stacked, one block a device (local BatchNorm), or replicated (synchronised: graphdef's
    BatchNorm psums the statistics, resnet.BatchNorm)."""
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("devices"))
    options = compiler_options(network, wire)   # the module computes at the precision graphdef was built with
    held, state = (replicated, replicated) if layout is None else (layout.params, layout.state or replicated)
    if form == "jit":
        return jax.jit(functools.partial(jit_batchnorm_step, graphdef, tx, mesh.size, count, layout),
                       out_shardings=(held, state, replicated, rows, replicated), compiler_options=options)
    stacked = not sync
    statistics = P("devices") if stacked else P()
    if layout is not None:
        return jax.jit(functools.partial(shard_map_sharded_batchnorm_step, graphdef, tx, layout, bucket_bytes, wire,
                                         count, stacked),
                       out_shardings=(held, state, rows if stacked else replicated, rows, replicated),
                       compiler_options=options)
    return jax.jit(jax.shard_map(functools.partial(shard_map_batchnorm_step, graphdef, tx, bucket_bytes, wire, count,
                                                   stacked),
                                 mesh=mesh, in_specs=(P(), statistics, P(), P("devices"), P("devices"),
                                                      P("devices"), P(), P()),
                                 out_specs=(P(), P(), statistics, P("devices"), P())), compiler_options=options)


class Compiled:
    """A trainer's compiled step, one per micro-batch count (--accumulate; an epoch's last batch may cut fewer), each
    made once by make(form, count). `form` is get_model's, or shard_map's once the LeNet accumulates: under jit
    every micro-batch's gradient would be all-reduced (accumulated's docstring). lower() gives a step's program.
    `scaler`: fp16's loss scaler (common.loss_scaling.Scaler; None: no loss scaling), the trainer's state as the Optax
    state is: the compiled step takes its scale and gives back whether the gradients were finite, which moves it."""

    def __init__(self, make, form, switches=True, scaler=None):
        self.make, self.form, self.switches, self.made, self.scaler = make, form, switches, {}, scaler

    def step(self, count=1):
        if count not in self.made:
            if count > 1 and self.switches:
                self.form = "shard_map"
            self.made[count] = self.make(self.form, count)
        return self.made[count]

    def lower(self, *args, count=1):
        """The program of a step on `args`, at the loss scale this trainer runs (none: the step's last argument)."""
        return self.step(count).lower(*args, self.loss_scale())

    def loss_scale(self):
        """The scale the next step runs at, as the compiled step takes it: a traced scalar (no program per scale)."""
        return None if self.scaler is None else jnp.float32(self.scaler.scale)

    def rescale(self, finite):
        """The loss scaling's rule after a step whose gradients were `finite` or not (read here: a replicated scalar,
        read once, as the loss is)."""
        if self.scaler is not None:
            self.scaler.update(bool(finite.addressable_data(0)))


class Step(Compiled):
    """The recipe's SGD step."""
    opt_state = None

    def __call__(self, net, X, y, mask, scale, count=1):
        net, rows, finite = self.step(count)(net, X, y, mask, scale, self.loss_scale())
        self.rescale(finite)
        return net, rows


class BatchNormTrainer(Compiled):
    """The ResNet's step: the model is [parameters, BatchNorm statistics], two pytrees of global arrays; with an Optax
    transformation its state (opt_state) goes through the step and comes back new, as OptaxTrainer's. Its form
    follows the BatchNorm, accumulating or not."""

    def __init__(self, make, graphdef, sync, form, opt_state=None, scaler=None):
        super().__init__(make, form, switches=False, scaler=scaler)
        self.graphdef, self.sync, self.opt_state = graphdef, sync, opt_state

    def __call__(self, net, X, y, mask, scale, count=1):
        params, self.opt_state, stats, rows, finite = self.step(count)(*net, self.opt_state, X, y, mask, scale,
                                                                       self.loss_scale())
        self.rescale(finite)
        return [params, stats], rows


class OptaxTrainer(Compiled):
    """Optax's transformation is pure: this holds its state between steps and threads it through the step."""

    def __init__(self, make, opt_state, form, scaler=None):
        super().__init__(make, form, scaler=scaler)
        self.opt_state = opt_state

    def __call__(self, net, X, y, mask, scale, count=1):
        net, self.opt_state, rows, finite = self.step(count)(net, self.opt_state, X, y, mask, scale, self.loss_scale())
        self.rescale(finite)
        return net, rows


def get_model(weights, devices, optimizer=None, state=None, form=None, network=Network(), bucket_bytes=None,
              allreduce_dtype="fp32", shard="none"):
    """The recipe's plain SGD (optimizer None or its is_recipe) is today's step; any other optimizer is Optax's
    transformation (optimizer.py), its state made by a compiled tx.init, or holding the canonical `state` of a
    checkpoint (buffers laid out as the parameters, every count at its step): global arrays replicated over the
    mesh, across processes too. The form: jit's, or shard_map's where the all-reduce is bucketed (bucket_bytes, the
    run's --allreduce: common.buckets.bucket_bytes) or the loss scaled (fp16: under jit XLA all-reduces inside each
    weight gradient's batch sum, before its one rounding to fp16, so the global batch's sum would overflow where every
    device's own gradient, the rule's, is finite; the module docstring). At bf16 (network.precision) the parameters
    and the Optax state stay fp32 global arrays and the compiled step computes in bf16 (the module docstring); the
    model carries the precision (Model.precision; no mixed form beside the net). network.loss_scaling (fp16's): the
    trainer's loss scaler, common/loss_scaling.py's rule with the run's initial scale, interval and factors (JAX has
    none of its own). allreduce_dtype "bf16" (--allreduce-dtype): the psum's casts (psum_gradients), so shard_map's
    form; under jit XLA places the all-reduces inside the batch sums, where no cast can reach: a jit step asked for
    by `form` refuses it. The ResNet's form follows its BatchNorm: shard_map's for local, jit's for sync unless
    bucketed or bf16 on the wire (the module docstring). `shard` (--shard "optimizer", "gradients" or "parameters"):
    the Optax state, and at "parameters" the parameters too, placed sliced over the mesh and kept so by the compiled
    step (Layout; the BatchNorm statistics stay as they are, as FSDP keeps buffers); at "gradients" the step is
    shard_map's, whose psum_scatter is the reduce-scatter (under jit XLA's CPU compiler makes an all-reduce)."""
    wire = allreduce_dtype
    mesh = mesh_of(devices)
    scattered = shard == "gradients"   # stage 2: a reduce-scatter, which only shard_map's psum_scatter makes
    form = form or ("shard_map" if bucket_bytes or network.loss_scaling or wire != "fp32" or scattered else "jit")
    if wire != "fp32" and form == "jit":
        raise Unavailable("JAX's jit step all-reduces where XLA places it, in the sum's own dtype: --allreduce-dtype "
                          "bf16 needs shard_map's psum")
    if scattered and form == "jit":
        raise Unavailable("JAX's jit step all-reduces the gradients where XLA places them (no reduce-scatter on the "
                          "CPU): --shard gradients needs shard_map's psum_scatter")
    scaler = None if network.loss_scaling is None else Scaler(network.loss_scaling)
    bucket_bytes = bucket_bytes if form == "shard_map" else None
    replicated = NamedSharding(mesh, P())   # every device holds the whole parameter
    tx = None if optimizer is None or optimizer.is_recipe else get_trainer(optimizer)
    layout = None

    def replicate(a):
        return place(a, replicated)

    def optax_start(params, host, laid_out, names):
        """tx's state for the `params`: zero (a compiled tx.init), or the checkpoint's `state`; replicated, or sliced
        as `layout` keeps it."""
        shardings = replicated if layout is None else layout.state
        if state is None:
            return jax.jit(tx.init, out_shardings=shardings)(params)
        return place(optax_state(state, tx.init(host), laid_out, names), shardings)

    if network.bn_state is not None:   # the ResNet: the form follows the BatchNorm (module docstring)
        form = "jit" if network.sync and not bucket_bytes and wire == "fp32" and not scattered else "shard_map"
        axis_name = "devices" if network.sync and form == "shard_map" else None
        graphdef, host, stats = nnx.split(resnet.build_model(weights, network.bn_state, precision=network.precision,
                                                             axis_name=axis_name), nnx.Param, nnx.BatchStat)
        if not network.sync:   # one copy per device, stacked along the mesh axis
            stats = jax.tree.map(lambda s: np.stack([np.asarray(s)] * mesh.size), stats)
        put = replicate if network.sync else lambda a: jax.make_array_from_callback(
            a.shape, NamedSharding(mesh, P("devices")), lambda index: a[index])
        if shard != "none":
            layout = Layout(mesh, shard, host, tx)
        params, stats = place(host, replicated if layout is None else layout.params), jax.tree.map(put, stats)
        laid_out = lambda arrays: nnx.split(   # noqa: E731
            resnet.build_model(arrays, network.bn_state), nnx.Param, nnx.BatchStat)[1]
        opt_state = None if tx is None else optax_start(params, host, laid_out, RESNET_PARAMS)
        make = lambda form, count: compile_batchnorm_step(   # noqa: E731
            mesh, graphdef, network.sync, tx, bucket_bytes, count, network, wire, layout, form)
        trainer = BatchNormTrainer(make, graphdef, network.sync, form, opt_state, scaler)
        return Model([params, stats], trainer, mesh, network.precision)
    host = [held(name, weights[name]) for name in PARAM_NAMES]
    if shard != "none":
        layout = Layout(mesh, shard, host, tx)
    params = place(host, replicated if layout is None else layout.params)
    if tx is None:
        return Model(params, Step(lambda form, count: compile_step(mesh, form, bucket_bytes, count, network, wire,
                                                                   layout),
                                  form,
                                  scaler=scaler), mesh, network.precision)
    laid_out = lambda arrays: [held(name, arrays[name]) for name in PARAM_NAMES]   # noqa: E731
    opt_state = optax_start(params, host, laid_out, PARAM_NAMES)
    return Model(params, OptaxTrainer(lambda form, count: compile_optax_step(mesh, form, tx, bucket_bytes, count,
                                                                             network, wire, layout), opt_state, form,
                                      scaler),
                 mesh, network.precision)


def place(tree, shardings):
    """Each array of `tree` a global array laid out as `shardings` says (one for all, or a tree like `tree`'s), from
    this process's whole copy of it: each device takes its block."""
    def put(a, sharding):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])
    if isinstance(shardings, NamedSharding):
        return jax.tree.map(lambda a: put(a, shardings), tree)
    return jax.tree.map(put, tree, shardings)


def train_step(model, batch, lr, batch_size, accumulate=1):
    """The summed loss of the global batch, its gradient all-reduced by XLA, the recipe's update
    lr * sum / global batch (an Optax trainer's own schedule sets the rate: lr is not used, the gradient is made
    the mean); this process's rows' mean loss comes back. The batch is pipeline.py's: global arrays sharded over
    the mesh, padding masked. accumulate: each device's rows in that many micro-batches (common.sharding
    .micro_batches), their gradients added up on the device before the one all-reduce (accumulated)."""
    net, trainer = model.net, model.trainer                # the replicated parameters and the compiled step
    X, y, mask, rows = batch
    rate = lr if trainer.opt_state is None else 1.0
    net[:], losses = trainer(net, X, y, mask, jnp.float32(rate / batch_size), accumulate)
    return sum(float(shard.data.sum()) for shard in losses.addressable_shards) / rows


def scaler_state(model):
    """The trainer's loss scaler between steps (common.loss_scaling.ScalerState; None without one)."""
    return None if model.trainer.scaler is None else model.trainer.scaler.state()


def restore_scaler(model, state):
    """The trainer's loss scaler carries on from a checkpoint's ScalerState."""
    model.trainer.scaler.restore(state)


def local_copy(tree):
    """This process's whole copy of every array of `tree`: a replicated array's own; a sliced one's (--shard) gathered
    from every device, across processes by process_allgather, a collective: every process calls it, for the same
    arrays (their shardings are the same in every process). The harness calls to_numpy, optimizer_state and evaluate
    on every rank of a sharded run (evaluate on every rank with test rows: all of them, unless there are more
    processes than test images)."""
    def whole(a):
        if a.is_fully_replicated:
            return a.addressable_data(0)
        if a.is_fully_addressable:
            return jax.device_put(a, a.addressable_shards[0].device)
        return jax.device_put(multihost_utils.process_allgather(a, tiled=True), a.addressable_shards[0].device)
    return jax.tree.map(whole, tree)


def local_params(model):
    """This process's copy of the parameters (gathered where sliced: local_copy)."""
    return local_copy(list(model.net))


def local_model(model, device=0, params=None):
    """The ResNet as a Flax module holding this process's copy of the parameters (`params` if given: local_copy's)
    and its device-th statistics."""
    params, stats = local_copy(model.net[0]) if params is None else params, model.net[1]
    if model.trainer.sync:
        stats = jax.tree.map(lambda a: a.addressable_data(device), stats)
    else:
        stats = jax.tree.map(lambda a: a.addressable_data(device)[0], stats)
    return nnx.merge(model.trainer.graphdef, params, stats)


def is_resnet(model):
    return isinstance(model.trainer, BatchNormTrainer)


def to_numpy(model):
    if is_resnet(model):
        return resnet.model_to_numpy(local_model(model))[0]
    return params_to_numpy(local_params(model))


def bn_state(model):
    return resnet.model_to_numpy(local_model(model))[1]


def replica_bn_states(model):
    """Each of this process's devices' statistics: its own block (local), or its copy of the replicated ones."""
    devices, params = len(model.placement.local_devices), local_copy(model.net[0])
    return [resnet.model_to_numpy(local_model(model, i, params))[1] for i in range(devices)]


def optimizer_state(model):
    """The canonical state of the model's Optax state: this process's copy, converted as the weights are (the
    ResNet's buffers, a pytree like its parameters, through its Flax module: resnet.model_to_numpy)."""
    local = local_copy(model.trainer.opt_state)
    if not is_resnet(model):
        return optax_canonical(local, params_to_numpy)
    params = local_copy(model.net[0])

    def to_canonical(buffers):
        module = local_model(model, params=params)
        nnx.update(module, buffers)
        return resnet.model_to_numpy(module)[0]
    return optax_canonical(local, to_canonical)


def state_bytes(model):
    """The bytes of the Optax state's buffers the first local device holds between steps (its slices under --shard;
    the counts, one scalar each, are no buffers: common.zero.memory counts the slots alone)."""
    opt_state = model.trainer.opt_state
    return 0 if opt_state is None else first_device_bytes(model, [kept for _, kept in buffers(opt_state)])


def parameter_bytes(model):
    """The bytes of parameters the first local device holds between steps (its slices at --shard parameters; the
    ResNet's BatchNorm statistics are no parameters)."""
    return first_device_bytes(model, model.net[0] if is_resnet(model) else model.net)


def save_sharded(model, path, optimizer, replacing):
    """The engine's checkpoint as its processes hold it, nothing gathered: checkpoint.save_sharded, every process
    writing its shards of the sliced parameters and Optax state with Orbax. Orbax commits each directory once every
    process has written (`replacing`, the harness's temporary for frameworks without such a commit, is not needed)."""
    state = None
    if model.trainer.opt_state is not None:
        counts = optax.tree_utils.tree_get_all_with_path(model.trainer.opt_state, "count")
        (step,) = {int(np.asarray(count.addressable_data(0))) for _, count in counts}
        state = {"step": step}
        for slot, kept in buffers(model.trainer.opt_state):
            state.update({f"{slot}.{name}": a for name, a in named(model, kept).items()})
    weights = named(model, model.net[0] if is_resnet(model) else model.net)
    stats = None
    if is_resnet(model):   # this process's first device's statistics, beside parameters of their shapes alone
        shaped = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), model.net[0])
        stats = resnet.model_to_numpy(local_model(model, params=shaped))[1]
    save_checkpoint(weights, stats, state, optimizer, path)


def named(model, tree):
    """canonical name -> array of a tree laid out as the parameters are (the LeNet's list, the ResNet's nnx.State)."""
    if not is_resnet(model):
        return dict(zip(PARAM_NAMES, tree))
    pure = nnx.to_pure_dict(tree)
    return {name: at(pure, path) for name, path in flax_paths(local_model(model, params=model.net[0])).items()}


def first_device_bytes(model, tree):
    device = model.placement.local_devices[0]
    return sum(shard.data.nbytes for a in jax.tree.leaves(tree) for shard in a.addressable_shards
               if shard.device == device)


def evaluate(model, X, y):
    if is_resnet(model):
        return evaluate_flax(Model(local_model(model), None), X, y)
    return evaluate_params(local_params(model), X, y)
