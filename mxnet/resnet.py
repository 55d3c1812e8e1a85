"""d2l's ResNet-18 (common/resnet.py) in MXNet ops. A replica is the list of parameter NDArrays on one context, in
common.resnet.PARAM_NAMES order, and its BatchNorm state the list of running statistics in BN_STATE_NAMES order;
MXNet's layout is PyTorch's, so no conversion is needed."""
import numpy as np
from mxnet import autograd, gluon, nd

from common.resnet import (BLOCKS, BN_LAYERS, BN_STATE_NAMES, CANONICAL_BN, CONVS, PARAM_NAMES, by_canonical_name,
                           has_projection, layer_arguments, layers)

from . import data_parallel, distributed as dist
from .data_parallel import allreduce_gradients, sgd, split_and_load
from .lenet import loss_sum


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


def channel_sum(h):
    """Per-channel sum over the batch, rows and columns, in two reductions over contiguous axes (one over (0, 2, 3)
    takes twice as long in MXNet 1.9.1's CPU kernels)."""
    return h.reshape((h.shape[0], h.shape[1], -1)).sum(axis=2).sum(axis=0)


def affine(h, scale, shift):
    """h * scale + shift per channel, as a depthwise 1x1 convolution: the same arithmetic, but its backward sums the
    per-channel gradients in oneDNN's convolution kernel, where broadcast_mul and broadcast_sub's backward takes
    20 ms per (128, 8, 28, 28) tensor. The ResNet step is 5x faster so (width 8, batch 256, 2 contexts: 2.3 s
    against 0.44 s)."""
    c = h.shape[1]
    return nd.Convolution(h, scale.reshape((c, 1, 1, 1)), shift, kernel=(1, 1), num_filter=c, num_group=c)


