"""A user's multi-process JAX program, written as JAX's and Flax's guides write one: jax.distributed over 2
processes of one CPU device each, a mesh over both, the Flax NNX LeNet's parameters and its nnx.Optimizer's Optax
state placed with NamedSharding (each array cut along its last axis where 2 divides it) and kept so by the jitted step
(a sharding constraint on what it returns), the global batch cut by rows. Before step --save-at every process saves
the model's and the optimizer's state with Orbax (nnx.to_pure_dict, Flax's checkpointing guide), each writing the
shards it holds. The network's definition is the only thing of this project it imports (as a user's own module).

    python stock_sharded_jax_program.py --process 0|1 --coordinator 127.0.0.1:PORT --data batches.npz \
        --weights initial.npz --save-at 20 --folder DIR --losses losses.json --params '{"learning_rate": 0.005}'"""
import argparse
import json
import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main():
    parser = argparse.ArgumentParser()
    for option in ("--process", "--coordinator", "--data", "--weights", "--folder", "--losses", "--params"):
        parser.add_argument(option, required=True)
    parser.add_argument("--save-at", type=int, required=True)
    args = parser.parse_args()
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=2, process_id=int(args.process))
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from harness.loader import load_module
    build_model = load_module("jax", "lenet").build_model   # the user's own network module

    mesh = Mesh(np.array(jax.devices()), ("data",))

    def sharding(a):
        return NamedSharding(mesh, P(*[None] * (a.ndim - 1), "data") if a.ndim and a.shape[-1] % 2 == 0 else P())

    def place(tree):   # every process holds the same values: each puts its own shards
        return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding(a), lambda i: np.asarray(a)[i]),
                            tree)

    model = build_model(dict(np.load(args.weights)))
    optimizer = nnx.Optimizer(model, optax.sgd(**json.loads(args.params)), wrt=nnx.Param)
    nnx.update(model, place(nnx.state(model)))
    nnx.update(optimizer, place(nnx.state(optimizer)))
    shardings = (jax.tree.map(sharding, nnx.state(model)), jax.tree.map(sharding, nnx.state(optimizer)))

    @nnx.jit
    def train_step(model, optimizer, X, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(X), y).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        nnx.update(model, jax.lax.with_sharding_constraint(nnx.state(model), shardings[0]))
        nnx.update(optimizer, jax.lax.with_sharding_constraint(nnx.state(optimizer), shardings[1]))
        return loss

    data, rows = np.load(args.data), NamedSharding(mesh, P("data"))
    losses = []
    for step, (X, y) in enumerate(zip(data["X"], data["y"])):
        if step == args.save_at:
            with ocp.StandardCheckpointer() as checkpointer:
                for saved, name in ((model, "lenet-epoch1.orbax"), (optimizer, "lenet-epoch1.optimizer.orbax")):
                    checkpointer.save(os.path.join(os.path.abspath(args.folder), name),
                                      nnx.to_pure_dict(nnx.state(saved)))
        X, y = (jax.make_array_from_callback(a.shape, rows, lambda i, a=a: a[i]) for a in (X, y.astype(np.int32)))
        losses.append(float(train_step(model, optimizer, X, y)))
    sharded = [a.sharding.is_fully_replicated for a in jax.tree.leaves(nnx.state(optimizer)) if a.ndim]
    if jax.process_index() == 0:
        with open(args.losses, "w") as f:
            json.dump({"losses": losses, "replicated": sum(sharded), "sharded": len(sharded) - sum(sharded)}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
