"""A Gluon program as a team leaving MXNet runs one: a ResNet with BatchNorm trained on 4 devices by a stock
gluon.Trainer, SGD with momentum 0.9, weight decay 5e-4 and a linear warm-up, saved with save_parameters and
save_states. The network is this repo's ResNet-18 (width 8); yours is your own (docs/migration.md, "Your own
network"). The 4 devices are CPU contexts here; on GPUs they are mx.gpu(i), nothing else changes.

    python docs/walkthrough/gluon_resnet.py walk

Trains 30 steps of 32 digits images (8 on each device), saves walk/resnet-epoch1.params and walk/resnet-epoch1.states,
trains 10 steps more and writes their losses to walk/mxnet-losses.txt: what a continuation elsewhere should give."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from harness.loader import load_module   # noqa: E402  this repo's network (and MXNet 1.9.1 on numpy >= 1.24)
from common import resnet   # noqa: E402
from common.data import load_dataset   # noqa: E402

gluon_resnet = load_module("mxnet", "resnet")
import mxnet as mx   # noqa: E402
from mxnet import autograd, gluon   # noqa: E402

STEPS, MORE, BATCH, WIDTH, WARMUP = 30, 10, 32, 8, 15
folder = sys.argv[1]
os.makedirs(folder, exist_ok=True)
devices = [mx.cpu(i) for i in range(4)]
net = gluon_resnet.build_model(resnet.init_weights(0, WIDTH), resnet.init_bn_state(WIDTH))
net.collect_params().reset_ctx(devices)
schedule = mx.lr_scheduler.FactorScheduler(step=STEPS + MORE, factor=1.0, base_lr=0.02, warmup_steps=WARMUP,
                                           warmup_begin_lr=0.0, warmup_mode="linear")
trainer = gluon.Trainer(net.collect_params(), "sgd",
                        {"learning_rate": 0.02, "momentum": 0.9, "wd": 5e-4, "lr_scheduler": schedule})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
data = load_dataset("digits")


def train(first, count):
    losses = []
    for i in range(first, first + count):
        X, y = (a[i * BATCH:(i + 1) * BATCH] for a in (data.X_train, data.y_train))
        Xs, ys = (gluon.utils.split_and_load(mx.nd.array(a), devices) for a in (X, y))
        with autograd.record():
            shards = [loss_fn(net(a), b) for a, b in zip(Xs, ys)]   # each device's BatchNorm sees its 8 images
        autograd.backward(shards)
        trainer.step(BATCH)
        losses.append(sum(float(loss.sum().asscalar()) for loss in shards) / BATCH)
    return losses


train(0, STEPS)
net.save_parameters(os.path.join(folder, "resnet-epoch1.params"))
trainer.save_states(os.path.join(folder, "resnet-epoch1.states"))
losses = train(STEPS, MORE)
np.savetxt(os.path.join(folder, "mxnet-losses.txt"), losses)
print("mxnet: " + " ".join(f"{loss:.4f}" for loss in losses))
