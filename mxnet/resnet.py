"""d2l's ResNet-18 (common/resnet.py) in MXNet ops. A replica is the list of parameter NDArrays on one context, in
common.resnet.PARAM_NAMES order, and its BatchNorm state the list of running statistics in BN_STATE_NAMES order;
MXNet's layout is PyTorch's, so no conversion is needed."""
import numpy as np
from mxnet import gluon, nd

from common.resnet import (BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, PARAM_NAMES, by_canonical_name, has_projection,
                           layer_arguments, layers)


def to_layout(X):
    """NCHW as it is: the only layout MXNet's CPU Convolution takes (execution.py)."""
    return X


def get_params(weights, device):
    params = [nd.array(weights[name], ctx=device) for name in PARAM_NAMES]
    for p in params:
        p.attach_grad()
    return params


def get_bn_state(state, device):
    """The running statistics, on the context: plain NDArrays, no gradient; forward returns new ones."""
    return [nd.array(state[name], ctx=device) for name in BN_STATE_NAMES]


def conv(p, name, h):
    kernel, stride, pad = CONVS[name]
    w = p[f"{name}.weight"]
    return nd.Convolution(h, w, p[f"{name}.bias"], kernel=(kernel, kernel), stride=(stride, stride),
                          pad=(pad, pad), num_filter=w.shape[0])


def batch_norm(p, s, name, h, training, bn, new_state):
    """common.resnet.batch_norm written out (nd.BatchNorm updates its running statistics as aux states of the op,
    by its own convention). The batch statistics are those of this NDArray; a synchronised BatchNorm would
    all-reduce common.resnet.moments of each shard here."""
    c = (1, -1, 1, 1)
    gamma, beta = p[f"{name}.weight"].reshape(c), p[f"{name}.bias"].reshape(c)
    mean, var = s[f"{name}.running_mean"], s[f"{name}.running_var"]
    if training:
        count = h.size // h.shape[1]
        batch_mean = h.mean(axis=(0, 2, 3))
        batch_var = nd.square(nd.broadcast_sub(h, batch_mean.reshape(c))).mean(axis=(0, 2, 3))
        running_var = batch_var * count / (count - 1) if bn.unbiased else batch_var
        new_state[f"{name}.running_mean"] = (1 - bn.momentum) * mean + bn.momentum * batch_mean.detach()
        new_state[f"{name}.running_var"] = (1 - bn.momentum) * var + bn.momentum * running_var.detach()
        mean, var = batch_mean, batch_var
    h = nd.broadcast_mul(nd.broadcast_sub(h, mean.reshape(c)), nd.rsqrt(var.reshape(c) + bn.eps))
    return nd.broadcast_add(nd.broadcast_mul(h, gamma), beta)


def forward(params, bn_state, X, training, bn=CANONICAL_BN):
    """Logits of the NCHW batch X; in training mode (batch statistics) also the new BatchNorm state, a list in
    BN_STATE_NAMES order. Nothing is updated in place: the caller keeps or drops the new state."""
    p, s, new_state = dict(zip(PARAM_NAMES, params)), dict(zip(BN_STATE_NAMES, bn_state)), {}
    norm = lambda name, h: batch_norm(p, s, name, h, training, bn, new_state)   # noqa: E731
    h = nd.relu(norm("stem.bn", conv(p, "stem.conv", to_layout(X))))
    for block, stride in BLOCKS:
        y = nd.relu(norm(f"{block}.bn1", conv(p, f"{block}.conv1", h)))
        y = norm(f"{block}.bn2", conv(p, f"{block}.conv2", y))
        h = nd.relu(y + (conv(p, f"{block}.conv3", h) if has_projection(stride) else h))
    w = p["fc.weight"]
    logits = nd.FullyConnected(h.mean(axis=(2, 3)), w, p["fc.bias"], num_hidden=w.shape[0])   # average pool, fc
    return (logits, [new_state[name] for name in BN_STATE_NAMES]) if training else logits


def to_numpy(params):
    return {name: p.asnumpy().astype(np.float32) for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: t.asnumpy().astype(np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


class Residual(gluon.HybridBlock):
    """d2l's Residual (MXNet tab), with explicit in_channels so that the weights can be set before a forward."""

    def __init__(self, c_in, c, stride, bn_args):
        super().__init__()
        nn = gluon.nn
        self.conv1 = nn.Conv2D(c, 3, stride, 1, in_channels=c_in)
        self.bn1 = nn.BatchNorm(in_channels=c, **bn_args)
        self.conv2 = nn.Conv2D(c, 3, 1, 1, in_channels=c)
        self.bn2 = nn.BatchNorm(in_channels=c, **bn_args)
        self.conv3 = nn.Conv2D(c, 1, stride, in_channels=c_in) if has_projection(stride) else None

    def hybrid_forward(self, F, X):
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        return F.relu(Y + (self.conv3(X) if self.conv3 is not None else X))


class ResNet(gluon.HybridBlock):
    def __init__(self, width, bn_args):
        super().__init__()
        nn = gluon.nn
        self.conv = nn.Conv2D(width, 3, 1, 1, in_channels=1)
        self.bn = nn.BatchNorm(in_channels=width, **bn_args)
        self.blocks = nn.HybridSequential()
        c_in = width
        for block, stride in BLOCKS:
            c = layers(width)[f"{block}.conv1"][1][0]
            self.blocks.add(Residual(c_in, c, stride, bn_args))
            c_in = c
        self.pool = nn.GlobalAvgPool2D()
        self.fc = nn.Dense(layers(width)["fc"][1][0], in_units=c_in)   # flattens the pooled (N, C, 1, 1)

    def hybrid_forward(self, F, X):
        return self.fc(self.pool(self.blocks(F.relu(self.bn(self.conv(X))))))


# canonical suffix -> the Gluon attribute of a layer that holds it
GLUON_NAMES = {"weight": ("weight", "gamma"), "bias": ("bias", "beta"), "running_mean": ("running_mean",),
               "running_var": ("running_var",)}


def gluon_parameters(net):
    """canonical name -> gluon.Parameter, for parameters and BatchNorm state alike."""
    return by_canonical_name(net, GLUON_NAMES)


def build_model(weights, bn_state, bn=CANONICAL_BN, static_shape=False):
    """The same ResNet-18 as an idiomatic Gluon HybridBlock with nn.BatchNorm set to `bn`'s momentum (Gluon's
    weighs the running value) and epsilon, on the CPU, hybridized. Training mode is autograd.record(); the
    BatchNorm layers move their running statistics in the BACKWARD pass (a forward alone leaves them).
    Not static_shape, unlike lenet.py: with hybridize(static_alloc=True, static_shape=True), MXNet 1.9.1's graph
    normalises by updated running statistics while the Parameters (running_mean.data(), what a checkpoint saves)
    keep their initial values (tests/test_resnet.py)."""
    net = ResNet(weights["stem.conv.weight"].shape[0], layer_arguments("mxnet", bn))
    net.initialize()
    for name, param in gluon_parameters(net).items():
        param.set_data(nd.array({**weights, **bn_state}[name]))
    net.hybridize(static_alloc=True, static_shape=static_shape)
    return net


def model_to_numpy(net):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse."""
    found = {name: param.data().asnumpy().astype(np.float32) for name, param in gluon_parameters(net).items()}
    return {name: found[name] for name in PARAM_NAMES}, {name: found[name] for name in BN_STATE_NAMES}
