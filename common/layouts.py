"""The one weight-layout conversion this repo needs: canonical (PyTorch's: NCHW, OIHW kernels (OIL, OIDHW for 1-
and 3-D convs), dense (out, in), flatten in C, H, W order) <-> channels-last (TensorFlow/Keras and Flax: NHWC, HWIO
kernels, dense (in, out), flatten in H, W, C order). MXNet Gluon uses the canonical layout exactly."""
from .lenet import layer_outputs

FLAT_CHW = dict(layer_outputs())["pool after conv2"]   # (C, H, W) = (50, 4, 4): what fc1 sees
SPATIAL = {3: "L", 4: "HW", 5: "DHW"}   # a 1-, 2- or 3-D conv's kernel: its number of axes -> its spatial axes


def channels_last(a, flat=None):
    """A canonical tensor in the channels-last layout: conv kernels (out, in, *spatial) -> (*spatial, in, out), for
    1-, 2- and 3-D convs alike; dense weights (out, in) -> (in, out); vectors (biases, BatchNorm's) as they are. The
    first dense layer after a flatten reorders its rows too, `flat` = (C, *spatial) of what it flattens (C, *spatial
    canonically, *spatial, C channels-last): without it every shape fits and the logits differ by O(1), silently."""
    if a.ndim in SPATIAL:
        return a.transpose(*range(2, a.ndim), 1, 0)
    if a.ndim == 2 and flat is not None:
        return channels_last(a.reshape(a.shape[0], *flat)).reshape(-1, a.shape[0])
    if a.ndim == 2:
        return a.T
    return a


def canonical(a, flat=None):
    """The inverse of channels_last."""
    if a.ndim in SPATIAL:
        return a.transpose(a.ndim - 1, a.ndim - 2, *range(a.ndim - 2))
    if a.ndim == 2 and flat is not None:
        channels, *spatial = flat
        return canonical(a.reshape(*spatial, channels, a.shape[1])).reshape(a.shape[1], -1)
    if a.ndim == 2:
        return a.T
    return a


def to_channels_last(name, a):
    """The LeNet's (or the ResNet's, by name) parameter `name` channels-last: fc1 follows the LeNet's flatten."""
    return channels_last(a, FLAT_CHW if name == "fc1.weight" else None)


def to_canonical(name, a):
    """The inverse of to_channels_last."""
    return canonical(a, FLAT_CHW if name == "fc1.weight" else None)
