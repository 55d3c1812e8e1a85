"""--precision bf16: the numpy reference (common/backprop.py) against autograd in float64, every framework's scratch
step against the reference (one device's gradients, then steps on two devices), the proof that bf16 really ran, and
the option in the machinery. bf16 keeps 8 significant bits, so the bounds are common/precision.py's, not fp32's."""
import numpy as np
import pytest

from common import backprop, models, optim as common_optim, precision
from common.interface import Unavailable
from common.precision import BOUND, GRADIENT_BOUND
from common.sharding import shard_bounds
from conftest import run_compare, scratch
from harness.spec import RunSpec

NETWORKS = {"lenet": "lenet", "resnet": "resnet18"}   # conftest.scratch's name: common.models' name
# A batch of 64: bf16's rounding flips average out over more images (the reference's own gradients move 2e-2 when a
# BatchNorm weight moves 1e-6; 4e-2 at 16 images), so GRADIENT_BOUND keeps a margin over that noise.
WIDTH, BATCH, LR = 8, 64, 0.1
# The first BatchNorm sees the stem convolution's bf16 output, which every framework rounds alike (one input channel,
# nine products): its running statistics are fp32 arithmetic on equal inputs, and a framework that took them in bf16
# would be off by bf16's rounding, 2e-3 of them.
FIRST_BN_TOL = 1e-5
DRIFT = 3e-2   # the ResNet's loss after bf16 steps on 16 images a device: measured 0.7e-2 to 1.5e-2 off the reference


def case(network, digits, batch=BATCH):
    name = NETWORKS[network]
    weights = models.init_weights(name, 0, width=WIDTH if name != "lenet" else None)
    return weights, models.init_bn_state(name, WIDTH), digits.X_train[:batch], digits.y_train[:batch]


def as_numpy(t):
    t = t.detach() if hasattr(t, "detach") else t
    return np.asarray(t.asnumpy() if hasattr(t, "asnumpy") else t, np.float64)


def relative(got, want):
    return abs(float(got) - float(want)) / abs(float(want))


def total_error(grads, want):
    """The gradients' distance from the reference's, all parameters at once, relative to its norm: a bias before a
    BatchNorm has no gradient in exact arithmetic and a rounding-sized one in bf16, so per-tensor ratios mislead."""
    diff = sum(np.sum((np.asarray(grads[n], np.float64).reshape(want[n].shape) - want[n]) ** 2) for n in want)
    return float(np.sqrt(diff / sum(np.sum(np.square(want[n], dtype=np.float64)) for n in want)))


def test_the_reference_is_autograd_in_float64(digits):
    """The tape at fp32 is float64 arithmetic: PyTorch's autograd in float64 gives the same loss, gradients and
    running statistics (the tape returns float32)."""
    import torch
    from pytorch import lenet, resnet
    for network in NETWORKS:
        weights, state, X, y = case(network, digits)
        loss, grads, new_state = backprop.loss_and_grads(NETWORKS[network], weights, state, X, y)
        module = lenet if network == "lenet" else resnet
        params = [torch.tensor(weights[n], dtype=torch.float64, requires_grad=True) for n in module.PARAM_NAMES]
        X64 = torch.tensor(X, dtype=torch.float64)
        if network == "lenet":
            logits = lenet.forward(params, X64)
        else:
            bn = [torch.tensor(state[n], dtype=torch.float64) for n in resnet.BN_STATE_NAMES]
            logits, torch_state = resnet.forward(params, bn, X64, True)
            for name, t in zip(resnet.BN_STATE_NAMES, torch_state):
                np.testing.assert_allclose(new_state[name], t.numpy(), rtol=1e-6, atol=1e-7)
        want = torch.nn.functional.cross_entropy(logits, torch.tensor(y, dtype=torch.long), reduction="sum")
        assert loss == pytest.approx(want.item(), rel=1e-12)
        torch_grads = torch.autograd.grad(want, params)
        assert total_error(grads, {n: g.numpy() for n, g in zip(module.PARAM_NAMES, torch_grads)}) < 1e-6


def test_bf16_rounds_to_nearest_even_through_fp32():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -9, 3.14159265])
    assert precision.rounded(x, "bf16").tolist() == [1.0, 1.0, 1 + 2 ** -6, 1.0, 3.140625]   # ties to even
    assert precision.rounded(x, "fp32").tolist() == x.tolist()                                # fp32: unrounded
    assert precision.is_representable(np.float32([1.0, 3.140625]), "bf16")
    assert not precision.is_representable(np.float32([1 + 2 ** -8]), "bf16")


