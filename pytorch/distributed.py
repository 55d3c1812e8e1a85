"""PyTorch across processes: torch.distributed. A worker joins from the variables that torchrun sets
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); compare.py sets the same ones."""
import datetime
import os

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("ROSETTA_COLLECTIVE_TIMEOUT", "300")))


def init_process():
    """Join the process group; gloo on the CPU, nccl on GPUs. Returns (rank, world size)."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()
