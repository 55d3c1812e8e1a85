"""How the step runs: TensorFlow executes eagerly unless tf.function traces the step into a graph,
which XLA can further compile into fused kernels (jit_compile=True). XLA compiles each device's forward
and backward, not the whole step: one XLA cluster runs on one device and cannot reach the variables of
the others ("Trying to access resource ... located in device CPU:1 from device CPU:0").
Its layout: NHWC is TensorFlow's usual one on the CPU; its CPU kernels also run NCHW convolutions and pooling,
forward and backward (data_format="NCHW"), with the same HWIO kernels, but only through oneDNN, which TensorFlow
turns on by default only on some x86 CPUs (Intel's with AVX-512; not on an AMD EPYC, where NCHW pooling fails:
"Default AvgPoolingOp only supports NHWC on device type CPU"; TF_ENABLE_ONEDNN_OPTS=1 turns it on). GPUs run
NCHW with cuDNN. NHWC, the transpose of the input included, is faster here (docs/results.md), so it is the
default."""
import functools

import tensorflow as tf

from common.interface import choose

from . import data_parallel, lenet
from .devices import gpu_count

NAMES = {"eager": "eager", "graph": "tf.function", "xla": "tf.function+XLA"}
# How each level compiles the units of data_parallel.py (UNITS); a unit it does not name runs as written
graph = functools.partial(tf.function, reduce_retracing=True)
COMPILERS = {"eager": {}, "graph": {"step_on_shards": graph},
             "xla": {"step_on_shards": graph, "loss_and_grads": functools.partial(graph, jit_compile=True)}}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"eager": "nothing", "tf.function": "whole step", "tf.function+XLA": "whole step, fwd+bwd by XLA"}
DEFAULT = "graph"


def onednn_enabled():
    """Whether TensorFlow's CPU kernels are oneDNN's here (no public API tells; assume so if it cannot)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return True


LAYOUTS = {"nchw": 'NCHW (data_format="NCHW")', "nhwc": "NHWC (transposed in)"}
MISSING_LAYOUTS = {"nchw": "its CPU pooling runs NCHW only with oneDNN, which is off on this CPU; "
                           "TF_ENABLE_ONEDNN_OPTS=1 turns it on"}
if not (gpu_count() or onednn_enabled()):
    del LAYOUTS["nchw"]
DEFAULT_LAYOUT = "nhwc"   # what lenet.layout starts as


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here. Every unit
    of data_parallel.py (UNITS) becomes what COMPILERS[level] makes of it, or the function as written."""
    level = choose(level, NAMES, DEFAULT, "TensorFlow")
    for name, written in data_parallel.UNITS.items():
        compiler = COMPILERS[level].get(name)
        setattr(data_parallel, name, compiler(written) if compiler else written)
    return NAMES[level]


def use_layout(layout):
    """Switch the scratch step's convolutions to `layout` ('default', 'nchw' or 'nhwc'); returns its name here.
    Call it before use(): a traced step keeps the layout it was traced with."""
    lenet.layout = choose(layout, LAYOUTS, DEFAULT_LAYOUT, "TensorFlow", "layout", MISSING_LAYOUTS)
    return LAYOUTS[lenet.layout]
