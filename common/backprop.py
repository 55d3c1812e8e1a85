"""The numpy reference of one device's part of the step, forward and backward, for both networks and every precision:
its shard's summed loss, every parameter's gradient and the new BatchNorm state.

Computed in float64 by a small reverse-mode tape. At --precision bf16 every tensor common/precision.py holds in bf16
is rounded to bf16 where it is made, in the forward and in the backward alike, so a framework's bf16 step is held
to what bf16 must give rather than to fp32's numbers; at fp32 nothing is rounded and the gradients are float64's.
At fp16 the same tensors are rounded to fp16, and the backward starts from the loss scale, not 1.
"""
import numpy as np

from . import lenet
from .precision import rounded
from .resnet import BLOCKS, BN_STATE_NAMES, CANONICAL_BN, CONVS, has_projection, update_running


class Tensor:
    """A value of the forward and the gradient flowing back into it. `low`: held in the compute precision, so what
    flows back into it (summed over its uses) is rounded as it is."""

    def __init__(self, value, low, parents=(), backward=None):
        self.value, self.low, self.parents, self.backward = value, low, parents, backward
        self.grad = None


class Tape:
    """The ops of one forward at `precision`, and the parameters' gradients after backward()."""

    def __init__(self, weights, precision):
        self.precision = precision
        self.weights = {name: np.asarray(w, np.float64) for name, w in weights.items()}
        self.grads = {name: np.zeros_like(w) for name, w in self.weights.items()}
        self.order = []

    def low(self, x):
        return rounded(x, self.precision)

    def op(self, value, low, parents, backward):
        out = Tensor(self.low(value) if low else value, low, parents, backward)
        self.order.append(out)
        return out

    def param(self, name, low):
        """A master weight as an op reads it (cast to bf16 by a bf16 op): its gradient is the op's, in its precision."""
        return self.low(self.weights[name]) if low else self.weights[name]

    def add_grad(self, name, g, low):
        self.grads[name] += self.low(g) if low else g

    def backward(self, loss, scale=1.0):
        loss.grad = np.full_like(loss.value, scale)
        for out in reversed(self.order):
            if out.grad is None or out.backward is None:
                continue
            for parent, g in zip(out.parents, out.backward(out.grad)):
                if g is None:
                    continue
                total = g if parent.grad is None else parent.grad + g
                parent.grad = self.low(total) if parent.low else total
        return {name: g.astype(np.float32) for name, g in self.grads.items()}

    # ------------------------------------------------------------------------------------------------ the ops
    def conv(self, x, name, stride, pad):
        """A convolution in the compute precision: inputs, weight and bias rounded, the output rounded once."""
        w, b = self.param(f"{name}.weight", True), self.param(f"{name}.bias", True)
        k = w.shape[2]
        padded = np.pad(self.low(x.value), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        windows = np.lib.stride_tricks.sliding_window_view(padded, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
        value = np.einsum("nchwij,ocij->nohw", windows, w, optimize=True) + b.reshape(1, -1, 1, 1)

        def backward(d):
            d = self.low(d)
            self.add_grad(f"{name}.weight", np.einsum("nchwij,nohw->ocij", windows, d, optimize=True), True)
            self.add_grad(f"{name}.bias", d.sum(axis=(0, 2, 3)), True)
            dx = np.zeros_like(padded)
            ho, wo = d.shape[2:]
            for i in range(k):
                for j in range(k):
                    dx[:, :, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride] += np.einsum(
                        "nohw,oc->nchw", d, w[:, :, i, j], optimize=True)
            return (dx[:, :, pad:pad + x.value.shape[2], pad:pad + x.value.shape[3]],)
        return self.op(value, True, (x,), backward)

    def dense(self, x, name):
        w, b = self.param(f"{name}.weight", True), self.param(f"{name}.bias", True)
        h = self.low(x.value)

        def backward(d):
            d = self.low(d)
            self.add_grad(f"{name}.weight", d.T @ h, True)
            self.add_grad(f"{name}.bias", d.sum(axis=0), True)
            return (d @ w,)
        return self.op(h @ w.T + b, True, (x,), backward)

    def relu(self, x):
        return self.op(np.maximum(x.value, 0.0), x.low, (x,), lambda d: (d * (x.value > 0),))

    def add(self, a, b):
        return self.op(a.value + b.value, a.low or b.low, (a, b), lambda d: (d, d))

    def avg_pool(self, x, size):
        """size x size windows, stride size, the last row and column dropped where they do not fill a window."""
        n, c, h, w = x.value.shape
        ho, wo = h // size, w // size
        value = x.value[:, :, :ho * size, :wo * size].reshape(n, c, ho, size, wo, size).mean(axis=(3, 5))

        def backward(d):
            dx = np.zeros_like(x.value)
            dx[:, :, :ho * size, :wo * size] = np.repeat(np.repeat(d, size, axis=2), size, axis=3) / size ** 2
            return (dx,)
        return self.op(value, x.low, (x,), backward)

    def global_pool(self, x):
        n, c, h, w = x.value.shape
        return self.op(x.value.mean(axis=(2, 3)), x.low, (x,),
                       lambda d: (np.broadcast_to(d[:, :, None, None] / (h * w), x.value.shape),))

    def flatten(self, x):
        shape = x.value.shape
        return self.op(x.value.reshape(shape[0], -1), x.low, (x,), lambda d: (d.reshape(shape),))

    def batch_norm(self, x, name, state, new_state, bn=CANONICAL_BN):
        """Training mode, the shard's own statistics, in fp32 whatever its input (common/precision.py); the output in
        the input's precision."""
        gamma, beta = self.weights[f"{name}.weight"], self.weights[f"{name}.bias"]
        h, c = x.value, (1, -1, 1, 1)
        mean, var = h.mean(axis=(0, 2, 3)), h.var(axis=(0, 2, 3))
        count = h.size // h.shape[1]
        new_state[f"{name}.running_mean"], new_state[f"{name}.running_var"] = update_running(
            np.asarray(state[f"{name}.running_mean"], np.float64), np.asarray(state[f"{name}.running_var"], np.float64),
            mean, var, count, bn)
        inv = 1.0 / np.sqrt(var + bn.eps)
        normed = (h - mean.reshape(c)) * inv.reshape(c)

        def backward(d):
            d = np.asarray(d, np.float64)
            self.add_grad(f"{name}.weight", (d * normed).sum(axis=(0, 2, 3)), False)
            self.add_grad(f"{name}.bias", d.sum(axis=(0, 2, 3)), False)
            dn = d * gamma.reshape(c)
            dx = (dn - dn.mean(axis=(0, 2, 3), keepdims=True)
                  - normed * (dn * normed).mean(axis=(0, 2, 3), keepdims=True)) * inv.reshape(c)
            return (dx,)
        return self.op(normed * gamma.reshape(c) + beta.reshape(c), x.low, (x,), backward)

    def loss_sum(self, logits, y):
        """Cross-entropy summed over the shard, in fp32 from the (possibly bf16) logits."""
        z = logits.value - logits.value.max(axis=1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        onehot = np.eye(log_p.shape[1])[y]
        return self.op(-(log_p * onehot).sum(), False, (logits,), lambda d: (d * (np.exp(log_p) - onehot),))


def lenet_forward(tape, X):
    h = Tensor(np.asarray(X, np.float64), False)
    for layer in ("conv1", "conv2"):
        h = tape.avg_pool(tape.relu(tape.conv(h, layer, 1, 0)), lenet.POOL)
    h = tape.relu(tape.dense(tape.flatten(h), "fc1"))
    return tape.dense(h, "fc2")


def resnet_forward(tape, X, bn_state, new_state):
    norm = lambda h, name: tape.batch_norm(h, name, bn_state, new_state)   # noqa: E731
    conv = lambda h, name: tape.conv(h, name, *CONVS[name][1:])             # noqa: E731
    h = tape.relu(norm(conv(Tensor(np.asarray(X, np.float64), False), "stem.conv"), "stem.bn"))
    for block, stride in BLOCKS:
        y = tape.relu(norm(conv(h, f"{block}.conv1"), f"{block}.bn1"))
        y = norm(conv(y, f"{block}.conv2"), f"{block}.bn2")
        h = tape.relu(tape.add(y, conv(h, f"{block}.conv3") if has_projection(stride) else h))
    return tape.dense(tape.global_pool(h), "fc")


def loss_and_grads(model, weights, bn_state, X, y, precision="fp32", scale=1.0):
    """One shard's summed loss (float), the gradients (canonical names, float32) and the new BatchNorm state (None
    for the LeNet) of the network `model` ('lenet' or 'resnet18', common.models.MODELS) at `precision`. `scale`: the
    loss scale of fp16 (common/loss_scaling.py); the gradients are the scaled loss's, to be unscaled by the step."""
    with np.errstate(over="ignore", invalid="ignore"):   # an fp16 overflow makes inf and nan, as in the frameworks
        return run(model, Tape(weights, precision), bn_state, X, y, scale)


def run(model, tape, bn_state, X, y, scale):
    if model == "lenet":
        logits, new_state = lenet_forward(tape, X), None
    else:
        new_state = {}
        logits = resnet_forward(tape, X, bn_state, new_state)
        new_state = {name: new_state[name].astype(np.float32) for name in BN_STATE_NAMES}
    loss = tape.loss_sum(logits, np.asarray(y))
    grads = tape.backward(loss, scale)
    return float(loss.value), grads, new_state

