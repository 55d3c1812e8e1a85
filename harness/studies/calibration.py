"""The yardsticks that let a timing table travel: what this machine can do, and what else it was doing.

Absolute speed differs 2x between machines of the same kind; ratios inside one run hold. So a benchmark
measures this machine's dense float32 matmul peak at its start and end (numpy's BLAS, in a fresh process
with the run's thread count) and reports each row as a fraction of it (a bf16 or fp16 row: of the matmul peak in
its precision, PyTorch's, measured at the start), and records the load around the run:
the load average, and the CPU time that processes other than the run's own used meanwhile (/proc/stat's
busy time minus this process's and its children's). A run on a busy machine is flagged, not hidden.
"""
import json
import os
import resource
import subprocess
import sys
import time

# The best GFLOP/s of an n x n matmul in each of the named precisions: numpy's BLAS for fp32 (the yardstick of every
# row), PyTorch's oneDNN kernels for fp32, bf16 and fp16 (numpy has neither low precision; these use the CPU's bf16
# dot products, AVX512_BF16 or AMX, where it has them).
MATMUL = """
import json, sys, time
n, seconds, library = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
names, threads = sys.argv[4].split(","), int(sys.argv[5])
if library == "torch":
    import torch
    torch.set_num_threads(threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    make = lambda name, size: torch.ones((size, size), dtype=dtypes[name])
else:
    import numpy as np
    make = lambda name, size: np.ones((size, size), np.float32)
out = {}
for name in names:
    a = make(name, 256)
    a @ a
    t = time.perf_counter()
    a @ a
    slow = (time.perf_counter() - t) * (n / 256) ** 3 > seconds   # no fast kernel: fp16 without AVX512-FP16
    a = b = make(name, n)
    if not slow:   # a warm-up; a slow kernel's one timed matmul takes a minute, its start-up nothing beside it
        a @ b
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    out[name] = best
print(json.dumps(out))
"""
STEADY = """
import json, os, sys, time
import numpy as np
os.sched_setaffinity(0, {int(sys.argv[1])})
a = np.ones((384, 384), np.float32)
t = time.perf_counter()
for _ in range(5):
    a @ a
matmuls = max(1, round(float(sys.argv[2]) * 5 / (time.perf_counter() - t)))
times = []
for _ in range(int(sys.argv[3]) + 1):
    t = time.perf_counter()
    for _ in range(matmuls):
        a @ a
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""
QUIET_SHARE = 0.05   # other processes may use at most this share of the machine's CPU time


def blas_env(threads):
    """The environment of a numpy child whose BLAS uses `threads` threads (fixed before numpy starts it)."""
    return {**os.environ, **{v: str(threads) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}


def matmul_peaks(threads, library="numpy", names=("fp32",), n=2048, seconds=2.0):
    """{precision: best GFLOP/s of an n x n matmul}, by `library`, in a fresh process whose threads are fixed before
    it starts its BLAS."""
    out = subprocess.run([sys.executable, "-c", MATMUL, str(n), str(seconds), library, ",".join(names), str(threads)],
                         env=blas_env(threads), capture_output=True, text=True, timeout=300, check=True).stdout
    return json.loads(out)


def matmul_peak(threads, n=2048, seconds=2.0):
    """Best GFLOP/s of an n x n float32 matmul (numpy's BLAS)."""
    return matmul_peaks(threads, n=n, seconds=seconds)["fp32"]


def low_matmul_peaks(threads, names=("fp32", "bf16", "fp16"), n=2048, seconds=1.5):
    """The matmul peaks in `names` by PyTorch's CPU kernels: in bf16 and fp16 the yardstick of --precision's rows and
    what the hardware gives them over fp32; in fp32 the yardstick where numpy's BLAS does not know the CPU
    (benchmark.add_peak_fraction). A precision the CPU has no fast kernel for is timed once, with no warm-up: PyTorch's
    fp16 matmul on the AMD EPYC (no AVX512-FP16) makes 0.3-0.4 GFLOP/s at 2048, 45-65 s for one (3 GFLOP/s on a
    matrix of 256 or 512, which fits in its caches; every precision's peak is taken at the same n)."""
    return matmul_peaks(threads, "torch", names, n, seconds)


def machine_lockstep(cores, step_seconds=0.1, steps=60):
    """The waiting that lockstep costs on this machine with no framework at all: one single-threaded numpy process
    pinned to each core, all at once, each timing `steps` steps of the same matmuls (about step_seconds each), read as
    harness/studies/split.py reads a row's processes alongside. A core of a virtual machine does not run at one speed
    from one step to the next, and processes that wait for each other every step pay for the slower one each time.
    {"cores", "step_seconds": their mean step, "lockstep_seconds": at the slower one's pace}."""
    from .split import lockstep
    env = blas_env(1)
    workers = [subprocess.Popen([sys.executable, "-c", STEADY, str(core), str(step_seconds), str(steps)], env=env,
                                stdout=subprocess.PIPE, text=True) for core in cores]
    try:
        times = [json.loads(w.communicate(timeout=120)[0]) for w in workers]
    finally:
        for w in workers:
            w.kill()
            w.wait()
    mean, slowest = lockstep(times)
    return {"cores": list(cores), "step_seconds": mean, "lockstep_seconds": slowest}


def busy_seconds():
    """CPU seconds the whole machine has spent busy since boot (every core, every process)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_seconds():
    """CPU seconds of this process and of its children that have ended (the run's workers)."""
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


class LoadRecord:
    """The machine's load around a run: start() before its first row, stop() after its last."""

    def start(self):
        self.wall, self.busy, self.own, self.load_start = time.monotonic(), busy_seconds(), own_seconds(), os.getloadavg()
        return self

    def stop(self):
        wall, own = time.monotonic() - self.wall, own_seconds() - self.own
        others = max(0.0, (busy_seconds() - self.busy) - own)
        share = others / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0
        return {"wall_seconds": wall, "own_cpu_seconds": own, "other_cpu_seconds": others, "other_cpu_share": share,
                "loadavg_start": list(self.load_start), "loadavg_end": list(os.getloadavg()),
                "quiet": share <= QUIET_SHARE}


def warning(load):
    """One line for a run whose machine was not quiet, else None."""
    if load["quiet"]:
        return None
    return (f"warning: the machine was not quiet: other processes used {100 * load['other_cpu_share']:.0f}% of its "
            f"CPU time during the run ({load['other_cpu_seconds']:.0f} CPU s); its speeds are not this machine's, "
            f"and not comparable between frameworks either: they slow unequally (docs/profiling.md)")
