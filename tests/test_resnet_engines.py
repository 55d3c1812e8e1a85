"""The ResNet in worker processes, as compare.py runs it: synchronised BatchNorm across 2 processes is one device
holding the whole batch, in the recipe and in each framework's own engine; the built-in engines with local BatchNorm
compute the recipe's local step; and what each engine does with its replicas' running statistics, measured (how
many different states its replicas end with). The in-process steps are the reference (tests/test_resnet_training.py
proves them against the spec)."""
import numpy as np
import pytest

from common import FRAMEWORKS, Unavailable
from common.optim import Optimizer
from harness.processes.launch import run_workers
from harness.spec import RunSpec

pytestmark = pytest.mark.slow   # every test here starts real worker processes

WIDTH, BATCH, SEED, STEPS, LR = 8, 97, 5, 1, 0.1
# One step: BatchNorm's backward cancels large terms on these images (the stem's gradient is 49.44 in float32 and
# 49.32 in float64), so float32 round-off of a reordered sum moves a weight by ~1e-4 after one step, and a second
# step multiplies that tenfold. Local against synchronised BatchNorm differs by 1e-2 after one step.
TOL = 1e-3


# The built-in engines' local step with the framework's own optimizer over the ResNet's parameters: momentum with a
# decay large enough to show on BatchNorm's scale and shift after one step (0.1 x 0.05 x 1 = 5e-3 > TOL).
MOMENTUM = {"optimizer": "momentum", "weight_decay": 0.05}


@pytest.fixture
def reference(recipe_runs):
    """weights(framework, devices, optimizer): the recipe's first STEPS steps in this process, run once a session
    (tests/test_resnet_modes.py's reference on one device is the same run). One device with local BatchNorm is the
    whole batch's statistics without the all-reduce path that the synchronised rows test. With an optimizer
    (common.optim.Optimizer), its update and state in the one scratch step."""
    def weights(framework, devices, optimizer=None):
        spec = RunSpec(framework=framework, model="resnet18", width=WIDTH, bn="local", mode="scratch", devices=devices,
                       dataset="digits", epochs=1, batch_size=BATCH, lr=LR, seed=SEED, threads=1, max_steps=STEPS)
        return recipe_runs(spec, optimizer or Optimizer(lr=LR))[0]
    return weights


def workers(framework, mode, devices, processes, bn, tmp_path, timeout=300, **options):
    """A row's processes: (their records, rank 0's final weights), or the skip reason of a row that cannot run."""
    out = tmp_path / f"{framework}-{mode}-{devices}-{processes}-{bn}.npz"
    spec = {"framework": framework, "model": "resnet18", "width": WIDTH, "bn": bn, "mode": mode, "devices": devices,
            "processes": processes, "dataset": "digits", "epochs": 1, "batch_size": BATCH, "lr": LR, "seed": SEED,
            "threads": 1, "max_steps": STEPS, "weights_out": str(out), **options}
    results = run_workers(spec, timeout=timeout)
    if results[0]["status"] == "skipped":
        return results[0]["error"], None
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    assert len({r["digest"] for r in results}) == 1, "processes hold different weights"
    return results, dict(np.load(out))


def assert_weights(got, want, what, tol=TOL):
    for name, value in want.items():
        err = np.max(np.abs(got[name] - value) / np.maximum(1.0, np.abs(value)))
        assert err <= tol, f"{what}: {name} off by {err:.1e}"


def states(results):
    """How many different running states the row's replicas (every process's) ended with, of how many."""
    digests = sum((r["bn_digests"] for r in results), [])
    return len(set(digests)), len(digests)


