"""`--allreduce bucketed`: the plan (common/buckets.py), and in every framework the bucketed sum of the gradients is
the per-tensor sum, element for element, in allreduce_gradients and in a whole step of the LeNet and the ResNet."""
import numpy as np
import pytest

from common import FRAMEWORKS
from common import resnet as resnet_spec
from common.buckets import BUCKET_MB, bucket_bytes, plan
from common.lenet import PARAM_SHAPES, init_weights
from conftest import framework_or_skip, replicas_of, scratch, train_steps, weights_of
from harness.loader import load_module

SMALL = 4096   # bytes: the LeNet's 8 gradients in 5 buckets, its dense weights (48,000 bytes) each alone in one


def test_the_plan_fills_buckets_in_order_up_to_the_cap():
    assert plan([10, 10, 300, 5, 5], cap_bytes=100) == [[0, 1], [2], [3, 4]]   # 300 floats pass the cap: alone
    assert plan([25, 25], cap_bytes=100) == [[0], [1]]                          # exactly full
    assert plan([24, 1], cap_bytes=100) == [[0, 1]]
    assert plan([], cap_bytes=100) == []


def test_the_default_cap_is_ddp_s_and_holds_each_model_in_few_buckets():
    assert bucket_bytes("per-tensor") is None and bucket_bytes("bucketed") == 25 * 2**20 == BUCKET_MB * 2**20
    lenet = [int(np.prod(s)) for s in PARAM_SHAPES.values()]
    assert plan(lenet, bucket_bytes("bucketed")) == [list(range(8))]   # one collective a step instead of 8
    d2l = [w.size for w in resnet_spec.init_weights(0, 64).values()]  # d2l's width: 42.6 MiB of gradients
    first, second = plan(d2l, bucket_bytes("bucketed"))   # 2 collectives instead of 76
    assert first + second == list(range(76))
    assert 4 * sum(d2l[i] for i in first) <= 25 * 2**20 < 4 * sum(d2l[i] for i in first + second[:1])
    assert sorted(i for b in plan(lenet, SMALL) for i in b) == list(range(8)) and len(plan(lenet, SMALL)) == 5
    with pytest.raises(ValueError, match="unknown all-reduce 'ring'"):
        bucket_bytes("ring")


def plain(name, t):
    """A framework's tensor as numpy, in its own layout (the comparisons are within one framework)."""
    if name == "pytorch":
        return t.detach().cpu().numpy()
    if name == "mxnet":
        return t.asnumpy()
    return np.asarray(t)


def gradients(name, devices, seed):
    """One list of LeNet-shaped random 'gradients' per device, as the framework's step holds them."""
    fw = framework_or_skip(name)
    grads = []
    for i, d in enumerate(fw.get_devices(devices)):
        (replica,) = replicas_of(fw, init_weights(seed + i), [d])
        if name == "pytorch":
            grads.append([p.detach().clone() for p in replica])
        elif name == "tensorflow":
            import tensorflow as tf
            grads.append([tf.identity(p) for p in replica])
        elif name == "mxnet":
            grads.append([p.copy() for p in replica])
        else:
            grads.append(list(replica))
    return grads


