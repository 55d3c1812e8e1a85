"""The one weight-layout conversion this repo needs: canonical (PyTorch's: NCHW, OIHW kernels, dense
(out, in), flatten in C, H, W order) <-> channels-last (TensorFlow/Keras and Flax: NHWC, HWIO kernels,
dense (in, out), flatten in H, W, C order). MXNet Gluon uses the canonical layout exactly."""
from .lenet import layer_outputs

FLAT_CHW = dict(layer_outputs())["pool after conv2"]   # (C, H, W) = (50, 4, 4): what fc1 sees


def channels_last(a, flat=None):
    """A canonical tensor in the channels-last layout: conv kernels (out, in, kh, kw) -> HWIO (kh, kw, in, out); dense
    weights (out, in) -> (in, out); vectors (biases, BatchNorm's) as they are. The first dense layer after a flatten
    also reorders its inputs, `flat` = (C, H, W) of what it flattens: a channels-last flatten is H, W, C, the
    canonical one C, H, W. Viewed as (out, C, H, W), it is transposed like a conv kernel, then flattened to
    (H*W*C, out). Forget this and every shape still fits while the logits differ by O(1): the classic silent trap."""
    if a.ndim == 4:
        return a.transpose(2, 3, 1, 0)
    if a.ndim == 2 and flat is not None:
        return a.reshape(a.shape[0], *flat).transpose(2, 3, 1, 0).reshape(-1, a.shape[0])
    if a.ndim == 2:
        return a.T
    return a


def canonical(a, flat=None):
    """The inverse of channels_last."""
    if a.ndim == 4:
        return a.transpose(3, 2, 0, 1)
    if a.ndim == 2 and flat is not None:
        c, h, w = flat
        return a.reshape(h, w, c, -1).transpose(3, 2, 0, 1).reshape(a.shape[1], -1)
    if a.ndim == 2:
        return a.T
    return a


def to_channels_last(name, a):
    """The LeNet's (or the ResNet's, by name) parameter `name` channels-last: fc1 follows the LeNet's flatten."""
    return channels_last(a, FLAT_CHW if name == "fc1.weight" else None)


def to_canonical(name, a):
    """The inverse of to_channels_last."""
    return canonical(a, FLAT_CHW if name == "fc1.weight" else None)
