"""Native checkpoints: each framework writes and reads its own format without loss, a file converted to another
framework loads with that framework's own calls and computes the same logits, a bad file gets one line and
leaves nothing behind, and a run resumed from epoch k ends with the uninterrupted run's weights."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from common import FRAMEWORKS
from common import optim
from harness.training.checkpoints import STATE_SUFFIXES, SUFFIXES, checkpoint_name, read_state, read_weights, \
    state_path, write_state, write_weights
from harness.training.convert import main as convert
from common.interface import RosettaError
from harness.loader import load_module
from harness.processes.launch import run_workers
from harness.spec import RunSpec
from common.lenet import init_weights
from conftest import framework_or_skip, installed_frameworks


def saved(framework, folder, weights=None, name="lenet"):
    path = str(folder / f"{name}{SUFFIXES[framework]}")
    write_weights(framework, init_weights(3) if weights is None else weights, path)
    return path


def test_a_checkpoint_holds_the_weights_exactly(fw, tmp_path):
    path = saved(fw.name, tmp_path)
    checkpoint = load_module(fw.name, "checkpoint")
    assert sorted(checkpoint.read(path)) == sorted(checkpoint.KEYS.values())   # the keys the module promises
    weights = read_weights(fw.name, path)
    assert all(np.array_equal(weights[k], v) for k, v in init_weights(3).items())
    assert os.listdir(tmp_path) == [os.path.basename(path)]   # no temporary file left beside it


# Every kind of state: rmsprop's with all three of its buffers (the squares', the gradients' average and momentum's)
KINDS = {"sgd": optim.Optimizer("sgd"), "momentum": optim.Optimizer("momentum"), "adamw": optim.Optimizer("adamw"),
         "rmsprop": optim.Optimizer("rmsprop", centered=True, momentum=0.9), "adagrad": optim.Optimizer("adagrad")}


def a_state(name, seed=4, step=7):
    """A canonical optimizer state (of KINDS[name], or of the optimizer `name` is) with distinct random buffers (a
    layout slip cannot go unseen); sums and averages of squares at least 0, as every optimizer's are."""
    rng = np.random.default_rng(seed)
    state = {"step": step}
    optimizer = name if isinstance(name, optim.Optimizer) else KINDS.get(name, optim.Optimizer(name))
    for key, value in optim.init_state(optimizer, init_weights()).items():
        if key != "step":
            state[key] = rng.normal(size=value.shape).astype(np.float32)
            if key.split(".")[0] in ("exp_avg_sq", "square_avg", "sum"):
                state[key] = np.abs(state[key])
    return state


def saved_with_state(framework, folder, name, state=None, file="lenet"):
    path = saved(framework, folder, name=file)
    write_state(framework, a_state(name) if state is None else state, KINDS.get(name, optim.Optimizer(name)), path)
    return path


@pytest.mark.parametrize("name", KINDS)
def test_an_optimizer_state_is_saved_natively_and_read_back_exactly(fw, name, tmp_path):
    path = saved_with_state(fw.name, tmp_path, name)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (path, state_path(fw.name, path)))
    assert state_path(fw.name, path).endswith(STATE_SUFFIXES[fw.name])   # as named for compare.py's check
    state = read_state(fw.name, path, KINDS[name])
    want = a_state(name)
    assert sorted(state) == sorted(want) and state["step"] == want["step"]
    assert all(np.array_equal(state[k], want[k]) for k in want if k != "step")


@pytest.fixture(scope="module")
def available():
    return [fw.name for fw in installed_frameworks()]


