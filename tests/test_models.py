"""--model, --width and --bn in the machinery (no training here): the spec of a run, the rows planned, the options a
ResNet refuses with one line, the parity column's groups, the table's and the CSV's BatchNorm columns."""
import csv

import numpy as np
import pytest

from common import models
from common.interface import RosettaError
from conftest import run_compare as compare
from harness.spec import RunSpec


def test_each_model_has_its_spec_s_weights_and_flops():
    lenet, resnet = models.init_weights("lenet", seed=3), models.init_weights("resnet18", seed=3, width=16)
    assert "conv1.weight" in lenet and "stage4.1.bn2.weight" in resnet
    assert resnet["stem.conv.weight"].shape == (16, 1, 3, 3)
    assert np.array_equal(models.init_weights("resnet18", seed=3)["fc.weight"],
                          models.init_weights("resnet18", seed=3, width=models.DEFAULT_WIDTH)["fc.weight"])
    assert models.init_bn_state("lenet") is None
    assert models.init_bn_state("resnet18", 16)["stem.bn.running_var"].tolist() == [1.0] * 16
    # the ResNet at width 64 is d2l's 2.7 GFLOP a training image, ~200x the LeNet's; FLOPs grow with width squared
    assert models.flops_per_image("resnet18", 64) / models.flops_per_image("lenet") > 150
    ratio = models.flops_per_image("resnet18", 16) / models.flops_per_image("resnet18", 8)
    assert 3.9 < ratio < 4.0   # the stem's one input channel grows linearly


def test_a_run_spec_knows_its_network():
    resnet = RunSpec("pytorch", model="resnet18")
    assert (resnet.width, resnet.bn, resnet.lr) == (models.DEFAULT_WIDTH, "local", 0.1)   # d2l's rate
    assert RunSpec("pytorch", model="resnet18", optimizer="adam").lr == 1e-3
    lenet = RunSpec("pytorch", width=16, bn="sync")   # a hand-written LeNet spec: neither applies
    assert (lenet.width, lenet.bn, lenet.lr) == (None, None, 0.2)
    assert RunSpec.of(RunSpec("jax", model="resnet18", bn="sync", width=4).to_json()).bn == "sync"
    for bad, message in [({"model": "vgg"}, "unknown model 'vgg'"), ({"model": "resnet18", "bn": "global"},
                         "unknown BatchNorm mode 'global'"), ({"model": "resnet18", "init": "recipe"}, "--init recipe"),
                         ({"model": "resnet18", "width": -2}, "--width must be >= 1")]:
        with pytest.raises(RosettaError, match=message):
            RunSpec("pytorch", **bad)


def plan(*argv):
    import compare as cli
    from harness.run.plan import run_specs
    return list(run_specs(cli.parse_args(list(argv))))


def test_every_bn_mode_is_a_row_and_exec_levels_are_the_resnet_s_too():
    """The one scratch step takes the exec level and the layout whatever the network (a framework that cannot
    compile a combination says so as a skipped row, at run time, with its own reason)."""
    rows = plan("--model", "resnet18", "--width", "16", "--bn", "local,sync", "--frameworks", "mxnet",
                "--exec", "default,graph", "--devices", "2")
    specs = [(s.model, s.width, s.bn, s.exec, reason) for s, reason in rows]
    assert specs[0] == ("resnet18", 16, "local", "default", None)
    assert [s[2] for s in specs] == ["local", "sync", "local", "sync"]
    assert all(reason is None for *_, reason in specs)
    from harness.run.plan import row_label
    assert row_label(rows[1][0]) == "mxnet scratch (resnet18 w16 sync BN, default), 2 device(s), 1 process(es)"
    lenet = plan("--frameworks", "mxnet")[0][0]
    assert (lenet.model, lenet.width, lenet.bn) == ("lenet", None, None)
    assert row_label(lenet) == "mxnet scratch (default), 2 device(s), 1 process(es)"   # as before: --resume keeps rows


