"""A user's own network, moved from Gluon into hand-written PyTorch, Keras and Flax models through
harness.training.transfer: an MLP with BatchNorm and Dropout, and a small convnet with a flatten before its dense
layers (whose rows a channels-last target orders H, W, C). Each network is written as the framework's tutorials
write one, nothing of the project in it; the Gluon one trains a few steps, so its weights and running statistics
are its own. The target's logits on the user's inputs, in inference mode, are the source's within 1e-4."""
import os

import numpy as np
import pytest

from conftest import framework_or_skip
from harness.training.transfer import main, table, transfer


TOLERANCE = 1e-4
RNG = np.random.default_rng(0)
MLP_INPUTS = RNG.normal(size=(64, 20)).astype(np.float32)
IMAGES = RNG.normal(size=(64, 1, 14, 14)).astype(np.float32)   # NCHW, as Gluon and PyTorch take them


def gluon_mlp(nn):
    net = nn.HybridSequential()
    net.add(nn.Dense(32, in_units=20), nn.BatchNorm(in_channels=32), nn.Activation("relu"), nn.Dropout(0.5),
            nn.Dense(10, in_units=32))
    return net


def gluon_convnet(nn):
    net = nn.HybridSequential()
    net.add(nn.Conv2D(6, 3, in_channels=1, activation="relu"), nn.MaxPool2D(2),
            nn.Conv2D(12, 3, in_channels=6), nn.BatchNorm(in_channels=12), nn.Activation("relu"), nn.Flatten(),
            nn.Dense(32, in_units=192, activation="relu"), nn.Dense(10, in_units=32))
    return net


@pytest.fixture(scope="module")
def gluon(tmp_path_factory):
    """Each Gluon network trained 5 steps of SGD on random labels, saved with save_parameters: (file, logits)."""
    framework_or_skip("mxnet")
    import mxnet as mx
    from mxnet import autograd, gluon
    folder, trained = tmp_path_factory.mktemp("gluon"), {}
    for name, build, X in (("mlp", gluon_mlp, MLP_INPUTS), ("convnet", gluon_convnet, IMAGES)):
        mx.random.seed(1)
        net = build(gluon.nn)
        net.initialize(mx.init.Xavier())
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        data, labels = mx.nd.array(X), mx.nd.array(RNG.integers(0, 10, len(X)))
        for _ in range(5):
            with autograd.record():
                loss = loss_fn(net(data), labels)
            loss.backward()
            trainer.step(len(X))
        path = str(folder / f"{name}.params")
        net.save_parameters(path)
        trained[name] = (path, net(data).asnumpy())   # outside autograd.record: inference (running statistics)
    return trained


def torch_models():
    framework_or_skip("pytorch")
    from torch import nn
    mlp = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))
    convnet = nn.Sequential(nn.Conv2d(1, 6, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 12, 3), nn.BatchNorm2d(12),
                            nn.ReLU(), nn.Flatten(), nn.Linear(192, 32), nn.ReLU(), nn.Linear(32, 10))
    return mlp, convnet


def torch_logits(model, X):
    import torch
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(X)).numpy()


def keras_models():
    """Keras's BatchNormalization epsilon is 1e-3 by default, Gluon's 1e-5: a port says so."""
    framework_or_skip("tensorflow")
    import keras
    from keras import layers
    mlp = keras.Sequential([keras.Input((20,)), layers.Dense(32), layers.BatchNormalization(epsilon=1e-5),
                            layers.ReLU(), layers.Dropout(0.5), layers.Dense(10)])
    convnet = keras.Sequential([keras.Input((14, 14, 1)), layers.Conv2D(6, 3, activation="relu"), layers.MaxPool2D(2),
                                layers.Conv2D(12, 3), layers.BatchNormalization(epsilon=1e-5), layers.ReLU(),
                                layers.Flatten(), layers.Dense(32, activation="relu"), layers.Dense(10)])
    return mlp, convnet


def keras_logits(model, X):
    return model(X if X.ndim == 2 else X.transpose(0, 2, 3, 1), training=False).numpy()   # Keras's images: NHWC


