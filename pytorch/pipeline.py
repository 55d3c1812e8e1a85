"""PyTorch's input pipeline: a Dataset, a DataLoader and a sampler that hands each process its part of
every batch. The stock DistributedSampler would give process r the rows r, r + world, r + 2 world, ... of its
own shuffle; the recipe wants the shared order (common.batches) and contiguous parts, so the sampler here is a
batch sampler over that order, with DistributedSampler's set_epoch. No worker processes (num_workers=0): the
data is in memory and the cores are busy training; with files to decode, num_workers > 0 would overlap it."""
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from common.batches import ProcessBatches

from .lenet import to_layout


class SharedOrderSampler(ProcessBatches, Sampler):
    """This process's rows of every global batch of the epoch, one list per step: what
    DistributedSampler(num_replicas=world, rank=rank) + BatchSampler give, in the shared order."""


def make_loader(data, order, rank, world, model, devices):
    """The loader feeds the process's first device: DistributedDataParallel's only one, or the one nn.DataParallel
    scatters the batch from."""
    dataset = TensorDataset(torch.from_numpy(data.X_train), torch.from_numpy(data.y_train))
    loader = DataLoader(dataset, batch_sampler=SharedOrderSampler(order, rank, world),
                        pin_memory=devices[0].type == "cuda")   # page-locked: the copy below can overlap
    return loader, devices[0]


def batches(loader, epoch):
    loader, device = loader
    loader.batch_sampler.set_epoch(epoch)
    for X, y in loader:
        yield to_layout(X.to(device, non_blocking=True)), y.to(device, non_blocking=True)   # the model's layout


def per_device(batch):
    """What each of this process's devices holds of a batch, as numpy (X, y): for tests and readers. (Under
    nn.DataParallel the first device holds the whole batch, which the forward scatters.)"""
    X, y = batch
    return [(X.cpu().numpy(), y.cpu().numpy())]