def one_device(fw, network, digits, level):
    """A framework's one-device loss, gradients and new BatchNorm state at `level`, canonical numpy."""
    weights, state, X, y = case(network, digits)
    model, _ = scratch(fw.name, network, precision=level)
    device = fw.get_devices(1)[0]
    replica, bn_state = model.get_params(weights, device), model.get_bn_state(state, device)
    losses, grads, bn_states = model.loss_and_grads([replica], [bn_state], fw.split_and_load(X, [device]),
                                                    fw.split_and_load(y, [device]), [device])
    new_state = model.bn_state_to_numpy(bn_states[0]) if bn_states[0] is not None else None
    return float(as_numpy(losses[0]).sum()), model.to_numpy(grads[0]), new_state   # canonical layout


REFERENCES = {}


def reference(network, level, digits):
    """The reference's loss, gradients and new statistics on case(network, digits) at `level`: the same for every
    framework, so computed once a session (the ResNet's take a second or two). Read-only."""
    key = network, level, id(digits)   # digits: the session's one data set
    if key not in REFERENCES:
        weights, state, X, y = case(network, digits)
        REFERENCES[key] = backprop.loss_and_grads(NETWORKS[network], weights, state, X, y, level)
    return REFERENCES[key]


@pytest.mark.parametrize("level", ["bf16", "fp16"])
@pytest.mark.parametrize("network", NETWORKS)
def test_one_device_s_low_precision_gradients_are_the_reference_s(fw, network, level, digits):
    """The loss within BOUND, the gradients within GRADIENT_BOUND of the reference's bf16 ones, and the first
    BatchNorm's running statistics to fp32's precision; bf16 really ran: every convolution's and dense layer's
    gradient is a bf16 value widened to fp32 (not so for the reference's fp32 gradients, so the check can fail; each
    framework's own fp32 gradients: tests/test_resnet.py, tests/test_parity.py), and the loss left fp32's. Measured
    (the LeNet's loss and gradients, then the ResNet's, 16 images): PyTorch 1e-7 and exact, 7e-5 and 3.2e-2; MXNet 5e-7
    and 4e-5, 2e-4 and 4.1e-2; TensorFlow 3e-6 and 9e-4, 6e-4 and 3.5e-2; JAX 2e-8 and 8e-6, 4e-4 and 4.6e-2 (64 images
    halve the ResNet's gradient distances). The same at fp16 (unscaled: these gradients stay inside its range), but in
    MXNet, whose fp16 kernels are cuDNN's: it refuses in one line."""
    weights, state, X, y = case(network, digits)
    if fw.name == "mxnet" and level == "fp16":
        with pytest.raises(Unavailable, match="needs a GPU"):
            one_device(fw, network, digits, level)
        return
    want_loss, want, want_state = reference(network, level, digits)
    fp32_loss, fp32_grads, _ = reference(network, "fp32", digits)
    loss, grads, new_state = one_device(fw, network, digits, level)
    assert relative(loss, want_loss) <= BOUND[level], (loss, want_loss)
    assert relative(loss, fp32_loss) > BOUND["fp32"]
    assert total_error(grads, want) <= GRADIENT_BOUND[level], total_error(grads, want)
    lowered = [n for n in grads if ".bn" not in n]
    assert all(precision.is_representable(grads[n], level) for n in lowered)
    if new_state is not None:
        for name in ("stem.bn.running_mean", "stem.bn.running_var"):
            np.testing.assert_allclose(new_state[name], want_state[name], rtol=0, atol=FIRST_BN_TOL)
    assert not all(precision.is_representable(fp32_grads[n], level) for n in lowered)   # not so at fp32


def reference_steps(network, weights, state, X, y, devices, steps):
    """The bf16 step on `devices` shards with local BatchNorm: each shard's tape, the gradients summed in fp32, the
    recipe's update in fp32. Returns each step's mean loss."""
    losses, states = [], [state] * devices
    for _ in range(steps):
        total, grads = 0.0, None
        for d, (a, b) in enumerate(shard_bounds(len(X), devices)):
            loss, g, states[d] = backprop.loss_and_grads(NETWORKS[network], weights, states[d], X[a:b], y[a:b], "bf16")
            total += loss
            grads = g if grads is None else {n: grads[n] + g[n] for n in g}
        weights = {n: (w - np.float32(LR / len(X)) * grads[n]).astype(np.float32) for n, w in weights.items()}
        losses.append(total / len(X))
    return losses


