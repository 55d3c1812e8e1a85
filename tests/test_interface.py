"""The contract, checked the same way for every framework that is implemented."""
import os

import numpy as np
import pytest

from common import CONTRACT, RosettaError
from common.interface import FUNCTIONAL, MODELS
from common.lenet import PARAM_NAMES, PARAM_SHAPES, init_weights
from conftest import replicas_of, scratch, train_steps, weights_of
from harness.training.loop import Scratch


def as_numpy(t):
    for attr in ("detach", "asnumpy", "numpy"):
        if hasattr(t, attr):
            t = getattr(t, attr)()
            if isinstance(t, np.ndarray):
                return t
    return np.asarray(t.cpu().numpy() if hasattr(t, "cpu") else t)


def placement(t):
    """Where a tensor lives, in the framework's own words."""
    for attr in ("context", "ctx", "device"):
        if hasattr(t, attr):
            return str(getattr(t, attr))
    raise AssertionError(f"cannot tell where {type(t)} lives")


def test_contract_is_complete(fw):
    assert all(callable(getattr(fw, name)) for name in CONTRACT)


@pytest.mark.parametrize("model", MODELS)
def test_every_model_file_meets_its_contract(fw, model):
    """lenet.py and resnet.py (common.interface.MODELS) each define the Functional the one scratch step trains, with
    every member of FUNCTIONAL; the ResNet's no step of its own."""
    from harness.loader import load_module
    module = load_module(fw.name, model)
    functional = module.Functional()
    assert [name for name in FUNCTIONAL if not hasattr(functional, name)] == []
    assert functional.name == {"lenet": "lenet", "resnet": "resnet18"}[model]
    assert not hasattr(module, "train_step")
    assert hash(functional) == hash(module.Functional())   # a static argument of a compiled step


def test_get_devices(fw):
    assert len(fw.get_devices()) == 1
    assert len(fw.get_devices(3)) == 3
    for bad in (0, -1):
        with pytest.raises(RosettaError):
            fw.get_devices(bad)
    info = fw.device_info(fw.get_devices(2))
    assert [d["index"] for d in info] == [0, 1] and all({"name", "type", "memory_bytes"} <= set(d) for d in info)


@pytest.mark.parametrize("n,k", [(10, 3), (10, 4), (7, 2), (4, 4), (9, 1)])
def test_split_and_load_sizes_values_and_placement(fw, n, k):
    devices = fw.get_devices(k)
    array = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)
    shards = fw.split_and_load(array, devices)
    assert len(shards) == k
    assert [as_numpy(s).shape[0] for s in shards] == [len(a) for a in np.array_split(array, k)]
    np.testing.assert_array_equal(np.concatenate([as_numpy(s) for s in shards]), array)
    for s, d in zip(shards, devices):
        assert placement(s) == placement(fw.split_and_load(array[:1], [d])[0])
    labels = np.arange(n, dtype=np.int64)
    np.testing.assert_array_equal(np.concatenate([as_numpy(s) for s in fw.split_and_load(labels, devices)]), labels)


def test_split_and_load_needs_a_row_per_device(fw):
    with pytest.raises(RosettaError, match="cannot split 2 rows across 3 devices"):
        fw.split_and_load(np.zeros((2, 4), np.float32), fw.get_devices(3))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_allreduce_sums_exactly_onto_every_device(fw, k):
    devices = fw.get_devices(k)
    rng = np.random.default_rng(k)
    values = [rng.integers(-100, 100, (3, 5)).astype(np.float32) for _ in range(k)]
    tensors = [fw.split_and_load(v, [d])[0] for v, d in zip(values, devices)]
    reduced = fw.allreduce(tensors)
    assert len(reduced) == k
    for t, d in zip(reduced, devices):
        np.testing.assert_array_equal(as_numpy(t), np.sum(values, axis=0))
        assert placement(t) == placement(fw.split_and_load(values[0], [d])[0])


def test_get_params_and_to_numpy_round_trip(fw):
    weights = init_weights(3)
    back = weights_of(fw, replicas_of(fw, weights, fw.get_devices(1))[0])
    assert list(back) == list(PARAM_NAMES)
    for name in PARAM_NAMES:
        assert back[name].shape == PARAM_SHAPES[name] and back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], weights[name])


def run_steps(fw, n_devices, data, steps, batch=64, lr=0.1, seed=0):
    devices = fw.get_devices(n_devices)
    replicas = replicas_of(fw, init_weights(seed), devices)
    losses = []
    for s in range(steps):
        idx = slice(s * batch, (s + 1) * batch)
        losses.append(train_steps(fw, replicas, data.X_train[idx], data.y_train[idx], devices, lr))
    return losses, replicas


