"""Shared fixtures: each framework's implementation, skipped (with the reason) only where the framework is not
installed, and a failure where its folder is broken; a time limit on every test; compare.py and hand-launched
processes as a user starts them; the real processes of a run, found by a tag in their environment."""
import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings

import pytest

# What the suite's processes put in the temporary folder goes into one folder of the session's, removed after it:
# torchrun's torchelastic_* logs, Chromium's profiles and TensorFlow's __autograph_generated_file*.py, which a process
# removes only as it exits through atexit (pytest-xdist's workers do not), were left in /tmp (about 190 of each after
# two days' runs here). The session's first process makes it; every process it starts inherits TMPDIR. pytest's own
# tmp_path folders stay where they were, the last three runs kept.
if "ROSETTA_TEST_TMPDIR" not in os.environ:
    os.environ["ROSETTA_TEST_TMPDIR"] = tempfile.mkdtemp(prefix="rosetta-tests-")
    atexit.register(shutil.rmtree, os.environ["ROSETTA_TEST_TMPDIR"], True)
    os.environ["TMPDIR"] = os.environ["ROSETTA_TEST_TMPDIR"]

# Every JAX process of the suite (this one, and every worker it starts: they inherit the environment) shares one
# persistent compilation cache, so a step is compiled once per shape, not once per process: a 2-epoch JAX row took
# 43 s cold and 17 s warm here. No test checks compilation itself. Fresh for each session, removed after it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["ROSETTA_TEST_TMPDIR"], "jax-cache")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# XLA's CPU backend compiles the suite's JAX programs without LLVM's machine-code optimisation and with its older
# fusion emitters (LLVM IR written directly, not the MLIR fusion emitters that are 0.7.1's default): the same HLO after
# the same XLA passes (fusion, layout, the collectives), only the machine code made another way, and compiling takes
# less (a width-8 ResNet test: 31 s at the default level, 12 s at 0; JAX's fast-tier tests 70 s on two workers, 59 s
# with the older emitters too). The suite's JAX time is compilation; its programs run a few steps. Every tolerance but
# test_zero's two sharded AdamW epochs on 3 devices, bucketed, holds at the default level too (a whole epoch amplifies
# its other order of sums: docs/profiling.md); the README's main job runs as a user's does (tests/test_parity.py's full
# default run is started without these flags).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
for flag in FAST_COMPILE_FLAGS:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common import FRAMEWORKS, Unavailable  # noqa: E402
from harness.loader import load_framework  # noqa: E402
from worker_exit import end_after_sending_results  # noqa: E402
from worker_groups import keep_together  # noqa: E402

# .ci/run sets this: CI installs every framework, so there a framework that is not installed fails the suite.
REQUIRE_ALL = os.environ.get("ROSETTA_REQUIRE_ALL_FRAMEWORKS") == "1"


def skip_not_installed(reason):
    """The one way a test leaves a framework out: it is not installed (and never where all are required)."""
    if REQUIRE_ALL:
        pytest.fail(f"{reason}; ROSETTA_REQUIRE_ALL_FRAMEWORKS=1 requires every framework", pytrace=False)
    pytest.skip(reason)


def framework_or_skip(name):
    """The framework's implementation. Not installed: skipped. Installed but its folder misses a file, fails to
    import or lacks a contract function: harness.loader raises a plain RosettaError and the test fails."""
    try:
        return load_framework(name)
    except Unavailable as err:
        skip_not_installed(str(err))


def installed_frameworks():
    """The implementations of every installed framework (a broken one fails the caller, as above)."""
    available = []
    for name in FRAMEWORKS:
        try:
            available.append(load_framework(name))
        except Unavailable as err:
            if REQUIRE_ALL:
                skip_not_installed(str(err))
    return available