@pytest.mark.parametrize("network", NETWORKS)
def test_the_bf16_step_on_two_devices_follows_the_reference(fw, network, digits):
    """Three steps of the one train_step at bf16 on two devices: the first within BOUND of the reference's, the later
    ones too for the LeNet; the ResNet's later steps start from weights its gradients' bf16 noise has already moved
    (2e-2 in norm at 64 images, 4e-2 at these 16 a device), so they are held to DRIFT. The replicas stay equal: one
    fp32 update on every one."""
    weights, state, X, y = case(network, digits, 32)
    model, settings = scratch(fw.name, network, precision="bf16")
    devices = fw.get_devices(2)
    replicas = [model.get_params(weights, d) for d in devices]
    bn_states = [model.get_bn_state(state, d) for d in devices]
    got = [fw.train_step(model, replicas, bn_states, X, y, devices, LR, settings=settings) for _ in range(3)]
    want = reference_steps(network, weights, state, X, y, 2, 3)
    assert relative(got[0], want[0]) <= BOUND["bf16"], (got, want)
    drift = BOUND["bf16"] if network == "lenet" else DRIFT
    assert max(relative(g, w) for g, w in zip(got[1:], want[1:])) <= drift, (got, want)
    for name, w in model.to_numpy(replicas[1]).items():
        np.testing.assert_array_equal(w, model.to_numpy(replicas[0])[name])


@pytest.mark.parametrize("network", NETWORKS)
def test_the_idiomatic_loop_at_bf16_is_the_reference_s_step(fw, network, digits):
    """The framework's own mixed precision (torch.autocast, MXNet's AMP conversion, a Keras dtype policy, Flax's
    dtype), in its idiomatic loop: one step's loss within BOUND of the reference's and the weights it makes within
    GRADIENT_BOUND of the reference step's, relative to the step's size (for SGD the gradients' distance). Keras's
    bias gradient (tf.nn.bias_add's, summed in bf16 on the CPU) is the largest part of TensorFlow's distance."""
    from common.interface import Network
    from harness.training.loop import Idiomatic
    weights, state, X, y = case(network, digits)
    runner = Idiomatic(fw, fw.get_devices(1), Network(NETWORKS[network], state, False, "bf16"))
    runner.start(weights, common_optim.Optimizer())
    loss = runner.step((X, y), LR, len(X))
    want_loss, grads, _ = backprop.loss_and_grads(NETWORKS[network], weights, state, X, y, "bf16")
    want = {n: w - np.float32(LR / len(X)) * grads[n] for n, w in weights.items()}
    assert relative(loss * len(X), want_loss) <= BOUND["bf16"], (loss * len(X), want_loss)
    fp32_loss = backprop.loss_and_grads(NETWORKS[network], weights, state, X, y, "fp32")[0]
    assert relative(loss * len(X), fp32_loss) > BOUND["fp32"]   # bf16 ran: the loss left fp32's
    got = runner.weights()
    moved = {n: np.asarray(got[n], np.float64) - weights[n] for n in want}
    assert total_error(moved, {n: want[n].astype(np.float64) - weights[n] for n in want}) <= GRADIENT_BOUND["bf16"]


# ------------------------------------------------------------------------------------------------- the machinery
def plan(*argv):
    import compare as cli
    from harness.run.plan import row_label, run_specs
    return [(spec.precision, spec.mode, row_label(spec), reason)
            for spec, reason in run_specs(cli.parse_args(list(argv)))]


def test_every_precision_is_a_row_of_every_mode():
    rows = plan("--frameworks", "pytorch", "--mode", "scratch,builtin", "--precision", "fp32,bf16", "--devices", "2")
    assert [(p, m) for p, m, _, _ in rows] == [("fp32", "scratch"), ("bf16", "scratch"), ("fp32", "builtin"),
                                               ("bf16", "builtin")]
    assert rows[1][2] == "pytorch scratch (default, bf16), 2 device(s), 1 process(es)"
    assert rows[0][2] == "pytorch scratch (default), 2 device(s), 1 process(es)"   # as before: --resume keeps rows
    assert all(reason is None for *_, reason in rows)
    assert RunSpec.of(RunSpec("jax", precision="bf16").to_json()).precision == "bf16"
    assert RunSpec("jax").row()["precision"] == "fp32"


