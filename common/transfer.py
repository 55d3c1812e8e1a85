"""A user's own network, moved from one framework's model to another's: which tensor goes where, written once.

Each framework's transfer.py lists a model's layers in its own traversal order (registration order in Gluon,
PyTorch and Keras; Flax NNX orders a module's attributes by name) and names each layer's tensors by role, ROLES.
The two lists are matched layer by layer, in order, role by role, and every tensor goes through the layout change
its role needs (canonical: Gluon's and PyTorch's, NCHW; channels-last: Keras's and Flax's, NHWC). A shape that does
not fit is an error naming both sides, never a guess."""
import math

import numpy as np

from .layouts import SPATIAL, canonical, channels_last

# A layer's tensors, in this order: a conv or dense layer's weight and bias; a BatchNorm's scale, shift and
# running statistics.
ROLES = ("weight", "bias", "gamma", "beta", "running_mean", "running_var")
BATCHNORM = {"gamma", "beta", "running_mean", "running_var"}
# A flattened feature map's axes, by its number of spatial axes: 1 -> C,L; 2 -> C,H,W; 3 -> C,D,H,W.
MAP_NAMES = {len(axes): ",".join("C" + axes) for axes in SPATIAL.values()}


def ordered(roles):
    """A layer's {role: value} in ROLES order."""
    return {role: roles[role] for role in ROLES if role in roles}


def flattened_shapes(layers, channels_last, flat_shape=None):
    """layer index -> (C, *spatial) for the first dense layer after a conv (`layers`: [{role: array}], in the
    canonical or the channels-last layout): its input is the flattened feature map, whose rows are C, *spatial in a
    canonical flatten and *spatial, C in a channels-last one. C is the conv's channels: its bias's length, or that
    of a BatchNorm after it, else its kernel's out axis (a transposed conv's kernel holds them second, in a Gluon
    file indistinguishably). The map has as many spatial axes as the conv, equal ones unless `flat_shape` gives
    (C, *spatial). A 1x1 map (after a global pooling) needs no reordering."""
    found, conv = {}, None
    for i, roles in enumerate(layers):
        weight = roles.get("weight")
        statistics = roles.get("gamma", roles.get("running_mean"))
        if weight is None and statistics is not None and conv is not None:
            conv = (len(statistics), conv[1])   # a BatchNorm after the conv: its channels
        elif weight is not None and weight.ndim in SPATIAL:
            channels = weight.shape[-1] if channels_last else weight.shape[0]
            conv = (len(roles["bias"]) if "bias" in roles else channels, weight.ndim - 2)
        elif weight is not None and weight.ndim == 2 and conv is not None:
            features = weight.shape[0] if channels_last else weight.shape[1]
            shape = map_shape(i, features, *conv, flat_shape)
            if math.prod(shape[1:]) > 1:
                found[i] = shape
            conv = None
    return found


def converted(a, role, flat, source_channels_last, target_channels_last):
    """A tensor from the source's layout to the target's (common/layouts.py: only a layer's weight changes), and the
    change made, as the table says it ("" for none): said by the branch that makes it, so it cannot say more."""
    if role != "weight" or source_channels_last == target_channels_last or a.ndim < 2:
        return np.ascontiguousarray(a), ""
    if a.ndim not in SPATIAL and a.ndim != 2:
        raise ValueError(f"a {a.ndim}-D weight {a.shape}: no layout change is known for it (a dense layer's is 2-D, "
                         "a 1-, 2- or 3-D conv's kernel 3- to 5-D)")
    value = np.ascontiguousarray(channels_last(a, flat) if target_channels_last else canonical(a, flat))
    if a.ndim in SPATIAL:
        return value, f"OI{SPATIAL[a.ndim]} <-> {SPATIAL[a.ndim]}IO"
    if flat is None:
        return value, "transposed"
    letters = MAP_NAMES[len(flat) - 1][2:]
    return value, f"transposed, rows C,{letters} <-> {letters},C of a {'x'.join(map(str, flat))} map"


def map_shape(i, features, channels, axes, flat_shape=None):
    """(C, *spatial) of the map the dense layer `i` flattens: `flat_shape` if it fits, else a map of `axes` equal
    spatial axes; one that cannot be told is an error, never a guess that does not fit."""
    if flat_shape:
        if len(flat_shape) != axes + 1 or math.prod(flat_shape) != features:
            raise ValueError(f"layer {i}: a dense layer of {features} inputs after a {axes}-D conv: the flattened "
                             f"shape {','.join(map(str, flat_shape))} is not a {axes}-D map of {features} values "
                             f"(give {MAP_NAMES[axes]})")
        return tuple(flat_shape)
    side = round((features // channels) ** (1 / axes)) if features % channels == 0 else 0
    if channels * side ** axes != features:
        raise ValueError(f"layer {i}: a dense layer of {features} inputs after a {axes}-D conv of {channels} "
                         f"channels: the flattened map is not {'square' if axes == 2 else 'cubic'}; give its shape, "
                         f"{MAP_NAMES[axes]} (--flat-shape, or flat_shape=)")
    return (channels,) + (side,) * axes
