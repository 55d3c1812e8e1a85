"""How the step runs: JAX executes op by op (eager, each op dispatched on its own) unless jax.jit traces
the function and XLA compiles it into fused kernels, once per input shape (a new shard shape compiles
again). jax.jit is JAX's usual way, and it is already XLA: there is no separate XLA level.
Its layout: lax convolutions run in the layout their dimension numbers name: NCHW/OIHW, the canonical one,
or NHWC/HWIO with the weights converted (common/layouts.py) and the batch transposed inside the step. XLA's
CPU convolutions are faster in NHWC here (the transpose included; docs/results.md), so it is the default."""
import jax

from common.interface import choose

from . import data_parallel, lenet, optimizer

NAMES = {"eager": "eager", "graph": "jax.jit"}
# How each level compiles the units of data_parallel.py and optimizer.py (their UNITS; "update" names the recipe's
# and the optimizer's); a unit it does not name runs as written
COMPILERS = {"eager": {}, "graph": {"loss_and_grads": jax.jit, "update": jax.jit}}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"eager": "nothing", "jax.jit": "fwd+bwd, update"}   # the all-reduce between them runs op by op
DEFAULT = "graph"
LAYOUTS = {"nchw": "NCHW/OIHW (lax)", "nhwc": "NHWC/HWIO (lax)"}
DEFAULT_LAYOUT = "nhwc"   # what lenet.layout starts as


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here. Every unit
    of data_parallel.py and optimizer.py (UNITS) becomes what COMPILERS[level] makes of it, or the function as
    written."""
    level = choose(level, NAMES, DEFAULT, "JAX")
    for module in (data_parallel, optimizer):
        for name, written in module.UNITS.items():
            compiler = COMPILERS[level].get(name)
            setattr(module, name, compiler(written) if compiler else written)
    return NAMES[level]


def use_layout(layout):
    """Switch the scratch step to `layout` ('default', 'nchw' or 'nhwc'); returns its name here. Call it before
    use() and before get_params: compiled steps and replicas keep the layout they were made with."""
    lenet.layout = choose(layout, LAYOUTS, DEFAULT_LAYOUT, "JAX", "layout")
    return LAYOUTS[lenet.layout]
