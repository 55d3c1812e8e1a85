"""One process of a run: `python -m harness.run.worker SPEC_JSON OUT_JSON` (`{rank}` in OUT_JSON becomes the
process's rank).

compare.py starts one worker per run (several for a multi-process engine) so that each framework gets
a fresh process with its thread count fixed before the framework is imported, and a crash loses only
that run. The worker writes its own record; compare.py merges the records of a run's processes (its
own, or with `--merge` those of a hand-launched run).
"""
import atexit
import contextlib
import ctypes
import json
import os
import resource
import subprocess
import sys
import threading
import time
import traceback


def set_threads(spec):
    """Must happen before the framework is imported: OpenMP, MKL and TensorFlow read these at start-up."""
    from ..processes.cores import pin_from_env, thread_env
    os.environ.update(thread_env(spec.threads or os.cpu_count(), spec.cores, spec.per_process, spec.bn == "sync"))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # TensorFlow's start-up chatter
    pin_from_env()


def set_virtual_devices(n):
    """JAX fixes its number of CPU devices when it starts, from XLA_FLAGS: set before it is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


_last_report = [0.0]
PARENT_POLL_SECONDS = 0.5


def progress(step, steps, loss):
    """A line at most twice a second; compare.py reads the last one for its progress bar."""
    now = time.monotonic()
    if now - _last_report[0] >= 0.5 or step == steps:
        _last_report[0] = now
        print(f"progress {step}/{steps} loss {loss:.4f}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def joined(fw, spec):
    """This process within its run: (rank, world, its devices), joined to the framework's multi-process
    engine if the run has one, and leaving it however the block ends. Its devices follow common.placement."""
    from common.interface import RosettaError
    from ..loader import load_module
    from ..processes.launch import uses_engine
    from common.placement import local_devices, my_gpus
    world, per_process = spec.processes, spec.per_process
    gpus = my_gpus(fw.name, fw.gpu_count(), per_process, world)   # before the engine: it binds its GPUs
    engine = load_module(fw.name, "distributed") if uses_engine(spec) else None
    rank, engine_world = engine.init_process(gpus) if engine else (0, 1)
    try:
        if engine_world != world:
            raise RosettaError(f"the run asks for {world} processes but {engine_world} joined the engine")
        yield rank, world, local_devices(fw, gpus, per_process)
    finally:
        if engine:
            engine.shutdown()


def reset_peak_rss():
    """Start the peak resident memory (VmHWM) afresh from what the process holds now (Linux); False where
    it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def scaling_inputs(fw, spec):
    """The scaling model's inputs (harness/studies/projection.py): one step's compute, or one all-reduce across the
    run."""
    from ..studies import projection as scaling
    with joined(fw, spec) as (rank, world, devices):
        if spec.task == "step":
            return {"step": scaling.measure_step(fw, spec, devices)}
        return {"allreduce": scaling.measure_allreduce(fw, spec, rank, world, devices), "rank": rank}


