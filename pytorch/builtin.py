"""PyTorch's own data parallelism: DistributedDataParallel, one process per device, and nn.DataParallel, one process
over all its GPUs. nn.DataParallel replicates onto CUDA devices only (on the CPU it silently runs the plain module),
so the CPU's built-in engine is always DistributedDataParallel, even for a run of one device; on GPUs a one-process
run is nn.DataParallel (harness/processes/launch.py's process_per_device decides). primitives_step is nn.DataParallel's step
written out with its four primitives, side by side with the recipe (docs/rosetta.md).

--shard (common/zero.py), PyTorch's own engines for ZeRO's stages, one process per device:
    optimizer    DDP with torch.distributed.optim.ZeroRedundancyOptimizer in the optimizer's place: DDP's all-reduce,
                 then each rank updates the parameters it owns with their state, the only state it keeps, and
                 broadcasts them. It owns whole parameters (a greedy partition by size, largest first), not the
                 spec's equal slices of each: so one device may keep more than 1 / N of the state.
    gradients    FSDP2 (fully_shard, each block then the root, over a device mesh of the world) with
                 reshard_after_forward=False: the whole parameters kept from the forward through the backward (one
                 all-gather a step), the gradients reduce-scattered, each rank updating its shards. ZeRO-2's traffic;
                 FSDP2 still frees the whole parameters after the backward, so its shards alone stay between steps.
    parameters   FSDP2 with reshard_after_forward=True: ZeRO-3, the parameters all-gathered a block at a time for the
                 forward and again for the backward, and freed after each.
FSDP2's shards are dim-0 chunks of each parameter (torch.chunk's, padded on the wire), not the spec's flat slices:
the same bytes where every first dimension divides by N. Its BatchNorm buffers are not sharded nor synchronised: each
rank's running statistics are its own shards' (local BatchNorm), where DDP sends rank 0's before every forward."""
import contextlib

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from common.interface import Model, Network, RosettaError, Unavailable
from common.precision import check_wire
from common.sharding import micro_batches
from common.zero import check as check_shard

from . import lenet, resnet
from .checkpoint import save_sharded as save_checkpoint
from .data_parallel import sgd
from .execution import DEFAULT_LAYOUT, LAYOUTS
from .idiomatic import build, evaluate as evaluate_idiomatic, grad_scaler, is_resnet, param_names, restore_scaler, \
    scaler_state   # noqa: F401 (scaler_state, restore_scaler: both engines' model.mixed is a GradScaler)
from .lenet import loss_sum, to_numpy as params_to_numpy
from .optimizer import Trainer, canonical_state, get_trainer

ENGINES = {DistributedDataParallel: "eager+DDP", nn.DataParallel: "eager+DataParallel"}


def EXEC(model):
    """The engine that ran, by the model: DDP (with ZeroRedundancyOptimizer at --shard optimizer), nn.DataParallel, or
    FSDP2."""
    if isinstance(model.net, FSDPModule):
        return "eager+FSDP2"
    sharded = isinstance(optimizer_of(model), ZeroRedundancyOptimizer)
    return ENGINES[type(model.net)] + ("+ZeroRedundancyOptimizer" if sharded else "")


COMPILES = "nothing"
# Its gradients' reduction (harness/studies/split.py): DDP's buckets, 25 MiB (the first 1 MiB), one gloo all-reduce each
# as it fills: each model here fits one.
ALLREDUCE = "bucketed"


def LAYOUT(model):
    """The layout the engine ran: build_model's kernels and pipeline.py's batches, the default; FSDP2 takes
    contiguous parameters only, so its kernels are NCHW (fully_sharded)."""
    return LAYOUTS["nchw"] if isinstance(model.net, FSDPModule) else LAYOUTS[DEFAULT_LAYOUT]


