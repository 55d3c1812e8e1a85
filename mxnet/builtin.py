"""MXNet's own data parallelism: gluon.Trainer over a kvstore. In one process the `device` kvstore
sums the gradients of the Parameters' copies on every context; across processes the `dist_sync`
kvstore that distributed.py created also sums them over all workers (through the server)."""

from mxnet import autograd, gluon, nd

from common.interface import Model

from . import distributed as dist
from .data_parallel import evaluate as evaluate_params
from .lenet import build_model, loss_sum, to_numpy as params_to_numpy
from .optimizer import Trainer, get_trainer, canonical_state

EXEC = "hybridize"
COMPILES = "fwd+bwd"
LAYOUT = "NCHW (Gluon)"


def get_model(weights, devices, optimizer=None, state=None):
    """A copy of every Parameter on every context. update_on_kvstore=False: the kvstore only sums the
    gradients and each context applies the SGD update to its own copy, like the scratch sgd (a dist
    kvstore would otherwise run the optimizer on the server, fixed at its first learning rate and batch
    size). Without a kvstore (kvstore=None) the Trainer would update each copy with its own gradient.
    The recipe's plain SGD (optimizer None or is_recipe) is Gluon's "sgd" at the harness's rate; any other
    optimizer is optimizer.py's Trainer: MXNet's optimizer and schedule, and clipping by global norm, from the
    canonical `state` of a checkpoint if given (every context's updater, in every process, gets it)."""
    net = build_model(weights)             # hybridized, on the CPU
    net.collect_params().reset_ctx(devices)
    kvstore = {"kvstore": dist.KV if dist.is_initialized() else "device", "update_on_kvstore": False}
    if optimizer is None or optimizer.is_recipe:
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.0}, **kvstore)
    else:
        trainer = get_trainer(net.collect_params(), optimizer, state=state, **kvstore)
    if dist.is_initialized():
        trainer._init_kvstore()            # broadcast the weights now, not in the first step: there, on the
        trainer._init_params()             # CPU, the weights' pull can overtake the gradients' pushpull and
        nd.waitall()                       # come back holding the summed gradients (MXNet 1.9.1)
    return Model(net, trainer, devices)


def train_step(model, batch, lr, batch_size):
    """The Trainer sums the contexts' (and processes') gradients of their summed losses; step(global
    batch) then makes its update lr * sum / global batch, the recipe's, even when shards differ in size.
    The batch is one shard per context, from pipeline.py's DataLoader and split_and_load. A Trainer of
    optimizer.py clips that sum, the same on every context, and its schedule sets the rate, not `lr`."""
    net, trainer, _ = model
    X_shards, y_shards = batch
    with autograd.record():                # queued asynchronously: the contexts work in parallel
        losses = [loss_sum(net(X_shard), y_shard) for X_shard, y_shard in zip(X_shards, y_shards)]
    autograd.backward(losses)
    if not isinstance(trainer, Trainer):
        trainer.set_learning_rate(lr)
    trainer.step(batch_size)
    return sum(loss.asscalar() for loss in losses) / sum(len(y) for y in y_shards)


def params(net):
    """The Parameters' copies on the first context, in PARAM_NAMES order: a scratch replica."""
    return [p.list_data()[0] for p in net.collect_params().values()]


def to_numpy(model):
    return params_to_numpy(params(model.net))


def optimizer_state(model):
    return canonical_state(model.trainer)


def evaluate(model, X, y):
    return evaluate_params(params(model.net), X, y)
