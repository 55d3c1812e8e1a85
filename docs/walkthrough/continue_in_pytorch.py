"""The Gluon run of gluon_resnet.py, converted (python -m harness.training.convert), continued by stock PyTorch code:
the model loaded with load_state_dict, a torch.optim.SGD with the converted state, 10 steps on the same batches.
As DistributedDataParallel on 4 GPUs would, each quarter of the batch goes through the BatchNorm alone (DDP without
SyncBatchNorm normalises each GPU's shard by its own statistics, as Gluon's contexts did); here in one process.

    python docs/walkthrough/continue_in_pytorch.py walk

Prints the 10 losses and their largest relative difference to MXNet's own continuation; exits 1 above TOLERANCE."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from harness.loader import load_module   # noqa: E402  this repo's network
from common import resnet   # noqa: E402
from common.data import load_dataset   # noqa: E402

torch_resnet = load_module("pytorch", "resnet")
import torch   # noqa: E402
import torch.nn.functional as F   # noqa: E402

STEPS, MORE, BATCH, WIDTH, DEVICES = 30, 10, 32, 8, 4
TOLERANCE = 1e-2   # MXNet's BatchNorm backward rounds the most (one step: 3e-3, tests/test_resnet_modes.py); 10 steps
folder = sys.argv[1]
model = torch_resnet.build_model(resnet.init_weights(1, WIDTH), resnet.init_bn_state(WIDTH))   # any weights
model.load_state_dict(torch.load(os.path.join(folder, "resnet-epoch1.pt")))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
optimizer.load_state_dict(torch.load(os.path.join(folder, "resnet-epoch1.optimizer.pt"))["optimizer"])
data = load_dataset("digits")
model.train()
losses = []
for i in range(STEPS, STEPS + MORE):
    X, y = (torch.from_numpy(a[i * BATCH:(i + 1) * BATCH]) for a in (data.X_train, data.y_train))
    loss = sum(F.cross_entropy(model(a), b.long(), reduction="sum") for a, b in
               zip(X.chunk(DEVICES), y.chunk(DEVICES))) / BATCH
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
mxnet = np.loadtxt(os.path.join(folder, "mxnet-losses.txt"))
difference = float(np.max(np.abs(np.array(losses) - mxnet) / np.abs(mxnet)))
print("pytorch: " + " ".join(f"{loss:.4f}" for loss in losses))
print(f"largest relative difference to MXNet's continuation: {difference:.1e}")
sys.exit(0 if difference <= TOLERANCE else 1)
