"""How the step runs: PyTorch executes eagerly, op by op, unless torch.compile traces the model into
fused kernels (a first step of seconds, then less Python overhead per step)."""
import torch

from common.interface import exec_level

from . import data_parallel, lenet

NAMES = {"eager": "eager", "graph": "torch.compile"}
# What each level puts in a compiled graph (the rest runs op by op): the table's "compiles" column
COMPILES = {"eager": "nothing", "torch.compile": "fwd+bwd"}   # AOTAutograd compiles the backward too
DEFAULT = "eager"


def use(level):
    """Switch the scratch step to `level` ('default', 'eager', 'graph' or 'xla'); returns its name here."""
    level = exec_level(level, NAMES, DEFAULT, "PyTorch")
    data_parallel.forward = torch.compile(lenet.forward) if level == "graph" else lenet.forward
    return NAMES[level]
