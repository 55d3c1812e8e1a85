"""The ResNet's native checkpoints: the weights and every BatchNorm's running statistics in each framework's own
format, read back exactly; converted between frameworks, loaded by each framework's own calls and run in inference
mode, they give the same logits (by the running statistics: a framework that normalised by the batch's instead
would be off by far more than the tolerance); a file of another network is named for what it holds."""
import numpy as np
import pytest

from common import optim
from common import resnet as spec
from common.interface import RosettaError
from conftest import framework_or_skip, installed_frameworks
from harness.training.checkpoints import SUFFIXES, read_model, read_state, resnet_keys, resume_point, write_state, write_weights
from harness.training.convert import main as convert
from harness.loader import load_module
from harness.spec import RunSpec
from common.lenet import init_weights as lenet_weights

WIDTH = 8


@pytest.fixture(scope="module")
def trained():
    """Weights and a running state far from the initial (0, 1), so that inference by the running statistics and by
    the batch's cannot agree by accident."""
    rng = np.random.default_rng(2)
    weights = spec.init_weights(2, WIDTH)
    for name in weights:
        if name.endswith("bias") or ".bn" in name:
            weights[name] = (weights[name] + rng.normal(0, 0.2, weights[name].shape)).astype(np.float32)
    state = {name: (rng.normal(0, 0.5, shape) if name.endswith("mean") else rng.uniform(0.3, 3.0, shape))
             .astype(np.float32) for name, shape in spec.bn_state_shapes(WIDTH).items()}
    return weights, state


@pytest.fixture(scope="module")
def available():
    return [fw.name for fw in installed_frameworks()]


def saved(framework, folder, trained, name="resnet"):
    path = str(folder / f"{name}{SUFFIXES[framework]}")
    write_weights(framework, *trained[:1], path, trained[1])
    return path


def test_every_format_holds_the_weights_and_running_statistics_exactly(fw, trained, tmp_path):
    path = saved(fw.name, tmp_path, trained)
    weights, state = read_model(fw.name, path)
    assert list(weights) == list(spec.PARAM_NAMES) and list(state) == list(spec.BN_STATE_NAMES)
    assert all(np.array_equal(weights[k], v) for k, v in trained[0].items())
    assert all(np.array_equal(state[k], v) for k, v in trained[1].items())
    keys, extras = resnet_keys(fw.name)
    assert len(set(keys.values())) == len(spec.PARAM_NAMES) + len(spec.BN_STATE_NAMES)
    # PyTorch alone keeps a step count per BatchNorm (num_batches_tracked): 17 BatchNorm layers
    assert sorted(extras) == sorted(f"{layer}.num_batches_tracked" for layer in spec.BN_LAYERS) \
        if fw.name == "pytorch" else not extras


def test_jax_s_stored_tree_is_what_its_file_holds(trained, tmp_path):
    """JAX's keys come from the tree its checkpoint writes (Orbax writes numpy arrays from process 0 only, so the
    other processes of a run cannot probe with a file of their own): Orbax's round trip keeps that tree's keys and
    arrays as read() reports them. (A tree missing an entry fails the format test above.)"""
    framework_or_skip("jax")
    checkpoint = load_module("jax", "checkpoint")
    on_file = checkpoint.read(saved("jax", tmp_path, trained))
    tree = dict(checkpoint.flatten(checkpoint.stored(*trained)))
    assert sorted(tree) == sorted(on_file) and all(np.array_equal(tree[k], on_file[k]) for k in tree)


def test_every_conversion_runs_in_inference_mode_with_the_same_logits(digits, trained, tmp_path, available, capsys):
    reference = spec.forward(*trained, digits.X_test[:200], training=False)
    batch_statistics = spec.forward(*trained, digits.X_test[:200], training=True)[0]
    assert np.max(np.abs(batch_statistics - reference)) > 1.0   # what a slip into training mode would give
    for source in available:
        src = saved(source, tmp_path / source, trained)
        checkpoint = load_module(source, "checkpoint")
        logits = checkpoint.logits(checkpoint.load(src, WIDTH), digits.X_test[:200])
        np.testing.assert_allclose(logits, reference, atol=1e-4, err_msg=f"{source}'s own load")
        target = available[(available.index(source) + 1) % len(available)]   # a ring: every format read and written
        dst = str(tmp_path / source / f"to-{target}{SUFFIXES[target]}")
        assert convert([src, dst, "--verify"]) == 0
        out = capsys.readouterr().out
        assert "largest |logit difference|" in out, out
        weights, state = read_model(target, dst)
        assert all(np.array_equal(state[k], v) for k, v in trained[1].items())


