"""d2l's ResNet-18 (Dive into Deep Learning, "Concise Implementation for Multiple GPUs": `resnet18(num_classes,
in_channels=1)`), specified once, with its BatchNorm conventions as data and a numpy reference forward.

The network, as d2l builds it for 28x28 Fashion-MNIST:
- stem: 3x3 convolution, stride 1, padding 1 -> BatchNorm -> ReLU. No 7x7 stride-2 stem and no max-pool: on a
  28x28 image they would leave 7x7 after the stem.
- four stages of two residual blocks, `width` x (1, 2, 4, 8) channels. A block: conv3x3(stride) -> BN -> ReLU ->
  conv3x3 -> BN, plus the shortcut, then ReLU. The first block of stages 2-4 has stride 2 and a 1x1 stride-2
  projection shortcut (d2l's `use_1x1conv`, its attribute `conv3`); d2l's projection has no BatchNorm of its
  own, unlike torchvision's `downsample`. Stage 1 is d2l's `first_block=True`: identity shortcuts only.
- global average pooling, then a dense layer to 10 logits.
Every convolution keeps its bias, as d2l's nn.Conv2d (bias=True) does: a bias just before a BatchNorm is
cancelled by the batch mean in training, so it changes no logit and gets no gradient in training mode, but it
shifts the running mean, and the translations must agree on all of it (the projection's bias is not followed by
a BatchNorm and does matter). Spatial sizes at 28x28: 28, 28, 14, 7, 4.

Padding is explicit and symmetric (1 for 3x3, 0 for 1x1) in every framework: "same" in Keras and Flax pads a
stride-2 convolution of an even input at the bottom/right only, which shifts every later activation.

Canonical layout and names are PyTorch's: kernels (out, in, kh, kw), dense (out, in), BatchNorm weight/bias
(gamma/beta), running_mean/running_var. The order of PARAM_NAMES is the forward order, not d2l's registration
order (d2l registers conv1, conv2, conv3, bn1, bn2). Nothing here imports a framework.
"""
import collections

import numpy as np

IMAGE_SHAPE = (1, 28, 28)   # C, H, W of one input image
NUM_CLASSES = 10
WIDTH = 64                  # d2l's: stage channels 64, 128, 256, 512

# The eight residual blocks: (name, stride). Stride 2 is exactly where d2l adds the 1x1 projection `conv3`.
BLOCKS = tuple((f"stage{s}.{b}", 2 if s > 1 and b == 0 else 1) for s in (1, 2, 3, 4) for b in (0, 1))
STAGE_CHANNELS = {"stage1": 1, "stage2": 2, "stage3": 4, "stage4": 8}   # times the width


def has_projection(stride):
    return stride != 1


def convolutions():
    """Every convolution's (kernel, stride, padding): the geometry does not depend on the width."""
    found = {"stem.conv": (3, 1, 1)}
    for block, stride in BLOCKS:
        found[f"{block}.conv1"] = (3, stride, 1)
        found[f"{block}.conv2"] = (3, 1, 1)
        if has_projection(stride):
            found[f"{block}.conv3"] = (1, stride, 0)
    return found


CONVS = convolutions()


def layers(width=WIDTH):
    """name -> (kind, weight shape) of every layer with parameters, in forward order; kind is conv, bn or dense."""
    found = {"stem.conv": ("conv", (width, IMAGE_SHAPE[0], 3, 3)), "stem.bn": ("bn", (width,))}
    c_in = width
    for block, stride in BLOCKS:
        c = width * STAGE_CHANNELS[block.split(".")[0]]
        found[f"{block}.conv1"] = ("conv", (c, c_in, 3, 3))
        found[f"{block}.bn1"] = ("bn", (c,))
        found[f"{block}.conv2"] = ("conv", (c, c, 3, 3))
        found[f"{block}.bn2"] = ("bn", (c,))
        if has_projection(stride):
            found[f"{block}.conv3"] = ("conv", (c, c_in, 1, 1))
        c_in = c
    found["fc"] = ("dense", (NUM_CLASSES, c_in))
    return found