def test_rows_of_each_precision_keep_their_own_files():
    """A row's checkpoints and profiles are named by its run: an fp32 and a bf16 row of one command must not write
    the same file (nor rows that accumulate differently or bucket their all-reduce)."""
    from harness.training.checkpoints import checkpoint_name
    names = {checkpoint_name(RunSpec("mxnet", mode="builtin", devices=2, **change), 3)
             for change in ({}, {"precision": "bf16"}, {"accumulate": 2}, {"allreduce": "bucketed"})}
    assert len(names) == 4 and "mxnet-builtin-2d-1p-epoch3.params" in names   # fp32's as before
    assert "mxnet-builtin-bf16-2d-1p-epoch3.params" in names


def test_an_unknown_precision_is_one_line():
    proc = run_compare("--precision", "fp8")
    assert proc.returncode != 0 and "unknown precision 'fp8'; choose from fp32, bf16" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_the_table_shows_the_precision_and_compares_bf16_rows_among_themselves():
    from harness.publishing.tables import add_parity, table_cells
    base = {"framework": "pytorch", "mode": "scratch", "devices": 2, "processes": 1, "status": "ok", "exec": "eager",
            "layout": "nhwc", "epochs": 1, "batch_size": 256}
    runs = [{**base, "precision": "fp32", "step_losses": [2.0]}, {**base, "precision": "bf16", "step_losses": [2.01]},
            {**base, "framework": "jax", "precision": "bf16", "step_losses": [2.011]}]
    add_parity(runs)
    assert [r["step1_loss_diff"] for r in runs] == pytest.approx([0.0, 0.0, 0.001])
    columns, rows = table_cells(runs)
    assert [row[columns.index("precision")] for row in rows] == ["fp32", "bf16", "bf16"]
    assert "precision" not in table_cells(runs[:1])[0]   # an fp32 table as before


def test_rows_that_differ_only_in_the_all_reduce_dtype_are_told_apart_in_the_table_and_the_plot():
    from harness.publishing.plots import label
    from harness.publishing.tables import table_cells
    base = {"framework": "jax", "mode": "builtin", "devices": 2, "processes": 1, "status": "ok", "exec": "jax.jit",
            "layout": "NHWC/HWIO (lax)", "epochs": 1, "batch_size": 256}
    runs = [{**base, "allreduce_dtype": "fp32"}, {**base, "allreduce_dtype": "bf16"}]
    columns, rows = table_cells(runs)
    assert [row[columns.index("all-reduce dtype")] for row in rows] == ["fp32", "bf16"]
    assert "all-reduce dtype" not in table_cells(runs[:1])[0]   # an fp32 table as before
    assert [label(r) for r in runs] == ["jax builtin jax.jit NHWC/HWIO 2d/1p, 1 trial",
                                        "jax builtin jax.jit NHWC/HWIO 2d/1p, bf16 all-reduce, 1 trial"]


def test_fp16_rows_carry_their_loss_scaling_and_a_bad_scale_is_one_line():
    from harness.training.loop import network_of
    rows = plan("--frameworks", "jax", "--precision", "fp32,fp16", "--loss-scale", "1024", "--loss-scale-interval", "3")
    assert [label for _, _, label, _ in rows][1] == "jax scratch (default, fp16), 2 device(s), 1 process(es)"
    fp16 = RunSpec("jax", precision="fp16", loss_scale=1024.0, loss_scale_interval=3)
    assert network_of(fp16).loss_scaling[:2] == (1024.0, 3)
    assert network_of(RunSpec("jax", precision="bf16")).loss_scaling is None   # bf16 has fp32's exponent
    proc = run_compare("--precision", "fp16", "--loss-scale", "1000")
    assert proc.returncode != 0 and "--loss-scale 1000: the loss scale must be a power of two" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_what_a_low_precision_buys_is_its_row_against_the_fp32_row_of_the_same_run(tmp_path):
    """The speed and memory ratios pair each bf16 row with the fp32 row of the same framework, mode and devices;
    a bf16 row's share of the machine is of the bf16 matmul peak; the CSV names the precision."""
    from harness.publishing.tables import format_precision, precision_cells, precision_ratios
    from harness.studies.benchmark import add_peak_fraction, write_csv
    base = {"framework": "pytorch", "model": "lenet", "mode": "scratch", "exec": "eager", "devices": 2,
            "processes": 1, "status": "ok", "gflops": 10.0, "test_accuracy": 0.9}
    runs = [{**base, "precision": "fp32", "images_per_second": 1000.0, "train_memory_bytes": 200, "peak_rss_bytes": 800},
            {**base, "precision": "bf16", "images_per_second": 1500.0, "train_memory_bytes": 100, "peak_rss_bytes": 600},
            {**base, "mode": "builtin", "precision": "bf16", "images_per_second": 900.0},   # no fp32 builtin row
            {**base, "framework": "jax", "precision": "fp32", "images_per_second": 500.0}]
    (low, fp32, speed, memory, rss), = precision_ratios(runs)
    assert (low, fp32) == (runs[1], runs[0]) and (speed, memory, rss) == (1.5, 0.5, 0.75)
    assert precision_cells(runs)[1] == [["pytorch", "scratch (eager), 2 device(s), 1 process(es)", "bf16", "1,500",
                                         "1,000", "1.50", "0.50", "0.75", "0.9000", "0.9000"]]
    assert format_precision(runs).count("\n") == 2 and format_precision(runs[2:]) == ""   # one row, or no table
    add_peak_fraction(runs, {"matmul_peak_gflops_start": 100.0, "low_matmul_peaks_gflops": {"bf16": 400.0}})
    assert [r["peak_fraction"] for r in runs] == [0.1, 0.025, 0.025, 0.1]
    add_peak_fraction(runs, {"matmul_peak_gflops_start": 40.0, "matmul_peak_gflops_end": 30.0,
                             "low_matmul_peaks_gflops": {"fp32": 250.0, "bf16": 400.0}})
    assert [r["peak_fraction"] for r in runs] == [0.04, 0.025, 0.025, 0.04]   # numpy's weak BLAS is no yardstick
    write_csv(tmp_path / "run.csv", runs, {})
    header = (tmp_path / "run.csv").read_text().splitlines()[0].split(",")
    assert "precision" in header and "accumulate" not in header   # a column only where a row sets it


