"""MXNet checkpoints: Gluon's save_parameters and load_parameters, an NDArray file (mx.nd.load reads it as a
dict). Gluon names a parameter by its block's position in the HybridSequential and its own name: conv1 is
block 0, conv2 block 3, fc1 and fc2 (whose ReLU is inside the Dense) blocks 6 and 7.

The optimizer state is Gluon's Trainer.save_states file: the pickle of its first updater's states by parameter index
(the Trainer's numbering, by sorted names: optimizer.trainer_order) and of the optimizer itself, which counts the
updates made (num_update) and holds its schedule. The files this project writes pickle MXNet's stock classes
(save_state), so stock Gluon code loads them alone; a stock Gluon program's own files are read as they are.
Trainer.load_states reads it into a Trainer(net.collect_params()) of the same network: the LeNet's numbers 8
parameters, a ResNet's all of its Parameters (the BatchNorms' running statistics too, which have no state)."""
import mxnet as mx
import numpy as np

from common import resnet
from common.interface import RosettaError
from common.lenet import PARAM_NAMES, init_weights

from . import resnet as resnet_model
from .idiomatic import canonical_names
from .lenet import build_model
from .optimizer import (buffers, carry_exact, exact_optimizer, get_optimizer, get_trainer, momentum_inside, told,
                        trainer_order, updater_state)
from .optimizer import stock_gap as optimizer_stock_gap

KEYS = dict(zip(PARAM_NAMES, (f"{block}.{part}" for block in (0, 3, 6, 7) for part in ("weight", "bias"))))
CHANNELS_LAST = False   # MXNet's layout is the canonical one
STATE_SUFFIX = ".states"   # beside the .params, as Gluon's CheckpointHandler (estimator) saves a Trainer


def idiomatic(weights, bn_state=None):
    """The LeNet, or with a BatchNorm state the ResNet, as the idiomatic modes build it."""
    return build_model(weights) if bn_state is None else resnet_model.build_model(weights, bn_state)


def save(weights, path, bn_state=None):
    """The ResNet's file holds its running statistics beside the parameters (Gluon Parameters both)."""
    idiomatic(weights, bn_state).save_parameters(path)


def load(path, width=None):
    """The idiomatic model (the ResNet of `width`, else the LeNet) with the file's weights: nothing but Gluon's own
    calls. Called outside autograd.record(), it runs in inference mode."""
    net = idiomatic(*any_weights(width))   # any weights: load_parameters replaces every one
    net.load_parameters(path, ctx=mx.cpu())
    return net


def any_weights(width=None):
    return (init_weights(),) if width is None else (resnet.init_weights(0, width), resnet.init_bn_state(width))


def read(path):
    """The file's arrays by key, as stored."""
    arrays = mx.nd.load(path)
    if not isinstance(arrays, dict):
        raise ValueError("its arrays have no names (not written by save_parameters)")
    if arrays and all(key.startswith(("arg:", "aux:")) for key in arrays):
        raise RosettaError("a HybridBlock.export file (its parameters named by the symbol's, arg:conv0_weight): "
                           "build the network in Gluon, net.load_parameters(this file) and net.save_parameters("
                           "'x.params'), then convert that; or move its weights into your own network with python -m "
                           "harness.training.transfer")
    return {key: value.asnumpy() for key, value in arrays.items()}


def state_network(state):
    """The idiomatic network a canonical optimizer state belongs to, read off its names (`<slot>.<name>`): a ResNet of
    the stem's width if a name is the ResNet's, else the LeNet (a state without buffers, plain SGD's, fits either)."""
    names = {key.split(".", 1)[1] for key in state if key != "step"}
    if names & set(resnet.PARAM_NAMES):
        width = next(a.shape[0] for key, a in state.items() if key.endswith(".stem.conv.weight"))
        return idiomatic(*any_weights(width))
    return idiomatic(*any_weights())


