"""The recipe with BatchNorm (each framework's one train_step, handed the ResNet), in one process: with local BatchNorm each replica
normalises by its own shard and its running statistics follow that shard (the spec's forward on the shard), and the
update is the sum of the shards' own gradients; with synchronised BatchNorm, N devices are one device holding the
whole batch, uneven shards included. A tiny width and batch keep it small; the several-device steps are in the slow tier."""
import numpy as np
import pytest

from common import resnet as spec
from common.sharding import shard_bounds
from conftest import framework_or_skip, scratch, train_steps

WIDTH, BATCH, LR = 8, 7, 0.5   # 7 rows: 4 + 3 on 2 devices, 3 + 2 + 2 on 3, 2 + 2 + 2 + 1 on 4
TOL = 2e-4


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(1)
    weights = spec.init_weights(1, WIDTH)
    state = {name: (rng.normal(0, 0.3, shape) if name.endswith("mean") else rng.uniform(0.5, 2.0, shape))
             .astype(np.float32) for name, shape in spec.bn_state_shapes(WIDTH).items()}
    X = rng.normal(0, 1, (BATCH, *spec.IMAGE_SHAPE)).astype(np.float32)
    y = rng.integers(0, spec.NUM_CLASSES, BATCH)
    return weights, state, X, y


def step(name, case, devices, sync, rows=None, batch_size=None):
    """One train_step on `devices` devices (of the rows `rows`, default all): (mean loss, every replica's weights,
    every replica's BatchNorm state), canonical numpy."""
    fw = framework_or_skip(name)
    model, _ = scratch(name, "resnet", sync=sync)
    weights, state, X, y = case
    X, y = (X, y) if rows is None else (X[rows], y[rows])
    found = fw.get_devices(devices)
    replicas = [model.get_params(weights, d) for d in found]
    bn_states = [model.get_bn_state(state, d) for d in found]
    loss = train_steps(fw, replicas, X, y, found, LR, batch_size or len(X), bn_states=bn_states, network="resnet",
                       sync=sync)
    return (loss, [model.to_numpy(r) for r in replicas], [model.bn_state_to_numpy(s) for s in bn_states])


@pytest.fixture(scope="module")
def stepped(case):
    """step() of the module's case, each distinct (framework, devices, BatchNorm, rows, batch size) taken once: the
    one device's whole-batch step is three tests' reference, the local step on 2 devices two tests'. Read-only."""
    done = {}

    def get(name, devices, sync, rows=None, batch_size=None):
        key = name, devices, sync, None if rows is None else (rows.start, rows.stop), batch_size
        if key not in done:
            done[key] = step(name, case, devices, sync, rows, batch_size)
        return done[key]
    return get


def assert_close(got, want, tol=TOL, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))) if got.size else 0.0
    assert err <= tol, f"{what}: off by {err:.2e} (tolerance {tol:.0e})"


def assert_dicts_close(got, want, tol=TOL, what=""):
    assert list(got) == list(want)
    for key in want:
        assert_close(got[key], want[key], tol, f"{what} {key}")


def spec_on(case, rows):
    """The spec's training-mode forward on some rows: (summed loss, new BatchNorm state)."""
    weights, state, X, y = case
    logits, new_state = spec.forward(weights, state, X[rows], training=True)
    return spec.loss_sum(logits, y[rows]), new_state


@pytest.mark.parametrize("name", ("pytorch", "mxnet", "tensorflow", "jax"))
def test_one_device_is_the_spec_forward(name, case, stepped):
    loss, _, (bn_state,) = stepped(name, 1, sync=False)
    want_loss, want_state = spec_on(case, slice(None))
    assert_close(loss, want_loss / BATCH, what="loss")
    assert_dicts_close(bn_state, want_state, what="running statistics")


@pytest.mark.slow
@pytest.mark.parametrize("devices", (2, 3))
@pytest.mark.parametrize("name", ("pytorch", "mxnet", "tensorflow", "jax"))
def test_local_batchnorm_follows_each_shard(name, case, devices, stepped):
    """Replica i's running statistics are the spec's on shard i alone; the loss is the shards' summed; the new
    weights are the old ones moved by every shard's own gradient (each computed on one device with the global
    batch size), and equal on every replica."""
    loss, replicas, bn_states = stepped(name, devices, sync=False)
    shards = [slice(a, b) for a, b in shard_bounds(BATCH, devices)]
    assert_close(loss, sum(spec_on(case, rows)[0] for rows in shards) / BATCH, what="loss")
    for i, rows in enumerate(shards):
        assert_dicts_close(bn_states[i], spec_on(case, rows)[1], what=f"replica {i}'s running statistics")
    weights = case[0]
    moved = {k: w.astype(np.float64) for k, w in weights.items()}
    for rows in shards:
        _, (alone,), _ = stepped(name, 1, sync=False, rows=rows, batch_size=BATCH)
        for k in moved:
            moved[k] += alone[k] - weights[k]
    for i, replica in enumerate(replicas):
        assert_dicts_close(replica, moved, what=f"replica {i}")


@pytest.mark.slow
@pytest.mark.parametrize("devices", (2, 4))   # 4: shards of 2, 2, 2 and 1 row (3 devices: the local test's)
@pytest.mark.parametrize("name", ("pytorch", "mxnet", "tensorflow", "jax"))
def test_sync_batchnorm_on_n_devices_is_one_device(name, devices, stepped):
    """The reference is one device's step with the plain (local) BatchNorm: the batch's own statistics, differentiated
    by the framework, not the all-reduce path under test (which a slip such as statistics cut off from the gradient
    would make wrong on 1 device too). And the two are not one computation under two names: on several devices the
    local step's weights differ from it."""
    one_loss, (one,), (one_state,) = stepped(name, 1, sync=False)
    loss, replicas, bn_states = stepped(name, devices, sync=True)
    assert_close(loss, one_loss, what="loss")
    for i, (replica, bn_state) in enumerate(zip(replicas, bn_states)):
        assert_dicts_close(replica, one, what=f"replica {i}")
        assert_dicts_close(bn_state, one_state, what=f"replica {i}'s running statistics")
    if devices == 2:
        _, (local, _), _ = stepped(name, 2, sync=False)
        assert max(np.max(np.abs(local[k] - replicas[0][k])) for k in local) > 10 * TOL


@pytest.mark.parametrize("name", ("pytorch", "mxnet", "tensorflow", "jax"))
def test_evaluate_uses_the_running_statistics(name, case):
    fw = framework_or_skip(name)
    model, _ = scratch(name, "resnet")
    weights, state, X, y = case
    (device,) = fw.get_devices(1)
    want = spec.forward(weights, state, X, training=False).argmax(1)
    replica, bn_state = model.get_params(weights, device), model.get_bn_state(state, device)
    assert fw.evaluate(model, replica, bn_state, X, want) == 1.0
    assert fw.evaluate(model, replica, bn_state, X, (want + 1) % spec.NUM_CLASSES) == 0.0