@pytest.fixture(scope="session", autouse=True)
def devices_first():
    """TensorFlow and JAX fix their number of CPU devices when they first run anything, and the suite needs several:
    get_devices() makes them before this process's first test, whichever it is (pytest-xdist hands each worker
    process its own tests in its own order)."""
    with warnings.catch_warnings():   # the first test's own filter (say, warnings as errors) is not the imports'
        warnings.simplefilter("ignore", DeprecationWarning)
        for fw in installed_frameworks():
            fw.get_devices()


# Every schedule with its parameters given (the frameworks' rate tests run each over optim.SCHEDULES with their
# defaults too), for a run of 24 steps with a warm-up of up to 5: the first milestone at the warm-up's end, three
# decays by half, a factor's every 3 steps, a power that is not the default, a cosine to a floor
EXPLICIT_SCHEDULES = [{"schedule": "step", "decay_at": (5, 9, 17), "decay_factor": 0.5},
                      {"schedule": "factor", "decay_every": 3, "decay_factor": 0.5},
                      {"schedule": "poly", "power": 1.5},
                      {"schedule": "cosine", "final_lr": 1e-3}]


@functools.cache
def scratch(name, network="lenet", layout="default", sync=False, level="default", bucket_bytes=None, precision="fp32"):
    """(model, settings) of a framework's scratch step: the network's Functional (lenet.py's, or resnet.py's with
    --bn sync or local) in `layout` at `precision`, and the run's settings (execution.compile's units at `level`,
    the all-reduce's buckets). Cached: a tf.function or a jit is made once per configuration, as a run makes it once."""
    from common.interface import StepSettings
    from harness.loader import load_module
    from common.interface import Network
    from harness.training.loop import functional
    execution = load_module(name, "execution")
    model = functional(load_framework(name),
                       Network("lenet" if network == "lenet" else "resnet18", None, sync, precision), layout)
    return model, StepSettings(bucket_bytes, execution.compile(level, model))


def train_steps(fw, replicas, X, y, devices, lr, batch_size=None, states=None, bn_states=None, **configuration):
    """One data_parallel.train_step of the `configuration`'s scratch step (scratch()'s arguments) on `replicas`."""
    model, settings = scratch(fw.name, **configuration)
    bn_states = [None] * len(replicas) if bn_states is None else bn_states
    return fw.train_step(model, replicas, bn_states, X, y, devices, lr, batch_size, states, settings)


def replicas_of(fw, weights, devices, **configuration):
    """One replica of canonical `weights` per device, as the configuration's model lays them out."""
    model, _ = scratch(fw.name, **configuration)
    return [model.get_params(weights, d) for d in devices]


def weights_of(fw, replica, **configuration):
    return scratch(fw.name, **configuration)[0].to_numpy(replica)


def assert_evaluated_together(records, fw, weights, data):
    """A multi-process run's test accuracy, which its processes share (harness.training.loop.shared_accuracy): every
    record says how many shared it and gives the same accuracy, the LeNet's final `weights` evaluated on the whole test
    split in this one process, to the image."""
    model, _ = scratch(fw.name)
    alone = fw.evaluate(model, model.get_params(weights, fw.get_devices(1)[0]), None, data.X_test, data.y_test)
    assert [r["evaluated_by"] for r in records] == [len(records)] * len(records)
    assert [r["test_accuracy"] for r in records] == [alone] * len(records)


@pytest.fixture(scope="module")
def pt():
    """PyTorch's framework module (get_devices, ...), for PyTorch's own test files."""
    return framework_or_skip("pytorch")


@pytest.fixture(scope="module")
def torch(pt):
    import torch
    return torch


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return framework_or_skip(request.param)