def test_every_conversion_loads_natively_and_computes_the_same_logits(digits, tmp_path, available):
    """Each framework's file converted to each other: the weights arrive exactly, and the target framework's
    own load (torch.load + load_state_dict, load_parameters, load_weights, Orbax restore) into its build_model
    gives the logits of the source within 1e-4: the channels-last layouts (and fc1's rows) are right."""
    reference = None
    for source in available:
        src = saved(source, tmp_path / source)
        for target in available:
            dst = str(tmp_path / source / f"to-{target}{SUFFIXES[target]}")
            assert convert([src, dst]) == 0
            assert all(np.array_equal(read_weights(target, dst)[k], v) for k, v in init_weights(3).items())
            checkpoint = load_module(target, "checkpoint")
            logits = checkpoint.logits(checkpoint.load(dst), digits.X_test)
            reference = logits if reference is None else reference
            np.testing.assert_allclose(logits, reference, atol=1e-4, err_msg=f"{source} -> {target}")


# an update of Adam first: its moments read exactly (JAX's first eager ops, 3 s of the fast tier: slow); none: the
# nnx.Optimizer's state as the guide saves it still converts (its leaves {"value": array})
@pytest.mark.parametrize("steps", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_flax_checkpoint_saved_as_flax_s_guide_converts_and_verifies(steps, tmp_path, capsys):
    """Flax's checkpointing guide saves the nnx.State of nnx.split(model) itself with Orbax (each variable a
    {"value": array}), not its pure dict: such a file converts, and --verify's JAX side restores it as the guide
    does. Stock torch code finds the Flax model's weights in the converted file. The guide saves the nnx.Optimizer's
    nnx.State so too, beside the weights: it converts, its Adam moments into torch.optim's exactly. A
    CheckpointManager's directory or step, given for its item, is one line naming the item."""
    framework_or_skip("jax")
    framework_or_skip("pytorch")
    import optax
    import orbax.checkpoint as ocp
    import torch
    from flax import nnx
    from common.data import load_dataset

    class LeNet(nnx.Module):   # a user's own, as Flax's tutorials write one
        def __init__(self, rngs):
            self.conv1 = nnx.Conv(1, 20, (3, 3), padding="VALID", rngs=rngs)
            self.conv2 = nnx.Conv(20, 50, (5, 5), padding="VALID", rngs=rngs)
            self.fc1 = nnx.Linear(800, 128, rngs=rngs)
            self.fc2 = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
            x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
            return self.fc2(nnx.relu(self.fc1(x.reshape(x.shape[0], -1))))

    model = LeNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    digits = load_dataset("digits")

    def loss_fn(model, X, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(X), y).mean()
    X, y = digits.X_train[:32].transpose(0, 2, 3, 1), digits.y_train[:32]   # Flax's NHWC
    for _ in range(steps):
        optimizer.update(model, nnx.grad(loss_fn)(model, X, y))
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((tmp_path / "state.orbax").absolute(), state)
    checkpointer.save((tmp_path / "state.optimizer.orbax").absolute(), nnx.state(optimizer))
    checkpointer.wait_until_finished()
    capsys.readouterr()
    verify = ["--verify"] if steps else []   # --verify's Flax and torch inference: with the Adam step, in the slow tier
    assert convert([str(tmp_path / "state.orbax"), str(tmp_path / "model.pt"), *verify]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert ("verify on digits" in out) == bool(steps) and f"with adam's state after {steps} steps" in out, out
    weights = torch.load(tmp_path / "model.pt")
    np.testing.assert_array_equal(weights["conv1.weight"].numpy(), np.transpose(model.conv1.kernel.value, (3, 2, 0, 1)))
    np.testing.assert_array_equal(weights["fc2.weight"].numpy(), np.asarray(model.fc2.kernel.value).T)
    manager = ocp.CheckpointManager((tmp_path / "ckpt").absolute())   # Orbax's docs: a step's items in its directory
    manager.save(5, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    for given in ("ckpt", "ckpt/5"):
        assert convert([str(tmp_path / given), str(tmp_path / "out.pt"), "--from", "jax"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"not one of its items: give {tmp_path / 'ckpt/5/default'}\n" in err, err
    if not steps:
        return
    saved = torch.load(tmp_path / "model.optimizer.pt")["optimizer"]
    adam = optimizer.opt_state[0]   # optax.adam's ScaleByAdamState
    assert [s["step"] for s in saved["state"].values()] == [1.0] * 8
    np.testing.assert_array_equal(saved["state"][0]["exp_avg"].numpy(),
                                  np.transpose(adam.mu["conv1"]["kernel"].value, (3, 2, 0, 1)))
    np.testing.assert_array_equal(saved["state"][7]["exp_avg_sq"].numpy(), np.asarray(adam.nu["fc2"]["bias"].value))


def test_a_failed_verify_says_the_output_is_written_but_untrusted(tmp_path, monkeypatch, capsys):
    """--verify runs after the output is written: where it fails, its one error line says the file is there and
    did not pass."""
    import harness.training.convert as command
    framework_or_skip("pytorch")
    src = saved("pytorch", tmp_path)
    monkeypatch.setattr(command, "TOLERANCE", -1.0)   # no difference passes
    capsys.readouterr()
    assert convert([src, str(tmp_path / "copy.pt"), "--verify"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "copy.pt is written, but did not pass --verify" in line, line


def test_a_state_whose_file_gives_no_rate_says_so_where_the_target_keeps_one(tmp_path, capsys):
    """An Orbax state holds no rate; torch.optim's file does, and load_state_dict takes it: converted without --lr,
    the default (0.2, where a Flax program's Adam ran at 1e-3) went in silently. With --lr it is the rate given."""
    import torch
    framework_or_skip("jax")
    framework_or_skip("pytorch")
    src = saved_with_state("jax", tmp_path, "adam", a_state("adam"))
    capsys.readouterr()
    assert convert([src, str(tmp_path / "default.pt")]) == 0
    assert "gives no rate the converter reads: default.pt's optimizer holds lr 0.2" in capsys.readouterr().err
    assert convert([src, str(tmp_path / "given.pt"), "--lr", "0.001"]) == 0
    assert "no rate" not in capsys.readouterr().err
    saved = torch.load(tmp_path / "given.optimizer.pt", weights_only=False)
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.001)


def test_verify_fails_on_logits_that_are_not_numbers(tmp_path, capsys):
    """A diverged run's NaN weights convert to NaN weights; --verify must not pass them (NaN > 1e-4 is False)."""
    framework_or_skip("pytorch")
    weights = init_weights(3)
    weights["fc2.bias"] = np.full_like(weights["fc2.bias"], np.nan)   # every logit NaN
    src = saved("pytorch", tmp_path, weights)
    capsys.readouterr()
    assert convert([src, str(tmp_path / "copy.pt"), "--verify"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "logits or" in line and "are not finite" in line and "did not pass --verify" in line, line


def test_every_conversion_carries_the_optimizer_state(tmp_path, available, capsys):
    """Adam's moments and step count, from each framework's native file to each other's, exactly."""
    want = a_state("adam")
    for source in available:
        src = saved_with_state(source, tmp_path / source, "adamw", want)   # adam's buffers; an MXNet file says adamw
        for target in available:
            dst = str(tmp_path / source / f"to-{target}{SUFFIXES[target]}")
            assert convert([src, dst, "--optimizer", "adamw"]) == 0
            assert "with adamw's state after 7 steps" in capsys.readouterr().out
            got = read_state(target, dst, optim.Optimizer("adamw"))
            assert all(np.array_equal(got[k], want[k]) for k in want), (source, target)


@pytest.mark.parametrize("name", ["rmsprop", "adagrad"])
def test_rmsprop_s_and_adagrad_s_states_go_round_every_framework(name, tmp_path, available, capsys):
    """A centered rmsprop's three buffers (and adagrad's sum) from each framework's file to the next one's, told by
    the buffers alone (no --optimizer): every framework reads and writes each once, exactly. Keras's and Optax's
    stock RMSprop keep the rate inside the momentum buffer, so their file holds it times the rate, which this
    project's own files do not say: without --lr, one line."""
    want = a_state(name)
    for source, target in zip(available, available[1:] + available[:1]):
        src = saved_with_state(source, tmp_path / source, name, want)
        dst = str(tmp_path / source / f"to-{target}{SUFFIXES[target]}")
        rate_inside = name == "rmsprop" and target != "pytorch" and source != "mxnet"   # MXNet's says it
        if rate_inside:
            assert convert([src, dst]) == 1
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and err.endswith("give --lr, the rate of its last update"), err
        assert convert([src, dst, *(["--lr", "0.01"] if rate_inside else [])]) == 0
        assert f"with {name}'s state after 7 steps" in capsys.readouterr().out
        got = read_state(target, dst, KINDS[name])
        assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want), (source, target)


@pytest.mark.parametrize("schedule", [{"warmup_steps": 30, "total_steps": 100},   # written for MXNet's stock SGD
                                      {"schedule": "cosine", "total_steps": 100}])   # for the project's class
def test_a_stock_sgd_that_keeps_the_rate_in_its_buffer_gets_a_note_where_the_rate_changes(schedule, tmp_path,
                                                                                         available, capsys):
    """Keras's SGD and MXNet's stock SGD keep the rate inside the momentum buffer (v = mu * v - lr * g): the file
    they load holds -lr * the canonical buffer, which continues the canonical run only until the schedule changes the
    rate. An MXNet file (the one format that keeps the schedule) of a run saved at step 20 of a 30-step warm-up, or
    of a cosine: each target whose stock SGD keeps the rate says so in one note; torch's and Optax's files need none.
    MXNet's file pickles its stock SGD and schedule, and its note says what stock Gluon code continues otherwise (the
    stock cosine one update ahead too); as a source it is the canonical run it came from, not a stock Gluon state
    (refused: test_stock_gluon_states)."""
    optimizer = optim.Optimizer("momentum", lr=0.005, **schedule)
    src = saved("mxnet", tmp_path)
    write_state("mxnet", a_state("momentum", step=20), optimizer, src)
    warmup = "warmup_steps" in schedule
    rates = "0.003333 to 0.0035" if warmup else "0.004568 to 0.004523"   # updates 20 and 21's
    says = {"tensorflow": ("note: keras.optimizers.SGD keeps the rate inside",
                           f"update 21, where the schedule changes the rate ({rates}"),
            "mxnet": ("note: stock Gluon code that loads lenet.states continues otherwise",
                      f"MXNet's stock SGD keeps the rate inside its momentum buffer", f"first at update 21 ({rates}",
                      *(() if warmup else ("MXNet's stock CosineScheduler is one update ahead",)))}
    for target in available:
        assert convert([src, str(tmp_path / target / f"lenet{SUFFIXES[target]}")]) == 0
        err = capsys.readouterr().err.strip()
        if target not in says:
            assert not err, (target, err)
        else:
            start, *within = says[target]
            assert len(err.splitlines()) == 1 and err.startswith(start) and all(w in err for w in within), (target, err)


def test_a_bad_optimizer_state_gets_one_line_and_no_output(tmp_path, available, capsys):
    """No state where one is asked for, another optimizer's state, a buffer of the wrong shape, a truncated file:
    one error line naming the file and the problem, nothing written."""
    source, target = available[0], available[-1]
    plain = saved(source, tmp_path / "plain")
    momentum = saved_with_state(source, tmp_path / "momentum", "momentum")
    wrong = a_state("adam")
    wrong["exp_avg.conv1.weight"] = np.zeros((20, 1, 5, 5), np.float32)
    negative = {**a_state("adam"), "exp_avg_sq.fc2.bias": -np.ones(10, np.float32)}
    cases = [([plain, "--optimizer", "adam"], "no optimizer state beside it"),
             ([momentum, "--optimizer", "adam"], "holds momentum-style state"),
             ([saved_with_state(source, tmp_path / "wrong", "adam", wrong)], "exp_avg.conv1.weight is"),
             ([saved_with_state(source, tmp_path / "negative", "adam", negative)],
              "exp_avg_sq.fc2.bias has negative")]
    truncated = saved_with_state(source, tmp_path / "truncated", "adam")
    truncate(state_path(source, truncated))
    cases.append(([truncated], "not a readable"))
    for args, says in cases:
        out = tmp_path / "out"
        capsys.readouterr()
        assert convert([args[0], str(out / f"converted{SUFFIXES[target]}"), *args[1:]]) != 0
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (args, lines)
        assert not out.exists() or os.listdir(out) == [], args


def truncate(path):
    """Cut the file (or the largest file of an Orbax directory) in half."""
    if os.path.isdir(path):
        files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
        path = max(files, key=os.path.getsize)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])


def rewrite(framework, path, change):
    """change(arrays) on the file's arrays by key, written back in the framework's own format."""
    arrays = load_module(framework, "checkpoint").read(path)
    change(arrays)
    if framework == "pytorch":
        import torch
        torch.save({key: torch.from_numpy(a) for key, a in arrays.items()}, path)
    elif framework == "mxnet":
        import mxnet as mx
        mx.nd.save(path, {key: mx.nd.array(a) for key, a in arrays.items()})
    elif framework == "tensorflow":
        import h5py
        with h5py.File(path, "w") as f:
            for key, a in arrays.items():
                f[key] = a
    else:
        import shutil
        import orbax.checkpoint as ocp
        tree = {}
        for key, a in arrays.items():
            module, name = key.split("/")
            tree.setdefault(module, {})[name] = a
        shutil.rmtree(path)
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, tree)


EXTRA_KEY = {"pytorch": "fc3.weight", "mxnet": "8.weight", "tensorflow": "layers/dense_2/vars/0", "jax": "fc3/kernel"}


def damage_file(framework, path, damage):
    """Damage a good checkpoint; returns what the error line must name."""
    keys = load_module(framework, "checkpoint").KEYS
    if damage == "truncated":
        truncate(path)
    elif damage == "wrong shape":   # conv1 with a 5x5 kernel
        rewrite(framework, path, lambda a: a.update({keys["conv1.weight"]: np.zeros(
            (5, 5, 1, 20) if framework in ("tensorflow", "jax") else (20, 1, 5, 5), np.float32)}))
        return "parameter conv1.weight"
    elif damage == "missing parameter":
        rewrite(framework, path, lambda a: a.pop(keys["fc2.weight"]))
        return "parameter fc2.weight"
    elif damage == "extra parameter":
        rewrite(framework, path, lambda a: a.update({EXTRA_KEY[framework]: np.zeros((10, 10), np.float32)}))
        return EXTRA_KEY[framework]
    else:   # not a checkpoint at all
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        open(path, "w").write("not weights\n")
    return None


@pytest.mark.parametrize("damage", ["truncated", "wrong shape", "missing parameter", "extra parameter",
                                    "not a checkpoint"])
def test_a_bad_checkpoint_gets_one_line_and_no_output(fw, damage, tmp_path, capsys):
    src = saved(fw.name, tmp_path / "in")
    named = damage_file(fw.name, src, damage)
    out = tmp_path / "out"
    target = "tensorflow" if fw.name != "tensorflow" else "pytorch"
    capsys.readouterr()
    assert convert([src, str(out / f"converted{SUFFIXES[target]}")]) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}: "), lines
    if named:
        assert named in lines[0], lines[0]
    assert not out.exists() or os.listdir(out) == []   # nothing written, not even a temporary file


def test_a_write_that_fails_midway_leaves_nothing(tmp_path, monkeypatch):
    framework_or_skip("pytorch")
    checkpoint = load_module("pytorch", "checkpoint")

    def broken(weights, path, bn_state=None):
        open(path, "wb").write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint, "save", broken)
    with pytest.raises(OSError):
        write_weights("pytorch", init_weights(0), str(tmp_path / "lenet.pt"))
    assert os.listdir(tmp_path) == []


def test_names_and_suffixes(tmp_path):
    spec = RunSpec(framework="mxnet", mode="builtin", exec="default", devices=2, processes=1)
    assert checkpoint_name(spec, 30) == "mxnet-builtin-2d-1p-epoch30.params"
    assert checkpoint_name(spec.replace(framework="jax", mode="scratch", exec="eager", processes=2), 5) \
        == "jax-scratch-eager-2d-2p-epoch5.orbax"
    with pytest.raises(RosettaError, match="must end in .weights.h5"):
        write_weights("tensorflow", init_weights(0), str(tmp_path / "lenet.h5"))


def test_every_row_of_a_command_has_a_name_of_its_own():
    """A row's checkpoints and profile folder are named by run_name: two rows of one command with one name would
    overwrite each other's files (the later row's checkpoint replacing the earlier's, a profile folder holding two
    traces). Every option that takes a comma-separated list, with two values each, at once."""
    import compare
    from harness.run.plan import run_specs
    from harness.training.checkpoints import run_name
    lists = {"--mode": "scratch,builtin,idiomatic", "--devices": "1,2", "--processes": "1,2",
             "--per-device-batch": "32,64", "--cores": "shared,per-device", "--exec": "default,eager",
             "--layout": "default,nchw", "--allreduce": "per-tensor,bucketed", "--shard": "none,optimizer",
             "--accumulate": "1,2", "--precision": "fp32,bf16", "--allreduce-dtype": "fp32,bf16"}
    for more in (["--frameworks", "pytorch,jax"], ["--frameworks", "jax", "--model", "resnet18", "--bn", "local,sync"]):
        rows = run_specs(compare.parse_args([*more, *(word for option in lists.items() for word in option)]))
        names = [run_name(spec) for spec, skip in rows if not skip]
        assert len(names) > 1000 and len(set(names)) == len(names)


# Every optimizer option at once: a warm-up, a schedule that changes the rate every step, decay, clipping
TRAINING = {"lr_schedule": "cosine", "warmup_epochs": 1, "weight_decay": 5e-4, "clip_norm": 3.5}


def run(framework, folder, mode="builtin", **extra):
    """Two processes for PyTorch's built-in engine (DDP's way) and JAX (Orbax refuses host-local arrays across
    processes)."""
    folder.mkdir(exist_ok=True)
    processes = 2 if framework == "jax" or (framework, mode) == ("pytorch", "builtin") else 1
    spec = RunSpec(framework=framework, mode=mode, devices=2, processes=processes, dataset="digits", epochs=2,
                   batch_size=256, seed=2, threads=1, weights_out=str(folder / "final.npz"), **extra)
    results = run_workers(spec, timeout=300)
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    trained = spec.epochs - results[0]["first_epoch"]   # and the input pipeline's cost, measured per epoch:
    assert all(len(r["epoch_input_seconds"]) == trained and min(r["epoch_input_seconds"]) > 0 for r in results)
    return spec, dict(np.load(folder / "final.npz"))


# Every framework resumes its built-in mode's state bit for bit; scratch mode's state too where a run is cheap.
# TensorFlow's and JAX's scratch state is resumed by test_a_run_stopped_in_mxnet_goes_on_in_every_framework. The
# built-in runs of 2 processes (PyTorch's DDP, JAX's) are tests/test_restarts.py's, killed mid-run and restarted.
BUILTIN, SCRATCH = ("builtin", "momentum", TRAINING), ("scratch", "adam", TRAINING)   # sgd: no state, same path
RESUMED = [(fw, *run) for fw in FRAMEWORKS for run in (BUILTIN, SCRATCH)
           if (run is BUILTIN and fw in ("mxnet", "tensorflow")) or (run is SCRATCH and fw in ("pytorch", "mxnet"))]


@pytest.mark.slow
@pytest.mark.parametrize("framework,mode,optimizer,options", RESUMED, ids=[f"{f}-{m}-{o}" for f, m, o, _ in RESUMED])
def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(framework, mode, optimizer, options, tmp_path):
    """Epoch 2 after a restart sees the batches the uninterrupted run saw (the built-in mode's from the
    framework's own pipeline), starts from the saved optimizer state at the saved step of the schedule (after the
    warm-up, in the cosine), and ends with the uninterrupted run's weights, bit for bit."""
    framework_or_skip(framework)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    extra = {"optimizer": optimizer, **options}
    spec, weights = run(framework, whole, mode, checkpoint_dir=str(whole), checkpoint_every=1, **extra)
    names = sorted(f for f in os.listdir(whole) if f != "final.npz")
    files = [checkpoint_name(spec, k) for k in (1, 2)]
    assert names == sorted(files + ([state_path(framework, f) for f in files] if optimizer != "sgd" else []))
    last = read_weights(framework, str(whole / checkpoint_name(spec, 2)))
    assert all(np.array_equal(last[k], weights[k]) for k in weights)   # the file holds what was trained
    _, again = run(framework, resumed, mode, resume_from=str(whole / checkpoint_name(spec, 1)), **extra)
    for name, value in weights.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_stopped_in_mxnet_goes_on_in_every_framework(tmp_path, available):
    """The migration path with an optimizer: Gluon trains an epoch with momentum, the checkpoint and its state are
    converted, and PyTorch, TensorFlow and JAX (scratch mode) train epoch 2 from it: their weights end
    where the run continued in MXNet ends, within the optimizer parity tolerance (tests/test_optimizers.py)."""
    framework_or_skip("mxnet")
    extra = {"optimizer": "momentum", **TRAINING}
    spec, weights = run("mxnet", tmp_path / "mxnet", "scratch", checkpoint_dir=str(tmp_path / "mxnet"),
                        checkpoint_every=1, **extra)
    src = str(tmp_path / "mxnet" / checkpoint_name(spec, 1))
    for target in FRAMEWORKS[:1] + FRAMEWORKS[2:]:
        framework_or_skip(target)
        dst = str(tmp_path / target / f"converted-epoch1{SUFFIXES[target]}")
        assert convert([src, dst]) == 0
        _, continued = run(target, tmp_path / target, "scratch", resume_from=dst, **extra)
        for name, value in weights.items():
            np.testing.assert_allclose(continued[name], value, atol=1e-4, err_msg=f"{target} {name}")


def test_converting_in_process_leaves_the_callers_environment(tmp_path, monkeypatch):
    """harness.training.convert quiets TensorFlow only as a command: called in a process that already runs TensorFlow, a
    TF_ENABLE_ONEDNN_OPTS=0 it set would switch that process's kernels (NCHW pooling then fails on the CPU)."""
    framework_or_skip("pytorch")
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    before = dict(os.environ)
    assert convert([saved("pytorch", tmp_path), str(tmp_path / "copy.pt")]) == 0
    assert dict(os.environ) == before


def test_the_temporary_of_a_writer_killed_mid_save_is_removed_by_the_next_write(tmp_path):
    """SIGKILL skips write_weights' own clean-up: the next write into that folder removes what the dead writer left
    (its temporary file, and anything the framework made beside it), never a live writer's temporary."""
    framework_or_skip("pytorch")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".lenet.partial-{dead.pid}.pt").write_bytes(b"half a file")
    (tmp_path / f".lenet.partial-{dead.pid}.pt.tmp-dir").mkdir()
    live = tmp_path / f".lenet.partial-{os.getppid()}.pt"
    live.write_bytes(b"being written")
    other = tmp_path / f".other.partial-{dead.pid}.pt"   # another checkpoint's: its own next write sweeps it
    other.write_bytes(b"half")
    saved("pytorch", tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(["lenet.pt", live.name, other.name])

