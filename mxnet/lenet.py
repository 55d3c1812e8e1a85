"""LeNet in MXNet ops. A replica is the list of parameter NDArrays on one context, in
common.lenet.PARAM_NAMES order; MXNet's layout is PyTorch's, so no conversion is needed. Functional (at the end) is
the network as the scratch step trains it."""
import dataclasses

import numpy as np
from mxnet import autograd, gluon, nd

from common.lenet import LAYERS, NUM_CLASSES, PARAM_NAMES, POOL
from common.precision import is_low

from .devices import check_precision

CONV1, CONV2, FC1 = (LAYERS[name][1] for name in ("conv1", "conv2", "fc1"))   # weight shapes
DEFAULT_LAYOUT = "nchw"   # execution.LAYOUTS' only key, here so that the networks' files need not import execution.py
# Each low precision's dtype as amp_cast takes it: MXNet's name for bfloat16 (contrib/amp/amp.py's), a structured dtype
# because numpy has no such type; numpy's float16
DTYPES = {"bf16": np.dtype([("bfloat16", np.uint16)]), "fp16": np.float16}


def to_layout(X, layout=DEFAULT_LAYOUT):
    """A canonical NCHW batch in the convolutions' layout: as it is, NCHW being the only one MXNet's CPU
    Convolution takes (execution.py)."""
    return X


def get_params(weights, device):
    params = [nd.array(weights[name], ctx=device) for name in PARAM_NAMES]
    for p in params:
        p.attach_grad()                    # grad_req "write": each backward overwrites the last gradient
    return params


def low(F, x, precision):
    """x as a convolution or dense layer at `precision` takes it (common/precision.py): cast to bf16 or fp16 as
    contrib.amp casts its BF16_FUNCS' or FP16_FUNCS' inputs, by amp_cast, whose backward casts the gradient back (an
    fp32 master weight gets an fp32 gradient, a bf16 or fp16 value). x itself at fp32: the fp32 graph is as it always
    was."""
    return F.amp_cast(x, dtype=DTYPES[precision]) if is_low(precision) else x


def fp32(F, x, precision):
    """x, made at `precision`, widened to fp32 for what runs in fp32 whatever its input (common/precision.py): the
    ResNet's BatchNorm and global mean (mean, like log_softmax, is one of contrib.amp's FP32_FUNCS); x itself at
    fp32."""
    return F.amp_cast(x, dtype=np.float32) if is_low(precision) else x


def forward(params, X, F=nd, layout=DEFAULT_LAYOUT, precision="fp32"):
    """F is where the ops come from: mx.nd runs them one by one, mx.sym builds a graph of them, which is how
    hybridize traces this function (hybridized, below). A traced graph has no shapes to read: kernel sizes and
    widths come from the spec. At bf16 or fp16 the convolutions and dense layers take X and the weights cast (low),
    and every op after them runs on the low-precision values they make, as contrib.amp runs them: so are the
    logits."""
    w1, b1, w2, b2, w3, b3, w4, b4 = (low(F, p, precision) for p in params)
    relu = {"act_type": "relu"}            # Activation, not F.relu: its oneDNN kernel is faster (docs/results.md)
    pool = {"kernel": (POOL, POOL), "stride": (POOL, POOL), "pool_type": "avg"}
    h = F.Convolution(low(F, to_layout(X, layout), precision), w1, b1, kernel=CONV1[2:], num_filter=CONV1[0])
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
    """`function`(params, X, F) compiled by hybridize: traced once into a cached graph, as torch.compile or tf.function
    would; static_alloc and static_shape also reuse its memory from step to step, as an idiomatic Gluon loop does.
    One block serves every context: the CachedOp keeps a graph's state per context."""
    block = Traced(function)
    block.hybridize(static_alloc=True, static_shape=True)
    return block


cross_entropy = gluon.loss.SoftmaxCrossEntropyLoss()   # one loss per example


def loss_sum(logits, y):
    """Cross-entropy summed over the shard, in fp32 whatever the logits' precision (common/precision.py; log_softmax
    is one of contrib.amp's FP32_FUNCS): shards add up to the global batch exactly."""
    if logits.dtype != np.float32:
        logits = nd.amp_cast(logits, dtype=np.float32)
    return cross_entropy(logits, y).sum()


def scaled(loss, scale):
    """What the backward differentiates: the loss times the step's loss scale (common/loss_scaling.py), recorded, as
    contrib.amp.scale_loss makes it; the loss itself without one (scale None). The scale is an input of the
    multiplication, not of a traced graph: a new scale retraces nothing."""
    return loss if scale is None else loss * scale