def test_a_bf16_engine_s_checkpoint_keeps_the_fp32_master_weights_and_converts(fw, digits, tmp_path, capsys, request):
    """Two bf16 steps of the framework's built-in engine, checkpointed the harness's way: the file holds the fp32
    master weights the engine trains (to the bit, and not bf16 values: a bf16 copy saved by mistake would be), and
    it converts to the next framework's format with --verify."""
    from harness.training.checkpoints import SUFFIXES, read_model, saver
    from harness.training.convert import main as convert
    from harness.training.loop import Hooks, runner as runner_for, train
    from common import FRAMEWORKS
    spec = RunSpec(fw.name, mode="builtin", batch_size=32, epochs=1, max_steps=2, precision="bf16",
                   checkpoint_dir=str(tmp_path))
    optimizer = common_optim.Optimizer()
    if fw.name == "pytorch":
        request.getfixturevalue("gloo_group")   # DDP, in a process group of this one process
    runner = runner_for(spec, fw, fw.get_devices(1))
    train(runner, digits, spec, optimizer, hooks=Hooks(after_epoch=saver(spec, 0, optimizer, steps_per_epoch=2)))
    (path,) = [str(p) for p in tmp_path.iterdir() if p.name.endswith(SUFFIXES[fw.name]) and "bf16" in p.name]
    weights, _ = read_model(fw.name, path)
    trained = runner.weights()
    assert all(np.array_equal(weights[n], trained[n]) for n in trained)
    assert not all(precision.is_representable(w, "bf16") for w in weights.values())
    target = FRAMEWORKS[(FRAMEWORKS.index(fw.name) + 1) % len(FRAMEWORKS)]
    assert convert([path, str(tmp_path / f"converted{SUFFIXES[target]}"), "--verify"]) == 0
    assert "largest |logit difference|" in capsys.readouterr().out


# ------------------------------------------------------------------------------- the gradients' precision on the wire
def test_bf16_on_the_wire_rounds_each_gradient_and_each_sum():
    a, b = np.float32([1 + 2 ** -7, 3.0, 1e-3]), np.float32([2 ** -8, 2 ** -9, 1e-3])
    wire = precision.summed_on_the_wire([a, b], "bf16")
    assert wire.dtype == np.float32 and precision.is_representable(wire, "bf16")
    np.testing.assert_array_equal(wire, precision.rounded(precision.rounded(a, "bf16") + precision.rounded(b, "bf16"),
                                                          "bf16").astype(np.float32))
    assert wire[0] == 1 + 2 ** -6 and wire[1] == 3.0   # a tie to even, and a sum below half a bf16 step lost
    np.testing.assert_array_equal(precision.summed_on_the_wire([a, b], "fp32"), a + b)
    from harness.studies.benchmark import aggregate
    trial = {"framework": "jax", "status": "ok", "images_per_second": 10.0, "devices": 2, "allreduce_dtype": "bf16"}
    assert aggregate([trial])["allreduce_bytes"] == 2 * 129068 and "allreduce_bytes" not in aggregate([
        {**trial, "devices": 1}])   # a row records what a device sends per step; one device sends nothing
    assert precision.wire_bytes(models.parameter_count("lenet"), "bf16") * 2 == \
        precision.wire_bytes(models.parameter_count("lenet"), "fp32") == 4 * 129068   # the LeNet's gradients


