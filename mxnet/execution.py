"""How the step runs: MXNet executes imperatively, op by op, unless hybridize traces the forward into a
cached graph whose memory is planned once and reused every step (static_alloc).
Its layout: NCHW only. MXNet's CPU Convolution refuses NHWC ("Only support NCW, NCHW and NCDHW layout";
layout="NHWC" is for cuDNN, on a GPU); its oneDNN kernels run the plain NCHW tensors as they are (DNNL_VERBOSE
shows abcd formats, gemm convolutions, no reorder into blocked layouts)."""
from common.interface import choose

from . import data_parallel
from .lenet import hybridized

NAMES = {"eager": "imperative", "graph": "hybridize"}
# How each level compiles the units of data_parallel.py (UNITS); a unit it does not name runs as written
COMPILERS = {"eager": {}, "graph": {"forward": hybridized}}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"imperative": "nothing", "hybridize": "fwd+bwd"}   # the CachedOp runs its backward as a graph too
DEFAULT = "graph"
LAYOUTS = {"nchw": "NCHW (the only one)"}
DEFAULT_LAYOUT = "nchw"   # lenet.py has no layout to switch: NCHW is the only one
MISSING_LAYOUTS = {"nhwc": "its CPU Convolution takes NCHW only; layout='NHWC' is for cuDNN, on a GPU"}


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here. Every unit
    of data_parallel.py (UNITS) becomes what COMPILERS[level] makes of it, or the function as written."""
    level = choose(level, NAMES, DEFAULT, "MXNet")
    for name, written in data_parallel.UNITS.items():
        compiler = COMPILERS[level].get(name)
        setattr(data_parallel, name, compiler(written) if compiler else written)
    return NAMES[level]


def use_layout(layout):
    """The scratch step's layout for `layout` ('default', 'nchw' or 'nhwc'): NCHW is the only one here; returns
    its name."""
    return LAYOUTS[choose(layout, LAYOUTS, DEFAULT_LAYOUT, "MXNet", "layout", MISSING_LAYOUTS)]
