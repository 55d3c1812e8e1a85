"""Starting worker processes and making sure they all end, however the run ends (see `run_workers`).

A run is one worker process, or for a multi-process engine `processes` workers (plus MXNet's
scheduler and server), on 127.0.0.1 with free ports, or this host's share of them when the run spans
several hosts (harness/processes/cluster.py). Each worker is started with exactly the variables the framework's own
launcher would set (torchrun, TF_CONFIG, DMLC_*, JAX_*), so the same workers can also be started by hand
(see docs/usage.md).
"""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from common.placement import machine_gpus

from .cluster import ONE_HOST, engine_env, free_ports
from .cores import CPUS_VARIABLE, worker_cpus
from ..loader import ROOT
from ..spec import RunSpec

POLL_SECONDS = 0.2   # how often a run's progress, stall and timeout are looked at


def process_per_device(framework, mode, processes, gpus=None):
    """Whether a run is one process per device whatever `processes` asks: PyTorch's built-in engine, but for a
    one-process run on GPUs. DistributedDataParallel is PyTorch's only data parallelism that works on the CPU (a
    process group even for one device); nn.DataParallel, its in-process engine, replicates onto CUDA devices only,
    so on a machine with GPUs (`gpus`, default machine_gpus()) a one-process run is nn.DataParallel in that process."""
    if (framework, mode) != ("pytorch", "builtin"):
        return False
    gpus = machine_gpus() if gpus is None else gpus
    return not gpus or processes > 1


def uses_engine(spec):
    """Whether the run's processes join their framework's multi-process engine."""
    return spec.processes > 1 or process_per_device(spec.framework, spec.mode, spec.processes)


# The signals that end a run: Ctrl-C, `kill`/`timeout`/CI job limits/batch schedulers, a closed terminal.
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PARENT_VARIABLE = "ROSETTA_PARENT_PID"   # set for the workers compare.py starts; they watch that process
LOGS_VARIABLE = "ROSETTA_LOG_DIR"   # the run's log folder: removed by a worker whose compare.py died (SIGKILL)


class Interrupted(KeyboardInterrupt):
    """One of ENDING_SIGNALS, raised where the main thread is: every `finally` on the way out runs (the
    running row's processes are killed there), and the exit status can name the signal."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_signals():
    """Handle SIGTERM and SIGHUP exactly like Ctrl-C. The workers lead process groups of their own, so
    these signals never reach them: only our clean-up can end them. Repeats are ignored so that the
    clean-up itself cannot be cut short."""
    def handler(signum, frame):
        for s in ENDING_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)
    for s in ENDING_SIGNALS:
        signal.signal(s, handler)


def say(text):
    """A last word on stderr, which may be gone (a closed terminal is what sent SIGHUP): then what is
    left to print goes nowhere, rather than fail the exit."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.dup2(devnull, sys.stderr.fileno())