def loss_and_grads(replicas, X_shards, y_shards, forward=forward, scale=None):
    """Each context's summed loss on its shard and its replica's gradients (in its parameters' .grad): a record and a
    backward per context, queued asynchronously, so the contexts work in parallel. `forward`(params, X): the written
    one, or its hybridized graph. With a loss scale the gradients are the scaled loss's (scaled), the losses not."""
    losses = []
    for params, X, y in zip(replicas, X_shards, y_shards):
        with autograd.record():
            loss = loss_sum(forward(params, X), y)
            head = scaled(loss, scale)
        head.backward()
        losses.append(loss)
    return losses, [[p.grad for p in params] for params in replicas]


def to_numpy(params):
    return {name: p.asnumpy().astype(np.float32) for name, p in zip(PARAM_NAMES, params)}


def evaluate(params, X, y, forward=forward, batch_size=1000):
    """Accuracy of one replica, outside autograd.record."""
    device = params[0].context
    correct = 0
    for i in range(0, len(X), batch_size):
        X_batch = nd.array(X[i:i + batch_size], ctx=device)
        correct += (forward(params, X_batch).argmax(axis=1).asnumpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)


def build_model(weights):
    """The same LeNet as an idiomatic Gluon HybridSequential (for the built-in engine and the reference
    loop), on the CPU: move it with collect_params().reset_ctx. Its parameters come out in PARAM_NAMES
    order; hybridized like the scratch forward."""
    nn = gluon.nn
    net = nn.HybridSequential()
    with net.name_scope():   # names numbered within the net, whatever was made before (resnet.ResNet says why)
        net.add(nn.Conv2D(CONV1[0], CONV1[2:], in_channels=CONV1[1]), nn.Activation("relu"), nn.AvgPool2D(POOL),
                nn.Conv2D(CONV2[0], CONV2[2:], in_channels=CONV2[1]), nn.Activation("relu"), nn.AvgPool2D(POOL),
                nn.Dense(FC1[0], activation="relu", in_units=FC1[1]),   # flattens in C, H, W order
                nn.Dense(NUM_CLASSES, in_units=FC1[0]))
    net.initialize()
    for p, name in zip(net.collect_params().values(), PARAM_NAMES):
        p.set_data(nd.array(weights[name]))
    net.hybridize(static_alloc=True, static_shape=True)
    return net


def canonical_names(net):
    """Gluon name -> canonical name of every parameter build_model's net trains (optimizer.get_trainer's names)."""
    return {p.name: name for p, name in zip(net.collect_params().values(), PARAM_NAMES)}


@dataclasses.dataclass(frozen=True)
class Functional:
    """The LeNet as the scratch step trains it (common.interface.FUNCTIONAL): replicas as lists of NDArrays, the
    forward as a function of them. Its settings: the layout (NCHW, the only one here) and the precision the step
    computes at (common/precision.py; evaluate runs in fp32, as PyTorch's). fp16 needs a GPU (check_precision)."""
    layout: str = DEFAULT_LAYOUT
    precision: str = "fp32"
    name = "lenet"
    param_names = PARAM_NAMES

    def __post_init__(self):
        check_precision(self.precision)

    def get_params(self, weights, device):
        return get_params(weights, device)

    def get_bn_state(self, state, device):
        return None   # no BatchNorm

    def forward(self, params, X, F=nd):
        return forward(params, X, F, self.layout, self.precision)

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        """The contract's, and the gradients of the loss times `scale` where the step scales it (data_parallel)."""
        return (*loss_and_grads(replicas, X_shards, y_shards, self.forward, scale), bn_states)

    def hybridized(self):
        """loss_and_grads with the forward traced by hybridize (execution.py's graph level): one cached graph, its
        backward too; the loss scale multiplies the graph's output, outside it."""
        compiled = hybridized(self.forward)
        return lambda replicas, bn_states, X_shards, y_shards, devices, scale=None: (
            *loss_and_grads(replicas, X_shards, y_shards, compiled, scale), bn_states)

    def to_numpy(self, replica):
        return to_numpy(replica)

    def bn_state_to_numpy(self, bn_state):
        return {}

    def evaluate(self, replica, bn_state, X, y):
        return evaluate(replica, X, y, lambda params, X: forward(params, X, nd, self.layout))
