"""How the step runs: MXNet executes imperatively, op by op, unless hybridize traces the forward into a
cached graph whose memory is planned once and reused every step (static_alloc); the graph runs its backward too.
hybridize traces a block on one context: the LeNet's forward is one graph, and so is the ResNet's per replica with
local BatchNorm. With synchronised BatchNorm no graph can span the contexts and the kvstore: every BatchNorm's
moments are summed across them before any shard goes on, so each replica's forward is cut there into 41 graphs
(resnet.segments), everything but the all-reduces of the moments (per-channel vectors) compiled, forward and
backward.
Its layout: NCHW only. MXNet's CPU Convolution refuses NHWC ("Only support NCW, NCHW and NCDHW layout";
layout="NHWC" is for cuDNN, on a GPU); its oneDNN kernels run the plain NCHW tensors as they are (DNNL_VERBOSE
shows abcd formats, gemm convolutions, no reorder into blocked layouts)."""
from common.interface import choose

from . import data_parallel
from .lenet import DEFAULT_LAYOUT

NAMES = {"eager": "imperative", "graph": "hybridize"}


def hybridize(written, model):
    """The unit loss_and_grads with the model's forward traced by hybridize (model.hybridized: each network says what
    its graphs hold)."""
    compiled = model.hybridized()

    def loss_and_grads(model, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        return compiled(replicas, bn_states, X_shards, y_shards, devices, scale)
    return loss_and_grads


# How each level compiles the units of data_parallel.py (UNITS), compiler(written unit, model); a unit it does not
# name runs as written
COMPILERS = {"eager": {}, "graph": {"loss_and_grads": hybridize}}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"imperative": "nothing", "hybridize": "fwd+bwd"}   # the CachedOp runs its backward as a graph too
DEFAULT = "graph"
LAYOUTS = {"nchw": "NCHW (the only one)"}
MISSING_LAYOUTS = {"nhwc": "its CPU Convolution takes NCHW only; layout='NHWC' is for cuDNN, on a GPU"}


def level(option):
    """The exec level for `option` ('default', 'eager', 'graph' or 'xla'): a key of NAMES, or Unavailable."""
    return choose(option, NAMES, DEFAULT, "MXNet")


def layout(option):
    """The layout for `option` ('default', 'nchw' or 'nhwc'): a key of LAYOUTS (NCHW, the only one), or Unavailable."""
    return choose(option, LAYOUTS, DEFAULT_LAYOUT, "MXNet", "layout", MISSING_LAYOUTS)


def compile(level_option, model):
    """The step's units at a level for `model` (a Functional): every name of data_parallel.UNITS, as
    COMPILERS[level] makes it or as written. Each call compiles anew: two steps of other levels, networks or
    settings run one after the other in one process, each with its own units. Unavailable for a level MXNet lacks
    (level)."""
    compilers = COMPILERS[level(level_option)]
    return {name: compilers[name](written, model) if name in compilers else written
            for name, written in data_parallel.UNITS.items()}
