"""MXNet's minimal training loop, as in the Gluon tutorials: a hybridized HybridSequential, a
gluon.Trainer with SGD and SoftmaxCrossEntropyLoss on one context, no harness. The benchmark times
it beside the scratch step to show what the from-scratch recipe costs."""

from mxnet import autograd, gluon, nd

from common.interface import Model, Network, RosettaError, Unavailable
from common.precision import refuse_until_written
from common.sharding import micro_batches

from . import lenet, resnet
from .lenet import build_model, to_numpy as params_to_numpy
from .optimizer import CLASSES, Trainer, get_trainer, canonical_state

EXEC = "hybridize"
COMPILES = "fwd+bwd"
LAYOUT = "NCHW (Gluon)"

loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()   # one loss per example
# How the optimizer is ported: "canonical" computes common/optim.py, "stock" is a straightforward port (MXNet's
# stock classes given the same hyperparameters, its defaults and conventions for the rest: optimizer.CLASSES).
PORTS = tuple(CLASSES)


def get_model(weights, devices, optimizer=None, state=None, port="canonical", network=Network()):
    """On one context the Trainer updates the weights itself (it makes no kvstore). The recipe's plain SGD
    (optimizer None or is_recipe) is Gluon's "sgd" at the harness's rate; any other optimizer is optimizer.py's
    Trainer, as in builtin.py, from the canonical `state` of a checkpoint if given, for either network (its
    parameters by their canonical names: canonical_names). The network is the LeNet, or the ResNet with nn.BatchNorm
    (network.sync changes nothing on one context)."""
    refuse_until_written(network.precision, "MXNet's idiomatic loop")
    if len(devices) != 1:
        raise Unavailable("the idiomatic loop is the single-device reference: run it with 1 device")
    if port not in PORTS:
        raise RosettaError(f"unknown port {port!r}; choose from {', '.join(PORTS)}")
    net = build(weights, network)
    net.collect_params().reset_ctx(devices[0])
    if optimizer is None or optimizer.is_recipe:
        return Model(net, gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.0}))
    return Model(net, get_trainer(net.collect_params(), optimizer, canonical_names(net), port, state))


def build(weights, network, sync_devices=None):
    """The idiomatic network, hybridized on the CPU: the LeNet, or the ResNet holding network.bn_state (its
    BatchNorm Gluon's SyncBatchNorm over sync_devices contexts if given)."""
    if network.bn_state is None:
        return build_model(weights)
    return resnet.build_model(weights, network.bn_state, sync_devices=sync_devices)


def is_resnet(net):
    return isinstance(net, resnet.ResNet)


def canonical_names(net):
    """Gluon name -> canonical name of the parameters the network trains: the LeNet's or the ResNet's."""
    return (resnet if is_resnet(net) else lenet).canonical_names(net)


def trained(net, accumulate):
    """The net's trained Parameters (not BatchNorm's statistics), switched to grad_req 'add' (fresh, zeroed gradient
    buffers) the first time a step accumulates: each micro-batch's backward then adds into .grad."""
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    if accumulate > 1 and params[0].grad_req != "add":
        for p in params:
            p.grad_req = "add"
    return params


def clear_added(params):
    """After trainer.step: gradients that add up must be zeroed for the next update ('write' overwrites them)."""
    if params[0].grad_req == "add":
        for p in params:
            p.zero_grad()


def train_step(model, X, y, devices, lr, batch_size=None, accumulate=1):
    """backward() of the per-example losses sums their gradients; trainer.step(batch_size) divides
    the sum by the batch size: the recipe's update. A Trainer of optimizer.py clips that sum and its schedule
    sets the rate, not `lr`. accumulate: the batch in that many micro-batches (common.sharding.micro_batches), the
    tutorial's way: the Parameters' grad_req 'add', a backward each, one trainer.step, then zero_grad."""
    net, trainer = model.net, model.trainer
    X = nd.array(X, ctx=devices[0], dtype=X.dtype)   # copies, as split_and_load
    y = nd.array(y, ctx=devices[0], dtype=y.dtype)
    params = trained(net, accumulate)
    loss = 0.0
    for start, stop in micro_batches(len(y), accumulate):
        with autograd.record():
            micro = loss_fn(net(X[start:stop]), y[start:stop])
        micro.backward()
        loss += float(micro.sum().asscalar())
    if not isinstance(trainer, Trainer):
        trainer.set_learning_rate(lr)
    trainer.step(batch_size or len(X))
    clear_added(params)
    return loss / len(X)


def to_numpy(model):
    if is_resnet(model.net):
        return resnet.model_to_numpy(model.net)[0]
    return params_to_numpy([p.data() for p in model.net.collect_params().values()])


def bn_state(model):
    return resnet.model_to_numpy(model.net)[1]


def replica_bn_states(model):
    return [bn_state(model)]   # one context


def optimizer_state(model):
    return canonical_state(model.trainer)


def evaluate(model, X, y, batch_size=1000):
    """Outside autograd.record(): inference mode, the ResNet's BatchNorm by its running statistics."""
    net = model.net
    correct = 0
    for i in range(0, len(X), batch_size):
        X_batch = nd.array(X[i:i + batch_size], ctx=net.collect_params().list_ctx()[0])
        correct += (net(X_batch).argmax(axis=1).asnumpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
