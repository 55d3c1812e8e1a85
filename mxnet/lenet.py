"""LeNet in MXNet ops. A replica is the list of parameter NDArrays on one context, in
common.lenet.PARAM_NAMES order; MXNet's layout is PyTorch's, so no conversion is needed."""
import numpy as np
from mxnet import gluon, nd

from common.lenet import LAYERS, NUM_CLASSES, PARAM_NAMES, POOL

CONV1, CONV2, FC1 = (LAYERS[name][1] for name in ("conv1", "conv2", "fc1"))   # weight shapes


def to_layout(X):
    """A canonical NCHW batch in the convolutions' layout: as it is, NCHW being the only one MXNet's CPU
    Convolution takes (execution.py)."""
    return X


def get_params(weights, device):
    params = [nd.array(weights[name], ctx=device) for name in PARAM_NAMES]
    for p in params:
        p.attach_grad()                    # grad_req "write": each backward overwrites the last gradient
    return params


def forward(params, X, F=nd):
    """F is where the ops come from: mx.nd runs them one by one, mx.sym builds a graph of them, which is how
    hybridize traces this function (hybridized, below). A traced graph has no shapes to read: kernel sizes and
    widths come from the spec. A unit of data_parallel.py's step: execution.use replaces it there with
    hybridized(forward) at the graph level."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    relu = {"act_type": "relu"}            # Activation, not F.relu: its oneDNN kernel is faster (docs/results.md)
    pool = {"kernel": (POOL, POOL), "stride": (POOL, POOL), "pool_type": "avg"}
    h = F.Convolution(to_layout(X), w1, b1, kernel=CONV1[2:], num_filter=CONV1[0])
    h = F.Pooling(F.Activation(h, **relu), **pool)
    h = F.Convolution(h, w2, b2, kernel=CONV2[2:], num_filter=CONV2[0])
    h = F.Pooling(F.Activation(h, **relu), **pool)
    h = F.Activation(F.FullyConnected(h, w3, b3, num_hidden=FC1[0]), **relu)   # flattens in C, H, W order
    return F.FullyConnected(h, w4, b4, num_hidden=NUM_CLASSES)


class Traced(gluon.HybridBlock):
    """hybridize compiles a block, not a function: this block holds no weights and runs `function`(params, X, F)
    with the block's F, so hybridize traces the function itself. The parameters are inputs, so a replica stays
    a plain list of NDArrays."""
    def __init__(self, function):
        super().__init__()
        self.function = function

    def hybrid_forward(self, F, params, X):
        return self.function(params, X, F)


def hybridized(function):
    """`function` compiled by hybridize: traced once into a cached graph, as torch.compile or tf.function would;
    static_alloc and static_shape also reuse its memory from step to step, as an idiomatic Gluon loop does."""
    block = Traced(function)
    block.hybridize(static_alloc=True, static_shape=True)
    return block


cross_entropy = gluon.loss.SoftmaxCrossEntropyLoss()   # one loss per example


def loss_sum(logits, y):
    """Cross-entropy summed over the shard: shards add up to the global batch exactly."""
    return cross_entropy(logits, y).sum()


def to_numpy(params):
    return {name: p.asnumpy().astype(np.float32) for name, p in zip(PARAM_NAMES, params)}


def build_model(weights):
    """The same LeNet as an idiomatic Gluon HybridSequential (for the built-in engine and the reference
    loop), on the CPU: move it with collect_params().reset_ctx. Its parameters come out in PARAM_NAMES
    order; hybridized like the scratch forward."""
    nn = gluon.nn
    net = nn.HybridSequential()
    net.add(nn.Conv2D(CONV1[0], CONV1[2:], in_channels=CONV1[1]), nn.Activation("relu"), nn.AvgPool2D(POOL),
            nn.Conv2D(CONV2[0], CONV2[2:], in_channels=CONV2[1]), nn.Activation("relu"), nn.AvgPool2D(POOL),
            nn.Dense(FC1[0], activation="relu", in_units=FC1[1]),   # flattens in C, H, W order
            nn.Dense(NUM_CLASSES, in_units=FC1[0]))
    net.initialize()
    for p, name in zip(net.collect_params().values(), PARAM_NAMES):
        p.set_data(nd.array(weights[name]))
    net.hybridize(static_alloc=True, static_shape=True)
    return net
