"""LeNet in PyTorch ops. A replica is the list of parameter tensors on one device, in
common.lenet.PARAM_NAMES order; the layout is canonical, so no conversion is needed."""
import numpy as np
import torch
import torch.nn.functional as F

from common.lenet import PARAM_NAMES, POOL


def get_params(weights, device):
    return [torch.tensor(weights[name], device=device, requires_grad=True) for name in PARAM_NAMES]


def forward(params, X):
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
    return {name: p.detach().cpu().numpy().astype(np.float32) for name, p in zip(PARAM_NAMES, params)}
