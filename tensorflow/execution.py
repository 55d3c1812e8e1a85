"""How the step runs: TensorFlow executes eagerly unless tf.function traces the step into a graph,
which XLA can further compile into fused kernels (jit_compile=True). XLA compiles each device's forward
and backward, not the whole step: one XLA cluster runs on one device and cannot reach the variables of
the others ("Trying to access resource ... located in device CPU:1 from device CPU:0").
Its layout: NHWC is TensorFlow's usual one on the CPU; its CPU kernels (oneDNN) also run NCHW convolutions
and pooling, forward and backward (data_format="NCHW"), with the same HWIO kernels. NHWC, the transpose of
the input included, was ~1.3x faster here, so it is the default."""
import tensorflow as tf

from common.interface import choose

from . import data_parallel, lenet

NAMES = {"eager": "eager", "graph": "tf.function", "xla": "tf.function+XLA"}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"eager": "nothing", "tf.function": "whole step", "tf.function+XLA": "whole step, fwd+bwd by XLA"}
DEFAULT = "graph"
LAYOUTS = {"nchw": 'NCHW (data_format="NCHW")', "nhwc": "NHWC (transposed in)"}
DEFAULT_LAYOUT = "nhwc"   # what lenet.layout starts as
python_step = data_parallel.step_on_shards.python_function   # the undecorated step
python_device_part = data_parallel.loss_and_grads


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here."""
    level = choose(level, NAMES, DEFAULT, "TensorFlow")
    data_parallel.step_on_shards = (python_step if level == "eager" else
                                    tf.function(python_step, reduce_retracing=True))
    data_parallel.loss_and_grads = (tf.function(python_device_part, reduce_retracing=True, jit_compile=True)
                                    if level == "xla" else python_device_part)
    return NAMES[level]


def use_layout(layout):
    """Switch the scratch step's convolutions to `layout` ('default', 'nchw' or 'nhwc'); returns its name here.
    Call it before use(): a traced step keeps the layout it was traced with."""
    lenet.layout = choose(layout, LAYOUTS, DEFAULT_LAYOUT, "TensorFlow", "layout")
    return LAYOUTS[lenet.layout]
