"""The networks a run can train (compare.py --model), by name: the recipe's LeNet (common/lenet.py) and d2l's
ResNet-18 (common/resnet.py). What differs between them for the machinery is said here once: the initial weights
and BatchNorm state, the width, the FLOPs per image."""
from . import lenet, resnet
from .interface import RosettaError

MODELS = {"lenet": lenet, "resnet18": resnet}
# The ResNet's default width: one Fashion-MNIST epoch (60,000 images) takes about a minute per framework on
# 2 cores (docs/results.md). d2l's is 64 (resnet.WIDTH): 64x the FLOPs of width 8.
DEFAULT_WIDTH = 8
RESNET_SGD_LR = {"resnet18": 0.1}   # d2l's rate for its ResNet-18 at batch 256 (the LeNet's is 0.2)
# --bn: how the data-parallel replicas normalise. local: each by its own shard's statistics (every framework's
# default); sync: by the global batch's, the per-channel sums all-reduced across devices and processes.
BN_MODES = ("local", "sync")


def check(model, width=None, init="he", bn=None):
    """One line for a combination the spec does not define (compare.py's options and a worker's spec alike)."""
    if model not in MODELS:
        raise RosettaError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    if model == "lenet" and (width is not None or bn is not None):
        raise RosettaError("--width and --bn are the ResNet's (--model resnet18); the LeNet has neither")
    if model == "resnet18" and init != "he":
        raise RosettaError("--init recipe is the LeNet's normal(0, 0.01); the ResNet starts from He-normal weights "
                           "and BatchNorm's (1, 0)")
    if model == "resnet18" and width is not None and width < 1:
        raise RosettaError("--width must be >= 1")


def check_bn(model, bn):
    if has_batchnorm(model) and bn not in BN_MODES:
        raise RosettaError(f"unknown BatchNorm mode {bn!r}; choose from {', '.join(BN_MODES)}")


def has_batchnorm(model):
    return model == "resnet18"


def init_weights(model="lenet", seed=0, init="he", width=None):
    """The canonical initial weights of `model`: every framework starts from these."""
    check(model, width, init)
    if model == "lenet":
        return lenet.init_weights(seed, init)
    return resnet.init_weights(seed, width or DEFAULT_WIDTH)


def init_bn_state(model="lenet", width=None):
    """The canonical initial BatchNorm state (running means 0, variances 1); None for a model without BatchNorm."""
    return resnet.init_bn_state(width or DEFAULT_WIDTH) if has_batchnorm(model) else None


def flops_per_image(model="lenet", width=None):
    """FLOPs of one training step per image (forward and backward), as each model's spec counts them."""
    return lenet.flops_per_image() if model == "lenet" else resnet.flops_per_image(width or DEFAULT_WIDTH)


def parameter_count(model="lenet", width=None):
    """The values every step all-reduces: one gradient per weight."""
    return sum(w.size for w in init_weights(model, width=width).values())
