"""How the step runs: JAX executes op by op (eager, each op dispatched on its own) unless jax.jit traces
the function and XLA compiles it into fused kernels, once per input shape (a new shard shape compiles
again). jax.jit is JAX's usual way, and it is already XLA: there is no separate XLA level."""
import jax

from common.interface import exec_level

from . import data_parallel

NAMES = {"eager": "eager", "graph": "jax.jit"}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"eager": "nothing", "jax.jit": "fwd+bwd, update"}   # the all-reduce between them runs op by op
DEFAULT = "graph"
python_steps = {name: getattr(data_parallel, name).__wrapped__ for name in ("loss_and_grads", "update")}


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here."""
    level = exec_level(level, NAMES, DEFAULT, "JAX")
    for name, fn in python_steps.items():
        setattr(data_parallel, name, jax.jit(fn) if level == "graph" else fn)
    return NAMES[level]