def get_model(weights, devices, optimizer=None, state=None, network=Network(), allreduce_dtype="fp32", shard="none"):
    """In a process group (distributed.py joined one), DistributedDataParallel over this process's one device;
    otherwise nn.DataParallel over its GPUs, the module on the first one, as its documentation requires. The
    recipe's plain SGD (optimizer None or is_recipe) is torch.optim.SGD at the harness's rate; any other optimizer
    is optimizer.py's Trainer: torch.optim's class, its scheduler and the clipping norm, over the parameters of
    the wrapped module (the network's PARAM_NAMES order, the LeNet's or the ResNet's), going on from a checkpoint's
    canonical `state` if given (every process loads the same one).
    The ResNet's BatchNorm under DDP: local (network.sync False) keeps DDP's default broadcast_buffers=True, rank 0's
    running statistics sent to every rank before each forward (each rank's shard then moves its own copy); sync is
    torch.nn.SyncBatchNorm, for DDP on GPUs (nn.DataParallel's replicas in one process it does not synchronise).
    The model's `mixed` is a torch.amp.GradScaler, PyTorch's dynamic loss scaler, set to network.loss_scaling and
    enabled only with it (the AMP recipe's GradScaler(enabled=...)): one step for every precision.
    allreduce_dtype 'bf16' (--allreduce-dtype) registers DDP's bf16 communication hook (bf16_hook); nn.DataParallel
    sums its replicas' gradients inside their backward, with no hook, and refuses it.
    shard (--shard, the module's docstring): "optimizer" is the same DDP with ZeroRedundancyOptimizer wrapping the
    optimizer's class and hyperparameters, in the Trainer (or the recipe's SGD) where the optimizer was, so that the
    scheduler and the clipping act on it as before; "gradients" and "parameters" are FSDP2 (fully_sharded)."""
    check_wire(allreduce_dtype)
    if check_shard(shard) in ("gradients", "parameters"):
        return fully_sharded(weights, devices, optimizer, state, network, allreduce_dtype, shard)
    device = devices[0]
    module = build(weights, network)
    if network.sync:   # every BatchNorm2d a SyncBatchNorm: its forward all-reduces the statistics over the group
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if dist.is_initialized() and len(devices) == 1:
        try:
            net = DistributedDataParallel(module.to(device),
                                          device_ids=[device.index] if device.type == "cuda" else None)
        except ValueError as err:   # torch's own reason: SyncBatchNorm runs on GPUs only
            raise Unavailable(f"torch.nn.SyncBatchNorm under DistributedDataParallel: {err}") from None
        if allreduce_dtype == "bf16":
            net.register_comm_hook(None, bf16_hook())   # None: the hooks' default group, WORLD
    elif not dist.is_initialized() and device.type == "cuda":
        if allreduce_dtype == "bf16":
            raise Unavailable(f"--allreduce-dtype {allreduce_dtype} in nn.DataParallel: its replicas' gradients are "
                              "summed in their backward (Broadcast's reduce_add), in their dtype; DDP takes a hook")
        if shard != "none":
            raise Unavailable(f"--shard {shard} in nn.DataParallel: ZeroRedundancyOptimizer shards over a process "
                              "group, one process per device")
        net = nn.DataParallel(module.to(device), device_ids=[d.index for d in devices])
    else:
        raise RosettaError("PyTorch's built-in engine is DistributedDataParallel, one process per device, or on "
                           "GPUs nn.DataParallel in one process: start it through compare.py or torchrun "
                           "(docs/usage.md)")
    scaler = grad_scaler(device.type, network.loss_scaling)
    if optimizer is None or optimizer.is_recipe:
        plain = (ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.0) if shard == "optimizer"
                 else torch.optim.SGD(net.parameters(), lr=0.0))
        return Model(net, plain, device, network.precision, scaler)
    return Model(net, get_trainer(net.parameters(), optimizer, state, param_names(module), zero=shard == "optimizer"),
                 device, network.precision, scaler)


