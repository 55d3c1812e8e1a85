"""PyTorch across processes: torch.distributed. A worker joins from the variables that torchrun sets
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); compare.py sets the same ones."""
import datetime
import os

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("ROSETTA_COLLECTIVE_TIMEOUT", "300")))


def backend(gpus):
    return "nccl" if gpus else "gloo"


def init_process(gpus):
    """Join the process group: gloo on the CPU; on GPUs nccl, bound first to this process's own GPU
    (`gpus`, its GPUs' indices, from common.placement). torch.distributed makes that the user's job:
    without it, whatever uses the current device (NCCL's setup, barriers) uses GPU 0 in every process.
    device_id also starts the communicator now, so a broken GPU setup fails here. Returns (rank, world
    size)."""
    device = torch.device("cuda", gpus[0]) if gpus else None
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend(gpus), timeout=TIMEOUT, device_id=device)
    return dist.get_rank(), dist.get_world_size()


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()


def reduce_scatter(x):
    """This process's chunk (its rank's, of `processes` equal ones) of the sum of every process's flat x: the
    process group's own reduce-scatter, each process receiving only its chunk's sum (half an all-reduce's traffic).
    reduce_scatter_single is torch 2.13's name for reduce_scatter_tensor; gloo runs it, bf16 too."""
    chunk = x.new_empty(x.numel() // dist.get_world_size())
    dist.reduce_scatter_single(chunk, x)
    return chunk


def all_gather(x):
    """Every process's chunk x, concatenated in rank order, on every process: the inverse of reduce_scatter's cut
    (all_gather_single, torch 2.13's name for all_gather_into_tensor)."""
    whole = x.new_empty(x.numel() * dist.get_world_size())
    dist.all_gather_single(whole, x)
    return whole


def sum_count(n):
    """The integer n summed over every process (the test split's correct counts), by the process group's all-reduce:
    on this process's GPU under nccl, which takes no CPU tensor."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    total = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())