def test_the_wire_s_dtype_is_a_row_where_there_is_a_wire():
    rows = {label: reason for _, _, label, reason in plan(
        "--frameworks", "pytorch,tensorflow", "--mode", "scratch,builtin", "--allreduce-dtype", "fp32,bf16",
        "--devices", "1,2")}
    assert rows["tensorflow scratch (default, bf16 all-reduce), 2 device(s), 1 process(es)"] is None
    assert rows["pytorch builtin (default, bf16 all-reduce), 2 device(s), 2 process(es)"] is None   # DDP
    assert "no option for another" in rows["tensorflow builtin (default, bf16 all-reduce), 2 device(s), 1 process(es)"]
    assert rows["pytorch scratch (default, bf16 all-reduce), 1 device(s), 1 process(es)"] == \
        "--allreduce-dtype: one device has no all-reduce"


@pytest.mark.parametrize("bucket_bytes", [None, 2 ** 16])
def test_the_scratch_all_reduce_puts_bf16_on_the_wire(fw, digits, bucket_bytes):
    """allreduce_gradients(..., dtype='bf16'), per tensor and by buckets: every device ends with the spec's sum of
    the devices' gradients rounded to bf16, summed in bf16 (summed_on_the_wire), to the bit; with 'fp32' the sum is
    not bf16's (so the cast really happened)."""
    weights, _, X, y = case("lenet", digits, 32)
    model, _ = scratch(fw.name, "lenet")
    devices = fw.get_devices(2)
    sums = {}
    for dtype in ("fp32", "bf16"):
        replicas = [model.get_params(weights, d) for d in devices]
        _, grads, _ = model.loss_and_grads(replicas, [None, None], fw.split_and_load(X, devices),
                                           fw.split_and_load(y, devices), devices)
        local = [model.to_numpy(g) for g in grads]
        local = [{n: np.array(g[n], copy=True) for n in g} for g in local]
        out = fw.allreduce_gradients(grads, bucket_bytes, dtype)
        sums[dtype] = [model.to_numpy(g) for g in out]
        for name in local[0]:
            want = precision.summed_on_the_wire([g[name] for g in local], dtype)
            for device_sum in sums[dtype]:
                np.testing.assert_array_equal(np.asarray(device_sum[name], np.float32), want, err_msg=name)
    assert not all(precision.is_representable(sums["fp32"][0][n], "bf16") for n in sums["fp32"][0])


def test_the_scratch_step_with_bf16_on_the_wire_updates_by_the_bf16_sum(fw, digits):
    """One train_step with settings.allreduce_dtype='bf16' on two devices: the replicas move by lr / batch times the
    bf16 sum of the devices' gradients (the reference's: within 1e-2 in norm, for the few gradients whose fp32 value
    lies within fp32's rounding of a bf16 tie and rounds the other way), not by the fp32 sum's step (the setting
    reaches the all-reduce), and stay equal."""
    weights, _, X, y = case("lenet", digits, 32)
    model, settings = scratch(fw.name, "lenet")
    devices = fw.get_devices(2)
    shards = [backprop.loss_and_grads("lenet", weights, None, X[a:b], y[a:b])[1] for a, b in shard_bounds(len(X), 2)]
    want = {n: -LR / len(X) * precision.summed_on_the_wire([g[n] for g in shards], "bf16").astype(np.float64)
            for n in weights}
    moved = {}
    for dtype in ("fp32", "bf16"):
        replicas = [model.get_params(weights, d) for d in devices]
        fw.train_step(model, replicas, [None, None], X, y, devices, LR, settings=settings._replace(allreduce_dtype=dtype))
        got = model.to_numpy(replicas[0])
        moved[dtype] = {n: got[n].astype(np.float64) - weights[n] for n in weights}
        for name in weights:
            np.testing.assert_array_equal(got[name], model.to_numpy(replicas[1])[name])
    assert total_error(moved["bf16"], want) <= 1e-2
    assert total_error(moved["fp32"], want) > total_error(moved["bf16"], want)
