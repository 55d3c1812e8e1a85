"""A user's own network, moved from Gluon into hand-written PyTorch, Keras and Flax models through
harness.training.transfer: an MLP with BatchNorm and Dropout, a small convnet with a flatten before its dense
layers (whose rows a channels-last target orders H, W, C), 1-D and 3-D convnets with a flatten (C, L and C, D, H, W),
and a transposed conv before a depthwise one. Each network is written as the framework's tutorials write one,
nothing of the project in it; the Gluon one trains a few steps, so its weights and running statistics are its own.
The target's logits on the user's inputs, in inference mode, are the source's within 1e-4 (1e-5 for the tiny
convnets)."""
import os

import numpy as np
import pytest

from conftest import framework_or_skip
from harness.training.transfer import main, table, transfer


TOLERANCE = 1e-4
RNG = np.random.default_rng(0)
MLP_INPUTS = RNG.normal(size=(64, 20)).astype(np.float32)
IMAGES = RNG.normal(size=(64, 1, 14, 14)).astype(np.float32)   # NCHW, as Gluon and PyTorch take them
SIGNALS = RNG.normal(size=(8, 3, 10)).astype(np.float32)   # NCL
VOLUMES = RNG.normal(size=(8, 2, 4, 4, 4)).astype(np.float32)   # NCDHW
MAPS = RNG.normal(size=(8, 4, 5, 5)).astype(np.float32)


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


def gluon_conv1d(nn):
    """Channels equal to the kernel's size: a (3, 3, 3) kernel fits the target's shape however it is laid out."""
    net = nn.HybridSequential()
    net.add(nn.Conv1D(3, 3, in_channels=3, activation="relu"), nn.Flatten(), nn.Dense(10, in_units=24))
    return net


def gluon_conv3d(nn):
    net = nn.HybridSequential()
    net.add(nn.Conv3D(2, 2, in_channels=2, activation="relu"), nn.Flatten(), nn.Dense(10, in_units=54))
    return net


def gluon_upsampler(nn):
    """A transposed conv, then a depthwise conv (groups = channels) with 2 filters per channel."""
    net = nn.HybridSequential()
    net.add(nn.Conv2DTranspose(4, 3, in_channels=4, activation="relu"), nn.Conv2D(8, 3, groups=4, in_channels=4),
            nn.GlobalAvgPool2D(), nn.Dense(10, in_units=8))
    return net


NETS = {"mlp": (gluon_mlp, MLP_INPUTS), "convnet": (gluon_convnet, IMAGES), "conv1d": (gluon_conv1d, SIGNALS),
        "conv3d": (gluon_conv3d, VOLUMES), "upsampler": (gluon_upsampler, MAPS)}


@pytest.fixture(scope="module")
def gluon(tmp_path_factory):
    """Each Gluon network trained 5 steps of SGD on random labels, saved with save_parameters: (file, logits)."""
    framework_or_skip("mxnet")
    import mxnet as mx
    from mxnet import autograd, gluon
    folder, trained = tmp_path_factory.mktemp("gluon"), {}
    for name, (build, X) in NETS.items():
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


def torch_convnets():
    from torch import nn
    return {"conv1d": nn.Sequential(nn.Conv1d(3, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(24, 10)),
            "conv3d": nn.Sequential(nn.Conv3d(2, 2, 2), nn.ReLU(), nn.Flatten(), nn.Linear(54, 10)),
            "upsampler": nn.Sequential(nn.ConvTranspose2d(4, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3, groups=4),
                                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))}


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


def keras_convnets():
    import keras
    from keras import layers
    return {"conv1d": keras.Sequential([keras.Input((10, 3)), layers.Conv1D(3, 3, activation="relu"),
                                        layers.Flatten(), layers.Dense(10)]),
            "conv3d": keras.Sequential([keras.Input((4, 4, 4, 2)), layers.Conv3D(2, 2, activation="relu"),
                                        layers.Flatten(), layers.Dense(10)]),
            "upsampler": keras.Sequential([keras.Input((5, 5, 4)), layers.Conv2DTranspose(4, 3, activation="relu"),
                                           layers.DepthwiseConv2D(3, depth_multiplier=2),
                                           layers.GlobalAveragePooling2D(), layers.Dense(10)])}


def keras_logits(model, X):
    return model(np.moveaxis(X, 1, -1), training=False).numpy()   # Keras's images: NHWC (NLC, NDHWC)


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


