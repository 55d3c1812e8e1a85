"""d2l's ResNet-18 (common/resnet.py) in MXNet ops. A replica is the list of parameter NDArrays on one context, in
common.resnet.PARAM_NAMES order, and its BatchNorm state the list of running statistics in BN_STATE_NAMES order;
MXNet's layout is PyTorch's, so no conversion is needed. Functional is the network as the scratch step trains it;
build_model, below it, the idiomatic Gluon one."""
import dataclasses

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

from common.resnet import (BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, NUM_CLASSES, PARAM_NAMES,
                           by_canonical_name, has_projection, layer_arguments, layers, width_of)

from . import distributed as dist
from .devices import check_precision
from .lenet import DEFAULT_LAYOUT, fp32, hybridized, loss_sum, low, scaled


def to_layout(X, layout=DEFAULT_LAYOUT):
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


# The ops below take F, where they come from (lenet.forward): mx.nd runs them, mx.sym builds hybridize's graph. A
# traced graph has no shapes to read: channel counts come from the spec's layers(width), a shard's size from
# shape_array, an op of the graph.
def conv(F, p, name, h, width, precision="fp32"):
    """At `precision`: its input, weight and bias cast (lenet.low), its output too."""
    kernel, stride, pad = CONVS[name]
    return F.Convolution(low(F, h, precision), low(F, p[f"{name}.weight"], precision),
                         low(F, p[f"{name}.bias"], precision), kernel=(kernel, kernel), stride=(stride, stride),
                         pad=(pad, pad), num_filter=layers(width)[name][1][0])


def channel_sum(F, h):
    """Per-channel sum over the batch, rows and columns, in two reductions over contiguous axes (one over (0, 2, 3)
    takes twice as long in MXNet 1.9.1's CPU kernels)."""
    return F.sum(F.sum(F.reshape(h, (0, 0, -1)), axis=2), axis=0)


def count(F, h):
    """The values per channel, N * H * W, as a float32 array of shape (1,)."""
    shape = F.cast(F.shape_array(h), "float32")
    return F.slice_axis(shape, axis=0, begin=0, end=1) * F.prod(F.slice_axis(shape, axis=0, begin=2, end=4))


def affine(F, h, scale, shift, channels):
    """h * scale + shift per channel, as a depthwise 1x1 convolution: the same arithmetic, but its backward sums the
    per-channel gradients in oneDNN's convolution kernel, where broadcast_mul and broadcast_sub's backward takes
    20 ms per (128, 8, 28, 28) tensor. The ResNet step is 5x faster so (width 8, batch 256, 2 contexts: 2.3 s
    against 0.44 s)."""
    return F.Convolution(h, F.reshape(scale, (-1, 1, 1, 1)), shift, kernel=(1, 1), num_filter=channels,
                         num_group=channels)


class AllSum(autograd.Function):
    """A sum over processes that autograd differentiates: the kvstore's all-reduce forward, and of the gradient
    backward (the gradient of a sum reaches every term)."""

    def __init__(self, name):
        super().__init__()
        self.name = name

    def forward(self, x):
        return dist.all_reduce(x.copy(), (*self.name, "forward"))

    def backward(self, dy):
        return dist.all_reduce(dy.copy(), (*self.name, "backward"))


