"""MXNet's minimal training loop, as in the Gluon tutorials: a hybridized HybridSequential, a
gluon.Trainer with SGD and SoftmaxCrossEntropyLoss on one context, no harness. The benchmark times
it beside the scratch step to show what the from-scratch recipe costs. At --precision bf16 or fp16 the step trains
the network's graph as MXNet's own AMP converts it (mixed_precision), on the same fp32 Parameters; at fp16 with
AMP's own dynamic loss scaler on the Trainer (init_loss_scaler), as amp.init_trainer and amp.scale_loss use it."""
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.contrib import amp
from mxnet.contrib.amp.loss_scaler import LossScaler

from common.interface import Model, Network, RosettaError, Unavailable
from common.loss_scaling import ScalerState
from common.precision import is_low
from common.sharding import micro_batches

from . import lenet, resnet
from .devices import check_precision
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
    (network.sync changes nothing on one context). At network.precision bf16 or fp16 the step trains its
    mixed_precision twin; the Trainer updates the same fp32 Parameters either way. network.loss_scaling gives the
    Trainer AMP's loss scaler (init_loss_scaler). fp16 needs a GPU (devices.check_precision)."""
    if len(devices) != 1:
        raise Unavailable("the idiomatic loop is the single-device reference: run it with 1 device")
    if port not in PORTS:
        raise RosettaError(f"unknown port {port!r}; choose from {', '.join(PORTS)}")
    check_precision(network.precision, devices)
    net = build(weights, network)
    net.collect_params().reset_ctx(devices[0])
    if optimizer is None or optimizer.is_recipe:
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.0})
    else:
        trainer = get_trainer(net.collect_params(), optimizer, canonical_names(net), port, state)
    init_loss_scaler(trainer, network.loss_scaling)
    return Model(net, trainer, precision=network.precision, mixed=mixed_precision(net, network.precision))


def build(weights, network, sync_devices=None):
    """The idiomatic network, hybridized on the CPU: the LeNet, or the ResNet holding network.bn_state (its
    BatchNorm Gluon's SyncBatchNorm over sync_devices contexts if given)."""
    if network.bn_state is None:
        return build_model(weights)
    return resnet.build_model(weights, network.bn_state, sync_devices=sync_devices)


AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}   # contrib.amp's name of each low precision (its target_dtype)


def mixed_precision(net, precision):
    """The block a training step calls at `precision` (common/precision.py, Model.mixed): None at fp32 (the net
    itself); at bf16 or fp16 the net's graph as MXNet's AMP converts it, amp.convert_symbol (contrib/amp/amp.py). Its
    op lists (contrib/amp/lists/symbol_bf16.py, symbol_fp16.py) put an amp_cast to the low precision before the
    inputs, weights and biases of every Convolution and FullyConnected (BF16_FUNCS, FP16_FUNCS), run ReLU, pooling
    and the residual add (a widest-type op) on the low-precision values they make, nn.BatchNorm on its low-precision
    input with fp32 gamma, beta and running statistics (at bf16 by BF16_USE_FP32_PARAMS, oneDNN's bf16 kernel; at
    fp16 BatchNorm is one of FP16_FP32_FUNCS, left as it is, and its own type rule keeps the parameters of an fp16
    input fp32: cuDNN's kernel; statistics in fp32 either way), contrib's SyncBatchNorm in fp32 (one of FP32_FUNCS at
    either, with softmax and log_softmax), and cast the logits back to fp32 for the loss. cast_optional_params=False
    keeps every parameter fp32 (amp_cast's backward widens a weight's low-precision gradient). Not
    contrib.amp.init(), which patches mx.nd and mx.sym for the whole process (every fp32 model after it would change),
    nor convert_hybrid_block, the same conversion for inference: it needs a forward first (the cached graph) and copies
    the Parameters into a new SymbolBlock (averaged over the contexts, on gpu(0) by default), which the Trainer, the
    canonical names (the ResNet's layers) and a checkpoint of the net would not reach. Here the converted graph is a
    SymbolBlock over the net's own Parameters (params=): the Trainer updates them, both graphs read them, the ResNet's
    BatchNorm moves the running statistics the net evaluates with (in fp32, as evaluate runs, as PyTorch's loop
    evaluates outside autocast), a checkpoint saves the net."""
    if not is_low(precision):
        return None
    data = mx.sym.var("data", dtype="float32")
    block = gluon.SymbolBlock(amp_graph(net, data, precision), data, params=net.collect_params())
    block.hybridize(static_alloc=True, static_shape=not is_resnet(net))   # as build's (resnet.build_model says)
    return block


def amp_graph(net, data, precision):
    """The net's graph on the fp32 input `data` (a symbol) as contrib.amp converts it at a low `precision`
    (mixed_precision says what it holds): a symbol, which type inference and its JSON show without running it."""
    return amp.convert_symbol(net(data), target_dtype=AMP_DTYPES[precision], data_names=[data.name],
                              cast_optional_params=False)


def init_loss_scaler(trainer, loss_scaling):
    """What amp.init_trainer does, by hand: it asserts that amp.init() ran, which patches mx.nd and mx.sym for the
    whole process. The Trainer gets contrib.amp's own LossScaler (_amp_loss_scaler), which its _update asks
    has_overflow before updating (it skips an overflowing step), and the rescale it had (_amp_original_scale, which
    amp.scale_loss divides by the loss scale: the update unscales). The scaler starts at loss_scaling.initial and
    doubles after growth_interval finite steps; its factors are fixed at 2 and 0.5, its ceiling at 2**24, and a new
    scale reaches the forward one step late (common.loss_scaling.FRAMEWORK_DEFAULTS). None: no scaling."""
    if loss_scaling is None:
        return
    if (loss_scaling.growth_factor, loss_scaling.backoff_factor) != (2.0, 0.5):
        raise Unavailable("contrib.amp's LossScaler fixes its factors at 2 and 0.5")
    scaler = LossScaler()
    scaler._loss_scale = scaler._next_loss_scale = float(loss_scaling.initial)
    scaler._scale_seq_len = loss_scaling.growth_interval
    trainer._amp_loss_scaler = scaler
    trainer._amp_original_scale = trainer._scale