LAYER_NAMES = tuple(layers())
BN_LAYERS = tuple(name for name, (kind, _) in layers().items() if kind == "bn")
# The canonical parameter order (a replica, a gradient list, an allreduce loop): weight then bias of every layer;
# a BatchNorm's weight and bias are its gamma and beta.
PARAM_NAMES = tuple(f"{layer}.{part}" for layer in LAYER_NAMES for part in ("weight", "bias"))
# The BatchNorm state: not trained, updated by every training-mode forward. PyTorch's num_batches_tracked is left
# out: it only matters for momentum=None (a cumulative average), no other framework keeps it, and the canonical
# convention has a fixed momentum.
BN_STATE_NAMES = tuple(f"{layer}.{part}" for layer in BN_LAYERS for part in ("running_mean", "running_var"))


def param_shapes(width=WIDTH):
    shapes = {}
    for layer, (_, shape) in layers(width).items():
        shapes[f"{layer}.weight"] = shape
        shapes[f"{layer}.bias"] = (shape[0],)
    return shapes


def bn_state_shapes(width=WIDTH):
    return {name: layers(width)[name.rsplit(".", 1)[0]][1] for name in BN_STATE_NAMES}


def width_of(weights):
    return weights["stem.conv.weight"].shape[0]


def named_layers(model):
    """(canonical layer name, layer) of an idiomatic model built with the same attribute names in every framework: its
    stem `conv` and `bn`, its residual `blocks` (conv1, bn1, conv2, bn2, and conv3 or None), its dense `fc`."""
    yield "stem.conv", model.conv
    yield "stem.bn", model.bn
    for (block, _), residual in zip(BLOCKS, model.blocks):
        for part in ("conv1", "bn1", "conv2", "bn2", "conv3"):
            if getattr(residual, part) is not None:
                yield f"{block}.{part}", getattr(residual, part)
    yield "fc", model.fc


def by_canonical_name(model, attributes):
    """canonical name -> a framework's variable, from its idiomatic model (named_layers) and, for each canonical
    suffix, the attribute names the framework gives it (the first one a layer has: Gluon's gamma is a BatchNorm's
    weight, Flax's scale too). Parameters and BatchNorm state alike."""
    found = {}
    for layer, module in named_layers(model):
        for suffix, names in attributes.items():
            name = next((n for n in names if hasattr(module, n)), None)
            if name is not None:
                found[f"{layer}.{suffix}"] = getattr(module, name)
    return found


def init_weights(seed=0, width=WIDTH):
    """Canonical initial weights, name -> float32 array, the same for every framework: He-normal convolutions
    (fan in), Glorot-normal for the output layer (as common.lenet), zero biases, BatchNorm gamma 1 and beta 0."""
    rng = np.random.default_rng(seed)
    weights = {}
    for layer, (kind, shape) in layers(width).items():
        if kind == "bn":
            weights[f"{layer}.weight"] = np.ones(shape, np.float32)
        else:
            fan_in = int(np.prod(shape[1:]))
            std = np.sqrt(2.0 / (fan_in + shape[0])) if kind == "dense" else np.sqrt(2.0 / fan_in)
            weights[f"{layer}.weight"] = rng.normal(0.0, std, size=shape).astype(np.float32)
        weights[f"{layer}.bias"] = np.zeros(shape[0], np.float32)
    return weights


def init_bn_state(width=WIDTH):
    """Running mean 0 and running variance 1: every framework's starting state."""
    return {name: (np.zeros if name.endswith("mean") else np.ones)(shape, np.float32)
            for name, shape in bn_state_shapes(width).items()}


def layer_outputs(width=WIDTH):
    """(layer name, output shape C, H, W) of every convolution, from the spec; the dense layer gives (10,). A
    projection sees its block's input and, with the same stride as conv1, gives conv1's size."""
    h, w = IMAGE_SHAPE[1:]
    shapes = {}
    for layer, (kind, shape) in layers(width).items():
        if kind == "conv" and layer.endswith("conv3"):
            shapes[layer] = (shape[0], *shapes[layer.replace("conv3", "conv1")][1:])
        elif kind == "conv":
            k, stride, pad = CONVS[layer]
            h, w = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
            shapes[layer] = (shape[0], h, w)
        elif kind == "dense":
            shapes[layer] = (shape[0],)
    return list(shapes.items())


def flops_per_image(width=WIDTH, training=True):
    """Multiply-adds of the convolutions and the dense layer, times 2; a training step counts 3 forward passes
    (forward, input gradient, weight gradient), as common.lenet does. BatchNorm, ReLU, the additions and the
    pooling are left out: a few FLOPs per activation against hundreds to thousands per output of a convolution."""
    shapes = dict(layer_outputs(width))
    macs = 0
    for layer, (kind, shape) in layers(width).items():
        if kind == "conv":
            c, h, w = shapes[layer]
            macs += c * h * w * int(np.prod(shape[1:]))
        elif kind == "dense":
            macs += shape[0] * shape[1]
    return 2 * macs * (3 if training else 1)


