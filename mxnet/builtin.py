"""MXNet's own data parallelism: gluon.Trainer over a kvstore. In one process the `device` kvstore
sums the gradients of the Parameters' copies on every context; across processes the `dist_sync`
kvstore that distributed.py created also sums them over all workers (through the server).
The ResNet's BatchNorm keeps its running statistics as aux Parameters (grad_req 'null'): the kvstore never sees
them, so each context keeps its own. Synchronised BatchNorm is Gluon's contrib.nn.SyncBatchNorm, which shares the
moments between the contexts of one process only; on CPU contexts it needs MXNet started with enough scratch
buffers (common/cpu_scratch.py), or it hangs. At --precision bf16 or fp16 every context trains the network's graph as
MXNet's own AMP converts it (idiomatic.mixed_precision) on the same fp32 Parameters: the kvstore sums fp32 gradients.
At fp16 the Trainer carries AMP's own loss scaler (idiomatic.init_loss_scaler): it checks the summed gradients, after
the kvstore's all-reduce, and skips the update on every context (and process) alike when one overflows."""
import os

from mxnet import autograd, gluon, nd

from common import cpu_scratch
from common.interface import Model, Network, Unavailable
from common.sharding import micro_batches

from . import distributed as dist, resnet
from .devices import check_precision
from .idiomatic import (Accumulation, amp_scaled, build, canonical_names, evaluate as evaluate_gluon, init_loss_scaler,
                        is_resnet, mixed_precision, restore_scaler,
                        scaler_state)   # noqa: F401 (scaler_state, restore_scaler: both engines' Trainer has it)
from .lenet import evaluate as evaluate_params, loss_sum, to_numpy as params_to_numpy
from .optimizer import Trainer, get_trainer, canonical_state

EXEC = "hybridize"
COMPILES = "fwd+bwd"
# Its gradients' reduction (harness/studies/split.py): the Trainer pushes and pulls each parameter under its own key.
ALLREDUCE = "per-tensor"
LAYOUT = "NCHW (Gluon)"


def get_model(weights, devices, optimizer=None, state=None, network=Network()):
    """A copy of every Parameter on every context. update_on_kvstore=False: the kvstore only sums the
    gradients and each context applies the SGD update to its own copy, like the scratch sgd (a dist
    kvstore would otherwise run the optimizer on the server, fixed at its first learning rate and batch
    size). Without a kvstore (kvstore=None) the Trainer would update each copy with its own gradient.
    The recipe's plain SGD (optimizer None or is_recipe) is Gluon's "sgd" at the harness's rate; any other
    optimizer is optimizer.py's Trainer: MXNet's optimizer and schedule, and clipping by global norm, from the
    canonical `state` of a checkpoint if given (every context's updater, in every process, gets it), for either
    network (its parameters by their canonical names: idiomatic.canonical_names).
    The ResNet's sync BatchNorm: SyncBatchNorm over this process's contexts (CPU contexts run here; GPUs: written,
    not run here). At network.precision bf16 or fp16 the step trains the net's mixed_precision twin (contrib.amp's
    conversion, over the same Parameters: a CachedOp per context, as the net's); the Trainer updates the fp32
    Parameters either way. network.loss_scaling gives the Trainer AMP's loss scaler (idiomatic.init_loss_scaler),
    which update_on_kvstore=False also keeps working: on the kvstore, pushpull would update the weights before
    Trainer._update asks the scaler whether to skip, and a dist kvstore refuses the rescale changing with the scale.
    fp16 needs GPUs (devices.check_precision)."""
    check_precision(network.precision, devices)
    if network.sync and dist.is_initialized():
        raise Unavailable("Gluon's contrib SyncBatchNorm synchronises the contexts of one process only, not a "
                          "kvstore's workers: run --bn sync in 1 process")
    if network.sync and devices[0].device_type == "cpu":
        check_scratch_buffers(len(devices), os.environ)
    net = build(weights, network, len(devices) if network.sync else None)   # hybridized, on the CPU
    net.collect_params().reset_ctx(devices)
    kvstore = {"kvstore": dist.KV if dist.is_initialized() else "device", "update_on_kvstore": False}
    if optimizer is None or optimizer.is_recipe:
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.0}, **kvstore)
    else:
        trainer = get_trainer(net.collect_params(), optimizer, canonical_names(net), state=state, **kvstore)
    # Broadcast the Parameters now, not in the first step (MXNet 1.9.1): there, across processes on the CPU, the
    # weights' pull can overtake the gradients' pushpull and come back holding the summed gradients; and in any
    # run it copies the first context's running statistics, already moved by the first backward, over every
    # other context's (tests/test_resnet_modes.py).
    trainer._init_kvstore()
    trainer._init_params()
    nd.waitall()
    init_loss_scaler(trainer, network.loss_scaling)
    return Model(net, trainer, devices, network.precision, mixed_precision(net, network.precision))


