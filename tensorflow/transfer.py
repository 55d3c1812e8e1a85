"""A user's own Keras model, layer by layer (common/transfer.py): model.weights in Keras's order (its layers', in
the order they were added or assigned), a layer's variables named by role: kernel is the weight; a
BatchNormalization's moving mean and variance are its running statistics. The model must be built."""
from common.transfer import ordered

CHANNELS_LAST = True
NAMES = {"kernel": "weight", "bias": "bias", "gamma": "gamma", "beta": "beta", "moving_mean": "running_mean",
         "moving_variance": "running_var"}


def layers(model):
    """[(layer path, {role: (the variable's path, numpy array)})], in model.weights' order. A depthwise conv's kernel
    (*spatial, C, multiplier) is given as the grouped conv it is, (*spatial, 1, C * multiplier): Gluon's and
    PyTorch's depthwise conv (groups = C) laid out channels-last, output channel c * multiplier + j either way."""
    found, depthwise = {}, depthwise_kernels(model)
    for variable in model.weights:
        layer, _, name = variable.path.rpartition("/")
        if name not in NAMES:
            raise ValueError(f"{variable.path}: a Keras {name} is none of the variables moved here "
                             f"({', '.join(NAMES)})")
        value = variable.numpy()
        if variable.path in depthwise:
            value = value.reshape(*value.shape[:-2], 1, -1)
        found.setdefault(layer, {})[NAMES[name]] = (variable.path, value)
    return [(layer, ordered(tensors)) for layer, tensors in found.items()]


def depthwise_kernels(model):
    """The paths of the model's depthwise convs' kernels."""
    from keras import layers as keras_layers
    return {layer.kernel.path for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, (keras_layers.DepthwiseConv1D, keras_layers.DepthwiseConv2D))}


def flattened_map(model):
    """(C, *spatial) of the one map the model flattens, as its Flatten layer was built (channels-last: its rows go
    *spatial, C), or None (no Flatten, several, or one of no known shape). The weights cannot tell it: a map of 2x8 and
    one of 4x4, of as many channels, make dense layers of one shape."""
    from keras import layers as keras_layers
    flattens = [layer for layer in model._flatten_layers(include_self=False)
                if isinstance(layer, keras_layers.Flatten)]
    if len(flattens) != 1 or flattens[0].data_format != "channels_last":
        return None
    try:
        *spatial, channels = flattens[0].input.shape[1:]
    except (AttributeError, ValueError):   # never called, or called on several inputs
        return None
    return None if not spatial or None in (*spatial, channels) else (channels, *spatial)


def assign(model, arrays):
    """Sets the model's variables from {variable path: numpy array} (a depthwise kernel as layers gives it); assign
    checks each shape."""
    depthwise = depthwise_kernels(model)
    for variable in model.weights:
        if variable.path in arrays:
            value = arrays[variable.path]
            variable.assign(value.reshape(variable.shape) if variable.path in depthwise else value)


def save(model, path):
    """As Keras saves a model's weights: save_weights (a .weights.h5 file)."""
    model.save_weights(path)