# ---------------------------------------------------------------------------------------------------- BatchNorm
# A convention, canonical form: `momentum` is the weight of the NEW batch (running = (1 - m) * running + m * batch),
# `eps` is added to the variance, `unbiased` says whether the running variance takes the batch variance times
# n / (n - 1) (n = values per channel: N * H * W). The normalisation itself always divides by the biased batch
# variance in training mode, in every framework.
Convention = collections.namedtuple("Convention", "momentum eps unbiased")

# The project's: PyTorch's momentum and epsilon, and the biased running variance of MXNet, Keras and Flax (three of
# the four, and the one the sum/sum-of-squares all-reduce gives directly). PyTorch cannot be told to use it: its
# idiomatic model keeps its unbiased running variance, a factor n / (n - 1) on the batch's share (1.0002 for a
# 256-image batch at stage 4's 4x4, 1.01 for 6 images there): framework_convention says so, the tests measure it.
CANONICAL_BN = Convention(momentum=0.1, eps=1e-5, unbiased=False)

# Each framework's BatchNorm layer as it states its convention. `momentum_weighs`: "batch" if its momentum is the
# new batch's weight, "running" if it is the running value's (then the batch weighs 1 - momentum). `running_var`
# and `updates` were measured by tests/test_resnet.py (one training step of the framework's own layer against the
# spec, 2 images of 3 channels at 2x2, so n = 8 and the unbiased variance is 8/7 of the biased; 2026-11-24): torch
# 2.13.0, mxnet 1.9.1, keras 3.15.1 on tensorflow 2.21.0, flax 0.12.0. `updates`: when the running statistics move.
# MXNet's move in the BatchNorm's BACKWARD pass: a training-mode forward (autograd.record or train_mode) with no
# backward leaves them as they were; the others move them in the training-mode forward.
BN_LAYERS_BY_FRAMEWORK = {
    "pytorch": dict(layer="torch.nn.BatchNorm2d", momentum_arg="momentum", momentum=0.1, momentum_weighs="batch",
                    eps_arg="eps", eps=1e-5, running_var="unbiased", updates="forward",
                    names=("weight", "bias", "running_mean", "running_var", "num_batches_tracked")),
    "mxnet": dict(layer="mxnet.gluon.nn.BatchNorm", momentum_arg="momentum", momentum=0.9, momentum_weighs="running",
                  eps_arg="epsilon", eps=1e-5, running_var="biased", updates="backward",
                  names=("gamma", "beta", "running_mean", "running_var")),
    "tensorflow": dict(layer="keras.layers.BatchNormalization", momentum_arg="momentum", momentum=0.99,
                       momentum_weighs="running", eps_arg="epsilon", eps=1e-3, running_var="biased", updates="forward",
                       names=("gamma", "beta", "moving_mean", "moving_variance")),
    "jax": dict(layer="flax.nnx.BatchNorm", momentum_arg="momentum", momentum=0.99, momentum_weighs="running",
                eps_arg="epsilon", eps=1e-5, running_var="biased", updates="forward",
                names=("scale", "bias", "mean", "var")),
}


def framework_convention(framework, momentum=None, eps=None):
    """The canonical form of what `framework`'s BatchNorm layer computes when given `momentum` and `eps` as ITS
    arguments (None: its defaults). framework_convention("tensorflow", momentum=0.1) is the classic slip:
    PyTorch's 0.1 given to Keras keeps only 10% of the running value."""
    table = BN_LAYERS_BY_FRAMEWORK[framework]
    momentum = table["momentum"] if momentum is None else momentum
    return Convention(momentum if table["momentum_weighs"] == "batch" else 1.0 - momentum,
                      table["eps"] if eps is None else eps, table["running_var"] == "unbiased")


def layer_arguments(framework, bn=CANONICAL_BN):
    """The keyword arguments that make `framework`'s BatchNorm layer compute convention `bn`, as far as it can:
    no framework has an argument for the running variance's bias (framework_convention tells what it does)."""
    table = BN_LAYERS_BY_FRAMEWORK[framework]
    momentum = bn.momentum if table["momentum_weighs"] == "batch" else 1.0 - bn.momentum
    return {table["momentum_arg"]: round(momentum, 12), table["eps_arg"]: bn.eps}