def all_sum(parts, name):
    """The sum of one NDArray per context, a copy on each context, over every process: differentiable, by copies
    that autograd records and, across processes, the kvstore inside AllSum. `name`: what it sums, the same in every
    process (distributed.all_reduce keys it)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part.as_in_context(parts[0].context)
    total = AllSum(name)(total) if dist.is_initialized() else total
    return [total.as_in_context(part.context) for part in parts]


def batch_norm(F, p, s, name, h, keep, training, bn, width, precision="fp32"):
    """common.resnet.batch_norm on one shard, a generator (replica_forward's). Training mode normalises by the batch's
    mean and biased variance, taken in two passes as on one device: the shard's per-channel sums and count give the
    mean, its squared deviations from it the variance, each handed to the caller (yield) and summed with the other
    shards' there, or not (lock_step: sync or local). Inference mode by the running statistics. Returns the normalised
    h and `keep`, the tensors its caller needs later, which pass through each yield (taken back as sent). In fp32
    whatever h's precision, the output cast back to it (common/precision.py: statistics of bf16 values summed in bf16
    would lose ~3 digits)."""
    c = layers(width)[name][1][0]
    h = fp32(F, h, precision)
    if training:
        total, (h, *keep) = yield name, F.concat(channel_sum(F, h), count(F, h), dim=0), (h, *keep)
        n = F.slice_axis(total, axis=0, begin=c, end=c + 1)
        mean = F.broadcast_div(F.slice_axis(total, axis=0, begin=0, end=c), n)
        d = affine(F, h, F.ones_like(mean), -mean, c)
        squares, (d, n, *keep) = yield name, channel_sum(F, F.square(d)), (d, n, *keep)
        var = F.broadcast_div(squares, n)
    else:
        mean, var = s[f"{name}.running_mean"], s[f"{name}.running_var"]
        d = affine(F, h, F.ones_like(mean), -mean, c)
    out = affine(F, d, p[f"{name}.weight"] * F.rsqrt(var + bn.eps), p[f"{name}.bias"], c)
    return low(F, out, precision), tuple(keep)


def replica_forward(F, p, s, X, training, width, bn=CANONICAL_BN, layout=DEFAULT_LAYOUT, precision="fp32"):
    """d2l's ResNet-18 on one replica's shard (p, s: its parameters and running statistics by canonical name), as a
    generator: in training mode each BatchNorm yields its shard's moments and goes on with the sums sent back (its
    own, or every shard's: lock_step drives every replica's forward at once). What a layer needs after a yield (the
    block's input, for the shortcut) passes through it, so that the ops between two yields depend on nothing else:
    there the graph level can cut the forward into graphs (segments). Returns the logits. At bf16 (fp16 alike) the
    convolutions and the dense layer run in bf16 (conv), BatchNorm in fp32 (batch_norm), the ReLUs and adds on the
    bf16 values they give, the global mean in fp32 (one of contrib.amp's FP32_FUNCS at either): the logits are
    bf16."""
    def norm(name, h, keep=()):
        return batch_norm(F, p, s, name, h, keep, training, bn, width, precision)
    h, _ = yield from norm("stem.bn", conv(F, p, "stem.conv", to_layout(X, layout), width, precision))
    h = F.relu(h)
    for block, stride in BLOCKS:
        y, (h,) = yield from norm(f"{block}.bn1", conv(F, p, f"{block}.conv1", h, width, precision), (h,))
        y, (h,) = yield from norm(f"{block}.bn2", conv(F, p, f"{block}.conv2", F.relu(y), width, precision), (h,))
        shortcut = conv(F, p, f"{block}.conv3", h, width, precision) if has_projection(stride) else h
        h = F.relu(F.elemwise_add(y, shortcut))   # NDArray's + is broadcast_add, whose bf16 kernel truncates
    pooled = F.mean(fp32(F, h, precision), axis=(2, 3))
    return F.FullyConnected(low(F, pooled, precision), low(F, p["fc.weight"], precision),   # pool, fc
                            low(F, p["fc.bias"], precision), num_hidden=NUM_CLASSES)


def lock_step(F, advance, bn_states, sync, bn, width):
    """Every replica's forward in step (advance(d, sent) -> replica d's next yield (BatchNorm name, moments, keep), or
    its logits at the end): at each yield the shards' moments are summed across the contexts and processes (sync:
    every replica normalises by the global batch's statistics, the backward passes through the sums) or each kept
    (local), and sent back with what the replica keeps. Also each replica's new running statistics, from the sums
    sent (F's arithmetic: a traced replica's too). Returns (logits, new states in BN_STATE_NAMES order; None in
    inference mode, which yields nothing)."""
    ss = [dict(zip(BN_STATE_NAMES, s)) for s in bn_states]
    new_states, totals, sent = [{} for _ in bn_states], {}, [None] * len(bn_states)
    while True:
        asked = [advance(d, value) for d, value in enumerate(sent)]
        if not isinstance(asked[0], tuple):
            return asked, [[new[name] for name in BN_STATE_NAMES] for new in new_states] if totals else None
        name, kind = asked[0][0], "squares" if asked[0][0] in totals else "sums"
        moments = [moment for _, moment, _ in asked]
        summed = all_sum(moments, (name, kind)) if sync else moments
        if kind == "sums":
            totals[name] = summed
        else:
            c = layers(width)[name][1][0]
            for new, s, total, squares in zip(new_states, ss, totals[name], summed):
                n = F.slice_axis(total, axis=0, begin=c, end=c + 1)
                mean = F.broadcast_div(F.slice_axis(total, axis=0, begin=0, end=c), n)
                var = F.broadcast_div(squares, n)
                var = F.broadcast_div(F.broadcast_mul(var, n), n - 1) if bn.unbiased else var
                for stat, batch in (("running_mean", mean), ("running_var", var)):
                    new[f"{name}.{stat}"] = (1 - bn.momentum) * s[f"{name}.{stat}"] + bn.momentum * F.BlockGrad(batch)
        sent = [(total, keep) for total, (_, _, keep) in zip(summed, asked)]


def generators(runs):
    """lock_step's advance over the replicas' replica_forward generators: the forward as written, op by op."""
    def advance(d, sent):
        try:
            return runs[d].send(sent)
        except StopIteration as done:
            return done.value
    return advance


def forward_shards(replicas, bn_states, X_shards, training, bn=CANONICAL_BN, sync=False, layout=DEFAULT_LAYOUT,
                   precision="fp32"):
    """Every replica on its own shard, in lock-step, layer by layer: a synchronised BatchNorm needs every shard's
    moments before any shard is normalised. Logits per shard (at `precision`'s: replica_forward); in training mode
    also each replica's new BatchNorm state (a list in BN_STATE_NAMES order). Nothing is updated in place. MXNet
    queues the ops asynchronously on each context."""
    width = width_of({"stem.conv.weight": replicas[0][0]})
    runs = [replica_forward(nd, dict(zip(PARAM_NAMES, r)), dict(zip(BN_STATE_NAMES, s)), X, training, width, bn,
                            layout, precision) for r, s, X in zip(replicas, bn_states, X_shards)]
    logits, new_states = lock_step(nd, generators(runs), bn_states, sync, bn, width)
    return (logits, new_states) if training else logits


def forward(params, bn_state, X, training, bn=CANONICAL_BN, layout=DEFAULT_LAYOUT):
    """Logits of the NCHW batch X on one replica; in training mode (batch statistics) also its new BatchNorm state."""
    out = forward_shards([params], [bn_state], [X], training, bn, False, layout)
    return (out[0][0], out[1][0]) if training else out[0]


def to_numpy(params):
    return {name: p.asnumpy().astype(np.float32) for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: t.asnumpy().astype(np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


def loss_and_grads(replicas, bn_states, X_shards, y_shards, sync, layout=DEFAULT_LAYOUT, forward_shards=forward_shards,
                   precision="fp32", scale=None):
    """The contexts' summed losses and each replica's gradients (in its parameters' .grad), from one backward through
    the whole lock-step forward: with sync, a replica's gradient includes what reaches it through the other shards'
    statistics. Also the replicas' new BatchNorm states. `forward_shards`: the written one, or segments', at
    `precision`. With a loss scale the gradients are the scaled losses' (lenet.scaled), the losses not."""
    with autograd.record():
        logits, new_states = forward_shards(replicas, bn_states, X_shards, True, CANONICAL_BN, sync, layout, precision)
        losses = [loss_sum(out, y) for out, y in zip(logits, y_shards)]
        heads = [scaled(loss, scale) for loss in losses]
    autograd.backward(heads)
    if sync and dist.is_initialized():
        nd.waitall()   # AllSum.backward runs on an engine thread: its all-reduces first, then the gradients' (their
        #                kvstore keys are declared in the same order on every process, or the workers deadlock)
    return losses, [[p.grad for p in params] for params in replicas], new_states


# hybridize, the graph level (execution.py), traces replica_forward with F=mx.sym. With local BatchNorm a replica
# needs nothing of the others: its whole training-mode forward (and new running statistics) is one cached graph, a
# record and a backward per replica as the LeNet's. With sync, no graph spans the contexts and the kvstore: the
# forward is cut at every yield into segments, each a cached graph per replica (forward and backward), lock_step
# summing the moments between them op by op. Graphs are made per width: a graph's symbols have no shapes to read.
def traced_replica(width, layout=DEFAULT_LAYOUT, precision="fp32"):
    """One replica's training-mode forward as one hybridized block: ([params, bn_state], X) -> (logits, new state)."""
    def function(inputs, X, F):
        params, bn_state = inputs
        run = replica_forward(F, dict(zip(PARAM_NAMES, params)), {}, X, True, width, CANONICAL_BN, layout, precision)
        (logits,), (new_state,) = lock_step(F, generators([run]), [bn_state], False, CANONICAL_BN, width)
        return logits, new_state
    return hybridized(function)


class Segment:
    """The ops of replica_forward between two yields, one hybridized SymbolBlock: its inputs are parameters (by
    canonical name), X and what earlier yields sent back (cut names), the graph's own variables with the dtypes
    segments gave them (SymbolBlock infers its types from them); its outputs the next yield's moments and what
    passes through it (an output that is an input of the segment is handed on without the graph), or the logits."""

    def __init__(self, name, outputs):
        self.name = name   # the BatchNorm whose yield ends it; None for the last, ending with the logits
        self.outputs = [out.name if out.get_children() is None else None for out in outputs]   # inputs handed on
        computed = [out for out in outputs if out.get_children() is not None]
        group = mx.sym.Group(computed)
        self.inputs = group.list_inputs()
        variables = group.get_internals()
        self.block = gluon.SymbolBlock(computed, [variables[name] for name in self.inputs])
        self.block.hybridize(static_alloc=True, static_shape=True)

    def __call__(self, values):
        computed = self.block(*[values[name] for name in self.inputs])
        computed = iter([computed] if isinstance(computed, nd.NDArray) else computed)   # one output: not a list
        return [values[name] if name is not None else next(computed) for name in self.outputs]


def segments(width, layout=DEFAULT_LAYOUT, precision="fp32"):
    """replica_forward cut at every yield: each yield's outputs are a segment's, and what is sent back are fresh
    symbols, the next segment's inputs, each of the dtype of what it stands for (the moments fp32; at bf16 a block's
    input kept for its shortcut is bf16)."""
    p = {name: mx.sym.var(name, dtype="float32") for name in PARAM_NAMES}
    run = replica_forward(mx.sym, p, {}, mx.sym.var("X", dtype="float32"), True, width, CANONICAL_BN, layout,
                          precision)
    found, sent = [], None
    while True:
        try:
            name, moments, keep = run.send(sent)
        except StopIteration as done:
            return found + [Segment(None, [done.value])]
        found.append(Segment(name, [moments, *keep]))
        k = len(found)
        _, dtypes, _ = mx.sym.Group([moments, *keep]).infer_type()
        sent = (mx.sym.var(f"cut{k}", dtype=dtypes[0]),
                tuple(mx.sym.var(f"cut{k}.keep{i}", dtype=dtype) for i, dtype in enumerate(dtypes[1:])))


def run_segments(cut, replicas, X_shards):
    """lock_step's advance over the replicas, each segment a cached graph: what a replica is sent goes into its
    values under the names of the cut it crosses."""
    values = [{"X": X, **dict(zip(PARAM_NAMES, r))} for r, X in zip(replicas, X_shards)]
    done = [0] * len(replicas)

    def advance(d, sent):
        k = done[d]
        if sent is not None:
            total, keep = sent
            values[d].update({f"cut{k}": total, **{f"cut{k}.keep{i}": t for i, t in enumerate(keep)}})
        done[d] += 1
        outputs = cut[k](values[d])
        return outputs[0] if cut[k].name is None else (cut[k].name, outputs[0], tuple(outputs[1:]))
    return advance


def hybridized_loss_and_grads(sync, layout=DEFAULT_LAYOUT, precision="fp32"):
    """loss_and_grads with the forward as hybridize's graphs (above), made on a width's first step, at `precision`;
    a loss scale multiplies the graphs' losses outside them (lenet.scaled)."""
    graphs = {}

    def traced(width):
        if width not in graphs:
            graphs[width] = (segments(width, layout, precision) if sync else
                             traced_replica(width, layout, precision))
        return graphs[width]

    def segmented(replicas, bn_states, X_shards, training, bn, sync, layout, precision):   # traced at precision
        width = width_of({"stem.conv.weight": replicas[0][0]})
        logits, new_states = lock_step(nd, run_segments(traced(width), replicas, X_shards), bn_states, sync, bn, width)
        return logits, new_states

    def compiled(replicas, bn_states, X_shards, y_shards, scale=None):
        if sync:
            return loss_and_grads(replicas, bn_states, X_shards, y_shards, sync, layout, segmented, precision, scale)
        losses, new_states = [], []
        for params, bn_state, X, y in zip(replicas, bn_states, X_shards, y_shards):
            with autograd.record():
                logits, new_state = traced(params[0].shape[0])([params, bn_state], X)
                loss = loss_sum(logits, y)
                head = scaled(loss, scale)
            head.backward()
            losses.append(loss)
            new_states.append(new_state)
        return losses, [[p.grad for p in params] for params in replicas], new_states
    return compiled


def evaluate(params, bn_state, X, y, layout=DEFAULT_LAYOUT, batch_size=1000):
    """Inference mode: every image normalised by the running statistics."""
    device = params[0].context
    correct = 0
    for i in range(0, len(X), batch_size):
        logits = forward(params, bn_state, nd.array(X[i:i + batch_size], ctx=device), False, layout=layout)
        correct += (logits.argmax(axis=1).asnumpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)


@dataclasses.dataclass(frozen=True)
class Functional:
    """The ResNet-18 as the scratch step trains it (common.interface.FUNCTIONAL): replicas and BatchNorm states as
    lists of NDArrays, the lock-step forward (forward_shards) as a function of them. Settings: the layout (NCHW, the
    only one here), sync, --bn sync, and the precision the step computes at (common/precision.py; evaluate runs in
    fp32, as PyTorch's). fp16 needs a GPU (check_precision)."""
    layout: str = DEFAULT_LAYOUT
    sync: bool = False
    precision: str = "fp32"
    name = "resnet18"
    param_names = PARAM_NAMES

    def __post_init__(self):
        check_precision(self.precision)

    def get_params(self, weights, device):
        return get_params(weights, device)

    def get_bn_state(self, state, device):
        return get_bn_state(state, device)

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices, scale=None):
        """The contract's, and the gradients of the losses times `scale` where the step scales them (data_parallel)."""
        return loss_and_grads(replicas, bn_states, X_shards, y_shards, self.sync, self.layout, forward_shards,
                              self.precision, scale)

    def hybridized(self):
        """loss_and_grads as hybridize's graphs (execution.py's graph level): with local BatchNorm each replica's
        forward and backward one graph; with sync, its segments between the moments' all-reduces."""
        compiled = hybridized_loss_and_grads(self.sync, self.layout, self.precision)
        return lambda replicas, bn_states, X_shards, y_shards, devices, scale=None: compiled(
            replicas, bn_states, X_shards, y_shards, scale)

    def to_numpy(self, replica):
        return to_numpy(replica)

    def bn_state_to_numpy(self, bn_state):
        return bn_state_to_numpy(bn_state)

    def evaluate(self, replica, bn_state, X, y):
        return evaluate(replica, bn_state, X, y, self.layout)


class Residual(gluon.HybridBlock):
    """d2l's Residual (MXNet tab), with explicit in_channels so that the weights can be set before a forward. Its
    layers are made in its name_scope: their Parameters' names are its own prefix's, numbered within it (see ResNet)."""

    def __init__(self, c_in, c, stride, norm):
        super().__init__()
        nn = gluon.nn
        with self.name_scope():
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
    """norm(channels) makes each BatchNorm layer: nn.BatchNorm, or contrib's SyncBatchNorm (build_model). Every layer
    is made in a name_scope, so that its Parameters' names (resnet3_residual0_conv1_weight) are numbered within the
    network: made outside one, they are numbered by every layer made before in the process (conv17, then conv38), and
    a gluon.Trainer, which numbers the Parameters by their sorted names, would number two ResNets' differently: its
    states file (save_states) would not fit another process's Trainer."""

    def __init__(self, width, norm):
        super().__init__()
        nn = gluon.nn
        with self.name_scope():
            self.conv = nn.Conv2D(width, 3, 1, 1, in_channels=1)
            self.bn = norm(width)
            self.blocks = nn.HybridSequential()
            c_in = width
            with self.blocks.name_scope():
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
    Not static_shape, unlike lenet.py: with hybridize(static_alloc=True, static_shape=True), MXNet 1.9.1's engine
    does not order a read of the running statistics (running_mean.data(), what a checkpoint saves) after the
    backward pass that moves them, so the read may see the old values (tests/test_resnet.py)."""
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


def canonical_names(net):
    """Gluon name -> canonical name of every parameter build_model's net trains (optimizer.get_trainer's names): the
    convolutions' and the dense layer's weight and bias, every BatchNorm's gamma and beta (grad_req 'write'); not
    their running statistics (grad_req 'null': the Trainer numbers them, updates nothing and keeps no state)."""
    found = gluon_parameters(net)
    return {found[name].name: name for name in PARAM_NAMES}


def model_to_numpy(net, replica=0):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse; a model on several
    contexts gives its copy on the replica-th."""
    found = {name: param.list_data()[replica].asnumpy().astype(np.float32)
             for name, param in gluon_parameters(net).items()}
    return {name: found[name] for name in PARAM_NAMES}, {name: found[name] for name in BN_STATE_NAMES}