# The fast tier (-m "not slow") proves every concept in every framework within two minutes. These cases repeat, at a
# cost of seconds of compiling each, what it proves: a concept on more devices or shapes than the fast case, or the
# third JAX program of a kind; the ResNet's conversions (the LeNet's are fast). The slow tier runs them, with the rest.
SLOW_REPEATS = {
    # sharding: each framework's stages 2 and 3 on 3 devices (padding, buckets, AdamW, clipping) are fast; stage 1 and
    # the momentum cases repeat them
    *[f"test_zero.py::test_a_sharded_epoch_is_the_replicated_one[{name}-{case}]" for name in FRAMEWORKS
      for case in ("optimizer-momentum-2-per-tensor", "optimizer-adamw-3-bucketed", "gradients-momentum-2-per-tensor",
                   "parameters-momentum-2-per-tensor")],
    # the same concept in the other frameworks, fast
    "test_execution.py::test_steps_configured_differently_run_one_after_the_other_with_no_reset[jax]",
    "test_execution.py::test_steps_configured_differently_run_one_after_the_other_with_no_reset[tensorflow]",
    # a torch general checkpoint continued by Optax is [momentum]'s; the frozen layer's zero buffer: the other case
    "test_pytorch_general_checkpoints.py::test_a_fine_tuning_run_s_frozen_layer_continues_as_torch_s_own_once_unfrozen"
    "[general checkpoint]",
    "test_expert.py::test_the_expert_step_is_the_recipe_s_step[jax]",
    "test_buckets.py::test_a_bucketed_lenet_step_is_the_per_tensor_step[jax]",   # its bucketed sum: fast
    "test_optimizers.py::test_every_mode_computes_the_spec[jax-scratch-2d-momentum]",   # test_optimizers_jax: fast
    "test_checkpoints.py::test_a_checkpoint_holds_the_weights_exactly[jax]",   # Orbax: the fast conversions
    # the same concept on fewer devices or shapes, fast
    "test_interface.py::test_train_step_on_several_devices_equals_one_device[jax-3]",
    "test_layouts.py::test_every_layout_computes_the_default_step[jax-2]",
    "test_idiomatic.py::test_idiomatic_loop_equals_scratch_step[jax-1-1e-05]",
    "test_jax.py::test_both_builtin_forms_compute_the_scratch_step[shard_map-4-64]",
    "test_jax.py::test_both_builtin_forms_compute_the_scratch_step[jit-3-101]",
    # the JAX ResNet's forward and its training step are fast; its gradients and Flax model compile two more
    "test_resnet.py::test_gradients_match_pytorch_in_every_layout[jax]",
    "test_resnet.py::test_idiomatic_model_equals_the_spec[jax]",
    # the ResNet's conversions (the LeNet's, its optimizer states included, are fast)
    "test_resnet_checkpoints.py::test_every_conversion_runs_in_inference_mode_with_the_same_logits",
    "test_resnet_checkpoints.py::test_every_conversion_carries_the_resnet_s_optimizer_state[momentum]",
    "test_resnet_checkpoints.py::test_every_conversion_carries_the_resnet_s_optimizer_state[adam]",
    # stock code continuing a stock Gluon Trainer: momentum's convention on one context is the fast case
    "test_stock_gluon_states.py::test_stock_torch_keras_and_optax_code_continue_a_stock_gluon_trainer[sgd-1ctx]",
    "test_stock_gluon_states.py::test_stock_torch_keras_and_optax_code_continue_a_stock_gluon_trainer[nag-1ctx]",
    "test_stock_gluon_states.py::test_stock_torch_keras_and_optax_code_continue_a_stock_gluon_trainer"
    "[sgd-momentum-2ctx]",
    "test_stock_gluon_states.py::test_stock_gluon_code_loads_the_converter_s_mxnet_files_alone[1]",
    # each framework once in the fast tier: the same step on another number of devices, or for more steps, is slow
    *[f"test_buckets.py::test_the_bucketed_sum_is_the_per_tensor_sum[{f}-1]" for f in FRAMEWORKS],   # 3 devices: fast
    *[f"test_interface.py::test_train_step_on_several_devices_equals_one_device[{f}-3]" for f in FRAMEWORKS
      if f != "jax"],
    *[f"test_layouts.py::test_every_layout_computes_the_default_step[{f}-2]" for f in FRAMEWORKS if f != "jax"],
    *[f"test_idiomatic.py::test_idiomatic_loop_equals_scratch_step[{f}-5-0.0001]" for f in FRAMEWORKS
      if f != "jax"],   # JAX's 5 steps stay fast, the others' first step
    # the ResNet at fp16 on one device: its BatchNorm at a low precision is the ResNet's bf16 case, fp16's casts the
    # LeNet's fp16 case, both fast (MXNet's fp16 is refused in a second: it stays)
    # JAX's ResNet at bf16 compiles for seconds: its LeNet at bf16 and the other frameworks' ResNets are fast
    "test_precision.py::test_one_device_s_low_precision_gradients_are_the_reference_s[jax-resnet-bf16]",
    *[f"test_precision.py::test_one_device_s_low_precision_gradients_are_the_reference_s[{f}-resnet-fp16]"
      for f in FRAMEWORKS if f != "mxnet"],
    # the idiomatic loop at bf16: the framework's own API on the LeNet is fast, the ResNet's bf16 on one device too
    *[f"test_precision.py::test_the_idiomatic_loop_at_bf16_is_the_reference_s_step[{f}-resnet]" for f in FRAMEWORKS],
    # bf16 on two devices: the LeNet's steps prove the step composes; the ResNet's repeat its one-device proof
    *[f"test_precision.py::test_the_bf16_step_on_two_devices_follows_the_reference[{f}-resnet]" for f in FRAMEWORKS],
    # a resumed scaler: the scratch step's is the harness's in every framework, and MXNet's run (fp32, an inf pixel)
    # takes a second; the others' fp16 steps 10-30 s (PyTorch's and Keras's fp16 convolutions are slow on a CPU)
    *[f"test_loss_scaling.py::test_a_run_resumed_at_fp16_carries_on_at_the_scale_and_count_it_stopped_at[{f}-scratch-"
      "lenet]" for f in FRAMEWORKS if f != "mxnet"],
    # stock Gluon RMSProp and AdaGrad continued elsewhere: the centered RMSProp (its momentum, both averages and the
    # epsilon gap) stays fast
    *[f"test_stock_gluon_states.py::test_stock_code_continues_a_stock_gluon_rmsprop_and_adagrad[{case}]"
      for case in ("rmsprop", "adagrad")],
    # JAX's scratch update: every optimizer compiled (graph; rmsprop centered with momentum, the others' superset),
    # and momentum eagerly
    *[f"test_optimizers_jax.py::test_the_scratch_update_is_the_spec_at_every_level[eager-{name}]"
      for name in ("sgd", "nesterov", "adam", "adamw", "rmsprop", "adagrad", "rmsprop-no-momentum",
                   "rmsprop-centered")],
    *[f"test_optimizers_jax.py::test_the_scratch_update_is_the_spec_at_every_level[graph-{name}]"
      for name in ("rmsprop", "rmsprop-no-momentum")],
}