def test_a_missing_running_statistic_is_one_line(trained, tmp_path):
    import torch
    path = saved("pytorch", tmp_path, trained)
    state = torch.load(path, weights_only=True)
    del state["stage3.0.bn2.running_var"]
    torch.save(state, path)
    with pytest.raises(RosettaError, match=r"not this ResNet-18 \(width 8\)'s checkpoint: parameter "
                                           r"stage3.0.bn2.running_var \('stage3.0.bn2.running_var' in the file\) is missing"):
        read_model("pytorch", path)


def test_a_run_resumes_only_from_its_own_network(trained, tmp_path):
    resnet_file = saved("mxnet", tmp_path, trained, name="mxnet-resnet-epoch1")
    lenet_file = str(tmp_path / "mxnet-lenet-epoch1.params")
    write_weights("mxnet", lenet_weights(0), lenet_file)
    sgd = RunSpec("mxnet").canonical_optimizer(10)
    weights, state, _, _, epoch = resume_point(RunSpec("mxnet", model="resnet18", resume_from=resnet_file), sgd, 10)
    assert epoch == 1 and all(np.array_equal(state[k], v) for k, v in trained[1].items())
    with pytest.raises(RosettaError, match="holds the lenet; this run trains the resnet18 of width 8"):
        resume_point(RunSpec("mxnet", model="resnet18", resume_from=lenet_file), sgd, 10)
    with pytest.raises(RosettaError, match="holds the resnet18 of width 8; this run trains the resnet18 of width 16"):
        resume_point(RunSpec("mxnet", model="resnet18", width=16, resume_from=resnet_file), sgd, 10)
    with pytest.raises(RosettaError, match="holds the resnet18 of width 8; this run trains the lenet"):
        resume_point(RunSpec("mxnet", resume_from=resnet_file), sgd, 10)


def a_state(name, step=7):
    """A canonical optimizer state of the ResNet's every parameter, distinct random buffers (a layout or name slip
    cannot go unseen); running statistics are not parameters and have none. Adam's second moment at least 0."""
    rng = np.random.default_rng(4)
    state = {key: step if key == "step" else rng.normal(size=value.shape).astype(np.float32)
             for key, value in optim.init_state(optim.Optimizer(name), spec.init_weights(0, WIDTH)).items()}
    return {key: np.abs(value) if key.startswith("exp_avg_sq.") else value for key, value in state.items()}


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_every_conversion_carries_the_resnet_s_optimizer_state(name, trained, tmp_path, available, capsys):
    """The weights, the running statistics and the optimizer state of a ResNet, from each framework's native files
    to each other's: every buffer exactly, under the ResNet's parameter names; each target reads its own file back."""
    want = a_state(name)
    rate = ["--lr", str(optim.Optimizer(name).lr)]   # MXNet's stock SGD holds the rate in its buffer: the files say none
    for source in available:
        src = saved(source, tmp_path / source, trained)
        write_state(source, want, optim.Optimizer(name), src)
        for target in available:
            dst = str(tmp_path / source / f"to-{target}{SUFFIXES[target]}")
            assert convert([src, dst, *rate]) == 0
            assert f"with {name}'s state after 7 steps" in capsys.readouterr().out
            weights, bn_state = read_model(target, dst)
            got = read_state(target, dst, optim.Optimizer(name), weights)
            assert sorted(got) == sorted(want), (source, target)
            assert all(np.array_equal(got[k], want[k]) for k in want), (source, target)
            assert all(np.array_equal(bn_state[k], v) for k, v in trained[1].items()), (source, target)


def test_a_lenet_s_state_beside_a_resnet_is_one_line(trained, tmp_path, available):
    """A state whose buffers are another network's: named, nothing read into the run."""
    source = available[0]
    path = saved(source, tmp_path, trained)
    lenet_state = optim.init_state(optim.Optimizer("momentum"), lenet_weights())
    write_state(source, lenet_state, optim.Optimizer("momentum"), path)
    with pytest.raises(RosettaError, match=r"momentum_buffer\.stem\.conv\.weight is missing; this ResNet-18 \(width "
                                           r"8\) needs"):
        read_state(source, path, optim.Optimizer("momentum"))
