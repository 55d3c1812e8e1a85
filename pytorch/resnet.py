"""d2l's ResNet-18 (common/resnet.py) in PyTorch ops. A replica is the list of parameter tensors on one device, in
common.resnet.PARAM_NAMES order, and its BatchNorm state the list of running statistics in BN_STATE_NAMES order;
the axis order is canonical, so no conversion is needed (the memory layout, NCHW or NHWC strides, is to_layout's,
as in lenet.py). Functional is the network as the recipe's step trains it, with local or synchronised BatchNorm.

The ResNet runs NCHW (contiguous), unlike the LeNet: PyTorch 2.13's CPU backward of this network in channels-last
memory corrupts the heap whenever a shard has an odd number of images ("double free or corruption", measured at
widths 8 and 12 with 3, 5, 7, 97 and 157 images; even batches and NCHW never). A lone channels-last 1x1 stride-2
convolution with fewer than 16 input channels reproduces it (oneDNN's jit_1x1 AVX2 kernel,
uxlfoundation/oneDNN#6035), yet computing those in NCHW alone did not cure the whole network. NCHW costs 4% here
(238 against 229 ms a step at width 8, batch 256, 2 threads), and odd shards are common (157 = 79 + 78).
"""
import dataclasses

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from common.resnet import (BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, PARAM_NAMES, has_projection, layer_arguments,
                           layers)

from . import lenet
from .lenet import loss_sum

LAYOUT = "nchw"   # the only one it runs in, whatever a run asks for (see above)


def to_layout(t, layout=LAYOUT):
    """lenet.to_layout, NCHW unless asked otherwise."""
    return lenet.to_layout(t, layout)


def get_params(weights, device, layout=LAYOUT):
    return [to_layout(torch.tensor(weights[name], device=device), layout).requires_grad_() for name in PARAM_NAMES]


def get_bn_state(state, device):
    """The running statistics, on the device: plain tensors, no gradient; forward returns new ones."""
    return [torch.tensor(state[name], device=device) for name in BN_STATE_NAMES]


def conv(p, name, h):
    _, stride, pad = CONVS[name]
    return F.conv2d(h, p[f"{name}.weight"], p[f"{name}.bias"], stride, pad)


