"""A user's own Gluon network, layer by layer (common/transfer.py): its parameters in registration order under the
structural names save_parameters writes (features.0.weight), a layer's tensors named by role, which are Gluon's
own names. The network is a Block, or the file its save_parameters wrote."""
import mxnet as mx

from common.transfer import ordered

CHANNELS_LAST = False


def parameters(model):
    """{structural name: numpy array}: a .params file's arrays as stored, or a Block's."""
    if isinstance(model, str):
        return {key.split(":", 1)[-1]: a.asnumpy() for key, a in mx.nd.load(model).items()}
    return {key: p.data().asnumpy() for key, p in model._collect_params_with_prefix().items()}


def layers(model):
    """[(layer name, {role: (the structural name, numpy array)})], in registration order."""
    found = {}
    for key, a in parameters(model).items():
        layer, _, name = key.rpartition(".")
        found.setdefault(layer, {})[name] = (key, a)
    return [(layer, ordered(tensors)) for layer, tensors in found.items()]


def assign(model, arrays):
    """Sets a Block's parameters from {structural name: numpy array}."""
    params = model._collect_params_with_prefix()
    for key, a in arrays.items():
        params[key].set_data(mx.nd.array(a))


def save(model, path):
    """As Gluon saves a network: save_parameters."""
    model.save_parameters(path)
