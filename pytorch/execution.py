"""How the step runs: PyTorch executes eagerly, op by op, unless torch.compile traces the model into
fused kernels (a first step of seconds, then less Python overhead per step).
Its memory layout: PyTorch picks the convolution path from the strides of the input and kernel, contiguous
NCHW or channels-last (NHWC strides, the same NCHW shape). oneDNN runs channels-last convolutions on the
tensors as they are, but reorders contiguous ones into its blocked layout and back around every
convolution, forward and backward; channels-last is faster here (docs/results.md), so it is the default."""
import torch

from common.interface import choose

from . import data_parallel, lenet

NAMES = {"eager": "eager", "graph": "torch.compile"}
# How each level compiles the units of data_parallel.py (UNITS); a unit it does not name runs as written
COMPILERS = {"eager": {}, "graph": {"forward": torch.compile}}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"eager": "nothing", "torch.compile": "fwd+bwd"}   # AOTAutograd compiles the backward too
DEFAULT = "eager"
LAYOUTS = {"nchw": "NCHW (contiguous)", "nhwc": "NHWC (channels_last)"}
DEFAULT_LAYOUT = "nhwc"   # what lenet.layout starts as


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here. Every unit
    of data_parallel.py (UNITS) becomes what COMPILERS[level] makes of it, or the function as written."""
    level = choose(level, NAMES, DEFAULT, "PyTorch")
    for name, written in data_parallel.UNITS.items():
        compiler = COMPILERS[level].get(name)
        setattr(data_parallel, name, compiler(written) if compiler else written)
    return NAMES[level]


def use_layout(layout):
    """Switch the scratch step's images and conv kernels to `layout` ('default', 'nchw' or 'nhwc'); returns
    its name here. Call it before use() and before get_params: replicas keep the layout they were made with."""
    lenet.layout = choose(layout, LAYOUTS, DEFAULT_LAYOUT, "PyTorch", "layout")
    return LAYOUTS[lenet.layout]
