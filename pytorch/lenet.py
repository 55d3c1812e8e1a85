"""LeNet in PyTorch ops. A replica is the list of parameter tensors on one device, in
common.lenet.PARAM_NAMES order; the axis order is canonical, so no conversion is needed (the memory layout,
NCHW or NHWC strides, is to_layout's). Functional is the network as the recipe's step trains it."""
import dataclasses
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.lenet import LAYERS, PARAM_NAMES, POOL
from common.precision import is_low


# PyTorch picks its convolution path from the strides of the input and the kernel, so the memory layout is
# set wherever they are made: a Functional's layout is its field, and every function here takes it as an argument.
# execution.py names and chooses the layouts (LAYOUTS); builtin.py and idiomatic.py run the default one.
MEMORY_FORMATS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
DEFAULT_LAYOUT = "nhwc"   # execution.DEFAULT_LAYOUT: channels-last is faster here (execution.py says why)
# Each precision's torch dtype (common.precision.DTYPES'): what torch.autocast computes in at bf16 and fp16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def to_layout(t, layout=DEFAULT_LAYOUT):
    """A 4-d tensor (images, conv kernels) with the strides of `layout`; others as they are. `.to(memory_format=)`
    sets them even with one channel, where both stride patterns pass as either format, so that
    `.contiguous(memory_format=)` may keep strides that PyTorch reads as the other layout."""
    return t.to(memory_format=MEMORY_FORMATS[layout]) if t.dim() == 4 else t


def get_params(weights, device, layout=DEFAULT_LAYOUT):
    return [to_layout(torch.tensor(weights[name], device=device), layout).requires_grad_() for name in PARAM_NAMES]


def forward(params, X):
    """The layout is in the strides of X and the kernels: the same code runs both. execution.py's graph level
    compiles this function (torch.compile), which recompiles for the other strides."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    h = F.avg_pool2d(F.relu(F.conv2d(X, w1, b1)), POOL)
    h = F.avg_pool2d(F.relu(F.conv2d(h, w2, b2)), POOL)
    h = h.flatten(1)                       # C, H, W order: the canonical flatten
    h = F.relu(F.linear(h, w3, b3))
    return F.linear(h, w4, b4)


def widened(t):
    """A bf16 or fp16 tensor in fp32; an fp32 or float64 one as it is (the tests run the network in float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def loss_sum(logits, y):
    """Cross-entropy summed over the shard, in fp32 whatever the logits' precision (common/precision.py): shards add
    up to the global batch exactly."""
    return F.cross_entropy(widened(logits), y, reduction="sum")


def autocast(device, precision):
    """PyTorch's own mixed precision around a forward: torch.autocast runs the convolutions and linear layers in the
    precision's bf16 or fp16 (their fp32 weights cast on the way in), every op after them on what they give; off at
    fp32. The backward runs each op in its forward's precision, and the cast's backward widens a weight's bf16 or fp16
    gradient to fp32. The CPU's autocast takes fp16 as well as bf16 (torch 2.13)."""
    return torch.autocast(device.type, dtype=DTYPES[precision], enabled=is_low(precision))


def loss_and_grads(params, X, y, forward=forward, precision="fp32", scale=1.0):
    """One device's part of the step: its shard's summed loss and the gradients of that loss times `scale` (fp16's
    loss scale, common/loss_scaling.py; exact, a power of two), `forward` as written or as a compiled level makes it,
    at `precision`. The loss comes back unscaled."""
    with autocast(X.device, precision):
        logits = forward(params, X)
    loss = loss_sum(logits, y)
    return loss.detach(), torch.autograd.grad(loss * scale, params)


def to_numpy(params):
    """Copies, C-ordered whatever the layout: a CPU tensor's numpy() is a view of it, which the next update would
    change under the caller (a hook keeping the weights before each step), and channels-last kernels would come out
    with their strides."""
    return {name: np.array(p.detach().cpu().numpy(), dtype=np.float32, order="C")
            for name, p in zip(PARAM_NAMES, params)}


def accuracy(params, X, y, layout=DEFAULT_LAYOUT, batch_size=1000):
    """Of one replica on numpy data, its batches laid out as its kernels are."""
    device = params[0].device
    correct = 0
    with torch.no_grad():
        for i in range(0, len(X), batch_size):
            X_batch = to_layout(torch.from_numpy(X[i:i + batch_size]).to(device), layout)
            correct += (forward(params, X_batch).argmax(1).cpu().numpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)


@dataclasses.dataclass(frozen=True)
class Functional:
    """The LeNet as the recipe's step trains it (common.interface.FUNCTIONAL): the functions above, in `layout`
    (execution.layout's key), computing at `precision` (common/precision.py). No BatchNorm: its state is None on
    every device."""
    layout: str = DEFAULT_LAYOUT
    precision: str = "fp32"
    name = "lenet"
    param_names = PARAM_NAMES

    def get_params(self, weights, device):
        return get_params(weights, device, self.layout)

    def get_bn_state(self, state, device):
        return None

    def loss_and_grads(self, replicas, bn_states, X_shards, y_shards, devices, compiled_forward=None, scale=1.0):
        """Each device's own loss and gradients (of its loss times `scale`), one device after another; on GPUs each
        call only queues the device's kernels, so the devices work in parallel. Each shard is laid out as the replica's
        kernels are. The forward is compiled_forward where a level compiles it (execution.py), else as written."""
        losses, grads = [], []
        for params, X, y in zip(replicas, X_shards, y_shards):
            loss, device_grads = loss_and_grads(params, to_layout(X, self.layout), y, compiled_forward or forward,
                                                self.precision, scale)
            losses.append(loss)
            grads.append(device_grads)
        return losses, grads, bn_states

    def to_numpy(self, replica):
        return to_numpy(replica)

    def bn_state_to_numpy(self, bn_state):
        return {}

    def evaluate(self, replica, bn_state, X, y):
        return accuracy(replica, X, y, self.layout)


def build_model(weights, layout=DEFAULT_LAYOUT):
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
