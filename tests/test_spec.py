"""One run spec: every field's default in one place, the command line's defaults taken from it, and a worker's
JSON read back into the same spec (a hand-launched worker's few fields filled in the same way)."""
import dataclasses
import json

import pytest

from common import RosettaError
from harness.spec import RunSpec


def test_a_spec_round_trips_through_json():
    spec = RunSpec(framework="jax", mode="builtin", devices=4, processes=2, dataset="synthetic", n_synthetic=600)
    assert RunSpec.of(spec.to_json()) == spec and RunSpec.of(spec.to_dict()) == spec and RunSpec.of(spec) is spec
    assert spec.per_process == 2 and spec.epochs == 10


def test_defaults_fill_a_hand_launched_spec():
    """docs/usage.md's SPEC gives a few fields; the rest are RunSpec's defaults (digits: 30 epochs)."""
    spec = RunSpec.of('{"framework": "pytorch", "devices": 2, "processes": 2, "dataset": "digits"}')
    assert (spec.mode, spec.exec, spec.layout, spec.cores, spec.epochs, spec.batch_size, spec.lr, spec.seed,
            spec.init, spec.n_synthetic, spec.threads, spec.per_process) == \
        ("scratch", "default", "default", "shared", 30, 256, 0.2, 0, "he", 60000, None, 1)


@pytest.mark.parametrize("bad,message", [
    ('{"framework": "pytorch", "epoch": 3}', "unknown run spec field.*'epoch'"),
    ('{"devices": 2}', 'at least a "framework"'),
    ("not json", "not JSON"),
])
def test_a_bad_spec_is_one_clear_error(bad, message):
    with pytest.raises(RosettaError, match=message):
        RunSpec.of(bad)


def test_compare_py_takes_its_defaults_from_the_spec():
    import compare
    args = compare.parse_args([])
    for field in ("mode", "cores", "dataset", "n_synthetic", "batch_size", "lr", "seed", "init"):
        default = next(f.default for f in dataclasses.fields(RunSpec) if f.name == field)
        value = getattr(args, field)
        assert (value[0] if isinstance(value, list) else value) == default, field
    assert args.epochs == RunSpec(framework="pytorch").epochs == 30


def test_the_planned_rows_are_specs_with_the_options_values():
    import compare
    from harness.run.plan import run_specs
    args = compare.parse_args(["--frameworks", "pytorch,mxnet", "--mode", "scratch,builtin", "--devices", "1,2",
                               "--epochs", "3", "--lr", "0.1"])
    rows = list(run_specs(args))
    assert len(rows) == 8 and all(isinstance(spec, RunSpec) for spec, _ in rows)
    assert {(s.epochs, s.lr, s.batch_size) for s, _ in rows} == {(3, 0.1, 256)}
    ddp = [s for s, _ in rows if (s.framework, s.mode) == ("pytorch", "builtin")]
    assert [(s.devices, s.processes) for s in ddp] == [(1, 1), (2, 2)]   # DDP: one process per device
    assert json.loads(ddp[1].to_json())["processes"] == 2


def test_a_schedule_s_own_options_reach_the_spec_s_optimizer_in_steps():
    """--lr-decay-at and --lr-decay-every are epochs, the spec's schedule counts steps: a row's optimizer gets them at
    the run's steps per epoch; the table's line says them. An option of another schedule is one line."""
    import compare
    from common.optim import Optimizer
    from harness.publishing.tables import optimizer_line
    from harness.run.plan import run_specs
    cases = {("--lr-schedule", "step", "--lr-decay-at", "1,2.5", "--lr-decay-factor", "0.5"):
             ({"decay_at": (10, 25), "decay_factor": 0.5}, "step schedule (x0.5, at epochs 1, 2.5)"),
             ("--lr-schedule", "factor", "--lr-decay-every", "0.5"): ({"decay_every": 5}, "factor schedule (every 0.5"),
             ("--lr-schedule", "poly", "--lr-power", "1.5"): ({"power": 1.5}, "poly schedule (power 1.5)"),
             ("--lr-schedule", "cosine", "--lr-final", "0.01"): ({"final_lr": 0.01}, "cosine schedule (to 0.01)")}
    for options, (given, line) in cases.items():
        args = compare.parse_args(["--frameworks", "pytorch", "--epochs", "4", "--lr", "0.1", *options])
        spec = next(iter(run_specs(args)))[0]
        assert spec.canonical_optimizer(10) == Optimizer("sgd", 0.1, schedule=options[1], total_steps=40, **given)
        assert RunSpec.of(spec.to_json()) == spec and line in optimizer_line(args), optimizer_line(args)


