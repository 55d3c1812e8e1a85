"""How the step runs: TensorFlow executes eagerly unless tf.function traces the step into a graph,
which XLA can further compile into fused kernels (jit_compile=True)."""
import tensorflow as tf

from common.interface import exec_level

from . import data_parallel

NAMES = {"eager": "eager", "graph": "tf.function", "xla": "tf.function+XLA"}
DEFAULT = "graph"
python_step = data_parallel.step_on_shards.python_function   # the undecorated step


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here."""
    level = exec_level(level, NAMES, DEFAULT, "TensorFlow")
    data_parallel.step_on_shards = (python_step if level == "eager" else
                                    tf.function(python_step, reduce_retracing=True, jit_compile=level == "xla"))
    return NAMES[level]
