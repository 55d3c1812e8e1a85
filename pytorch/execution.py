"""How the step runs: PyTorch executes eagerly, op by op, unless torch.compile traces the network's forward into
fused kernels (a first step of seconds, then less Python overhead per step; AOTAutograd compiles the backward too).
The LeNet's forward is one device's; the ResNet's is every shard's in lock-step, the all-reduces of a synchronised
BatchNorm included (across processes a functional collective, which compiles into the graph: one graph, no break).
Its memory layout: PyTorch picks the convolution path from the strides of the input and kernel, contiguous
NCHW or channels-last (NHWC strides, the same NCHW shape). oneDNN runs channels-last convolutions on the
tensors as they are, but reorders contiguous ones into its blocked layout and back around every
convolution, forward and backward; channels-last is faster here (docs/results.md), so it is the default (the
ResNet runs NCHW in every layout: resnet.py says why). Nothing here changes another module: compile returns the
units, the model carries its layout."""
import torch

from common.interface import choose

from . import data_parallel, lenet, resnet

NAMES = {"eager": "eager", "graph": "torch.compile"}
# The forward each network's loss_and_grads runs, which the graph level compiles, with Inductor's options for it. The
# ResNet's convolutions stay NCHW: Inductor's layout optimization makes them channels-last, where oneDNN's 1x1
# stride-2 kernel (resnet.py's docstring) gave stage2's projection a gradient off by up to half its size, and a
# different one at every call (width 5); without it the compiled gradients are the eager ones within float32 rounding.
FORWARDS = {"lenet": (lenet.forward, None), "resnet18": (resnet.forward_shards, {"layout_optimization": False})}


def compiled_forward(written, model):
    """The unit loss_and_grads with `model`'s forward compiled by torch.compile: autograd.grad, the loop over the
    devices and the rest of the step run as written. Dynamo guards the compiled code (shapes, strides, the number of
    shards, sync) and compiles it again for another configuration. fp16's loss scale never enters the compiled code:
    the loss is multiplied by it outside, and the compiled backward takes the gradient it makes as an input, so a new
    scale compiles nothing."""
    function, options = FORWARDS[model.name]
    forward = torch.compile(function, options=options)

    def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale=1.0):
        return written(model, replicas, bn_states, X_shards, y_shards, devices, forward, scale)
    return loss_and_grads


# How each level compiles the units of data_parallel.py (UNITS) for a model; a unit it does not name runs as written
COMPILERS = {"eager": {}, "graph": {"loss_and_grads": compiled_forward}}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"eager": "nothing", "torch.compile": "fwd+bwd"}   # AOTAutograd compiles the backward too
DEFAULT = "eager"
LAYOUTS = {"nchw": "NCHW (contiguous)", "nhwc": "NHWC (channels_last)"}
DEFAULT_LAYOUT = lenet.DEFAULT_LAYOUT


def level(option):
    """The exec level's key for `option` ('default', 'eager' or 'graph'); Unavailable for one PyTorch lacks."""
    return choose(option, NAMES, DEFAULT, "PyTorch")


def layout(option):
    """The layout's key for `option` ('default', 'nchw' or 'nhwc'): a Functional's field."""
    return choose(option, LAYOUTS, DEFAULT_LAYOUT, "PyTorch", "layout")


def compile(level_option, model):
    """Every unit of data_parallel.py (UNITS) as `level_option` makes it for `model` (a Functional): what
    COMPILERS[level] makes of it, else the function as written. Two steps compiled apart (another level, layout,
    network or bucket size) run one after the other with no reset."""
    key = level(level_option)
    return {name: COMPILERS[key][name](written, model) if name in COMPILERS[key] else written
            for name, written in data_parallel.UNITS.items()}