def test_rmsprop_s_options_reach_the_spec_s_optimizer_and_momentum_defaults_by_optimizer():
    """rmsprop's momentum is none unless given (torch's, Keras's and Optax's default), momentum's and nesterov's 0.9;
    --rmsprop-alpha and --rmsprop-centered reach the row's optimizer and the table's line, and survive JSON."""
    import compare
    from common.optim import Optimizer
    from harness.publishing.tables import optimizer_line
    from harness.run.plan import run_specs
    cases = {("--optimizer", "rmsprop"): ({"momentum": 0.0}, "optimizer: rmsprop, lr 0.1"),
             ("--optimizer", "rmsprop", "--rmsprop-centered", "--momentum", "0.5", "--rmsprop-alpha", "0.9"):
             ({"momentum": 0.5, "centered": True, "alpha": 0.9}, "rmsprop centered momentum 0.5 alpha 0.9,"),
             ("--optimizer", "nesterov"): ({"momentum": 0.9}, "optimizer: nesterov 0.9,"),
             ("--optimizer", "adagrad"): ({}, "optimizer: adagrad, lr 0.1")}
    for options, (given, line) in cases.items():
        args = compare.parse_args(["--frameworks", "pytorch", "--epochs", "4", "--lr", "0.1", *options])
        spec = next(iter(run_specs(args)))[0]
        assert spec.canonical_optimizer(10) == Optimizer(options[1], 0.1, total_steps=40, **given)
        assert RunSpec.of(spec.to_json()) == spec and line in optimizer_line(args), optimizer_line(args)
    assert RunSpec("jax", optimizer="rmsprop").momentum == 0.0 and RunSpec("jax", optimizer="momentum").momentum == 0.9


@pytest.mark.parametrize("options, says", [
    (["--optimizer", "adam", "--rmsprop-centered"], "--rmsprop-alpha and --rmsprop-centered are rmsprop's, not "
     "--optimizer adam's"),
    (["--optimizer", "rmsprop", "--rmsprop-alpha", "1"], "--rmsprop-alpha must be in (0, 1)"),
    (["--lr-schedule", "step", "--lr-power", "3"], "--lr-power is the poly schedule's, not --lr-schedule step's"),
    (["--lr-schedule", "step", "--warmup-epochs", "1", "--lr-decay-at", "0.5"], "--lr-decay-at: increasing epochs"),
    (["--lr-schedule", "factor", "--lr-decay-factor", "2"], "--lr-decay-factor in (0, 1]"),
    (["--lr-schedule", "cosine", "--lr-final", "1"], "--lr-final 1 is above the rate the cosine decays from, 0.2"),
    (["--lr-schedule", "cosine", "--lr-final", "0.1", "--lr-scaling", "linear", "--per-device-batch", "32,64"],
     "--lr-final 0.1 is above the rate the cosine decays from, 0.05 (the smallest global batch's"),
])
def test_a_schedule_option_that_does_nothing_or_cannot_be_is_one_line(options, says, capsys):
    import compare
    with pytest.raises(SystemExit) as exit_:
        compare.parse_args(options)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_several_per_device_batches_are_rows_with_their_batch_in_the_label_and_the_table():
    import compare
    from harness.run.plan import row_label, run_specs
    from harness.publishing.tables import format_table
    rows = [spec for spec, _ in run_specs(compare.parse_args(["--frameworks", "pytorch", "--devices", "4",
                                                              "--per-device-batch", "4,64"]))]
    assert [s.batch_size for s in rows] == [16, 256]
    assert [row_label(s) for s in rows] == ["pytorch scratch (default), 4 device(s), batch 16, 1 process(es)",
                                            "pytorch scratch (default), 4 device(s), 1 process(es)"]
    runs = [{**s.row(), "status": "ok"} for s in rows]
    header, _, small, large = format_table(runs).splitlines()
    assert header.split("|")[5].strip() == "batch" and small.split("|")[5].strip() == "16"
    assert "batch" not in format_table(runs[:1])


def test_rows_of_other_batch_sizes_are_not_compared_at_the_first_step():
    """--per-device-batch 4,64 on 4 devices: the first batches are 16 and 256 images, different losses by design;
    each row of a batch size is its own reference (found when a batch-size table showed 0.64 as a parity gap)."""
    from harness.publishing.tables import add_parity
    runs = [{"framework": "pytorch", "mode": "scratch", "devices": 4, "processes": 1, "status": "ok",
             "batch_size": b, "step_losses": [loss]} for b, loss in ((16, 2.9), (256, 2.3), (16, 2.9 + 1e-6))]
    add_parity(runs)
    assert [r["step1_loss_diff"] for r in runs] == [0.0, 0.0, pytest.approx(1e-6)]
