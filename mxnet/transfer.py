"""A user's own Gluon network, layer by layer (common/transfer.py): its parameters in registration order under the
structural names save_parameters writes (features.0.weight), a layer's tensors named by role, which are Gluon's
own names. The network is a Block, or the file its save_parameters (or HybridBlock.export) wrote."""
import mxnet as mx

from common.transfer import ROLES, ordered

CHANNELS_LAST = False


def parameters(model):
    """{structural name: numpy array}: a .params file's arrays as stored, or a Block's."""
    if isinstance(model, str):
        return {key.split(":", 1)[-1]: a.asnumpy() for key, a in mx.nd.load(model).items()}
    return {key: p.data().asnumpy() for key, p in model._collect_params_with_prefix().items()}


def layers(model):
    """[(layer name, {role: (the structural name, numpy array)})], in registration order. A HybridBlock.export file
    names each parameter by its symbol (arg:conv0_weight, aux:batchnorm0_running_mean), with no structure: its layer
    is the name before its role."""
    found = {}
    for key, a in parameters(model).items():
        layer, _, name = key.rpartition(".") if "." in key else by_role(key)
        found.setdefault(layer, {})[name] = (key, a)
    return [(layer, ordered(tensors)) for layer, tensors in found.items()]


def by_role(key):
    """(layer, "_", role) of an exported parameter's name (conv0_weight, batchnorm0_running_var): its role is one of
    ROLES, the longest that ends it (running_var, not var), else the word after its last underscore."""
    role = next((role for role in sorted(ROLES, key=len, reverse=True) if key.endswith(f"_{role}")), None)
    return (key[:-len(role) - 1], "_", role) if role else key.rpartition("_")


def assign(model, arrays):
    """Sets a Block's parameters from {structural name: numpy array}."""
    params = model._collect_params_with_prefix()
    for key, a in arrays.items():
        params[key].set_data(mx.nd.array(a))


def save(model, path):
    """As Gluon saves a network: save_parameters."""
    model.save_parameters(path)