@pytest.mark.parametrize("devices", (1, 3))
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_the_bucketed_sum_is_the_per_tensor_sum(name, devices):
    dp = load_module(name, "data_parallel") if framework_or_skip(name) else None
    want = [[plain(name, g) for g in device_grads] for device_grads in
            dp.allreduce_gradients(gradients(name, devices, 1))]
    inputs = gradients(name, devices, 1)
    total = [sum(plain(name, device_grads[i]) for device_grads in inputs) for i in range(len(inputs[0]))]
    got = dp.allreduce_gradients(inputs, SMALL)
    for d in range(devices):
        for i, g in enumerate(got[d]):
            assert g.shape == want[d][i].shape
            np.testing.assert_array_equal(plain(name, g), want[d][i], err_msg=f"device {d}, parameter {i}")
            np.testing.assert_allclose(want[d][i], total[i], rtol=1e-6, err_msg=f"device {d}, parameter {i}")


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_bucketed_lenet_step_is_the_per_tensor_step(name, digits):
    fw = framework_or_skip(name)
    devices = fw.get_devices(2)
    X, y = digits.X_train[:97], digits.y_train[:97]
    results = []
    for cap in (None, SMALL, bucket_bytes("bucketed")):
        replicas = replicas_of(fw, init_weights(3), devices)
        loss = train_steps(fw, replicas, X, y, devices, 0.2, bucket_bytes=cap)
        results.append((loss, [weights_of(fw, r) for r in replicas]))
    (want_loss, want), *others = results
    for loss, replicas in others:
        assert loss == want_loss
        for replica in replicas:
            for key in want[0]:
                np.testing.assert_array_equal(replica[key], want[0][key], err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_bucketed_resnet_step_is_the_per_tensor_step(name):
    """Width 8 and 7 images (shards of 4 and 3), as tests/test_resnet_training.py's: JAX compiles each shard's step
    per shape, and these are compiled already when the suite runs both."""
    fw = framework_or_skip(name)
    devices = fw.get_devices(2)
    rng = np.random.default_rng(0)
    X = rng.normal(0, 1, (7, *resnet_spec.IMAGE_SHAPE)).astype(np.float32)
    y = rng.integers(0, resnet_spec.NUM_CLASSES, 7)
    results = []
    for cap in (None, SMALL):
        model, _ = scratch(name, "resnet")
        replicas = [model.get_params(resnet_spec.init_weights(0, 8), d) for d in devices]
        bn_states = [model.get_bn_state(resnet_spec.init_bn_state(8), d) for d in devices]
        train_steps(fw, replicas, X, y, devices, 0.1, bn_states=bn_states, network="resnet", bucket_bytes=cap)
        results.append([model.to_numpy(r) for r in replicas])
    want, got = results
    for replica in got:
        for key in want[0]:
            np.testing.assert_array_equal(replica[key], want[0][key], err_msg=key)


def test_the_option_is_a_row_of_the_scratch_mode_and_a_column_of_the_table():
    import compare
    from harness.run.plan import row_label, run_specs
    from harness.publishing.tables import format_table
    rows = list(run_specs(compare.parse_args(["--frameworks", "pytorch,jax", "--mode", "scratch,builtin",
                                              "--allreduce", "per-tensor,bucketed"])))
    reasons = {(s.framework, s.mode, s.allreduce): reason for s, reason in rows}
    assert len(reasons) == 8 and [key for key, reason in reasons.items() if reason] == [("pytorch", "builtin", "bucketed")]
    assert reasons["pytorch", "builtin", "bucketed"] == ("--allreduce is the scratch step's; builtin sums the "
                                                         "gradients its framework's own way")   # DDP's buckets
    rows = [(s, reason) for s, reason in rows if s.framework == "jax"]   # JAX's built-in psum is written by hand
    assert row_label(rows[1][0]) == "jax scratch (default, bucketed), 2 device(s), 1 process(es)"
    run = {"framework": "jax", "mode": "scratch", "devices": 2, "processes": 1, "epochs": 1, "status": "ok"}
    assert "all-reduce" not in format_table([{**run, "allreduce": "per-tensor"}])
    table = format_table([{**run, "allreduce": "per-tensor"}, {**run, "allreduce": "bucketed"},
                          {**run, "mode": "builtin", "allreduce": "per-tensor"},
                          {**run, "mode": "builtin", "allreduce": "bucketed"}]).splitlines()   # JAX's psum: bucketed
    assert [line.split("|")[5].strip() for line in table] == ["all-reduce", "-" * 12, "per-tensor", "bucketed", "-",
                                                              "bucketed"]