def fully_sharded(weights, devices, optimizer, state, network, allreduce_dtype, shard):
    """FSDP2 as its documentation applies it: fully_shard on each block (the LeNet's layers, the ResNet's residual
    blocks), then on the root (the ResNet's stem and head), over a 1-d device mesh of the world, one process per
    device; reshard_after_forward False at stage 2 ("gradients"), True at stage 3 ("parameters"). fully_shard takes
    contiguous parameters only, so the kernels are NCHW here (the batches stay channels-last, the default layout).
    The optimizer is built after it, over the DTensor parameters (the Trainer's clip_grad_norm_ sums the shards'
    norms itself); a checkpoint's canonical state goes in as each rank's shards (optimizer.buffer_like).
    allreduce_dtype 'bf16' is FSDP2's MixedPrecisionPolicy(reduce_dtype=bfloat16), the reduce-scatter in bf16."""
    device = devices[0]
    if not dist.is_initialized() or len(devices) != 1:
        raise Unavailable(f"--shard {shard}: FSDP2 runs one process per device (compare.py --processes = --devices)")
    if network.sync and device.type != "cuda":   # torch's SyncBatchNorm.forward refuses CPU tensors
        raise Unavailable("torch.nn.SyncBatchNorm expects its input on a GPU (or XPU, or a PrivateUse1 device)")
    module = build(weights, network)
    if network.sync:
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    module = module.to(device, memory_format=torch.contiguous_format)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if allreduce_dtype == "bf16" else None)
    for block in blocks(module):
        fully_shard(block, mesh=mesh, reshard_after_forward=shard == "parameters", mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=shard == "parameters", mp_policy=policy)
    scaler = grad_scaler(device.type, network.loss_scaling)   # torch.amp's takes DTensor gradients (train_step)
    if optimizer is None or optimizer.is_recipe:
        return Model(module, torch.optim.SGD(module.parameters(), lr=0.0), device, network.precision, scaler)
    return Model(module, get_trainer(module.parameters(), optimizer, state, param_names(module)), device,
                 network.precision, scaler)


def blocks(module):
    """The units FSDP2 gathers one at a time, before the root: the ResNet's residual blocks, the LeNet's layers."""
    if is_resnet(module):
        return [m for m in module.modules() if isinstance(m, resnet.Residual)]
    return [m for m in module.children() if list(m.parameters(recurse=False))]


def module_of(net):
    """The network itself: the module DDP or nn.DataParallel wraps; FSDP2's is the module."""
    return net if isinstance(net, FSDPModule) else net.module


def optimizer_of(model):
    """The torch optimizer: the Trainer's, or the recipe's SGD."""
    return model.trainer.optimizer if isinstance(model.trainer, Trainer) else model.trainer


def bf16_hook():
    """DDP's communication hook that puts bf16 on the wire: torch's own bf16_compress_hook under NCCL. DDP refuses
    that function by its name unless torch was built with CUDA and NCCL 2.10+ (DistributedDataParallel.
    _check_comm_hook), though gloo sums bf16 tensors on the CPU: there it is bf16_on_gloo, the same steps."""
    return bf16_compress_hook if dist.get_backend() == "nccl" else bf16_on_gloo