def flax_models():
    framework_or_skip("jax")
    from flax import nnx
    rngs = nnx.Rngs(0)
    mlp = nnx.Sequential(nnx.Linear(20, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs), nnx.relu,
                         nnx.Dropout(0.5, rngs=rngs), nnx.Linear(32, 10, rngs=rngs))
    convnet = nnx.Sequential(nnx.Conv(1, 6, (3, 3), padding="VALID", rngs=rngs), nnx.relu,
                             lambda x: nnx.max_pool(x, (2, 2), (2, 2)),
                             nnx.Conv(6, 12, (3, 3), padding="VALID", rngs=rngs), nnx.BatchNorm(12, rngs=rngs), nnx.relu,
                             lambda x: x.reshape(x.shape[0], -1), nnx.Linear(192, 32, rngs=rngs), nnx.relu,
                             nnx.Linear(32, 10, rngs=rngs))
    return mlp, convnet


def flax_logits(model, X):
    model.eval()   # BatchNorm by its running statistics, no dropout
    return np.asarray(model(X if X.ndim == 2 else X.transpose(0, 2, 3, 1)))


TARGETS = {"pytorch": (torch_models, torch_logits), "tensorflow": (keras_models, keras_logits),
           "jax": (flax_models, flax_logits)}


@pytest.mark.parametrize("target", TARGETS)
def test_a_user_s_own_networks_move_into_their_hand_written_ports(target, gluon):
    build, logits = TARGETS[target]
    for (name, (path, want)), model in zip(gluon.items(), build()):
        rows = transfer(path, model)
        assert len(rows) == {"mlp": 8, "convnet": 12}[name]   # every weight, bias, gamma, beta and statistic
        X = MLP_INPUTS if name == "mlp" else IMAGES
        np.testing.assert_allclose(logits(model, X), want, atol=TOLERANCE, err_msg=f"{name} -> {target}")
        if target != "pytorch" and name == "convnet":   # the dense layer after the flatten is reordered
            assert any("rows C,H,W <-> H,W,C" in line for line in table(rows))


def test_a_target_that_does_not_match_is_one_error_naming_both_sides(gluon):
    """A layer of another size, or a Flax module whose attributes (ordered by name) put the BatchNorm first."""
    from torch import nn
    from flax import nnx
    narrow = nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    with pytest.raises(ValueError, match=r"^0\.weight \(32, 20\) -> 0\.weight needs \(16, 20\)"):
        transfer(gluon["mlp"][0], narrow)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1, self.bn, self.fc2 = nnx.Linear(20, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs), \
                nnx.Linear(32, 10, rngs=rngs)
    with pytest.raises(ValueError, match=r"^layer 0: the source's 0 has weight, bias; the target's bn has gamma, beta"):
        transfer(gluon["mlp"][0], MLP(nnx.Rngs(0)))
    short = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32))
    with pytest.raises(ValueError, match=r"the source has 3 layers with parameters and the target 2: the source's 4 "):
        transfer(gluon["mlp"][0], short)


def test_the_command_writes_the_user_s_model_natively(gluon, tmp_path, capsys):
    """--model names the user's own file and function; the .pt it writes loads with torch's own calls."""
    import torch
    user = tmp_path / "mynet.py"
    user.write_text("from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Linear(20, 32), "
                    "nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))\n")
    path, want = gluon["mlp"]
    assert main([path, str(tmp_path / "mlp.pt"), "--model", f"{user}:build"]) == 0
    out = capsys.readouterr().out
    assert "0.weight (32, 20) -> 0.weight (32, 20)" in " ".join(out.split()) and "1.running_var" in out
    model = torch_models()[0]
    model.load_state_dict(torch.load(tmp_path / "mlp.pt"))
    np.testing.assert_allclose(torch_logits(model, MLP_INPUTS), want, atol=TOLERANCE)
    assert not capsys.readouterr().err
    states = os.path.join(os.path.dirname(path), "trainer.states")   # a Trainer's state beside it: said, not carried
    open(states, "wb").close()
    try:
        assert main([path, str(tmp_path / "mlp.pt"), "--model", f"{user}:build"]) == 0
    finally:
        os.remove(states)
    assert capsys.readouterr().err.startswith("note: trainer.states beside it not carried")
    assert main([path, str(tmp_path / "x.pt"), "--model", f"{user}:nothing"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {user} has no function nothing"
    assert main([str(user), str(tmp_path / "x.pt"), "--model", f"{user}:build"]) == 1   # not a Gluon file
    assert capsys.readouterr().err.strip() == f"error: {user}: a source file must be a Gluon save_parameters file " \
                                              "(.params)"
