"""d2l's ResNet-18 (common/resnet.py) in PyTorch ops. A replica is the list of parameter tensors on one device, in
common.resnet.PARAM_NAMES order, and its BatchNorm state the list of running statistics in BN_STATE_NAMES order;
the axis order is canonical, so no conversion is needed (the memory layout, NCHW or NHWC strides, is to_layout's,
as in lenet.py).

Width 8 or more in NHWC: PyTorch 2.13's CPU weight gradient of a channels-last 1x1 stride-2 convolution with fewer
than 8 input channels is wrong and writes past a buffer (oneDNN's jit_1x1 AVX2 kernel, uxlfoundation/oneDNN#6035);
stage 2's projection has `width` input channels. d2l's 64 is far from it."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.resnet import (BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, PARAM_NAMES, has_projection, layer_arguments,
                           layers)

from .lenet import MEMORY_FORMATS

layout = "nhwc"   # as lenet.layout: execution.DEFAULT_LAYOUT


def to_layout(t):
    """A 4-d tensor with the strides of `layout` (lenet.to_layout, for this file's own `layout`)."""
    return t.to(memory_format=MEMORY_FORMATS[layout]) if t.dim() == 4 else t


def get_params(weights, device):
    return [to_layout(torch.tensor(weights[name], device=device)).requires_grad_() for name in PARAM_NAMES]


def get_bn_state(state, device):
    """The running statistics, on the device: plain tensors, no gradient; forward returns new ones."""
    return [torch.tensor(state[name], device=device) for name in BN_STATE_NAMES]


def conv(p, name, h):
    _, stride, pad = CONVS[name]
    return F.conv2d(h, p[f"{name}.weight"], p[f"{name}.bias"], stride, pad)


def batch_norm(p, s, name, h, training, bn, new_state):
    """common.resnet.batch_norm written out: F.batch_norm would update running_var in place with the unbiased batch
    variance, PyTorch's convention, not necessarily `bn`'s. The batch statistics are those of this tensor; a
    synchronised BatchNorm would all-reduce common.resnet.moments of each shard here."""
    gamma, beta = p[f"{name}.weight"], p[f"{name}.bias"]
    mean, var = s[f"{name}.running_mean"], s[f"{name}.running_var"]
    if training:
        count = h.numel() // h.shape[1]
        batch_mean = h.mean(dim=(0, 2, 3))
        batch_var = h.var(dim=(0, 2, 3), unbiased=False)
        running_var = batch_var * count / (count - 1) if bn.unbiased else batch_var
        new_state[f"{name}.running_mean"] = (1 - bn.momentum) * mean + bn.momentum * batch_mean.detach()
        new_state[f"{name}.running_var"] = (1 - bn.momentum) * var + bn.momentum * running_var.detach()
        mean, var = batch_mean, batch_var
    c = (1, -1, 1, 1)
    return (h - mean.view(c)) * torch.rsqrt(var.view(c) + bn.eps) * gamma.view(c) + beta.view(c)


def forward(params, bn_state, X, training, bn=CANONICAL_BN):
    """Logits of the NCHW batch X; in training mode (batch statistics) also the new BatchNorm state, a list in
    BN_STATE_NAMES order. Nothing is updated in place: the caller keeps or drops the new state."""
    p, s, new_state = dict(zip(PARAM_NAMES, params)), dict(zip(BN_STATE_NAMES, bn_state)), {}
    norm = lambda name, h: batch_norm(p, s, name, h, training, bn, new_state)   # noqa: E731
    h = F.relu(norm("stem.bn", conv(p, "stem.conv", to_layout(X))))
    for block, stride in BLOCKS:
        y = F.relu(norm(f"{block}.bn1", conv(p, f"{block}.conv1", h)))
        y = norm(f"{block}.bn2", conv(p, f"{block}.conv2", y))
        h = F.relu(y + (conv(p, f"{block}.conv3", h) if has_projection(stride) else h))
    logits = F.linear(h.mean(dim=(2, 3)), p["fc.weight"], p["fc.bias"])   # global average pooling, then fc
    return (logits, [new_state[name] for name in BN_STATE_NAMES]) if training else logits


def to_numpy(params):
    """C-ordered whatever the layout: channels-last kernels would otherwise come out with their strides."""
    return {name: np.ascontiguousarray(p.detach().cpu().numpy(), dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


def bn_state_to_numpy(bn_state):
    return {name: t.detach().cpu().numpy().astype(np.float32) for name, t in zip(BN_STATE_NAMES, bn_state)}


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
        h = F.relu(self.stem(X))
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
    return model.to(memory_format=MEMORY_FORMATS[layout])


def model_to_numpy(model):
    """(weights, BatchNorm state) of an idiomatic model, canonical numpy: build_model's inverse."""
    state = model.state_dict()
    as_numpy = lambda name: np.ascontiguousarray(state[name].cpu().numpy(), dtype=np.float32)   # noqa: E731
    return {name: as_numpy(name) for name in PARAM_NAMES}, {name: as_numpy(name) for name in BN_STATE_NAMES}
