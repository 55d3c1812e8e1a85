"""How the step runs: JAX executes op by op (eager, each op dispatched on its own) unless jax.jit traces
the function and XLA compiles it into fused kernels, once per input shape (a new shard shape compiles
again). jax.jit is JAX's usual way, and it is already XLA: there is no separate XLA level. A jitted function
runs on one device or one mesh, and the recipe's replicas are separate arrays on separate devices: jax.jit
compiles one device's part of loss_and_grads and calls it for each device (dispatched asynchronously, the devices
work in parallel), and the updates of each replica whole; the all-reduce between them runs op by op. The ResNet's
synchronised BatchNorm needs every shard at every BatchNorm (its lock-step forward all-reduces the moments across
the devices): its loss_and_grads is compiled for all the devices at once, one program over a mesh of them under
shard_map, each device's part psum-ing its moments (lock_step). Across processes the moments go through
resnet.process_sum, a collective of its own outside any mesh: there it runs op by op.
Its layout: lax convolutions run in the layout their dimension numbers name: NCHW/OIHW, the canonical one,
or NHWC/HWIO with the weights converted (common/layouts.py) and the batch transposed inside the step. XLA's
CPU convolutions are faster in NHWC here (the transpose included; docs/results.md), so it is the default.
At bf16 or fp16 (the model's precision field) the compiled step keeps every rounding to bf16 or fp16 the forward and
backward write (compiler_options). At fp16 the loss scale is an argument of the compiled loss_and_grads, traced:
every scale the run moves to runs the same program.
Nothing here sets anything on another module: compile returns the units, and the layout is the model's field."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.interface import choose
from common.precision import is_low

from . import data_parallel
from . import distributed as dist
from .lenet import DEFAULT_LAYOUT

NAMES = {"eager": "eager", "graph": "jax.jit"}


def compiler_options(model, allreduce_dtype="fp32"):
    """XLA's options for compiling the model's step: at bf16 or fp16, or bf16 on the wire, no excess precision. XLA
    allows it by default (xla_allow_excess_precision) and drops a rounding to bf16 that is widened again: the weight
    gradients of the bf16 convolutions reached their fp32 master weights unrounded, not the bf16 values
    common/precision.py says, and a bf16 psum's casts vanish (the CPU sums a bf16 all-reduce in fp32). At fp16 the
    rounding is also where an overflow becomes inf: without it a weight gradient past 65504 would reach its fp32
    master weight finite, and the step the loss scaling must skip would run."""
    low = is_low(getattr(model, "precision", "fp32")) or allreduce_dtype != "fp32"
    return {"xla_allow_excess_precision": False} if low else None


def per_device(unit, model):
    """jax.jit of a loss_and_grads unit, one device's part at a time: the unit compiled for a one-device call (its
    lists of one replica, one BatchNorm state, one shard; the model static), called for each device in turn. A
    lock-step forward (the ResNet's synchronised BatchNorm: model.sync) needs every shard at once: lock_step."""
    if getattr(model, "sync", False):
        return lock_step(unit, model)
    compiled = jax.jit(unit, static_argnums=0, compiler_options=compiler_options(model))

    def each_device(model, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        parts = [compiled(model, [params], [bn_state], [X], [y], [None], scale)   # one device: nothing to place
                 for params, bn_state, X, y in zip(replicas, bn_states, X_shards, y_shards)]
        return tuple([part[i][0] for part in parts] for i in range(3))   # losses, grads, bn_states
    return each_device


def lock_step(unit, model):
    """jax.jit of the synchronised loss_and_grads for every device at once: one program over a mesh of the run's
    devices. Each replica, BatchNorm state and shard becomes its device's block of a global array (made from the
    arrays where they are); under shard_map each device runs the lock-step forward on its own block, its BatchNorm
    moments lax.psum'd over the mesh (the model's axis). The shards are padded to one shape with rows labelled -1,
    which the statistics and the loss leave out. The loss scale (None: none) is every device's. Across processes it
    stays as written (COMPILES says so)."""
    if dist.is_initialized():
        return unit
    meshed, programs = dataclasses.replace(model, axis="devices"), {}

    def on_the_mesh(model, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        if tuple(devices) not in programs:
            mesh = Mesh(np.array(devices), ("devices",))
            programs[tuple(devices)] = mesh, jax.jit(jax.shard_map(
                functools.partial(one_block, unit, meshed), mesh=mesh, in_specs=(P("devices"),) * 4 + (P(),),
                out_specs=P("devices")), compiler_options=compiler_options(model))
        mesh, program = programs[tuple(devices)]
        rows = max(len(X) for X in X_shards)
        X_shards = [jnp.pad(X, ((0, rows - len(X)),) + ((0, 0),) * (X.ndim - 1)) for X in X_shards]
        y_shards = [jnp.pad(y.astype(jnp.int32), (0, rows - len(y)), constant_values=-1) for y in y_shards]
        blocks = [stacked(mesh, per_device) for per_device in (replicas, bn_states, X_shards, y_shards)]
        return tuple(unstacked(out, devices) for out in program(*blocks, scale))   # losses, grads, bn_states
    return on_the_mesh


def one_block(unit, model, replicas, bn_states, X, y, scale):
    """Inside shard_map: the unit on this device's block of each argument (leading axis 1), as on one device."""
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)   # noqa: E731
    out = unit(model, [first(replicas)], [first(bn_states)], [X[0]], [y[0]], [None], scale)
    return jax.tree.map(lambda a: a[None], [part[0] for part in out])


def stacked(mesh, per_device):
    """One global array per leaf of the devices' pytrees (a list, one per device in mesh order), device i's leaf
    its block i: no copy across devices."""
    sharding = NamedSharding(mesh, P("devices"))
    return jax.tree.map(lambda *leaves: jax.make_array_from_single_device_arrays(
        (len(leaves), *leaves[0].shape), sharding, [leaf[None] for leaf in leaves]), *per_device)


def unstacked(tree, devices):
    """stacked's inverse: a list of pytrees, one per device, each leaf that device's block."""
    def blocks(a):
        by_device = {shard.device: shard.data for shard in a.addressable_shards}
        return [by_device[d][0] for d in devices]
    leaves, treedef = jax.tree.flatten(tree)
    per_leaf = [blocks(leaf) for leaf in leaves]
    return [jax.tree.unflatten(treedef, [blocks_[i] for blocks_ in per_leaf]) for i in range(len(devices))]


def donating(*argnums):
    """jax.jit of an update, every array it takes on one device (one replica's), its arguments `argnums` donated (the
    old parameters, and the optimizer's state): XLA writes the new ones into their memory, as an update in place."""
    return lambda unit, model: jax.jit(unit, donate_argnums=argnums)


# How each level compiles the units of data_parallel.py (its UNITS: "update" is the recipe's sgd update,
# "optimizer.update" optimizer.py's); a unit it does not name runs as written
COMPILERS = {"eager": {}, "graph": {"loss_and_grads": per_device, "update": donating(0),
                                "optimizer.update": donating(0, 2)}}
# What each level puts in a compiled graph (the rest runs op by op), for each network: the table's "compiles" column
COMPILES = {"eager": "nothing",
            "jax.jit": "fwd+bwd (each device's), update; the ResNet with --bn sync: fwd+bwd (every device's at once; "
                       "op by op across processes), update"}
DEFAULT = "graph"
LAYOUTS = {"nchw": "NCHW/OIHW (lax)", "nhwc": "NHWC/HWIO (lax)"}
MISSING_LAYOUTS = {}   # JAX runs both


def level(option):
    """The exec level's key for `option` ('default', 'eager', 'graph'; Unavailable for one JAX lacks, 'xla')."""
    return choose(option, NAMES, DEFAULT, "JAX")


def layout(option):
    """The layout's key for `option` ('default', 'nchw' or 'nhwc'): a Functional's field."""
    return choose(option, LAYOUTS, DEFAULT_LAYOUT, "JAX", "layout", MISSING_LAYOUTS)


def compile(level, model):
    """Every unit of data_parallel.UNITS as the exec level `level` ('default', 'eager', 'graph') makes it for the
    network `model` (a Functional): what COMPILERS names, compiled; the rest as written. New compiled functions each
    call: steps of other levels, layouts or networks run one after the other in one process."""
    compilers = COMPILERS[choose(level, NAMES, DEFAULT, "JAX")]
    return {name: compilers[name](written, model) if name in compilers else written
            for name, written in data_parallel.UNITS.items()}