def run(spec, started):
    from ..loader import load_framework, load_module
    fw = load_framework(spec.framework)
    if spec.task == "devices":
        return {"devices": fw.device_info(fw.get_devices(spec.devices))}
    if spec.task in ("step", "allreduce"):
        return scaling_inputs(fw, spec)
    if spec.task == "collectives":   # harness/studies/split.py: a step's all-reduce alone
        from ..studies.split import measure
        with joined(fw, spec) as (rank, world, devices):
            return {"collectives": measure(fw, spec, rank, world, devices)}
    if spec.task == "expert":   # harness/studies/expert.py
        from ..studies.expert import measure
        with joined(fw, spec) as (_, _, devices):
            return {"expert": measure(fw, spec, devices)}
    import numpy as np
    from ..training.checkpoints import resume_point, saver
    from ..training.profile import profiler
    from ..studies.stepcheck import copies
    from common.data import load_dataset
    from ..training.loop import Hooks, Start, runner as runner_for, steps_per_epoch, train
    data = load_dataset(spec.dataset, spec.data_dir, spec.n_synthetic, spec.seed)
    with joined(fw, spec) as (rank, world, devices):
        runner = runner_for(spec, fw, devices)
        if spec.task == "feed":   # what the input pipeline hands each device (tests/test_pipelines.py)
            from ..training.loop import fed_rows
            return {"fed": fed_rows(runner, data, spec.epochs, spec.batch_size, spec.seed, rank, world,
                                    spec.devices), "rank": rank}
        if spec.mode == "scratch":   # the step's layout and compiled units are its own; the engines run their way
            execution = load_module(fw.name, "execution")
            layout_name, exec_name = execution.LAYOUTS[runner.functional.layout], execution.NAMES[execution.level(spec.exec)]
            compiles = execution.COMPILES[exec_name]
        else:
            layout_name, exec_name, compiles = None, None, runner.engine.COMPILES   # exec, layout: once built
        per_epoch = steps_per_epoch(len(data.y_train), spec.batch_size, spec.devices)
        optimizer = spec.canonical_optimizer(per_epoch)
        weights, bn_state, state, scaler, first_epoch = resume_point(spec, optimizer, per_epoch)   # fresh: 0, Nones
        if bn_state is not None:   # a resumed ResNet starts from the checkpoint's running statistics too
            runner.network = runner.network._replace(bn_state=bn_state)
        startup_seconds = time.perf_counter() - started   # imports, data, devices: before the first step
        # the weights before every step (tests): rank 0's, read by every rank where they may be sharded (a collective)
        gathers = spec.shard != "none"
        trace = [] if spec.weights_trace and (rank == 0 or gathers) else None
        profiled = {}
        profile_step, finish_profile = profiler(spec, rank, profiled)   # --profile: a few steps' trace

        def before_step(steps, runner):
            if trace is not None:
                trace.append(copies(runner.weights()))
            if profile_step:
                profile_step(steps, runner)
        fresh_peak = reset_peak_rss()   # the data set's generation peak (docs/results.md) is not training's
        record = train(runner, data, spec, optimizer, rank, world, Start(weights, state, first_epoch, scaler),
                       Hooks(progress, before_step if trace is not None or profile_step else None,
                             saver(spec, rank, optimizer, per_epoch)))
        if finish_profile:
            finish_profile(runner)
        record.update(profiled)
        exec_name = exec_name or runner.exec_name()
        layout_name = layout_name or runner.layout_name()
        # What the framework holds while it trains: the peak since the reset, less the harness's own copy of the data
        data_bytes = sum(a.nbytes for a in (data.X_train, data.y_train, data.X_test, data.y_test))
        record["train_memory_bytes"] = peak_rss() - data_bytes if fresh_peak else None
        final = runner.weights() if (spec.weights_out or trace is not None) and (rank == 0 or gathers) else None
        if spec.weights_out and rank == 0:   # final weights, canonical layout, for parity checks
            np.savez(spec.weights_out, **final)
        if trace is not None and rank == 0:
            trace.append(final)
            np.savez(spec.weights_trace, **{f"{k}/{name}": w for k, weights in enumerate(trace)
                                            for name, w in weights.items()})
    record.update(spec=spec.to_dict(), rank=rank, world=world, fingerprint=data.fingerprint(), exec=exec_name, compiles=compiles,
                  layout=layout_name,
                  startup_seconds=startup_seconds, device_names=[d["name"] for d in fw.device_info(devices)],
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  peak_device_memory_bytes=fw.peak_memory(devices))
    return record


def serve(spec):
    """MXNet's scheduler and server: importing mxnet with DMLC_ROLE set runs them until the job ends,
    and then mxnet ends the process itself (sys.exit in the import), so they write no record."""
    from common.interface import RosettaError
    from ..loader import load_framework
    load_framework(spec.framework)
    raise RosettaError(f"DMLC_ROLE={os.environ['DMLC_ROLE']} starts MXNet's scheduler or server; "
                       f"{spec.framework} has neither")