def amp_scaled(losses, trainer):
    """What the backward differentiates, made inside autograd.record: with a loss scaler on the trainer
    (init_loss_scaler), the losses times its scale, by amp.scale_loss, which also sets the trainer's rescale to
    1/scale (its update unscales); else the losses."""
    if getattr(trainer, "_amp_loss_scaler", None) is None:
        return losses
    with amp.scale_loss(losses, trainer) as scaled:
        return scaled


def is_resnet(net):
    return isinstance(net, resnet.ResNet)


def canonical_names(net):
    """Gluon name -> canonical name of the parameters the network trains: the LeNet's or the ResNet's."""
    return (resnet if is_resnet(net) else lenet).canonical_names(net)


class Accumulation:
    """How one step adds up its micro-batches' gradients in the net's trained Parameters (not BatchNorm's statistics).
    Gluon's way: grad_req 'add' (switched the first time a step accumulates: fresh, zeroed gradient buffers), each
    micro-batch's backward adding into .grad, and after trainer.step a zero_grad for the next update ('write'
    overwrites). At a low precision by hand, grad_req staying 'write': MXNet 1.9.1's amp_cast, which the converted
    graph (mixed_precision) puts between every Convolution's and FullyConnected's weight and bias and the op, loses a
    gradient it should add. Its backward's oneDNN kernel (AMPCastExCPU, src/operator/tensor/amp_cast.cc) makes a
    kAddTo output in CreateMKLDNNMem's temporary buffer and never commits it, so with grad_req 'add' those Parameters'
    .grad stays zero, silently. Here the earlier micro-batches' gradients are kept (copies, on their contexts) and
    added into .grad after the last micro-batch's backward, before trainer.step."""

    def __init__(self, net, accumulate, precision="fp32"):
        self.params = [p for p in net.collect_params().values() if p.grad_req != "null"]
        self.by_hand = accumulate > 1 and is_low(precision)
        self.earlier = None
        if accumulate > 1 and not self.by_hand and self.params[0].grad_req != "add":
            for p in self.params:
                p.grad_req = "add"

    def grads(self):
        return [g for p in self.params for g in p.list_grad()]   # every context's

    def after_backward(self, last):
        """After a micro-batch's backward; `last`: the step's last."""
        if not self.by_hand:
            return
        if last:
            for g, earlier in zip(self.grads(), self.earlier):
                g += earlier
        elif self.earlier is None:
            self.earlier = [g.copy() for g in self.grads()]
        else:
            for earlier, g in zip(self.earlier, self.grads()):
                earlier += g

    def after_step(self):
        """Gradients that add up in .grad must be zeroed for the next update."""
        if self.params[0].grad_req == "add":
            for p in self.params:
                p.zero_grad()


def train_step(model, X, y, devices, lr, batch_size=None, accumulate=1):
    """backward() of the per-example losses sums their gradients; trainer.step(batch_size) divides
    the sum by the batch size: the recipe's update. A Trainer of optimizer.py clips that sum and its schedule
    sets the rate, not `lr`. accumulate: the batch in that many micro-batches (common.sharding.micro_batches), the
    tutorial's way: the Parameters' grad_req 'add', a backward each, one trainer.step, then zero_grad (at bf16 added
    by hand: Accumulation says why). At bf16 or fp16 the forward is the net's mixed_precision twin: its logits come
    back fp32, the loss is fp32. With a loss scaler each micro-batch's backward is from the loss times its scale
    (amp_scaled: the same scale all step), and trainer.step skips the update if the summed gradients overflow."""
    net, trainer = model.net if model.mixed is None else model.mixed, model.trainer
    X = nd.array(X, ctx=devices[0], dtype=X.dtype)   # copies, as split_and_load
    y = nd.array(y, ctx=devices[0], dtype=y.dtype)
    adding = Accumulation(model.net, accumulate, model.precision)
    parts = micro_batches(len(y), accumulate)
    loss = 0.0
    for i, (start, stop) in enumerate(parts):
        with autograd.record():
            micro = loss_fn(net(X[start:stop]), y[start:stop])
            head = amp_scaled(micro, trainer)
        head.backward()
        adding.after_backward(last=i == len(parts) - 1)
        loss += float(micro.sum().asscalar())
    if not isinstance(trainer, Trainer):
        trainer.set_learning_rate(lr)
    trainer.step(batch_size or len(X))
    adding.after_step()
    return loss / len(X)


def scaler_state(model):
    """contrib.amp's LossScaler between steps (common.loss_scaling.ScalerState; None without one): the scale the next
    step's loss is multiplied by, the one it decided for the step after (a `late` scaler) and its finite steps."""
    scaler = getattr(model.trainer, "_amp_loss_scaler", None)
    if scaler is None:
        return None
    return ScalerState(scaler.loss_scale, scaler._next_loss_scale, scaler._unskipped)


def restore_scaler(model, state):
    """The LossScaler carries on from a checkpoint's ScalerState (amp keeps it in no file of its own)."""
    scaler = model.trainer._amp_loss_scaler
    scaler._loss_scale, scaler._next_loss_scale, scaler._unskipped = state.scale, state.decided, state.good_steps


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