@pytest.mark.parametrize("args,message", [
    (["--width", "16"], "--width and --bn are the ResNet's"),
    (["--bn", "sync"], "--width and --bn are the ResNet's"),
    (["--model", "resnet18", "--bn", "global"], "unknown BatchNorm mode 'global'"),
    (["--model", "resnet50"], "invalid choice: 'resnet50'"),
    (["--model", "resnet18", "--width", "0"], "--width must be >= 1"),
    (["--model", "resnet18", "--init", "recipe"], "--init recipe is the LeNet's"),
])
def test_what_the_resnet_refuses_is_one_line(args, message):
    proc = compare(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_the_resnet_plans_every_optimizer_option():
    """A BatchNorm network with momentum, weight decay, clipping and a schedule: what real programs run, planned as
    given for every mode and BatchNorm (no combination of these options is refused)."""
    rows = plan("--model", "resnet18", "--bn", "local,sync", "--mode", "scratch,builtin,idiomatic", "--optimizer",
                "adamw", "--weight-decay", "1e-2", "--clip-norm", "5", "--lr-schedule", "cosine", "--warmup-epochs", "1")
    specs = [spec for spec, *_ in rows]
    assert {(s.mode, s.bn) for s in specs} >= {("scratch", "sync"), ("builtin", "local"), ("idiomatic", "sync")}
    assert {(s.optimizer, s.weight_decay, s.clip_norm, s.lr_schedule, s.warmup_epochs) for s in specs} == {
        ("adamw", 1e-2, 5.0, "cosine", 1.0)}


def test_the_optimizer_line_names_the_resnet_s_own_default_rate():
    """A schedule prints the training options above the table: the rate the ResNet trains at is d2l's 0.1."""
    import argparse
    from harness.publishing.tables import optimizer_line
    args = argparse.Namespace(model="resnet18", optimizer="sgd", lr=None, lr_scaling="none", lr_schedule="cosine",
                              warmup_epochs=0, weight_decay=0, clip_norm=None, momentum=0.9)
    assert optimizer_line(args) == "optimizer: sgd, lr 0.1, cosine schedule"
    assert optimizer_line(argparse.Namespace(**{**vars(args), "model": "lenet"})) == \
        "optimizer: sgd, lr 0.2, cosine schedule"
    # the linear scaling rule alone changes the rate: the line says so (the batch-size table's)
    assert optimizer_line(argparse.Namespace(**{**vars(args), "lr_schedule": "constant", "lr_scaling": "linear",
                                                "reference_batch": 256})) == \
        "optimizer: sgd, lr 0.1 x batch / 256, constant schedule"


def run(framework, devices, loss, bn="local", model="resnet18", processes=1, states=None):
    return {"framework": framework, "model": model, "width": 8 if model != "lenet" else None,
            "bn": bn if model != "lenet" else None, "mode": "scratch", "exec": "eager", "layout": "-", "devices": devices,
            "processes": processes, "epochs": 1, "status": "ok", "step_losses": [loss], "epoch_losses": [loss],
            "bn_states": states, "bn_replicas": devices if states else None}


def test_parity_compares_runs_that_compute_the_same_first_step():
    """Local BatchNorm on 2 devices normalises two halves apart: its first loss is compared with other 2-device local
    rows, not with 1 device's; sync on any number of devices, and 1 device, are the whole batch's. With --accumulate
    each micro-batch is normalised apart too (a ResNet's first losses at 2 micro-batches differed from 1's by 8.6e-3
    to 1.5e-2, shown as parity gaps), but the LeNet's micro-batch losses add up to the batch's."""
    from harness.publishing.tables import add_parity

    def accumulated(row, k=2):
        return {**row, "accumulate": k}
    runs = [run("pytorch", 1, 2.0), run("jax", 2, 2.0001, "sync"), run("mxnet", 2, 2.3), run("tensorflow", 2, 2.3002),
            run("jax", 3, 2.5), run("pytorch", 2, 2.9, model="lenet"), run("jax", 2, 2.9001, model="lenet"),
            accumulated(run("pytorch", 2, 2.4)), accumulated(run("jax", 2, 2.4001)),   # 2 shards, 2 micro-batches each
            accumulated(run("tensorflow", 2, 2.6, "sync")),   # each micro-batch a slice of both devices' shards
            accumulated(run("pytorch", 1, 2.7)),   # the batch's two halves
            accumulated(run("mxnet", 2, 2.9002, model="lenet"))]
    add_parity(runs)
    diffs = [r["step1_loss_diff"] for r in runs]
    assert diffs == [0.0, pytest.approx(1e-4), 0.0, pytest.approx(2e-4), 0.0, 0.0, pytest.approx(1e-4),
                     0.0, pytest.approx(1e-4), 0.0, 0.0, pytest.approx(2e-4)]
    assert runs[3]["parity_reference"] == "mxnet scratch 2d/1p"


def test_the_table_and_the_csv_show_the_network_and_its_batchnorm_states(tmp_path):
    from harness.studies.benchmark import write_csv
    from harness.publishing.tables import format_table
    lenet = [run("pytorch", 2, 2.9, model="lenet")]
    assert "BN" not in format_table(lenet) and "model" not in format_table(lenet)
    runs = lenet + [run("mxnet", 2, 2.3, states=2), run("mxnet", 2, 2.3, "sync", states=1)]
    table = format_table(runs).splitlines()
    assert [cell.strip() for cell in table[0].split("|")[1:4]] == ["framework", "model", "BN: running states"]
    assert [[cell.strip() for cell in line.split("|")[2:4]] for line in table[2:]] == [
        ["lenet", "-"], ["resnet18 w8", "local: 2 of 2"], ["resnet18 w8", "sync: 1 of 2"]]
    for rows, has_model in ((lenet, False), (runs, True)):
        write_csv(tmp_path / "t.csv", rows, {})
        with open(tmp_path / "t.csv") as f:
            read = list(csv.DictReader(f))
        assert ("model" in read[0]) == has_model and ("bn_states" in read[0]) == has_model
    assert [(r["model"], r["bn"], r["bn_states"]) for r in read] == [("lenet", "", ""), ("resnet18", "local", "2"),
                                                                      ("resnet18", "sync", "1")]


def test_the_benchmark_times_the_resnet_in_its_default_exec_level_and_both_all_reduces():
    rows = plan("--benchmark", "--model", "resnet18", "--frameworks", "jax")
    ran = [(s.mode, s.exec, s.layout, s.devices, s.processes, s.cores, s.allreduce) for s, reason in rows if not reason]
    assert ran[0] == ("scratch", "default", "default", 1, 1, "shared", "per-tensor")   # the 'of peak' row
    assert ("scratch", "default", "default", 2, 2, "per-device", "bucketed") in ran
    assert [s.n_synthetic for s, _ in rows] == [5120] * len(rows)
    lenet = plan("--benchmark", "--frameworks", "jax")   # one bucketed row: the scratch step across 2 processes
    assert [(s.mode, s.devices, s.processes) for s, _ in lenet if s.allreduce == "bucketed"] == [("scratch", 2, 2)]
