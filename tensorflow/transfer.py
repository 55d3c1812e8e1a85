"""A user's own Keras model, layer by layer (common/transfer.py): model.weights in Keras's order (its layers', in
the order they were added or assigned), a layer's variables named by role: kernel is the weight; a
BatchNormalization's moving mean and variance are its running statistics. The model must be built."""
from common.transfer import ordered

CHANNELS_LAST = True
NAMES = {"kernel": "weight", "bias": "bias", "gamma": "gamma", "beta": "beta", "moving_mean": "running_mean",
         "moving_variance": "running_var"}


def layers(model):
    """[(layer path, {role: (the variable's path, numpy array)})], in model.weights' order."""
    found = {}
    for variable in model.weights:
        layer, _, name = variable.path.rpartition("/")
        found.setdefault(layer, {})[NAMES[name]] = (variable.path, variable.numpy())
    return [(layer, ordered(tensors)) for layer, tensors in found.items()]


def assign(model, arrays):
    """Sets the model's variables from {variable path: numpy array}; assign checks each shape."""
    for variable in model.weights:
        if variable.path in arrays:
            variable.assign(arrays[variable.path])


def save(model, path):
    """As Keras saves a model's weights: save_weights (a .weights.h5 file)."""
    model.save_weights(path)
