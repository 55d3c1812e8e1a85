"""How the step runs: JAX executes op by op (eager, each op dispatched on its own) unless jax.jit traces
the function and XLA compiles it into fused kernels, once per input shape (a new shard shape compiles
again). jax.jit is JAX's usual way, and it is already XLA: there is no separate XLA level. A jitted function
runs on one device or one mesh, and the recipe's replicas are separate arrays on separate devices: jax.jit
compiles one device's part of loss_and_grads and calls it for each device (dispatched asynchronously, the devices
work in parallel), and the updates of each replica whole; the all-reduce between them runs op by op. The ResNet's
synchronised BatchNorm needs every shard at every BatchNorm (its lock-step forward all-reduces the moments across
the devices, and across processes through resnet.process_sum), so its loss_and_grads runs op by op at every level:
its compiled form is the built-in engine's, a jit over a sharded batch.
Its layout: lax convolutions run in the layout their dimension numbers name: NCHW/OIHW, the canonical one,
or NHWC/HWIO with the weights converted (common/layouts.py) and the batch transposed inside the step. XLA's
CPU convolutions are faster in NHWC here (the transpose included; docs/results.md), so it is the default.
Nothing here sets anything on another module: compile returns the units, and the layout is the model's field."""
import jax

from common.interface import choose

from . import data_parallel
from .lenet import DEFAULT_LAYOUT

NAMES = {"eager": "eager", "graph": "jax.jit"}


def per_device(unit, model):
    """jax.jit of a loss_and_grads unit, one device's part at a time: the unit compiled for a one-device call (its
    lists of one replica, one BatchNorm state, one shard; the model static), called for each device in turn. A
    lock-step forward (the ResNet's synchronised BatchNorm: model.sync) needs every shard at once: it stays as
    written (COMPILES says so)."""
    if getattr(model, "sync", False):
        return unit
    compiled = jax.jit(unit, static_argnums=0)

    def each_device(model, replicas, bn_states, X_shards, y_shards, devices):
        parts = [compiled(model, [params], [bn_state], [X], [y], [None])   # one device: nothing to place
                 for params, bn_state, X, y in zip(replicas, bn_states, X_shards, y_shards)]
        return tuple([part[i][0] for part in parts] for i in range(3))   # losses, grads, bn_states
    return each_device


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
            "jax.jit": "fwd+bwd (each device's), update; the ResNet with --bn sync: update (its fwd+bwd op by op)"}
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