def save_state(state, optimizer, path):
    """A Trainer for `optimizer` on the state's network (LeNet or ResNet, any width), started from the canonical
    `state`, saves it: save_states(path). Its optimizer and schedule are MXNet's stock classes (get_optimizer's
    "stock" port, its buffers in their convention), so that stock Gluon code loads the file with Trainer.load_states
    and no import of this project; where they compute otherwise than `optimizer`, stock_gap says how. The canonical
    state and optimizer ride along (optimizer.EXACT), and read_state and read_optimizer read them back exactly."""
    net = state_network(state)   # any weights: the file holds the trainer's state, not the model's
    trainer = get_trainer(net.collect_params(), optimizer, canonical_names(net), port="stock", state=state)
    carry_exact(trainer._optimizer, state, optimizer)
    trainer.save_states(path)


def rate_inside(optimizer):
    """The stock class save_state pickles for `optimizer` (common.optim's) where it keeps the rate inside its momentum
    buffer (optimizer.momentum_inside: MXNet's SGD with momentum, NAG, a centered RMSProp with momentum), or None: the
    file holds -rate * the canonical buffer, and stock Gluon code that loads it continues the state's own run only
    while the rate stays (common.optim.rate_changes)."""
    stock = get_optimizer(optimizer, "stock")
    return f"MXNet's stock {type(stock).__name__}" if momentum_inside(stock) else None


def stock_gap(path, optimizer):
    """What stock Gluon code that loads the states file at `path` (save_state's) computes otherwise than `optimizer`,
    the state's own, from where the file leaves it (optimizer.stock_gap), or None where it continues the same run."""
    updater = saved_updater(path)
    return optimizer_stock_gap(updater.optimizer, optimizer, updater.states)


def read_state(path):
    """The file's buffers (canonical names, MXNet's layout) and step count, by what Trainer.load_states calls:
    Updater.set_states on a fresh updater, which unpickles the states and the saved optimizer into it. The network is
    the one whose Trainer numbers as many trained parameters as the file has states: the LeNet's 8, or a ResNet's,
    whose width the stem's buffer tells (the only 4-d buffer with one input channel)."""
    updater = saved_updater(path)
    if len(updater.states) == len(PARAM_NAMES):
        net = idiomatic(*any_weights())
    else:
        stems = [a.shape[0] for state in updater.states.values() for a in buffers(state)
                 if a.ndim == 4 and a.shape[1:] == resnet.layers(1)["stem.conv"][1][1:]]
        net = idiomatic(*any_weights(stems[0] if stems else 1))   # no buffers: any width numbers them alike
    return updater_state(updater, trainer_order(net.collect_params(), canonical_names(net)))


def read_optimizer(path, accept_gap=False):
    """The optimizer the file pickled (save_states dumps it with the states), as common.optim's (optimizer.told),
    and the line that says what differs where it is read across a convention gap it was told to accept (else None);
    a file this project wrote gives its own optimizer exactly, with no gap."""
    updater = saved_updater(path)
    optimizer = told(updater.optimizer, accept_gap, updater.states)
    if exact_optimizer(updater.optimizer) is not None:
        return optimizer, None
    return optimizer, optimizer_stock_gap(updater.optimizer, optimizer, updater.states)


def saved_updater(path):
    """What Trainer.load_states does: Updater.set_states on a fresh updater, which unpickles the file's states and
    optimizer into it."""
    fresh = mx.optimizer.SGD()
    updater = mx.optimizer.get_updater(fresh)
    with open(path, "rb") as file:
        updater.set_states(file.read())
    if updater.optimizer is fresh or not isinstance(updater.optimizer, mx.optimizer.Optimizer):
        raise ValueError("no optimizer in it (save_states saves one; get_states without dump_optimizer does not)")
    if updater.states and len(updater.states) not in (len(PARAM_NAMES), len(resnet.PARAM_NAMES)):
        raise ValueError(f"states for {len(updater.states)} parameters: neither the LeNet's {len(PARAM_NAMES)} nor "
                         f"a ResNet-18's {len(resnet.PARAM_NAMES)} (another network's Trainer saved it)")
    return updater


def logits(model, X):
    return model(mx.nd.array(X)).asnumpy()
