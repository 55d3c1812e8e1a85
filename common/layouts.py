"""The one weight-layout conversion this repo needs: canonical (PyTorch's: NCHW, OIHW kernels, dense
(out, in), flatten in C, H, W order) <-> channels-last (TensorFlow/Keras and Flax: NHWC, HWIO kernels,
dense (in, out), flatten in H, W, C order). MXNet Gluon uses the canonical layout exactly."""
from .lenet import layer_outputs

FLAT_CHW = dict(layer_outputs())["pool after conv2"]   # (C, H, W) = (50, 4, 4): what fc1 sees


def to_channels_last(name, a):
    """Conv kernels (out, in, kh, kw) -> HWIO (kh, kw, in, out); dense weights (out, in) -> (in, out).
    fc1 also reorders its inputs: a channels-last flatten is H, W, C, the canonical one C, H, W. Viewed as
    (out, C, H, W), fc1 is transposed like a conv kernel, then flattened to (H*W*C, out). Forget this and
    every shape still fits while the logits differ by O(1): the classic silent trap."""
    if name == "fc1.weight":
        return a.reshape(a.shape[0], *FLAT_CHW).transpose(2, 3, 1, 0).reshape(-1, a.shape[0])
    if a.ndim == 4:
        return a.transpose(2, 3, 1, 0)
    if a.ndim == 2:
        return a.T
    return a   # biases


def to_canonical(name, a):
    """The inverse of to_channels_last."""
    if name == "fc1.weight":
        c, h, w = FLAT_CHW
        return a.reshape(h, w, c, -1).transpose(3, 2, 0, 1).reshape(a.shape[1], -1)
    if a.ndim == 4:
        return a.transpose(3, 2, 0, 1)
    if a.ndim == 2:
        return a.T
    return a
