"""Data parallelism from scratch in PyTorch: split the batch, forward and backward on every device,
sum the gradients across devices, apply the same SGD update to every replica (or, with states, the same
update of optimizer.py)."""
import torch
import torch.distributed as dist

from common.buckets import plan
from common.sharding import shard_bounds

from . import optimizer
from .lenet import forward, loss_sum, to_layout


def split_and_load(array, devices):
    """torch.tensor copies: a shard never aliases the caller's numpy array, on the CPU as on a GPU. Images
    get the strides of the chosen memory layout (to_layout): PyTorch picks its convolution path from them."""
    return [to_layout(torch.tensor(array[a:b], device=d))
            for (a, b), d in zip(shard_bounds(len(array), len(devices)), devices)]


def allreduce(tensors):
    """Sum on the first tensor's device, then copy the sum back into every tensor, in place.
    In a multi-process run the local sum is also summed across processes by torch.distributed."""
    with torch.no_grad():
        for t in tensors[1:]:
            tensors[0] += t.to(tensors[0].device)
        if dist.is_initialized():
            dist.all_reduce(tensors[0])
        for t in tensors[1:]:
            t.copy_(tensors[0].to(t.device))
    return tensors


BUCKET_BYTES = None   # the run's --allreduce (common.buckets.bucket_bytes): None, one allreduce per parameter


def allreduce_gradients(grads, bucket_bytes=None):
    """Every parameter's gradient summed across devices, in place (grads[d]: device d's list): an allreduce per
    parameter, or per bucket of parameters (common/buckets.py), each device's gradients flattened into one buffer
    (torch.cat) and the sum copied back into them, as DistributedDataParallel does."""
    if bucket_bytes is None:
        for per_device in zip(*grads):     # one parameter's gradient on every device
            allreduce(list(per_device))
        return grads
    for bucket in plan([g.numel() for g in grads[0]], bucket_bytes):
        buffers = allreduce([torch.cat([device_grads[i].reshape(-1) for i in bucket]) for device_grads in grads])
        for device_grads, buffer in zip(grads, buffers):
            pieces = buffer.split([device_grads[i].numel() for i in bucket])
            for i, piece in zip(bucket, pieces):
                device_grads[i].copy_(piece.view(device_grads[i].shape))   # into its strides (channels-last too)
    return grads


def sgd(params, grads, lr, batch_size):
    """The recipe's update, lr / batch_size times the summed gradient, made in place (update)."""
    update(params, grads, lr / batch_size)


# The units of the step: execution.use replaces each name of UNITS (lenet.py's forward, imported above, too)
# with its compiled form at the chosen level, or with the function as written here. PyTorch compiles the
# forward (torch.compile; AOTAutograd compiles its backward).
def update(params, grads, scale):
    """The SGD update of one replica, in place."""
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(g, alpha=scale)


def loss_and_grads(params, X, y):
    """One device's part of the step: its shard's summed loss and the gradients."""
    loss = loss_sum(forward(params, X), y)
    return loss.detach(), torch.autograd.grad(loss, params)


def step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size, states=None, bucket_bytes=None):
    """The step on shards already on their devices: each device's loss and gradients, the gradients summed across
    devices (allreduce_gradients: per parameter, or by buckets of bucket_bytes), the same update on every replica (the
    recipe's sgd, or optimizer.apply with each replica's state). Returns each device's summed loss."""
    losses, grads = [], []
    for params, X_shard, y_shard in zip(replicas, X_shards, y_shards):
        loss, device_grads = loss_and_grads(params, X_shard, y_shard)
        losses.append(loss)
        grads.append(device_grads)
    allreduce_gradients(grads, bucket_bytes)
    if states is None:
        for params, device_grads in zip(replicas, grads):
            sgd(params, device_grads, lr, batch_size)
    else:
        for params, device_grads, state in zip(replicas, grads, states):
            optimizer.apply(params, device_grads, state, lr, batch_size)
    return losses


UNITS = {"forward": forward, "update": update, "loss_and_grads": loss_and_grads, "step_on_shards": step_on_shards}
# At import the units are what the default level makes them: eager, every one as written.


def train_step(replicas, X, y, devices, lr, batch_size=None, states=None):
    X_shards, y_shards = split_and_load(X, devices), split_and_load(y, devices)
    losses = step_on_shards(replicas, devices, X_shards, y_shards, lr, batch_size or len(X), states,
                            BUCKET_BYTES)
    return sum(loss.item() for loss in losses) / len(X)


def evaluate(params, X, y, batch_size=1000):
    device = params[0].device
    correct = 0
    with torch.no_grad():
        for i in range(0, len(X), batch_size):
            X_batch = to_layout(torch.from_numpy(X[i:i + batch_size]).to(device))
            correct += (forward(params, X_batch).argmax(1).cpu().numpy() == y[i:i + batch_size]).sum()
    return float(correct) / len(X)
