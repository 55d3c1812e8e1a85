"""How the step runs: TensorFlow executes eagerly unless tf.function traces the step into a graph,
which XLA can further compile into fused kernels (jit_compile=True). XLA compiles each device's forward
and backward, not the whole step: one XLA cluster runs on one device and cannot reach the variables of
the others ("Trying to access resource ... located in device CPU:1 from device CPU:0"). So XLA compiles the
ResNet's step with local BatchNorm (each device's part depends on its shard alone) but not with synchronised
BatchNorm, whose every layer all-reduces the shards' moments across devices (and processes) inside the forward
and the backward: no one-device part is left to compile (compile raises Unavailable).
Its layout: NHWC is TensorFlow's usual one on the CPU; its CPU kernels also run NCHW convolutions and pooling,
forward and backward (data_format="NCHW"), with the same HWIO kernels, but only through oneDNN, which TensorFlow
turns on by default only on some x86 CPUs (Intel's with AVX-512; not on an AMD EPYC, where NCHW pooling fails:
"Default AvgPoolingOp only supports NHWC on device type CPU"; TF_ENABLE_ONEDNN_OPTS=1 turns it on). GPUs run
NCHW with cuDNN. NHWC, the transpose of the input included, is faster here (docs/results.md), so it is the
default. Nothing here changes another module: compile returns the units, the model carries its layout."""
import functools

import tensorflow as tf

from common.interface import Unavailable, choose

from . import data_parallel, lenet
from .devices import gpu_count

NAMES = {"eager": "eager", "graph": "tf.function", "xla": "tf.function+XLA"}
# autograph=False: the step's Python has no control flow on tensors (a loop over devices or micro-batches unrolls, a
# condition is tf.cond), so AutoGraph's rewrite of its source changes nothing but the tracing time: a quarter of a
# ResNet worker's 13.7 s here. A tensor in a Python `if` would fail the trace, not change the graph.
graph = functools.partial(tf.function, reduce_retracing=True, autograph=False)


def per_device(compiler):
    """A compiler of the loss_and_grads unit that compiles each device's part on its own: the unit called with one
    device's replica, BatchNorm state and shard at a time, each call one XLA cluster on that device (traced per
    model and device; the loss scale, if any, a tensor argument)."""
    def compile_unit(written):
        compiled = compiler(written)

        def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale=None):
            losses, grads, new_states = [], [], []
            for params, bn_state, X, y, device in zip(replicas, bn_states, X_shards, y_shards, devices):
                with tf.device(device):
                    (loss,), (device_grads,), (new_state,) = compiled(model, [params], [bn_state], [X], [y], (device,),
                                                                      scale)
                losses.append(loss)
                grads.append(device_grads)
                new_states.append(new_state)
            return losses, grads, new_states
        return loss_and_grads
    return compile_unit


def on_their_devices(compiler):
    """A compiler of the loss_and_grads unit whose results say where they are. A tf.function called inside another
    graph (the step's) hands back tensors with no device, and the all-reduce across processes needs one (its
    collective's destinations: "destinations can not be empty"): each device's loss, gradients and BatchNorm state
    are handed on through tf.identity on that device."""
    def compile_unit(written):
        compiled = compiler(written)

        def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale=None):
            results = ([], [], [])
            for device, *parts in zip(devices, *compiled(model, replicas, bn_states, X_shards, y_shards, devices,
                                                         scale)):
                with tf.device(device):
                    for placed, part in zip(results, parts):   # the LeNet's BatchNorm state is None
                        placed.append(None if part is None else tf.nest.map_structure(tf.identity, part))
            return results
        return loss_and_grads
    return compile_unit


# How each level compiles the units of data_parallel.py (UNITS); a unit it does not name runs as written. The graph
# level traces loss_and_grads too (inlined in the step's graph), so the gradient alone rounds as the step's does
# (harness/studies/stepcheck.py takes it so): eager ops round a BatchNorm'd convolution's bias gradient (a true 0)
# otherwise than Grappler's fused graph
COMPILERS = {"eager": {}, "graph": {"step_on_shards": graph, "loss_and_grads": on_their_devices(graph)},
             "xla": {"step_on_shards": graph,
                     "loss_and_grads": per_device(functools.partial(graph, jit_compile=True))}}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"eager": "nothing", "tf.function": "whole step", "tf.function+XLA": "whole step, fwd+bwd by XLA"}
DEFAULT = "graph"
# Why a level cannot compile the step of a network with synchronised BatchNorm (compile raises Unavailable with it)
CANNOT_SYNC = {"xla": "XLA compiles each device's forward and backward as one cluster on that device, and "
                         "synchronised BatchNorm all-reduces every layer's moments across the devices and processes "
                         "inside them; run --bn sync at the graph or eager level"}


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
DEFAULT_LAYOUT = lenet.DEFAULT_LAYOUT


def level(option):
    """The exec level's key for `option` ('default', 'eager', 'graph' or 'xla'); Unavailable for one TensorFlow
    lacks."""
    return choose(option, NAMES, DEFAULT, "TensorFlow")


def layout(option):
    """The layout's key for `option` ('default', 'nchw' or 'nhwc'): a Functional's field. Unavailable for one that
    cannot run here (MISSING_LAYOUTS says why)."""
    return choose(option, LAYOUTS, DEFAULT_LAYOUT, "TensorFlow", "layout", MISSING_LAYOUTS)


def compile(level, model):
    """Every unit of data_parallel.py (UNITS) as `level` ('default', 'eager', 'graph' or 'xla') makes it for `model`
    (a Functional): what COMPILERS makes of it, else the function as written. New compiled functions at each call:
    two steps compiled apart (another level, layout, network or bucket size) run one after the other with no reset.
    Unavailable where the level cannot compile the model's step (CANNOT_SYNC)."""
    key = choose(level, NAMES, DEFAULT, "TensorFlow")
    if getattr(model, "sync", False) and key in CANNOT_SYNC:
        raise Unavailable(f"TensorFlow cannot run {NAMES[key]} for {model.name} with --bn sync: {CANNOT_SYNC[key]}")
    return {name: COMPILERS[key][name](written) if name in COMPILERS[key] else written
            for name, written in data_parallel.UNITS.items()}