def flax_convnets():
    """Flax's ConvTranspose as its docs write it: the default kernel layout, not transpose_kernel's."""
    from flax import nnx
    rngs = nnx.Rngs(0)
    flatten = lambda x: x.reshape(x.shape[0], -1)
    return {"conv1d": nnx.Sequential(nnx.Conv(3, 3, (3,), padding="VALID", rngs=rngs), nnx.relu, flatten,
                                     nnx.Linear(24, 10, rngs=rngs)),
            "conv3d": nnx.Sequential(nnx.Conv(2, 2, (2, 2, 2), padding="VALID", rngs=rngs), nnx.relu, flatten,
                                     nnx.Linear(54, 10, rngs=rngs)),
            "upsampler": nnx.Sequential(nnx.ConvTranspose(4, 4, (3, 3), padding="VALID", rngs=rngs), nnx.relu,
                                        nnx.Conv(4, 8, (3, 3), padding="VALID", feature_group_count=4, rngs=rngs),
                                        lambda x: x.mean(axis=(1, 2)), nnx.Linear(8, 10, rngs=rngs))}


def flax_logits(model, X):
    model.eval()   # BatchNorm by its running statistics, no dropout
    return np.asarray(model(np.moveaxis(X, 1, -1)))


TARGETS = {"pytorch": (torch_models, torch_logits), "tensorflow": (keras_models, keras_logits),
           "jax": (flax_models, flax_logits)}
CONVNETS = {"pytorch": torch_convnets, "tensorflow": keras_convnets, "jax": flax_convnets}