# What each engine does with the replicas' running statistics under local BatchNorm, measured at the end of a run of
# 2 devices (docs/rosetta.md, "BatchNorm in data parallel"): (different states, replicas).
LOCAL_BUILTIN_STATES = {
    "pytorch": (2, 2),      # DDP: rank 0's buffers broadcast before each forward, then each rank's shard moves its own
    "mxnet": (2, 2),        # Gluon: each context keeps its own
    "tensorflow": (2, 2),   # Keras under tf.distribute: each replica's own copy (reading the variable gives replica 0's)
    "jax": (2, 2),          # shard_map: each device's shard's statistics, out of shard_map per device
}
# Where a framework's own synchronised BatchNorm cannot run here, the row is skipped with the framework's reason.
SYNC_BUILTIN_SKIPS = {
    "pytorch": "SyncBatchNorm",   # torch.nn.SyncBatchNorm: GPU modules only
    "mxnet": "SyncBatchNorm",     # Gluon's contrib SyncBatchNorm: the devices of one process only
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sync_batchnorm_across_processes_is_one_device(framework, reference, tmp_path):
    """The recipe's all-reduce of the moments across 2 processes, differentiated through: the whole batch's step."""
    results, weights = workers(framework, "scratch", 2, 2, "sync", tmp_path)
    assert weights is not None, results
    assert_weights(weights, reference(framework, 1), f"{framework} scratch sync 2 processes")
    assert states(results) == (1, 2)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_built_in_engine_computes_the_local_step(framework, reference, tmp_path):
    """Across 2 processes of a device each (one process of 2 devices: tests/test_resnet_modes.py), with the
    framework's own momentum and weight decay over the ResNet's parameters (DDP's torch.optim.SGD, Gluon's Trainer,
    Keras's SGD, Optax)."""
    results, weights = workers(framework, "builtin", 2, 2, "local", tmp_path, **MOMENTUM)
    assert weights is not None, results
    optimizer = Optimizer(MOMENTUM["optimizer"], LR, weight_decay=MOMENTUM["weight_decay"], total_steps=STEPS)
    assert_weights(weights, reference(framework, 2, optimizer), f"{framework} builtin local momentum")
    assert states(results) == LOCAL_BUILTIN_STATES[framework]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_built_in_engine_synchronises_or_says_why_not(framework, reference, tmp_path):
    """Across 2 processes of a device each (one process of 2 devices: tests/test_resnet_modes.py)."""
    results, weights = workers(framework, "builtin", 2, 2, "sync", tmp_path)
    skip = SYNC_BUILTIN_SKIPS.get(framework)
    if skip:
        assert weights is None and skip in results, results
        return
    assert weights is not None, results
    assert_weights(weights, reference(framework, 1), f"{framework} builtin sync 2 processes")
    assert states(results) == (1, 2)


def test_gluon_s_synchronised_batchnorm_on_cpu_contexts_is_one_device(reference, tmp_path):
    """Gluon's contrib SyncBatchNorm on 2 CPU contexts of one process, which hangs unless MXNet starts with a scratch
    buffer for each of its ops (common/cpu_scratch.py): the worker's launcher gives it them, and the step is one
    device's. MXNet's own BatchNorm op rounds more in float32 (tests/test_resnet_modes.py's ENGINE_TOL)."""
    results, weights = workers("mxnet", "builtin", 2, 1, "sync", tmp_path, timeout=120)   # 10 s when it runs
    assert weights is not None, results
    assert_weights(weights, reference("mxnet", 1), "mxnet builtin sync 2 contexts", tol=3e-3)
    assert states(results) == (1, 2)


def test_gluon_s_synchronised_batchnorm_is_refused_where_mxnet_started_with_too_few_scratch_buffers():
    """MXNet's default 4 copies hang Gluon's SyncBatchNorm on 2 CPU contexts: one line instead, naming the variable
    and the number."""
    from harness.loader import load_module
    builtin = load_module("mxnet", "builtin")
    with pytest.raises(Unavailable, match=r"MXNET_CPU_TEMP_COPY>=256 \(it has 4\)"):
        builtin.check_scratch_buffers(2, {})
    builtin.check_scratch_buffers(2, {"MXNET_CPU_TEMP_COPY": "256"})


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_resumed_run_ends_with_the_uninterrupted_run_s_weights_and_statistics(framework, tmp_path):
    """Two epochs in one go, checkpointing after each, and the second epoch again from the first's checkpoint
    (weights, running statistics and the optimizer's state, in the framework's own format): the same weights bit
    for bit, and the same running statistics in the final file. Momentum, weight decay, clipping, a warm-up over the
    first epoch then cosine: the state's buffers and step count decide the second epoch's every update. Two full
    batches an epoch of synthetic images: no retrace for a last batch."""
    from harness.training.checkpoints import checkpoint_name, read_model
    spec = RunSpec(framework=framework, model="resnet18", width=WIDTH, bn="local", mode="scratch", devices=2,
                   dataset="synthetic", n_synthetic=512, epochs=2, batch_size=256, lr=LR, seed=SEED, threads=1,
                   checkpoint_dir=str(tmp_path / "whole"), checkpoint_every=1, optimizer="momentum",
                   weight_decay=5e-4, clip_norm=5.0, lr_schedule="cosine", warmup_epochs=1)
    (whole,) = run_workers(spec, timeout=300)
    assert whole["status"] == "ok", whole.get("error")
    resumed = spec.replace(checkpoint_dir=str(tmp_path / "resumed"), checkpoint_every=None,
                           resume_from=str(tmp_path / "whole" / checkpoint_name(spec, 1)))
    (rest,) = run_workers(resumed, timeout=300)
    assert rest["status"] == "ok", rest.get("error")
    assert rest["digest"] == whole["digest"] and rest["first_epoch"] == 1
    _, want = read_model(framework, str(tmp_path / "whole" / checkpoint_name(spec, 2)))
    _, got = read_model(framework, str(tmp_path / "resumed" / checkpoint_name(resumed, 2)))
    assert all(np.array_equal(got[k], want[k]) for k in want)