def engine_convention(framework, bn=CANONICAL_BN):
    """What `framework`'s own BatchNorm layer computes when built with layer_arguments(framework, bn), as the built-in
    engines and idiomatic loops build it: `bn`'s momentum and eps, and the framework's own running variance
    (PyTorch's unbiased, the others' biased)."""
    momentum, eps = layer_arguments(framework, bn).values()
    return framework_convention(framework, momentum, eps)


def moments(h, axes=(0, 2, 3)):
    """Per-channel (sum, sum of squares, count) of a shard: what a synchronised BatchNorm all-reduces. Sums add
    up across shards exactly where means do not (shards may differ in size)."""
    h = np.asarray(h, np.float64)
    count = int(np.prod([h.shape[a] for a in axes]))
    return h.sum(axis=axes), np.square(h).sum(axis=axes), count


def combine(parts):
    """The global batch's per-channel (mean, biased variance, count) from the shards' moments(...): the sums
    all-reduced, then divided once. E[x^2] - E[x]^2 cancels badly only when |mean| >> std; computed in float64
    here, and a float32 translation may shift by the mean first."""
    total, squares, count = (sum(p[i] for p in parts) for i in range(3))
    mean = total / count
    return mean, np.maximum(squares / count - np.square(mean), 0.0), count


def update_running(running_mean, running_var, mean, var, count, bn=CANONICAL_BN):
    """The running statistics after one training batch, under convention `bn`."""
    if bn.unbiased:
        var = var * count / max(count - 1, 1)
    return ((1 - bn.momentum) * running_mean + bn.momentum * mean,
            (1 - bn.momentum) * running_var + bn.momentum * var)


def batch_norm(h, gamma, beta, running_mean, running_var, training, bn=CANONICAL_BN):
    """One BatchNorm on NCHW h: (output, new running mean, new running var) in training mode (normalised by the
    batch's statistics), output in eval mode (by the running ones)."""
    c = (1, -1, 1, 1)
    if training:
        mean, var, count = combine([moments(h)])
    else:
        mean, var = running_mean, running_var
    out = (h - mean.reshape(c)) / np.sqrt(var.reshape(c) + bn.eps) * gamma.reshape(c) + beta.reshape(c)
    if not training:
        return out
    return (out, *update_running(running_mean, running_var, mean, var, count, bn))


# ------------------------------------------------------------------------------------------------ the reference
def conv2d(x, w, b, stride, pad):
    """NCHW x, OIHW w: a direct convolution (sliding windows and one einsum), the reference the frameworks meet."""
    k = w.shape[2]
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    windows = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.einsum("nchwij,ocij->nohw", windows, w, optimize=True) + b.reshape(1, -1, 1, 1)


def forward(weights, bn_state, X, training, bn=CANONICAL_BN):
    """The numpy reference: logits of the NCHW batch X, computed in float64. Training mode (batch statistics)
    returns (logits, new BatchNorm state, a dict like bn_state); eval mode (running statistics) the logits."""
    p = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    state = {k: np.asarray(v, np.float64) for k, v in bn_state.items()}
    new_state = {}

    def conv(name, h):
        _, stride, pad = CONVS[name]
        return conv2d(h, p[f"{name}.weight"], p[f"{name}.bias"], stride, pad)

    def norm(name, h):
        out = batch_norm(h, p[f"{name}.weight"], p[f"{name}.bias"], state[f"{name}.running_mean"],
                         state[f"{name}.running_var"], training, bn)
        if not training:
            return out
        out, new_state[f"{name}.running_mean"], new_state[f"{name}.running_var"] = out
        return out

    relu = lambda h: np.maximum(h, 0.0)   # noqa: E731
    h = relu(norm("stem.bn", conv("stem.conv", np.asarray(X, np.float64))))
    for block, stride in BLOCKS:
        y = relu(norm(f"{block}.bn1", conv(f"{block}.conv1", h)))
        y = norm(f"{block}.bn2", conv(f"{block}.conv2", y))
        h = relu(y + (conv(f"{block}.conv3", h) if has_projection(stride) else h))
    h = h.mean(axis=(2, 3))                # global average pooling
    logits = h @ p["fc.weight"].T + p["fc.bias"]
    if not training:
        return logits
    return logits, {name: new_state[name] for name in BN_STATE_NAMES}


def loss_sum(logits, y):
    """Cross-entropy summed over the batch, as every framework's loss_sum."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_p[np.arange(len(y)), y].sum()