@pytest.mark.parametrize("n_devices", [2, 3])
def test_train_step_on_several_devices_equals_one_device(fw, digits, n_devices):
    (loss_1,), (one,) = run_steps(fw, 1, digits, 1, batch=61)
    (loss_n,), many = run_steps(fw, n_devices, digits, 1, batch=61)   # uneven shards
    assert isinstance(loss_n, float)
    assert loss_n == pytest.approx(loss_1, abs=1e-5)
    expected = weights_of(fw, one)
    for replica in many:
        for name, value in weights_of(fw, replica).items():
            np.testing.assert_allclose(value, expected[name], atol=1e-5)
    assert not np.allclose(expected["fc2.weight"], init_weights(0)["fc2.weight"])   # the step did update


def test_replicas_stay_identical_and_the_loss_falls(fw, digits):
    losses, replicas = run_steps(fw, 4, digits, 12, batch=100, lr=0.2)
    runner = Scratch(fw, None)
    runner.replicas = replicas
    assert runner.spread() == 0.0
    assert np.mean(losses[-3:]) < 0.8 * losses[0]


def test_evaluate_counts_correct_predictions(fw, digits):
    (replica,) = replicas_of(fw, init_weights(0), fw.get_devices(1))
    X, y = digits.X_test[:50], digits.y_test[:50]
    import torch
    import torch.nn.functional as F
    w = {k: torch.from_numpy(v) for k, v in init_weights(0).items()}   # an independent reference forward
    h = F.avg_pool2d(F.relu(F.conv2d(torch.from_numpy(X), w["conv1.weight"], w["conv1.bias"])), 2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, w["conv2.weight"], w["conv2.bias"])), 2).flatten(1)
    logits = F.linear(F.relu(F.linear(h, w["fc1.weight"], w["fc1.bias"])), w["fc2.weight"], w["fc2.bias"])
    assert fw.evaluate(scratch(fw.name)[0], replica, None, X, y) == pytest.approx((logits.argmax(1).numpy() == y).mean())


def test_an_exec_level_a_framework_lacks_is_a_skip_not_a_failure(fw):
    from common.interface import Unavailable
    from harness.loader import load_module
    execution = load_module(fw.name, "execution")
    assert execution.level("default") == execution.DEFAULT
    if "xla" not in execution.NAMES:
        with pytest.raises(Unavailable, match=r"has no 'xla' mode here \(choose from eager, graph\)"):
            execution.level("xla")


def broken_copy(tmp_path, monkeypatch, framework, break_it):
    """The repo as harness.loader sees it, with one framework folder broken by `break_it(folder)`, mounted
    afresh under its private name (restored after the test)."""
    import shutil
    import sys
    from harness import loader
    shutil.copytree(os.path.join(loader.ROOT, framework), tmp_path / framework)
    break_it(tmp_path / framework)
    monkeypatch.setattr(loader, "ROOT", str(tmp_path))
    for name in [m for m in sys.modules if m == f"rosetta_{framework}" or m.startswith(f"rosetta_{framework}.")]:
        monkeypatch.delitem(sys.modules, name)


def rename(file, old, new):
    def edit(folder):
        path = folder / file
        path.write_text(path.read_text().replace(f"def {old}(", f"def {new}("))
    return edit


@pytest.mark.parametrize("break_it,message", [
    (rename("data_parallel.py", "allreduce", "all_reduce"), "does not implement allreduce"),
    (lambda folder: os.remove(folder / "lenet.py"), "lenet.py is missing"),
    (lambda folder: (folder / "devices.py").write_text("import no_such_module\n"), "does not import"),
])
def test_a_broken_translation_fails_the_suite_not_skips(fw, tmp_path, monkeypatch, break_it, message):
    """An installed framework whose folder misses a contract function or a file, or does not import, is a broken
    translation: a plain RosettaError (its rows fail), and the tests' loader fails instead of skipping."""
    from common import Unavailable
    from conftest import framework_or_skip
    from harness.loader import load_framework
    broken_copy(tmp_path, monkeypatch, fw.name, break_it)
    with pytest.raises(RosettaError, match=message) as err:
        load_framework(fw.name)
    assert not isinstance(err.value, Unavailable)
    try:   # the tests' own loader lets it through, so the test using it fails
        framework_or_skip(fw.name)
    except pytest.skip.Exception:
        pytest.fail("a broken translation was skipped, not failed")
    except RosettaError as raised:
        assert message in str(raised)
    else:
        pytest.fail("the broken translation loaded")