def bf16_on_gloo(process_group, bucket):
    """bf16_compress_hook (torch.distributed.algorithms.ddp_comm_hooks.default_hooks) as torch 2.13 writes it, under
    a name DDP accepts: the bucket's fp32 buffer cast to bf16 and divided by the world size there (DDP averages),
    all-reduced as bf16 (gloo's sum rounded to bf16), and widened back into the bucket's buffer, which DDP then
    copies into the parameters' .grad. Its branch for compiled autograd is left out: DDP here runs eagerly."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut):
        return buffer.copy_(fut.value()[0])   # in place, as torch's does (pytorch/pytorch#45968: peak memory)
    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def train_step(model, batch, lr, batch_size, accumulate=1):
    """PyTorch's AMP recipe under DDP: each process differentiates its summed loss times the GradScaler's scale
    (scaler.scale(loss).backward(): fp16's loss scaling, common/loss_scaling.py; a disabled scaler leaves the loss
    as it is), and DDP averages the gradients over the processes. The update takes them times world / global batch,
    the recipe's sum / global batch, even when the shards differ in size: the recipe's SGD by its rate, a Trainer
    in its step (Trainer.step: unscaled first, so that it clips the global batch's mean gradient, the same on every
    process). scaler.step skips the update where a gradient is not finite, on every process alike (the same
    all-reduced gradients), and scaler.update moves the scale. nn.DataParallel gathers the replicas' outputs on the
    first device, so the loss is the whole batch's, and its backward sums the replicas' gradients into the module's
    parameters: world is 1. The batch is this process's part, on its (first) device, from pipeline.py's DataLoader.
    A Trainer's scheduler sets the rate; the recipe's SGD takes the harness's `lr`.
    accumulate: the batch in that many micro-batches (common.sharding.micro_batches), each backward (of its loss
    times the same scale) adding into the parameters' .grad; DDP's no_sync keeps the first ones' backward from
    all-reducing, so the last one all-reduces the whole sum, once (without it every backward would); one unscale,
    step and scale update after them. The forward runs under torch.autocast at the network's precision
    (lenet.autocast): DDP all-reduces the fp32 gradients of the fp32 parameters either way (in bf16 on the wire
    with get_model's hook, which averages as DDP does, dividing before the sum: exact for a power-of-two world, the
    update is then lr / batch times the bf16 sum).
    Sharded (--shard): ZeroRedundancyOptimizer's step is the Trainer's or the scaler's optimizer.step(), the rest as
    DDP. FSDP2 reduce-scatters each block's gradients as its backward ends, averaged over the world as DDP does, and
    has no no_sync: set_requires_gradient_sync(False) keeps the first micro-batches' gradients whole and unreduced on
    each device, and the last backward reduce-scatters their sum. The GradScaler's unscale_ takes FSDP2's DTensor
    gradients: DTensor's handler of its non-finite check takes the max over the mesh, so every rank skips alike."""
    net, trainer, scaler = model.net, model.trainer, model.mixed
    X, y = batch
    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer.zero_grad()
    parts, loss = micro_batches(len(y), accumulate), 0.0
    for i, (start, stop) in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(net, FSDPModule):
            net.set_requires_gradient_sync(last)   # FSDP2's no_sync
        with contextlib.nullcontext() if last or not isinstance(net, DistributedDataParallel) else net.no_sync():
            with lenet.autocast(model.placement, model.precision):
                logits = net(X[start:stop])
            micro_loss = loss_sum(logits, y[start:stop])
            scaler.scale(micro_loss).backward()
        loss = loss + micro_loss.detach()
    if isinstance(trainer, Trainer):
        trainer.step(scaler, world / batch_size)
    else:
        for group in trainer.param_groups:
            group["lr"] = lr * world / batch_size
        scaler.step(trainer)
        scaler.update()
    return loss.item() / len(X)


def primitives_step(net, X, y, devices, lr, batch_size):
    """nn.DataParallel's step with its four primitives called by hand (GPU only: they refuse CPU devices), then the
    recipe's update; `net` is the plain module on devices[0]. scatter cuts the batch as torch.chunk does (10 rows over
    3 devices: 4, 4, 2, where split_and_load cuts 4, 3, 3: the same step, the loss being summed). replicate's copies
    are differentiable: backward sums their gradients into net's parameters, so there is no allreduce to call. The
    outputs are gathered on the first device, where the whole batch's loss is. Returns the mean loss."""
    ids = [d.index for d in devices]
    X_shards = nn.parallel.scatter(X, ids)
    replicas = nn.parallel.replicate(net, ids[:len(X_shards)])
    outputs = nn.parallel.parallel_apply(replicas, X_shards, devices=ids[:len(X_shards)])
    logits = nn.parallel.gather(outputs, ids[0])
    loss = loss_sum(logits, y.to(logits.device))
    params = list(net.parameters())
    sgd(params, torch.autograd.grad(loss, params), lr, batch_size)
    return loss.item() / len(X)