# The suite runs on two worker processes (pytest-xdist, `-n 2 --dist loadgroup`: a 2-core machine's fast tier 5 min 9 s
# on one, 3 min 16 s on two). Session fixtures that make something only one of them may have at a time (the two test
# hosts' network namespaces, fixed names) or that are worth running once (compare.py's one-host rows, a few minutes;
# the shrunk benchmark, which two files check) keep every test that uses them on one worker.
SHARED_BY_ONE_WORKER = {"two_hosts", "one_host_rows", "benchmark_run"}


@pytest.hookimpl(tryfirst=True)   # before pytest's own, which collect the garbage a worker can no longer report
def pytest_unconfigure(config):
    """A pytest-xdist worker's process ends here, its results sent (tests/worker_exit.py)."""
    end_after_sending_results(config)


@pytest.hookimpl(tryfirst=True)   # before -m deselects
def pytest_collection_modifyitems(config, items):
    """SLOW_REPEATS marked slow; a name there that a collected file does not have fails the collection. The tests of
    SHARED_BY_ONE_WORKER's fixtures kept on one worker (tests/worker_groups.py)."""
    keep_together(config, items, "one-worker",
                  lambda item: SHARED_BY_ONE_WORKER & set(getattr(item, "fixturenames", ())))
    found, files = set(), set()
    for item in items:
        name = f"{os.path.basename(str(item.fspath))}::{item.name}"
        files.add(name.split("::")[0])
        if name in SLOW_REPEATS:
            item.add_marker(pytest.mark.slow)
            found.add(name)
    if any("::" in arg for arg in config.args):   # tests picked by name: the others of their file are not collected
        return
    stale = sorted(name for name in SLOW_REPEATS - found if name.split("::")[0] in files)
    if stale:
        raise pytest.UsageError(f"conftest.SLOW_REPEATS names no collected test: {', '.join(stale)}")