def batch_statistics(hs, sync):
    """Each shard's per-channel (mean, biased variance, count) for training: its own (local BatchNorm), or the global
    batch's (sync), in two all-reduces as a one-device variance is taken in two passes: the shards' sums and counts
    (common.resnet.moments) give the mean, then their squared deviations from it give the variance (one pass of
    sums of squares, E[x^2] - E[x]^2, loses float32 digits where the mean is large against the spread: 1e-4 in the
    weights after one step here). Summed across this process's devices and, in a process group, across processes by
    torch.distributed's functional all_reduce, which autograd differentiates (its backward all-reduces the incoming
    gradient): every shard's gradient then includes what flows through the statistics, as if one device held the
    whole batch."""
    if not sync:
        return [(h.mean(dim=(0, 2, 3)), h.var(dim=(0, 2, 3), unbiased=False), h.numel() // h.shape[1]) for h in hs]
    c = hs[0].shape[1]
    total = all_sum([torch.cat([h.sum(dim=(0, 2, 3)), h.new_tensor([h.numel() // c])]) for h in hs])
    count = total[-1]
    mean = total[:c] / count
    squares = all_sum([((h - mean.to(h.device).view(1, -1, 1, 1)) ** 2).sum(dim=(0, 2, 3)) for h in hs])
    var = squares / count
    return [(mean.to(h.device), var.to(h.device), count.to(h.device)) for h in hs]


def all_sum(parts):
    """The sum of one tensor per device, on the first device: data_parallel.allreduce's sum, but differentiable. The
    functional collective is what PyTorch 2.13 names for it: torch.distributed.nn's all_reduce is deprecated and
    refused under torch.compile ("not supported under torch.compile"), and this one compiles into the graph."""
    total = sum(part.to(parts[0].device) for part in parts)
    return funcol.all_reduce(total, "sum", dist.group.WORLD) if dist.is_initialized() else total


def batch_norm(ps, ss, name, hs, training, bn, sync, new_states):
    """common.resnet.batch_norm written out, on every shard at once: F.batch_norm would update running_var in place
    with the unbiased batch variance, PyTorch's convention, not necessarily `bn`'s. In fp32 whatever the input's
    precision (bf16 or fp16), the output in the input's (common/precision.py: nn.BatchNorm2d does the same under
    torch.autocast)."""
    c = (1, -1, 1, 1)
    dtype = hs[0].dtype
    hs = [lenet.widened(h) for h in hs]
    running = [(s[f"{name}.running_mean"], s[f"{name}.running_var"]) for s in ss]
    if training:
        statistics = batch_statistics(hs, sync)
        for new, (mean, var), (batch_mean, batch_var, count) in zip(new_states, running, statistics):
            unbiased = batch_var * count / (count - 1) if bn.unbiased else batch_var
            new[f"{name}.running_mean"] = (1 - bn.momentum) * mean + bn.momentum * batch_mean.detach()
            new[f"{name}.running_var"] = (1 - bn.momentum) * var + bn.momentum * unbiased.detach()
        running = [(batch_mean, batch_var) for batch_mean, batch_var, _ in statistics]
    return [((h - mean.view(c)) * torch.rsqrt(var.view(c) + bn.eps) * p[f"{name}.weight"].view(c)
             + p[f"{name}.bias"].view(c)).to(dtype) for p, h, (mean, var) in zip(ps, hs, running)]


def forward_shards(replicas, bn_states, X_shards, training, bn=CANONICAL_BN, sync=False, layout=LAYOUT):
    """Every replica on its own shard, in lock-step, layer by layer: a synchronised BatchNorm needs every shard's
    moments before any shard is normalised. Logits per shard; in training mode also each replica's new BatchNorm
    state (a list in BN_STATE_NAMES order). Nothing is updated in place. execution.py's graph level compiles this
    function (torch.compile), the shards' all-reduces of a synchronised BatchNorm included."""
    ps, ss = [dict(zip(PARAM_NAMES, r)) for r in replicas], [dict(zip(BN_STATE_NAMES, s)) for s in bn_states]
    new_states = [{} for _ in replicas]
    convs = lambda name, hs: [conv(p, name, h) for p, h in zip(ps, hs)]   # noqa: E731
    norms = lambda name, hs: batch_norm(ps, ss, name, hs, training, bn, sync, new_states)   # noqa: E731
    relus = lambda hs: [F.relu(h) for h in hs]   # noqa: E731
    hs = relus(norms("stem.bn", convs("stem.conv", [to_layout(X, layout) for X in X_shards])))
    for block, stride in BLOCKS:
        ys = relus(norms(f"{block}.bn1", convs(f"{block}.conv1", hs)))
        ys = norms(f"{block}.bn2", convs(f"{block}.conv2", ys))
        shortcuts = convs(f"{block}.conv3", hs) if has_projection(stride) else hs
        hs = relus([y + shortcut for y, shortcut in zip(ys, shortcuts)])
    logits = [F.linear(h.mean(dim=(2, 3)), p["fc.weight"], p["fc.bias"]) for p, h in zip(ps, hs)]   # pool, fc
    if not training:
        return logits
    return logits, [[new[name] for name in BN_STATE_NAMES] for new in new_states]


def forward(params, bn_state, X, training, bn=CANONICAL_BN, layout=LAYOUT):
    """Logits of the batch X on one replica; in training mode (batch statistics) also its new BatchNorm state."""
    out = forward_shards([params], [bn_state], [X], training, bn, layout=layout)
    return (out[0][0], out[1][0]) if training else out[0]


def to_numpy(params):
    """Copies, C-ordered whatever the layout: a CPU tensor's numpy() is a view of it, which the next update would
    change under the caller (a hook keeping the weights before each step), and channels-last kernels would come out
    with their strides."""
    return {name: np.array(p.detach().cpu().numpy(), dtype=np.float32, order="C")
            for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: t.detach().cpu().numpy().astype(np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


def loss_and_grads(replicas, bn_states, X_shards, y_shards, sync=False, layout=LAYOUT, forward_shards=forward_shards,
                   precision="fp32", scale=1.0):
    """The devices' summed losses and each replica's gradients, from one backward through the whole lock-step
    forward: with sync, a replica's gradient includes what reaches it through the other shards' statistics. Also the
    replicas' new BatchNorm states. `forward_shards` as written, or as a compiled level makes it, at `precision`
    (lenet.autocast); the backward from the losses times `scale` (fp16's loss scale), the losses unscaled."""
    with lenet.autocast(X_shards[0].device, precision):
        logits, new_states = forward_shards(replicas, bn_states, X_shards, True, CANONICAL_BN, sync, layout)
    losses = [loss_sum(out, y) for out, y in zip(logits, y_shards)]
    params = [p for replica in replicas for p in replica]
    grads = torch.autograd.grad(sum(loss.to(losses[0].device) for loss in losses) * scale, params)
    n = len(replicas[0])
    return [loss.detach() for loss in losses], [grads[i * n:(i + 1) * n] for i in range(len(replicas))], new_states


def accuracy(params, bn_state, X, y, layout=LAYOUT, batch_size=1000):
    """Of one replica on numpy data, in inference mode: every image normalised by the running statistics."""
    device = params[0].device
    correct = 0
    with torch.no_grad():
        for i in range(0, len(X), batch_size):
            X_batch = torch.from_numpy(X[i:i + batch_size]).to(device)
            logits = forward(params, bn_state, X_batch, training=False, layout=layout)
            correct += (logits.argmax(1).cpu().numpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)


@dataclasses.dataclass(frozen=True)
class Functional:
    """The ResNet as the recipe's step trains it (common.interface.FUNCTIONAL): the functions above, every shard in
    lock-step, with local BatchNorm or (sync, --bn sync) the global batch's statistics, at `precision`. Its layout is NCHW whatever it
    is given (see above): the field then says what runs, in the table's layout column too."""
    layout: str = LAYOUT
    sync: bool = False
    precision: str = "fp32"
    name = "resnet18"
    param_names = PARAM_NAMES

    def __post_init__(self):
        object.__setattr__(self, "layout", LAYOUT)   # frozen: dataclasses' own way to set a field in __post_init__

    def get_params(self, weights, device):
        return get_params(weights, device, self.layout)

    def get_bn_state(self, state, device):
        return get_bn_state(state, device)

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices, compiled_forward=None, scale=1.0):
        """The lock-step forward of every shard and one backward (of the losses times `scale`); compiled_forward is
        forward_shards where a level compiles it (execution.py)."""
        return loss_and_grads(replicas, bn_states, X_shards, y_shards, self.sync, self.layout,
                              compiled_forward or forward_shards, self.precision, scale)

    def to_numpy(self, replica):
        return to_numpy(replica)

    def bn_state_to_numpy(self, bn_state):
        return bn_state_to_numpy(bn_state)

    def evaluate(self, replica, bn_state, X, y):
        return accuracy(replica, bn_state, X, y, self.layout)


class Residual(nn.Module):
    """d2l's Residual, its layers registered in forward order (d2l registers conv3 before bn1)."""

    def __init__(self, c_in, c, stride, bn_args):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1)
        self.bn1 = nn.BatchNorm2d(c, **bn_args)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(c, **bn_args)
        self.conv3 = nn.Conv2d(c_in, c, 1, stride) if has_projection(stride) else None

    def forward(self, X):
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        return F.relu(Y + (self.conv3(X) if self.conv3 is not None else X))


class ResNet(nn.Module):
    def __init__(self, width, bn_args):
        super().__init__()
        self.stem = nn.Sequential()
        self.stem.add_module("conv", nn.Conv2d(1, width, 3, 1, 1))
        self.stem.add_module("bn", nn.BatchNorm2d(width, **bn_args))
        c_in = width
        for block, stride in BLOCKS:
            stage, index = block.split(".")
            c = layers(width)[f"{block}.conv1"][1][0]
            if not hasattr(self, stage):
                self.add_module(stage, nn.Sequential())
            getattr(self, stage).add_module(index, Residual(c_in, c, stride, bn_args))
            c_in = c
        self.fc = nn.Linear(c_in, layers(width)["fc"][1][0])

    def forward(self, X):
        h = F.relu(self.stem(to_layout(X)))   # NCHW whatever the caller's strides (see above)
        for stage in ("stage1", "stage2", "stage3", "stage4"):
            h = getattr(self, stage)(h)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


def build_model(weights, bn_state, bn=CANONICAL_BN):
    """The same ResNet-18 as an idiomatic nn.Module with nn.BatchNorm2d set to `bn`'s momentum and eps (its running
    variance stays unbiased: PyTorch has no switch for it). Its state_dict keys are the canonical names plus each
    BatchNorm's num_batches_tracked, and its parameters come out in PARAM_NAMES order. model.train()/.eval()."""
    model = ResNet(weights["stem.conv.weight"].shape[0], layer_arguments("pytorch", bn))
    state = {name: torch.from_numpy(np.asarray(a)) for name, a in {**weights, **bn_state}.items()}
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all(key.endswith("num_batches_tracked") for key in missing), missing
    return model.to(memory_format=lenet.MEMORY_FORMATS[LAYOUT])


def model_to_numpy(model):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse. Copies, as
    to_numpy's."""
    state = model.state_dict()
    as_numpy = lambda name: np.array(state[name].cpu().numpy(), dtype=np.float32, order="C")   # noqa: E731
    return {name: as_numpy(name) for name in PARAM_NAMES}, {name: as_numpy(name) for name in BN_STATE_NAMES}
