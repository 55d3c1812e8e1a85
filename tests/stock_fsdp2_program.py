"""A user's FSDP2 program, written as PyTorch's FSDP2 tutorial and its "Getting Started with Distributed Checkpoint"
recipe write one, launched by torchrun: its own LeNet (layers named conv1 ... fc2), fully_shard on each layer and on
the model, a stock torch.optim optimizer, each rank training on its half of every batch, and a DCP checkpoint saved
through a Stateful app (get_state_dict) before step --save-at. It imports nothing of this project.

    torchrun --nproc-per-node 2 stock_fsdp2_program.py --data batches.npz --weights initial.npz --save-at 20 \
        --checkpoint DIR --losses losses.json --optimizer SGD --params '{"lr": 0.005, "momentum": 0.9}'

With --load, it loads the checkpoint instead (set_state_dict) and trains from it on every batch of --data."""
import argparse
import json
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard


class AppState(Stateful):
    """The recipe's wrapper: dcp.save and dcp.load call its state_dict and load_state_dict."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def lenet(weights):
    model = nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(1, 20, 3), relu1=nn.ReLU(), pool1=nn.AvgPool2d(2),
        conv2=nn.Conv2d(20, 50, 5), relu2=nn.ReLU(), pool2=nn.AvgPool2d(2),
        flatten=nn.Flatten(), fc1=nn.Linear(800, 128), relu3=nn.ReLU(), fc2=nn.Linear(128, 10)))
    model.load_state_dict({name: torch.from_numpy(value) for name, value in weights.items()})
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--losses", required=True)
    parser.add_argument("--optimizer", default="SGD")
    parser.add_argument("--params", default="{}")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = np.load(args.data)
    model = lenet(dict(np.load(args.weights)))
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer)
    fully_shard(model)
    optimizer = getattr(torch.optim, args.optimizer)(model.parameters(), **json.loads(args.params))
    if args.load:
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=args.checkpoint)
    losses = []
    for step, (X, y) in enumerate(zip(data["X"], data["y"])):
        if step == args.save_at:
            dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=args.checkpoint)
        half = len(X) // world
        X, y = torch.from_numpy(X[rank * half:(rank + 1) * half]), torch.from_numpy(y[rank * half:(rank + 1) * half])
        loss = F.cross_entropy(model(X), y.long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
