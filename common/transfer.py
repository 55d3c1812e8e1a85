"""A user's own network, moved from one framework's model to another's: which tensor goes where, written once.

Each framework's transfer.py lists a model's layers in its own traversal order (registration order in Gluon,
PyTorch and Keras; Flax NNX orders a module's attributes by name) and names each layer's tensors by role, ROLES.
The two lists are matched layer by layer, in order, role by role, and every tensor goes through the layout change
its role needs (canonical: Gluon's and PyTorch's, NCHW; channels-last: Keras's and Flax's, NHWC). A shape that does
not fit is an error naming both sides, never a guess."""
import math

import numpy as np

from .layouts import canonical, channels_last

# A layer's tensors, in this order: a conv or dense layer's weight and bias; a BatchNorm's scale, shift and
# running statistics.
ROLES = ("weight", "bias", "gamma", "beta", "running_mean", "running_var")
BATCHNORM = {"gamma", "beta", "running_mean", "running_var"}


def ordered(roles):
    """A layer's {role: value} in ROLES order."""
    return {role: roles[role] for role in ROLES if role in roles}


def flattened_shapes(layers, channels_last, flat_shape=None):
    """layer index -> (C, H, W) for the first dense layer after a conv (`layers`: [{role: array}], in the canonical
    or the channels-last layout): its input is the flattened feature map, whose rows are C, H, W in a canonical
    flatten and H, W, C in a channels-last one. C is the last conv's output channels; H = W unless `flat_shape`
    gives (C, H, W)."""
    found, channels = {}, None
    for i, roles in enumerate(layers):
        weight = roles.get("weight")
        if weight is None:
            continue
        if weight.ndim == 4:
            channels = weight.shape[-1] if channels_last else weight.shape[0]
        elif weight.ndim == 2 and channels is not None:
            features = weight.shape[0] if channels_last else weight.shape[1]
            found[i] = tuple(flat_shape) if flat_shape else square(features, channels)
            channels = None
    return found


def square(features, channels):
    side = math.isqrt(features // channels) if features % channels == 0 else 0
    if side * side * channels != features:
        raise ValueError(f"a dense layer of {features} inputs after a conv of {channels} channels: not a square "
                         "feature map; give the flattened (C, H, W)")
    return channels, side, side


def converted(a, role, flat, source_channels_last, target_channels_last):
    """A tensor from the source's layout to the target's (common/layouts.py: only a layer's weight changes)."""
    if role != "weight" or source_channels_last == target_channels_last:
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(channels_last(a, flat) if target_channels_last else canonical(a, flat))