def kill_group(proc):
    """Each process leads its own process group, so anything it started dies with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def kill_all(procs):
    """Every process group of a run. An ending signal that arrives meanwhile waits until all are dead:
    raised in the middle of the loop, it would leave the rest alive."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING_SIGNALS)
    try:
        for proc in procs:
            kill_group(proc)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def last_line(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def wrote_ok(path):
    """Whether the worker's record at `path` is whole and says ok."""
    try:
        with open(path) as f:
            return json.load(f).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def describe_exit(code):
    return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


def last_progress(path):
    """(step, steps) from the last 'progress a/b' line a worker wrote, or None. Read while the worker
    writes: a line still being written (no newline yet) does not count."""
    with open(path, errors="replace") as f:
        text = f.read()
    lines = [line for line in text[:text.rfind("\n") + 1].splitlines() if line.startswith("progress ")]
    if not lines:
        return None
    step, steps = lines[-1].split()[1].split("/")
    return int(step), int(steps)


def wait_for_an_end(procs, codes, seconds):
    """Wait up to `seconds`, but no longer than until one of the processes still running (`codes` None) ends: a row's
    result comes back as its last worker ends, not up to a poll later (Linux's pidfd; elsewhere the whole wait)."""
    fds = []
    try:
        for proc, code in zip(procs, codes):
            if code is None:
                fds.append(os.pidfd_open(proc.pid))
    except (AttributeError, OSError):   # no pidfd_open (not Linux, a kernel before 5.3)
        for fd in fds:
            os.close(fd)
        time.sleep(seconds)
        return
    try:
        waiting = select.poll()   # not select.select: a process with many files open may hold fds past its 1024
        for fd in fds:
            waiting.register(fd, select.POLLIN)   # a pidfd reads as ready once its process has ended
        waiting.poll(seconds * 1000)
    finally:
        for fd in fds:
            os.close(fd)


def run_workers(spec, timeout=None, progress=None, stall_timeout=None, cluster=ONE_HOST, copies=1):
    """Run one spec in its `processes` fresh `python -m harness.run.worker` processes (this host's share of them,
    on a `cluster` of several hosts); return their result dicts in rank order, or one failed result. Never raises for a failed run: a crash, a dead worker or helper
    (MXNet's scheduler, server), a timeout, a stall (no new progress line for `stall_timeout` seconds)
    becomes status 'failed' with the reason, and every process of the run is gone when this returns or
    raises (Interrupted included); a worker that crashes after writing an ok record has finished (a `note:` line
    says how it ended). progress(step, steps), if given, is called as the first worker reports.
    copies > 1 (a one-process spec on one host): that many independent runs of it at once, copy i pinned as worker
    i of a per-device run is, each with its own engine ports; their results in copy order (harness/studies/split.py)."""
    spec = RunSpec.of(spec)
    processes = spec.processes
    if copies > 1:
        if processes != 1 or cluster.nnodes != 1:
            raise ValueError("copies of a run are one-process runs on one host")
        ports = free_ports(2 * copies)
        worker_envs = [engine_env(spec.framework, 1, spec.devices, cluster=cluster, ports=(p, [q]))[0][0]
                       if uses_engine(spec) else {} for p, q in zip(ports[::2], ports[1::2])]
        helper_envs, ranks = [], list(range(copies))
    elif uses_engine(spec):
        worker_envs, helper_envs = engine_env(spec.framework, processes, spec.devices, cluster=cluster)
        ranks = list(cluster.ranks(processes))
    else:
        worker_envs, helper_envs, ranks = [{}], [], [0]
    if spec.cores == "per-device":   # each worker pinned to cores of its own on its host (harness/processes/cores.py)
        worker_envs = [{**env, CPUS_VARIABLE: ",".join(map(str, worker_cpus(local, spec.threads)))}
                       for local, env in enumerate(worker_envs)]
    n = len(helper_envs)   # procs, logs and names: the helpers first, then the workers in rank order
    names = [f"{spec.framework} {name}" for name, _ in helper_envs]
    names += [f"copy {r} of {copies}" if copies > 1 else f"worker {r} of {processes}" if processes > 1 else "worker"
              for r in ranks]
    with tempfile.TemporaryDirectory(prefix="rosetta-") as tmp:
        procs, logs = [], []

        def start(name, env, args):
            log_path = os.path.join(tmp, f"{name}.log")
            with open(log_path, "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "harness.run.worker", spec.to_json(), *args], cwd=ROOT, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, **env, PARENT_VARIABLE: str(os.getpid()), LOGS_VARIABLE: tmp}))
            logs.append(log_path)

        def log_tail(i):
            with open(logs[i], errors="replace") as f:
                return f.read()[-4000:]

        outs = [os.path.join(tmp, f"rank{r}.json") for r in ranks]
        try:
            for name, env in helper_envs:
                start(name, env, [os.path.join(tmp, f"{name}.json")])
            for r, env, out in zip(ranks, worker_envs, outs):
                start(f"worker{r}", env, [out])
            started = time.monotonic()
            reported, reported_at, kept = None, started, set()
            while True:
                codes = [p.poll() for p in procs]
                # a worker that wrote its record and then crashed as it ended (in an atexit handler, MXNet's teardown)
                # finished its run: its record is kept and the others go on
                for i in range(n, len(procs)):
                    if codes[i] not in (None, 0) and i not in kept and wrote_ok(outs[i - n]):
                        kept.add(i)
                        print(f"note: {names[i]} {describe_exit(codes[i])} after writing its record (kept)",
                              file=sys.stderr)
                dead = [i for i in [*range(n, len(procs)), *range(n)] if codes[i] not in (None, 0) and i not in kept]
                if dead:   # the others would wait for it (a collective, the server) forever: stop them all now
                    def said_why(i):   # a worker that failed cleanly and wrote its record
                        return i >= n and os.path.exists(outs[i - n])
                    # Found dead together, one that died without saying why (a signal, a crash) is the cause: a peer's
                    # clean failure is most often its collective breaking on the dead one (gloo's read error)
                    i = min(dead, key=said_why)
                    if said_why(i):
                        with open(outs[i - n]) as f:
                            return [{**json.load(f), "log": log_tail(i)}]
                    return [{"status": "failed", "log": log_tail(i),
                             "error": f"{names[i]} {describe_exit(codes[i])}: {last_line(log_tail(i)) or 'no output'}"}]
                if all(codes[i] == 0 or i in kept for i in range(n, len(procs))):
                    break
                now = time.monotonic()
                if timeout is not None and now - started > timeout:
                    return [{"status": "failed", "error": f"timed out after {timeout:g} s", "log": log_tail(n),
                             "timed_out": True}]
                latest = last_progress(logs[n])
                if latest != reported:
                    reported, reported_at = latest, now
                elif stall_timeout is not None and now - reported_at > stall_timeout:
                    where = f"after step {reported[0]} of {reported[1]}" if reported else "before its first step"
                    return [{"status": "failed", "log": log_tail(n),
                             "error": f"stalled {where}: no progress for {stall_timeout:g} s"}]
                if progress and reported:
                    progress(*reported)
                wait_for_an_end(procs, codes, POLL_SECONDS)
        finally:
            kill_all(procs)   # also on Ctrl-C, SIGTERM, SIGHUP: Interrupted propagates after the kill
        results = []
        for i, (r, out) in enumerate(zip(ranks, outs)):
            if not os.path.exists(out):
                return [{"status": "failed", "error": f"worker {r} wrote no result", "log": log_tail(n + i)}]
            with open(out) as f:
                results.append(json.load(f))
            if results[-1]["status"] == "failed":
                results[-1]["log"] = log_tail(n + i)
        return results