def check_scratch_buffers(contexts, environ):
    """Gluon's SyncBatchNorm on CPU contexts hangs unless MXNet started with a scratch buffer for each of its ops
    (common/cpu_scratch.py): refuse in one line before it can."""
    needed = cpu_scratch.copies(contexts, sync_batchnorm=True)
    if cpu_scratch.configured(environ) < needed:
        raise Unavailable(f"Gluon's contrib SyncBatchNorm on {contexts} CPU contexts hangs unless MXNet starts with "
                          f"{cpu_scratch.VARIABLE}>={needed} (it has {cpu_scratch.configured(environ)}): set it before "
                          "importing mxnet, as compare.py's workers do")


def train_step(model, batch, lr, batch_size, accumulate=1):
    """The Trainer sums the contexts' (and processes') gradients of their summed losses; step(global
    batch) then makes its update lr * sum / global batch, the recipe's, even when shards differ in size.
    The batch is one shard per context, from pipeline.py's DataLoader and split_and_load. A Trainer of
    optimizer.py clips that sum, the same on every context, and its schedule sets the rate, not `lr`.
    accumulate: each shard in that many micro-batches (common.sharding.micro_batches), Gluon's way: the Parameters'
    grad_req 'add', so each backward adds into their .grad, one trainer.step (its kvstore sums each key once), then
    zero_grad for the next update (at bf16 added by hand: idiomatic.Accumulation says why). At bf16 or fp16 each
    context's forward is the net's mixed_precision twin: logits back in fp32, the loss in fp32. With a loss scaler
    every micro-batch's backward is from the losses times its scale (idiomatic.amp_scaled), and trainer.step skips
    the update where the summed gradients overflow."""
    net, trainer = model.net if model.mixed is None else model.mixed, model.trainer
    X_shards, y_shards = batch
    adding = Accumulation(model.net, accumulate, model.precision)
    parts = [micro_batches(len(y), accumulate) for y in y_shards]
    loss = 0.0
    for i in range(accumulate):
        with autograd.record():            # queued asynchronously: the contexts work in parallel
            losses = [loss_sum(net(X[part[i][0]:part[i][1]]), y[part[i][0]:part[i][1]])
                      for X, y, part in zip(X_shards, y_shards, parts)]
            heads = amp_scaled(losses, trainer)
        autograd.backward(heads)
        adding.after_backward(last=i == accumulate - 1)
        loss += sum(micro.asscalar() for micro in losses)
    if not isinstance(trainer, Trainer):
        trainer.set_learning_rate(lr)
    trainer.step(batch_size)
    adding.after_step()
    return loss / sum(len(y) for y in y_shards)


def params(net):
    """The Parameters' copies on the first context, in PARAM_NAMES order: a scratch replica."""
    return [p.list_data()[0] for p in net.collect_params().values()]


def to_numpy(model):
    if is_resnet(model.net):
        return resnet.model_to_numpy(model.net)[0]
    return params_to_numpy(params(model.net))


def bn_state(model):
    return resnet.model_to_numpy(model.net)[1]


def replica_bn_states(model):
    """Every context's copy of the running statistics, as each context's BatchNorm moved it."""
    return [resnet.model_to_numpy(model.net, i)[1] for i in range(len(model.placement))]


def optimizer_state(model):
    return canonical_state(model.trainer)


def evaluate(model, X, y):
    if is_resnet(model.net):
        return evaluate_gluon(model, X, y)   # outside autograd.record: inference mode, on the first context
    return evaluate_params(params(model.net), X, y)