def to_numpy(model):
    """The canonical weights; under FSDP2 each parameter's shards all-gathered (DTensor.full_tensor(), in the
    parameters' order): a collective, which every rank calls."""
    module = module_of(model.net)
    if isinstance(model.net, FSDPModule):
        whole = [p.full_tensor() for p in module.parameters()]
        return resnet.to_numpy(whole) if is_resnet(module) else params_to_numpy(whole)
    if is_resnet(module):
        return resnet.model_to_numpy(module)[0]
    return params_to_numpy(list(module.parameters()))   # the module DDP or DataParallel wraps


def bn_state(model):
    """This rank's running statistics: FSDP2 leaves buffers as they are (plain tensors, each rank's own)."""
    module = module_of(model.net)
    if isinstance(model.net, FSDPModule):
        buffers = dict(module.named_buffers())
        return {name: np.array(buffers[name].cpu().numpy(), dtype=np.float32, order="C")
                for name in resnet.BN_STATE_NAMES}
    return resnet.model_to_numpy(module)[1]


def replica_bn_states(model):
    """This process's one replica (nn.DataParallel's replicas are made afresh each step from the module's)."""
    return [bn_state(model)]


def optimizer_state(model):
    """The canonical state, a collective when sharded, which every rank calls: ZeroRedundancyOptimizer's
    consolidate_state_dict(to=0) sends every rank's part to rank 0, whose state_dict() is then the whole one (None on
    the other ranks, which hold none of it); FSDP2's DTensor buffers all-gathered (full_tensor(), in the state's
    order), on every rank."""
    trainer = model.trainer
    if isinstance(trainer.optimizer, ZeroRedundancyOptimizer):
        trainer.optimizer.consolidate_state_dict(to=0)
        if dist.get_rank() != 0:
            return None
    saved = trainer.state_dict()
    if isinstance(model.net, FSDPModule):
        saved["optimizer"]["state"] = {
            i: {slot: t.full_tensor() if isinstance(t, DTensor) else t for slot, t in buffers.items()}
            for i, buffers in sorted(saved["optimizer"]["state"].items())}
    return canonical_state(saved, trainer.names)


def save_sharded(model, path, optimizer, replacing):
    """FSDP2's checkpoint at `path`, each rank writing its own shard (checkpoint.save_sharded: Distributed Checkpoint;
    the trainer holds the optimizer): `replacing()` gives rank 0 the temporary directory that becomes it."""
    save_checkpoint(model.net, model.trainer, replacing)


def local(t):
    """The part of a tensor this device holds: a DTensor's local shard, or the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model):
    """The optimizer state this process's device holds between steps: ZeroRedundancyOptimizer's local optimizer's
    (the whole parameters it owns), FSDP2's buffers' local shards; the step counts aside, as the scratch step's."""
    optimizer = optimizer_of(model)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    return sum(local(t).numel() * t.element_size() for buffers in optimizer.state.values()
               for slot, t in buffers.items() if slot != "step" and torch.is_tensor(t))


def parameter_bytes(model):
    """The parameters this process's device holds between steps: DDP's whole replica, FSDP2's local shards (its
    registered parameters after the backward, whatever reshard_after_forward)."""
    return sum(local(p).numel() * p.element_size() for p in module_of(model.net).parameters())


def evaluate(model, X, y):
    """Of this rank's rows. Under FSDP2 the weights are gathered once (to_numpy, a collective every rank calls: the
    harness's shared_accuracy has each rank evaluate its own rows) into a plain module, which evaluates them with
    this rank's BatchNorm statistics and no further collective: FSDP2's own forward all-gathers a block at a time,
    once a batch, and ranks with different numbers of batches would wait on each other."""
    module = module_of(model.net)
    if isinstance(model.net, FSDPModule):
        weights = to_numpy(model)
        if is_resnet(module):
            plain = resnet.build_model(weights, bn_state(model)).to(model.placement)
            return evaluate_idiomatic(Model(plain, None), X, y)
        return lenet.accuracy(lenet.get_params(weights, model.placement), X, y)
    if is_resnet(module):
        return evaluate_idiomatic(Model(module, None), X, y)
    return lenet.accuracy(list(module.parameters()), X, y)   # build_model's kernels: the default layout