@pytest.fixture(scope="session")
def digits():
    from common.data import load_dataset
    return load_dataset("digits")


SHORT_EPOCH_ROWS = 3 * 97 + 79


@pytest.fixture(scope="session")
def short_digits(digits):
    """digits with its first 370 training images: at batch 97 an epoch of four steps, the last of 79 images (a new
    shape, where a traced step retraces and a device's shard and micro-batches change size), the whole test split.
    For the tests that run a configuration's epoch twice and compare the two step by step, where four steps prove
    what 15 do (not Adam's accumulated steps: tests/test_accumulation.py), at about a quarter of the seconds."""
    import dataclasses
    return dataclasses.replace(digits, X_train=digits.X_train[:SHORT_EPOCH_ROWS],
                               y_train=digits.y_train[:SHORT_EPOCH_ROWS])


TEST_SECONDS = 300   # no test can hang the suite: each fails after this (pytest.mark.timeout(s) sets another)


@pytest.fixture(autouse=True)
def time_limit(request):
    marker = request.node.get_closest_marker("timeout")
    seconds = marker.args[0] if marker else TEST_SECONDS

    def expire(signum, frame):
        pytest.fail(f"the test ran over its {seconds} s limit", pytrace=False)
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def run_compare(*args, cwd=ROOT, timeout=600, env=None):
    """compare.py as a user runs it, to the end: the finished process, output captured."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "compare.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_processes(commands, timeout=300):
    """Processes started by hand as a launcher would (torchrun, TF_CONFIG, MXNet's scheduler, server and workers):
    `commands` is [(argv, extra environment)], helpers first. Waits for all, kills whatever is left (each leads
    its own process group), checks that every one exited 0; returns their stderr texts."""
    procs = [subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for argv, env in commands]
    try:
        errors = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in procs), "\n".join((e or "")[-1500:] for e in errors)
    return errors


@pytest.fixture(autouse=True)
def fast_tier_starts_no_worker(request, monkeypatch):
    """`python -m pytest -m "not slow"` is the fast tier: a test that starts a worker process (harness.run.worker,
    torchrun) must be marked slow, or it fails here the moment it tries."""
    if request.node.get_closest_marker("slow"):
        return
    start = subprocess.Popen.__init__

    def guarded(self, args, *rest, **options):
        argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
        if any("harness.run.worker" in a or a.endswith("torchrun") for a in argv):
            pytest.fail("this test starts worker processes: mark it @pytest.mark.slow", pytrace=False)
        start(self, args, *rest, **options)
    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


def processes_tagged(tag):
    """Live processes whose environment carries our tag (children inherit it, orphans too)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def role(pid):
    """'worker', or the helper an MXNet process is (scheduler, server): its DMLC_ROLE; None if it is not
    a worker process (compare.py, or gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"harness.run.worker" not in f.read():
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    return env.get(b"DMLC_ROLE", b"worker").decode()


def log_of(pid):
    """What a worker has written so far (compare.py sends its stdout and stderr to a log file)."""
    try:
        with open(os.readlink(f"/proc/{pid}/fd/2"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def processes_by_role(tag, wanted="worker"):
    return [p for p in processes_tagged(tag) if role(p) == wanted]


def wait_for_training(tag, count, timeout=180):
    """The pids of `count` workers, once one of them reports a training step (mid-row, past start-up)."""
    def training():
        workers = processes_by_role(tag)
        return len(workers) >= count and any("progress " in log_of(p) for p in workers) and workers
    return wait_for(training, timeout, f"{count} workers training")


@pytest.fixture
def tag(monkeypatch):
    """A tag for the environment of the processes a test starts (in-process launches inherit it too);
    none of them may outlive the test by more than a few seconds."""
    value = f"rosetta-{uuid.uuid4()}"
    monkeypatch.setenv("ROSETTA_TEST_TAG", value)
    yield value
    deadline = time.monotonic() + 5
    while processes_tagged(value) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_tagged(value), "a process of the run outlived it"


STUB_TRAINING = os.path.join(ROOT, "tests", "stub_training.py")


@pytest.fixture
def stub_workers(monkeypatch):
    """The workers this test starts train with tests/stub_training.py: no framework, a step of 50 ms, the ranks in
    lockstep. For what does not depend on the framework: how processes start, report, stall, die and end."""
    from harness.run.worker import STUB_VARIABLE
    monkeypatch.setenv(STUB_VARIABLE, STUB_TRAINING)


@pytest.fixture
def start_compare(tag):
    """Start compare.py in the background, tagged; killed at the end of the test whatever happens."""
    started = []

    def start(*args, cwd=ROOT):
        env = {**os.environ, "ROSETTA_TEST_TAG": tag}
        started.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "compare.py"), *args], cwd=cwd, env=env,
                                        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        return started[-1]
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()   # its workers notice and end themselves (harness.run.worker.exit_with_parent)
        proc.communicate()


def follow(proc):
    """(stdout, [(time, line)] of stderr) of a compare.py started by start_compare, read as it runs:
    compare.py says on stderr how each row ended, as it ends."""
    err = [(time.monotonic(), line) for line in proc.stderr]
    out = proc.stdout.read()
    proc.wait(timeout=30)
    return out, err


# One run of every engine that the two-host and the restart tests must each end with, bit for bit: 2 processes of
# the built-in engine, momentum under every option (a state that must come back with the weights, a schedule that
# must go on at its step), 3 epochs.
ENGINE_RUN = {"mode": "builtin", "devices": 2, "processes": 2, "epochs": 3, "seed": 4, "threads": 1,
              "optimizer": "momentum", "lr_schedule": "cosine", "warmup_epochs": 1, "weight_decay": 5e-4,
              "clip_norm": 3.5}


def engine_run_options(frameworks):
    """compare.py's options for ENGINE_RUN in `frameworks` (names)."""
    return ["--frameworks", ",".join(frameworks), *[option for key, value in ENGINE_RUN.items()
                                                     for option in (f"--{key.replace('_', '-')}", str(value))]]


@pytest.fixture(scope="session")
def one_host_rows(tmp_path_factory):
    """compare.py's ENGINE_RUN rows on this one host (loopback), every installed framework, run once per session, and
    profiled (--profile: each row's "profile" is its trace, tests/test_profile.py's). The unprofiled runs of the
    two-host and restart tests end with these rows' weights: the profiler changes no number."""
    import json
    folder = tmp_path_factory.mktemp("one-host")
    out = folder / "rows.json"
    proc = run_compare(*engine_run_options([fw.name for fw in installed_frameworks()]), "--json", str(out),
                       "--profile", str(folder / "traces"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["framework"]: r for r in json.loads(out.read_text())["runs"]}


# compare.py --benchmark shrunk to PyTorch on a few steps: a shared row and per-device rows of 1 and 2 devices and
# processes, scratch and built-in (the last the same run as the one before it: skipped, said so). Its rows, files
# and calibration are tests/test_cores.py's and tests/test_calibration.py's subjects.
BENCHMARK_PLAN = [("scratch", ("default",), ((1, 1),), "shared", ("default",)),
                  ("scratch", ("default",), ((1, 1), (2, 1), (2, 2)), "per-device", ("default",)),
                  ("builtin", ("default",), ((2, 1), (2, 2)), "per-device", ("default",))]


@pytest.fixture(scope="session")
def benchmark_run(tmp_path_factory):
    """The folder a real `compare.py --benchmark --frameworks pytorch` of BENCHMARK_PLAN wrote its results/ into, run
    once a session in this process (compare.main) and read by every test that checks a part of it."""
    framework_or_skip("pytorch")
    import compare
    from harness.run import options
    folder = tmp_path_factory.mktemp("benchmark")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(options, "BENCHMARK", {**options.BENCHMARK, "n_synthetic": 1200, "repeats": 1,
                                             "plan": BENCHMARK_PLAN})
        patch.setattr(compare, "raise_on_signals", lambda: None)   # pytest keeps its own handlers
        patch.chdir(folder)   # results/ is written here
        assert compare.main(["--benchmark", "--frameworks", "pytorch"]) == 0
    return folder / "results"


@pytest.fixture(scope="session")
def two_hosts():
    """The project's two test hosts (tests/hosts.py): two network namespaces joined by a veth pair, made for the
    session and removed after it. Skipped where they cannot be made (not root, no `ip`), failed under CI."""
    import hosts
    why = hosts.missing()
    if why:
        if REQUIRE_ALL:
            pytest.fail(f"{why}; .ci/run runs the two-host tests", pytrace=False)
        pytest.skip(why)
    made = hosts.up()
    yield made
    hosts.down()


@pytest.fixture
def gloo_group(tmp_path):
    """A torch.distributed process group of this one process (gloo, on the CPU): DistributedDataParallel in the
    test's own process, with no worker to start. Destroyed afterwards."""
    framework_or_skip("pytorch")
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/gloo-store", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def scratch_runners():
    """runner(spec): the harness's runner for `spec` (harness.training.loop.runner). A scratch runner is made once a
    session per configuration (network, width, BatchNorm, exec level, layout, all-reduce and its dtype, sharding,
    accumulation,
    precision and loss scaling, devices) and handed to every test that trains that configuration: its compiled units (a
    tf.function, a jit) are built once, as one run builds them once, while each train() starts it afresh (runner.start: new replicas, running statistics and
    optimizer states), so tests share its compilation, never a result. The engines' runners build their model in
    start(): made anew each time."""
    from harness.training.loop import runner as runner_for
    made = {}

    def runner(spec):
        fw = framework_or_skip(spec.framework)
        if spec.mode != "scratch":
            return runner_for(spec, fw, fw.get_devices(spec.devices))
        key = (spec.framework, spec.model, spec.width, spec.bn, spec.exec, spec.layout, spec.allreduce, spec.shard,
               spec.accumulate, spec.precision, spec.allreduce_dtype, spec.loss_scale, spec.loss_scale_interval,
               spec.devices)
        if key not in made:
            made[key] = runner_for(spec, fw, fw.get_devices(spec.devices))
        return made[key]
    return runner


@pytest.fixture(scope="session")
def recipe_runs(digits, scratch_runners):
    """run(spec, optimizer, data=digits): the scratch step's run of `spec` on digits (or the session's `data`, say
    short_digits) in this process, each distinct (spec, optimizer, data) once a session: (final weights, every
    replica's running statistics, the training record). Several modules take the same recipe run as their reference
    (tests/test_resnet_modes.py and tests/test_resnet_engines.py both start from the width-8 ResNet's first step on 97
    digits); the result is shared, read-only."""
    from harness.studies.stepcheck import copies
    from harness.training.loop import train
    done = {}

    def run(spec, optimizer, data=digits):
        assert spec.mode == "scratch" and spec.dataset == "digits", spec
        key = spec, optimizer, id(data)   # data: one of the session's fixtures, alive all session
        if key not in done:
            runner = scratch_runners(spec)
            record = train(runner, data, spec, optimizer)
            # copies: the runner trains again later, and the result is shared read-only
            done[key] = copies(runner.weights()), [copies(s) for s in runner.replica_bn_states()], record
        return done[key]
    return run
