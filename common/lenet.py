"""The LeNet of the "multi-GPU from scratch" recipe (Dive into Deep Learning), specified once.

Every framework builds this exact network from `PARAMS` and `init_weights`; nothing about the model
is decided in a framework folder. Canonical layout is PyTorch's: conv kernels (out, in, kh, kw),
dense weights (out, in), and the flatten in C, H, W order.
"""
import numpy as np

IMAGE_SHAPE = (1, 28, 28)   # C, H, W of one input image
NUM_CLASSES = 10
POOL = 2                    # average pooling: 2x2 window, stride 2, no padding

# name: (kind, weight shape). Convolutions have no padding and stride 1; every layer but fc2 is
# followed by ReLU; each convolution's ReLU is followed by the average pooling above.
LAYERS = {
    "conv1": ("conv", (20, 1, 3, 3)),
    "conv2": ("conv", (50, 20, 5, 5)),
    "fc1": ("dense", (128, 800)),
    "fc2": ("dense", (NUM_CLASSES, 128)),
}

# The canonical parameter order: what every replica, gradient list and allreduce loop follows.
PARAM_NAMES = tuple(f"{layer}.{part}" for layer in LAYERS for part in ("weight", "bias"))
PARAM_SHAPES = {f"{layer}.weight": shape for layer, (_, shape) in LAYERS.items()}
PARAM_SHAPES.update({f"{layer}.bias": (shape[0],) for layer, (_, shape) in LAYERS.items()})

INITS = ("he", "recipe")


def init_weights(seed=0, init="he"):
    """Canonical initial weights: a dict name -> float32 array, the same for every framework.

    "he": He-normal for the ReLU layers and Glorot-normal for the output layer, zero biases; it trains
    from the first epoch even with only a few steps per epoch. "recipe": normal(0, 0.01) as in the
    recipe, which stalls at chance for dozens of epochs on small data sets.
    """
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose from {INITS}")
    rng = np.random.default_rng(seed)
    weights = {}
    for layer, (_, shape) in LAYERS.items():
        fan_in = int(np.prod(shape[1:]))
        fan_out = shape[0] * int(np.prod(shape[2:]))
        if init == "recipe":
            std = 0.01
        elif layer == "fc2":
            std = np.sqrt(2.0 / (fan_in + fan_out))
        else:
            std = np.sqrt(2.0 / fan_in)
        weights[f"{layer}.weight"] = rng.normal(0.0, std, size=shape).astype(np.float32)
        weights[f"{layer}.bias"] = np.zeros(shape[0], dtype=np.float32)
    return weights


def layer_outputs():
    """(name, output shape C, H, W or features) of every layer, derived from the spec."""
    c, h, w = IMAGE_SHAPE
    shapes = []
    for layer, (kind, shape) in LAYERS.items():
        if kind == "conv":
            k = shape[2]
            c, h, w = shape[0], h - k + 1, w - k + 1
            shapes.append((layer, (c, h, w)))
            h, w = h // POOL, w // POOL
            shapes.append((f"pool after {layer}", (c, h, w)))
        else:
            if shape[1] != c * h * w:
                raise ValueError(f"{layer} expects {shape[1]} inputs, the layer before gives {c * h * w}")
            c, h, w = shape[0], 1, 1
            shapes.append((layer, (c,)))
    return shapes


def flops_per_image(training=True):
    """Multiply-adds of the convolutions and dense layers, times 2 (a multiply-add is 2 FLOPs); a
    training step counts 3 forward passes (forward, input gradient, weight gradient)."""
    c, h, w = IMAGE_SHAPE
    macs = 0
    for layer, (kind, shape) in LAYERS.items():
        if kind == "conv":
            out_c, in_c, k, _ = shape
            h, w = h - k + 1, w - k + 1
            macs += out_c * h * w * in_c * k * k
            h, w = h // POOL, w // POOL
        else:
            macs += shape[0] * shape[1]
    return 2 * macs * (3 if training else 1)
