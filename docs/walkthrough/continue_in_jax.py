"""The Gluon run of gluon_resnet.py, converted (python -m harness.training.convert), continued by stock Flax and Optax
code: the model and an nnx.Optimizer restored as Flax's checkpointing guide restores them (Orbax, into their own
state's structure), 10 steps on the same batches, each quarter of the batch through the BatchNorm alone as on
Gluon's 4 contexts. Optax's sgd keeps the rate outside the momentum buffer, like PyTorch; the warm-up is
optax.linear_schedule's (from 0, as Gluon's), past by now: a schedule, not a number, because the file's state has the
schedule's count (docs/migration.md, "Continuing in stock Optax").

    python docs/walkthrough/continue_in_jax.py walk

Prints the 10 losses and their largest relative difference to MXNet's own continuation; exits 1 above TOLERANCE."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from harness.loader import load_module   # noqa: E402  this repo's network
from common import resnet   # noqa: E402
from common.data import load_dataset   # noqa: E402

flax_resnet = load_module("jax", "resnet")
import jax.numpy as jnp   # noqa: E402
import optax   # noqa: E402
import orbax.checkpoint as ocp   # noqa: E402
from flax import nnx   # noqa: E402

STEPS, MORE, BATCH, WIDTH, DEVICES, WARMUP = 30, 10, 32, 8, 4, 15
TOLERANCE = 1e-2   # MXNet's BatchNorm backward rounds the most (one step: 3e-3, tests/test_resnet_modes.py); 10 steps
folder = os.path.abspath(sys.argv[1])   # Orbax takes absolute paths
model = flax_resnet.build_model(resnet.init_weights(1, WIDTH), resnet.init_bn_state(WIDTH))   # any weights
rate = optax.linear_schedule(0.0, 0.02, WARMUP)
optimizer = nnx.Optimizer(model, optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(rate, momentum=0.9)),
                          wrt=nnx.Param)
with ocp.StandardCheckpointer() as checkpointer:
    for saved, name in ((model, "resnet-epoch1.orbax"), (optimizer, "resnet-epoch1.optimizer.orbax")):
        state = nnx.state(saved)
        nnx.replace_by_pure_dict(state, checkpointer.restore(os.path.join(folder, name), nnx.to_pure_dict(state)))
        nnx.update(saved, state)


def loss_fn(model, X, y):
    return sum(optax.softmax_cross_entropy_with_integer_labels(model(a), b).sum()
               for a, b in zip(jnp.split(X, DEVICES), jnp.split(y, DEVICES))) / BATCH


@nnx.jit
def train_step(model, optimizer, X, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, X, y)
    optimizer.update(model, grads)
    return loss


data = load_dataset("digits")
model.train()
losses = []
for i in range(STEPS, STEPS + MORE):
    X, y = (jnp.asarray(a[i * BATCH:(i + 1) * BATCH]) for a in (data.X_train, data.y_train))
    losses.append(float(train_step(model, optimizer, X, y.astype(jnp.int32))))
mxnet = np.loadtxt(os.path.join(folder, "mxnet-losses.txt"))
difference = float(np.max(np.abs(np.array(losses) - mxnet) / np.abs(mxnet)))
print("jax: " + " ".join(f"{loss:.4f}" for loss in losses))
print(f"largest relative difference to MXNet's continuation: {difference:.1e}")
sys.exit(0 if difference <= TOLERANCE else 1)