def exit_with_parent():
    """Started by compare.py, end when it is gone, even SIGKILLed (which no handler can catch): with
    this process's whole group, so nothing trains on for nobody. A thread, so that it also watches
    MXNet's scheduler and server, which never return from `import mxnet`. The run's log folder goes too:
    compare.py, which would have removed it, cannot. Hand-launched workers (no PARENT_VARIABLE) may outlive
    their shell on purpose (nohup) and are left alone."""
    import shutil
    import signal
    import threading
    from ..processes.launch import LOGS_VARIABLE, PARENT_VARIABLE
    parent = int(os.environ.get(PARENT_VARIABLE, 0))
    if not parent:
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        if os.environ.get(LOGS_VARIABLE):   # every process of the run tries; the first one removes it
            shutil.rmtree(os.environ[LOGS_VARIABLE], ignore_errors=True)
        if os.getpgrp() == os.getpid():   # compare.py starts each worker as the leader of its own group
            os.killpg(0, signal.SIGKILL)
        os._exit(1)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def start_helpers(spec, helpers):
    """MXNet's scheduler and server for a task of a SLURM job (harness/processes/slurm.py): children of this worker,
    writing to its output, that end with it (exit_with_parent). Never waited for: they exit once every worker has
    passed the kvstore's barrier at exit, which this worker reaches only as its process ends."""
    from ..processes.launch import PARENT_VARIABLE
    return [subprocess.Popen([sys.executable, "-m", "harness.run.worker", spec.to_json(), os.devnull],
                             env={**os.environ, **env, PARENT_VARIABLE: str(os.getpid())}, start_new_session=True)
            for _, env in helpers]


# Tests of the process lifecycle only: a file whose run(spec, started) stands in for `run`, a training that imports no
# framework (tests/stub_training.py); everything else the worker does is done as ever.
STUB_VARIABLE = "ROSETTA_STUB_TRAINING"


def training():
    """`run`, or the stand-in the environment names (STUB_VARIABLE)."""
    if not os.environ.get(STUB_VARIABLE):
        return run
    import importlib.util
    spec = importlib.util.spec_from_file_location("stub_training", os.environ[STUB_VARIABLE])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run


def main(spec_json, out_path):
    """Exit code 0 (ok or skipped), 1 (failed: the reason in OUT and on stderr), 2 (OUT cannot be written: checked
    first, for a hand-launched worker would otherwise train to the end and lose its record)."""
    started = time.perf_counter()
    exit_with_parent()
    from common.interface import RosettaError, Unavailable
    from ..files import unwritable
    from ..processes import slurm
    from ..spec import RunSpec
    problem = unwritable(out_path.replace("{rank}", "0"))
    if problem:
        print(f"error: cannot write {out_path}: {problem}", file=sys.stderr)
        return 2
    try:
        spec = RunSpec.of(spec_json)
        if slurm.started_by_srun():   # srun started this task: its engine's variables come from the job
            env, helper_envs = slurm.task_env(spec)
            os.environ.update(env)
            start_helpers(spec, helper_envs)
        set_threads(spec)
        if spec.framework == "jax":   # its own share of the run's devices (common.placement)
            set_virtual_devices(spec.per_process)
        role = os.environ.get("DMLC_ROLE", "worker")
        result = {"status": "ok", "error": None, **(training()(spec, started) if role == "worker" else serve(spec))}
    except RosettaError as err:   # one line on stderr too: a hand-launched worker's user reads no OUT first
        result = {"status": "skipped" if isinstance(err, Unavailable) else "failed", "error": str(err)}
        print(f"{result['status']}: {err}", file=sys.stderr)
    except Exception as err:   # a crash in one framework must not take the others' results with it
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    result["cpus"] = sorted(os.sched_getaffinity(0))   # the cores it could run on (pinned: harness/processes/cores.py)
    if "{rank}" in out_path:   # hand-launched workers (torchrun, TF_CONFIG, DMLC_*) share one command line
        out_path = out_path.replace("{rank}", str(result.get("rank", os.environ.get("DMLC_ROLE", 0))))
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0 if result["status"] != "failed" else 1


def end(code):
    """End the process once its record is written, as the interpreter begins to end it: its thread pools finish their
    work and its threads end (torch.compile's pool waits for that), its atexit handlers run (TensorFlow's removes
    AutoGraph's generated files, JAX's frees its backends), every buffered output is flushed; but the interpreter's
    teardown of every module and C++ object is skipped: it ran after the run had finished and took 1.3 s of a
    TensorFlow row here (2.5 s of one across 2 processes), 0.4 s of a JAX or PyTorch one (docs/profiling.md).
    An MXNet process ends as ever: its kvstore's workers meet at a barrier as the store is freed at exit."""
    if "mxnet" in sys.modules:
        sys.exit(code)
    threading._shutdown()   # as the interpreter ends first: thread pools told to finish, then threads joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)   # what C and C++ code wrote to a redirected stdout, still in its buffer
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m harness.run.worker SPEC_JSON OUT_JSON ({rank} in OUT_JSON becomes the rank)")
    end(main(sys.argv[1], sys.argv[2]))
