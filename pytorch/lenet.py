"""LeNet in PyTorch ops. A replica is the list of parameter tensors on one device, in
common.lenet.PARAM_NAMES order; the axis order is canonical, so no conversion is needed (the memory layout,
NCHW or NHWC strides, is to_layout's)."""
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.lenet import LAYERS, PARAM_NAMES, POOL


# PyTorch picks its convolution path from the strides of the input and the kernel, so the memory layout is
# set wherever they are made. execution.py names and chooses the layouts (LAYOUTS, DEFAULT_LAYOUT); builtin.py
# and idiomatic.py run the default (nobody switches it in their processes).
MEMORY_FORMATS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
layout = "nhwc"   # the scratch step's: execution.DEFAULT_LAYOUT at import; execution.use_layout replaces it


def to_layout(t):
    """A 4-d tensor (images, conv kernels) with the strides of `layout`; others as they are. `.to(memory_format=)`
    sets them even with one channel, where both stride patterns pass as either format, so that
    `.contiguous(memory_format=)` may keep strides that PyTorch reads as the other layout."""
    return t.to(memory_format=MEMORY_FORMATS[layout]) if t.dim() == 4 else t


def get_params(weights, device):
    return [to_layout(torch.tensor(weights[name], device=device)).requires_grad_() for name in PARAM_NAMES]


def forward(params, X):
    """A unit of data_parallel.py's step: execution.use replaces it there with torch.compile(forward) at the
    graph level."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    h = F.avg_pool2d(F.relu(F.conv2d(X, w1, b1)), POOL)
    h = F.avg_pool2d(F.relu(F.conv2d(h, w2, b2)), POOL)
    h = h.flatten(1)                       # C, H, W order: the canonical flatten
    h = F.relu(F.linear(h, w3, b3))
    return F.linear(h, w4, b4)


def loss_sum(logits, y):
    """Cross-entropy summed over the shard: shards add up to the global batch exactly."""
    return F.cross_entropy(logits, y, reduction="sum")


def to_numpy(params):
    """C-ordered whatever the layout: channels-last kernels would otherwise come out with their strides."""
    return {name: np.ascontiguousarray(p.detach().cpu().numpy(), dtype=np.float32)
            for name, p in zip(PARAM_NAMES, params)}


def build_model(weights):
    """The same LeNet as an idiomatic nn.Module (for the built-in engines and the reference loop); its
    parameters come out in PARAM_NAMES order, so the scratch forward and to_numpy work on them too. The
    layers are named as in common.lenet, so its state_dict keys are the canonical names (conv1.weight, ...)."""
    (c1, _, k1, _), (c2, _, k2, _) = LAYERS["conv1"][1], LAYERS["conv2"][1]
    (h1, f1), (out, h2) = LAYERS["fc1"][1], LAYERS["fc2"][1]
    model = nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(1, c1, k1), relu1=nn.ReLU(), pool1=nn.AvgPool2d(POOL),
        conv2=nn.Conv2d(c1, c2, k2), relu2=nn.ReLU(), pool2=nn.AvgPool2d(POOL),
        flatten=nn.Flatten(), fc1=nn.Linear(f1, h1), relu3=nn.ReLU(), fc2=nn.Linear(h2, out)))
    with torch.no_grad():
        for p, name in zip(model.parameters(), PARAM_NAMES):
            p.copy_(torch.from_numpy(weights[name]))
    return model.to(memory_format=MEMORY_FORMATS[layout])   # the conv kernels; Module.to leaves other tensors