def batch_statistics(hs, sync, layer):
    """Each shard's per-channel (mean, biased variance, count) for training, and the shard centred on that mean: its
    own (local BatchNorm), or the global batch's (sync), in two all-reduces as a one-device variance is taken in two
    passes: the shards' sums and counts give the mean, their squared deviations from it the variance. Summed across
    the contexts by copies that autograd records, and across processes by the kvstore inside an autograd.Function
    (AllSum), so that every shard's gradient includes what flows through the statistics, as if one context held the
    whole batch. `layer` numbers the BatchNorm: its kvstore keys."""
    counts = [h.size // h.shape[1] for h in hs]
    if not sync:
        means = [channel_sum(h) / n for h, n in zip(hs, counts)]
        centred = [affine(h, nd.ones_like(mean), -mean) for h, mean in zip(hs, means)]
        return [(mean, channel_sum(nd.square(d)) / n, n, d) for mean, d, n in zip(means, centred, counts)]
    channels = hs[0].shape[1]
    total = all_sum([nd.concat(channel_sum(h), nd.full((1,), n, ctx=h.context), dim=0) for h, n in zip(hs, counts)],
                    key=KEYS + 4 * layer)
    count = total[channels:]
    mean = total[:channels] / count
    centred = [affine(h, nd.ones_like(mean, ctx=h.context), -mean.as_in_context(h.context)) for h in hs]
    var = all_sum([channel_sum(nd.square(d)) for d in centred], key=KEYS + 4 * layer + 1) / count
    return [(mean.as_in_context(h.context), var.as_in_context(h.context), count.as_in_context(h.context), d)
            for h, d in zip(hs, centred)]


# The kvstore keys of the statistics' all-reduces, past data_parallel's (one per parameter, or per bucket): four per
# BatchNorm, two sums forward and their gradients backward. Every process uses them in the same order.
KEYS = 1000


class AllSum(autograd.Function):
    """A sum over processes that autograd differentiates: the kvstore's all-reduce forward, and of the gradient
    backward (the gradient of a sum reaches every term)."""

    def __init__(self, key):
        super().__init__()
        self.key = key

    def forward(self, x):
        return dist.all_reduce(x.copy(), self.key)

    def backward(self, dy):
        return dist.all_reduce(dy.copy(), self.key + 2)


def all_sum(parts, key):
    """The sum of one NDArray per context, on the first context, over every process: differentiable."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part.as_in_context(parts[0].context)
    return AllSum(key)(total) if dist.is_initialized() else total


def batch_norm(ps, ss, name, hs, training, bn, sync, new_states):
    """common.resnet.batch_norm written out on every shard at once (nd.BatchNorm updates its running statistics as
    aux states of the op, by its own convention)."""
    if training:
        statistics = batch_statistics(hs, sync, BN_LAYERS.index(name))
        for new, s, (batch_mean, batch_var, count, _) in zip(new_states, ss, statistics):
            unbiased = batch_var * count / (count - 1) if bn.unbiased else batch_var
            mean, var = s[f"{name}.running_mean"], s[f"{name}.running_var"]
            new[f"{name}.running_mean"] = (1 - bn.momentum) * mean + bn.momentum * batch_mean.detach()
            new[f"{name}.running_var"] = (1 - bn.momentum) * var + bn.momentum * unbiased.detach()
        centred = [(d, var) for _, var, _, d in statistics]
    else:
        centred = [(affine(h, nd.ones_like(s[f"{name}.running_mean"]), -s[f"{name}.running_mean"]),
                    s[f"{name}.running_var"]) for h, s in zip(hs, ss)]
    return [affine(d, p[f"{name}.weight"] * nd.rsqrt(var + bn.eps), p[f"{name}.bias"])
            for p, (d, var) in zip(ps, centred)]


def forward_shards(replicas, bn_states, X_shards, training, bn=CANONICAL_BN, sync=False):
    """Every replica on its own shard, in lock-step, layer by layer: a synchronised BatchNorm needs every shard's
    moments before any shard is normalised. Logits per shard; in training mode also each replica's new BatchNorm
    state (a list in BN_STATE_NAMES order). Nothing is updated in place. Eager NDArray calls (MXNet queues them
    asynchronously on each context); hybridize would trace one block per replica, not the lock-step."""
    ps, ss = [dict(zip(PARAM_NAMES, r)) for r in replicas], [dict(zip(BN_STATE_NAMES, s)) for s in bn_states]
    new_states = [{} for _ in replicas]
    convs = lambda name, hs: [conv(p, name, h) for p, h in zip(ps, hs)]   # noqa: E731
    norms = lambda name, hs: batch_norm(ps, ss, name, hs, training, bn, sync, new_states)   # noqa: E731
    relus = lambda hs: [nd.relu(h) for h in hs]   # noqa: E731
    hs = relus(norms("stem.bn", convs("stem.conv", [to_layout(X) for X in X_shards])))
    for block, stride in BLOCKS:
        ys = relus(norms(f"{block}.bn1", convs(f"{block}.conv1", hs)))
        ys = norms(f"{block}.bn2", convs(f"{block}.conv2", ys))
        shortcuts = convs(f"{block}.conv3", hs) if has_projection(stride) else hs
        hs = relus([y + shortcut for y, shortcut in zip(ys, shortcuts)])
    logits = [nd.FullyConnected(h.mean(axis=(2, 3)), p["fc.weight"], p["fc.bias"], num_hidden=p["fc.weight"].shape[0])
              for p, h in zip(ps, hs)]   # average pool, fc
    if not training:
        return logits
    return logits, [[new[name] for name in BN_STATE_NAMES] for new in new_states]


def forward(params, bn_state, X, training, bn=CANONICAL_BN):
    """Logits of the NCHW batch X on one replica; in training mode (batch statistics) also its new BatchNorm state."""
    out = forward_shards([params], [bn_state], [X], training, bn)
    return (out[0][0], out[1][0]) if training else out[0]


def to_numpy(params):
    return {name: p.asnumpy().astype(np.float32) for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: t.asnumpy().astype(np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


def loss_and_grads(replicas, bn_states, X_shards, y_shards, sync):
    """The contexts' summed losses and each replica's gradients (in its parameters' .grad), from one backward through
    the whole lock-step forward: with sync, a replica's gradient includes what reaches it through the other shards'
    statistics. Also the replicas' new BatchNorm states."""
    with autograd.record():
        logits, new_states = forward_shards(replicas, bn_states, X_shards, True, CANONICAL_BN, sync)
        losses = [loss_sum(out, y) for out, y in zip(logits, y_shards)]
    autograd.backward(losses)
    if sync and dist.is_initialized():
        nd.waitall()   # AllSum.backward runs on an engine thread: its all-reduces first, then the gradients' (their
        #                kvstore keys are declared in the same order on every process, or the workers deadlock)
    return losses, [[p.grad for p in params] for params in replicas], new_states


def train_step(replicas, bn_states, X, y, devices, lr, batch_size=None, sync=False):
    """data_parallel.train_step with BatchNorm: the shards' forward in lock-step (batch_statistics), then the
    recipe's all-reduce of the gradients and its update; the replicas' new running statistics go into bn_states."""
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses, grads, bn_states[:] = loss_and_grads(replicas, bn_states, X_shards, y_shards, sync)
    grads = allreduce_gradients(grads, data_parallel.BUCKET_BYTES)
    for params, device_grads in zip(replicas, grads):
        sgd(params, device_grads, lr, batch_size or len(X))
    return sum(loss.asscalar() for loss in losses) / len(X)


def evaluate(params, bn_state, X, y, batch_size=1000):
    """Inference mode: every image normalised by the running statistics."""
    device = params[0].context
    correct = 0
    for i in range(0, len(X), batch_size):
        logits = forward(params, bn_state, nd.array(X[i:i + batch_size], ctx=device), training=False)
        correct += (logits.argmax(axis=1).asnumpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)


class Residual(gluon.HybridBlock):
    """d2l's Residual (MXNet tab), with explicit in_channels so that the weights can be set before a forward."""

    def __init__(self, c_in, c, stride, norm):
        super().__init__()
        nn = gluon.nn
        self.conv1 = nn.Conv2D(c, 3, stride, 1, in_channels=c_in)
        self.bn1 = norm(c)
        self.conv2 = nn.Conv2D(c, 3, 1, 1, in_channels=c)
        self.bn2 = norm(c)
        self.conv3 = nn.Conv2D(c, 1, stride, in_channels=c_in) if has_projection(stride) else None

    def hybrid_forward(self, F, X):
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        return F.relu(Y + (self.conv3(X) if self.conv3 is not None else X))


class ResNet(gluon.HybridBlock):
    """norm(channels) makes each BatchNorm layer: nn.BatchNorm, or contrib's SyncBatchNorm (build_model)."""

    def __init__(self, width, norm):
        super().__init__()
        nn = gluon.nn
        self.conv = nn.Conv2D(width, 3, 1, 1, in_channels=1)
        self.bn = norm(width)
        self.blocks = nn.HybridSequential()
        c_in = width
        for block, stride in BLOCKS:
            c = layers(width)[f"{block}.conv1"][1][0]
            self.blocks.add(Residual(c_in, c, stride, norm))
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


def build_model(weights, bn_state, bn=CANONICAL_BN, static_shape=False, sync_devices=None):
    """The same ResNet-18 as an idiomatic Gluon HybridBlock with nn.BatchNorm set to `bn`'s momentum (Gluon's
    weighs the running value) and epsilon, on the CPU, hybridized; with sync_devices=n, Gluon's
    contrib.nn.SyncBatchNorm over the n contexts of this process instead. Training mode is autograd.record(); the
    BatchNorm layers move their running statistics in the BACKWARD pass (a forward alone leaves them).
    Not static_shape, unlike lenet.py: with hybridize(static_alloc=True, static_shape=True), MXNet 1.9.1's graph
    normalises by updated running statistics while the Parameters (running_mean.data(), what a checkpoint saves)
    keep their initial values (tests/test_resnet.py)."""
    bn_args = layer_arguments("mxnet", bn)
    if sync_devices is None:
        norm = lambda c: gluon.nn.BatchNorm(in_channels=c, **bn_args)   # noqa: E731
    else:
        norm = lambda c: gluon.contrib.nn.SyncBatchNorm(in_channels=c, num_devices=sync_devices, **bn_args)  # noqa
    net = ResNet(weights["stem.conv.weight"].shape[0], norm)
    net.initialize()
    for name, param in gluon_parameters(net).items():
        param.set_data(nd.array({**weights, **bn_state}[name]))
    net.hybridize(static_alloc=True, static_shape=static_shape)
    return net


def model_to_numpy(net, replica=0):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse; a model on several
    contexts gives its copy on the replica-th."""
    found = {name: param.list_data()[replica].asnumpy().astype(np.float32)
             for name, param in gluon_parameters(net).items()}
    return {name: found[name] for name in PARAM_NAMES}, {name: found[name] for name in BN_STATE_NAMES}