@pytest.mark.parametrize("target", TARGETS)
def test_a_user_s_own_networks_move_into_their_hand_written_ports(target, gluon):
    build, logits = TARGETS[target]
    for name, model in zip(("mlp", "convnet"), build()):
        path, want = gluon[name]
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
    folder = os.path.dirname(path)   # the Trainer's state saved with it: said, not carried; another network's: not
    states = [os.path.join(folder, name) for name in ("mlp.states", "lenet.states")]
    for name in states:
        open(name, "wb").close()
    try:
        assert main([path, str(tmp_path / "mlp.pt"), "--model", f"{user}:build"]) == 0
    finally:
        for name in states:
            os.remove(name)
    err = capsys.readouterr().err
    assert err.startswith("note: mlp.states beside it not carried") and "lenet" not in err
    assert main([path, str(tmp_path / "x.pt"), "--model", f"{user}:nothing"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {user} has no function nothing"
    assert main([str(user), str(tmp_path / "x.pt"), "--model", f"{user}:build"]) == 1   # not a Gluon file
    assert capsys.readouterr().err.strip() == f"error: {user}: a source file must be a Gluon save_parameters file " \
                                              "(.params)"


def test_a_hybrid_block_s_exported_file_moves_too(tmp_path, capsys):
    """HybridBlock.export writes the parameters under their symbol's names (arg:conv0_weight, aux:
    batchnorm0_running_mean), with no structure: the layer is the name before its role. convert, which reads the
    LeNet's save_parameters file, says in one line what the file is and what to do."""
    framework_or_skip("mxnet")
    framework_or_skip("pytorch")
    import mxnet as mx
    from mxnet import gluon
    from harness.training import convert
    mx.random.seed(1)
    net = gluon_convnet(gluon.nn)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    want = net(mx.nd.array(IMAGES)).asnumpy()
    net.export(str(tmp_path / "convnet"), epoch=0)   # convnet-symbol.json, convnet-0000.params
    model = torch_models()[1]
    rows = transfer(str(tmp_path / "convnet-0000.params"), model)
    assert len(rows) == 12 and rows[6][0].endswith("_running_mean") and rows[6][2] == "4.running_mean"
    np.testing.assert_allclose(torch_logits(model, IMAGES), want, atol=TOLERANCE)
    capsys.readouterr()
    assert convert.main([str(tmp_path / "convnet-0000.params"), str(tmp_path / "convnet.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a HybridBlock.export file (its parameters named by the symbol's, " \
        "arg:conv0_weight): build the network in Gluon, net.load_parameters(this file) and " \
        "net.save_parameters('x.params'), then convert that" in err, err


@pytest.mark.parametrize("target", TARGETS)
def test_1d_3d_transposed_and_depthwise_convs_move_laid_out(target, gluon):
    """Every conv kernel goes (out, in, *spatial) <-> (*spatial, in, out), the flatten's rows C, L and C, D, H, W
    too; a Flax ConvTranspose's default kernel is flipped, a Keras depthwise kernel is (*spatial, C, multiplier).
    The table says a change only where one was made."""
    logits = TARGETS[target][1]
    for name, model in CONVNETS[target]().items():
        path, want = gluon[name]
        rows = transfer(path, model)
        np.testing.assert_allclose(logits(model, NETS[name][1]), want, atol=1e-5, err_msg=f"{name} -> {target}")
        changes = [change for *_, change in rows]
        if target == "pytorch":
            assert not any(changes)
        elif name != "upsampler":
            flat = {"conv1d": "rows C,L <-> L,C of a 3x8 map", "conv3d": "rows C,D,H,W <-> D,H,W,C of a 2x3x3x3 map"}
            assert changes == [{"conv1d": "OIL <-> LIO", "conv3d": "OIDHW <-> DHWIO"}[name], "",
                               f"transposed, {flat[name]}", ""]


def test_a_flattened_map_of_unequal_sides_is_read_off_a_keras_model_and_else_asked_for(gluon):
    """A 2-D conv's map of 2x8 has 16 values a channel, as a 4x4 one: taken as square, it moved silently wrong into
    Keras. A Keras model's Flatten knows its map; a 3-D map of 3x3x4, with no model to tell it, is asked for."""
    import keras
    import mxnet as mx
    from keras import layers
    from mxnet.gluon import nn
    from common.transfer import flattened_shapes
    for conv, size, units in ((nn.Conv2D, (4, 10), 48), (nn.Conv3D, (4, 4, 5), 72)):
        net = nn.HybridSequential()
        net.add(conv(3 if conv is nn.Conv2D else 2, 3 if conv is nn.Conv2D else 2, in_channels=2), nn.Flatten(),
                nn.Dense(10, in_units=units))
        net.initialize(mx.init.Xavier())
        X = RNG.normal(size=(2, 2, *size)).astype(np.float32)
        keras_conv = layers.Conv2D(3, 3) if conv is nn.Conv2D else layers.Conv3D(2, 2)
        model = keras.Sequential([keras.Input((*size, 2)), keras_conv, layers.Flatten(), layers.Dense(10)])
        rows = transfer(net, model)
        assert rows[2][-1] == ("transposed, rows C,H,W <-> H,W,C of a 3x2x8 map" if conv is nn.Conv2D else
                               "transposed, rows C,D,H,W <-> D,H,W,C of a 2x3x3x4 map")
        np.testing.assert_allclose(keras_logits(model, X), net(mx.nd.array(X)).asnumpy(), atol=1e-5)
    with pytest.raises(ValueError, match=r"the flattened shape 2,36 is not a 3-D map of 72 values"):
        transfer(net, model, flat_shape=(2, 36))
    arrays = [{r: p.data().asnumpy() for r, p in zip(("weight", "bias"), layer.collect_params().values())}
              for layer in (net[0], net[2])]
    with pytest.raises(ValueError, match=r"^layer 1: a dense layer of 72 inputs after a 3-D conv of 2 channels: the "
                                         r"flattened map is not cubic; give its shape, C,D,H,W"):
        flattened_shapes(arrays, channels_last=False)


def test_dst_must_be_named_for_the_model_s_framework(gluon, tmp_path, capsys):
    """A torch model is not written under a Keras name, nor a Flax one under a .pt name."""
    user = tmp_path / "mynets.py"
    user.write_text("from flax import nnx\nfrom torch import nn\n\n\ndef build():\n    return nn.Sequential("
                    "nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))\n\n\n"
                    "def build_flax():\n    rngs = nnx.Rngs(0)\n    return nnx.Sequential(nnx.Linear(20, 32, rngs=rngs), "
                    "nnx.BatchNorm(32, rngs=rngs), nnx.relu, nnx.Dropout(0.5, rngs=rngs), "
                    "nnx.Linear(32, 10, rngs=rngs))\n")
    path = gluon["mlp"][0]
    for dst, function, said in (("x.weights.h5", "build", "a tensorflow name, but the model is pytorch's: name it *.pt"),
                                ("z.pt", "build_flax", "a pytorch name, but the model is jax's: name it *.orbax")):
        assert main([path, str(tmp_path / dst), "--model", f"{user}:{function}"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / dst}: {said}") and err.count("\n") == 1, err
        assert not (tmp_path / dst).exists()
