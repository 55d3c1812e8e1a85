"""A worker's training with no framework in it: the process lifecycle's tests (tests/test_endings.py, the dead-worker
and timeout tests of tests/test_engines.py) need workers that start, report progress, wait for each other every step
as a collective does, and write their records, not workers that import a framework and compile for 10 s first.
`run(spec, started)` stands in for harness.run.worker.run when the worker's environment names this file
(harness.run.worker.STUB_VARIABLE); everything around it is the real worker: its signals, its parent watch, its
record, the real training loop (harness.training.loop.train) with this file's runner in place of a framework's.

The runner takes STEP_SECONDS a step and returns a loss that falls with the step; the processes of a run go in
lockstep (each step waits until every rank has done the one before), through files in the run's log folder, so that
one stopped process stalls the others as a stopped peer of an all-reduce does."""
import atexit
import os
import time

import numpy as np

STEP_SECONDS = 0.05
# The rank named here aborts as its interpreter exits, after its record is written: as PyTorch 2.13's gloo can abort
# a process at exit (tests/test_distributed_checkpoints.py)
ABORT_AT_EXIT_VARIABLE = "ROSETTA_STUB_ABORT_AT_EXIT"
# A folder named here gets a file from each rank's atexit handler, one from its open thread pool's last work, and one
# from an object freed only by the interpreter's teardown of its modules (as TensorFlow's are, for a second after the
# run); each rank's stdout a line that C code wrote into its buffer (harness.run.worker.end)
EXIT_MARKERS_VARIABLE = "ROSETTA_STUB_EXIT_MARKERS"
# Set: a rank waiting for a peer that is gone fails at once, as a collective does when its peer's connection closes
# (gloo's "Read error", TensorFlow's UnavailableError)
PEER_LOSS_VARIABLE = "ROSETTA_STUB_FAIL_ON_A_LOST_PEER"


class FreedAtTeardown:
    """Held by a module of sys.modules: its __del__ runs as the interpreter tears the modules down, after atexit."""

    def __init__(self, path):
        self.path = path

    def __del__(self):
        open(self.path, "w").close()


def mark_the_exit(folder, rank):
    import ctypes
    import sys
    import types
    from concurrent.futures import ThreadPoolExecutor
    atexit.register(lambda: open(os.path.join(folder, f"atexit-{rank}"), "w").close())
    module = sys.modules["stub_teardown"] = types.ModuleType("stub_teardown")
    module.held = FreedAtTeardown(os.path.join(folder, f"teardown-{rank}"))
    # A thread pool left open, as torch.compile's is (its threads end when the interpreter tells them to), with work
    # still to do, which the interpreter waits for
    module.pool = ThreadPoolExecutor(1)
    module.pool.submit(lambda: (time.sleep(0.5), open(os.path.join(folder, f"pool-{rank}"), "w").close()))
    ctypes.CDLL(None).printf(b"written by C, rank %d\n", rank)   # stays in C's buffer: stdout is a file


class Lockstep:
    """The runner interface of harness.training.loop (Scratch's), computing nothing: `weights` is the number of steps
    taken, equal on every rank that took them all."""

    def __init__(self, rank, world, folder):
        self.rank, self.world, self.folder, self.steps = rank, world, folder, 0
        with open(os.path.join(folder, f"stub-pid{rank}"), "w") as f:
            f.write(str(os.getpid()))

    def initial_weights(self, seed, init):
        return {"steps": np.zeros(1, np.float32)}

    def start(self, weights, optimizer, state=None, scaler=None):
        self.steps = int(weights["steps"][0])

    def feed(self, data, order, rank, world):
        pass

    def batches(self, epoch):
        while True:
            yield None

    def done(self, rank):
        try:
            with open(os.path.join(self.folder, f"stub-rank{rank}")) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0

    def gone(self, rank):
        """Whether rank's process has ended, a zombie too (its parent has not reaped it yet)."""
        try:
            with open(os.path.join(self.folder, f"stub-pid{rank}")) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            return False   # not started yet
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True   # reaped

    def step(self, batch, lr, batch_size):
        time.sleep(STEP_SECONDS)
        self.steps += 1
        if self.world > 1:   # written whole (a rename), then wait for every other rank to have taken this step
            path = os.path.join(self.folder, f"stub-rank{self.rank}")
            with open(path + ".part", "w") as f:
                f.write(str(self.steps))
            os.replace(path + ".part", path)
            while min(self.done(r) for r in range(self.world)) < self.steps:
                if os.environ.get(PEER_LOSS_VARIABLE) and any(self.gone(r) for r in range(self.world)):
                    raise RuntimeError("a peer's connection closed")
                time.sleep(0.01)
        return 2.3 * 0.97 ** self.steps

    def weights(self):
        return {"steps": np.array([self.steps], np.float32)}

    def skipped_steps(self):
        return 0   # no loss scaler: every step is an update

    def scaler_state(self):
        return None

    def loss_scale(self):
        return None   # no loss scaler

    def sync(self):
        pass

    def evaluate(self, X, y):
        return 0.1

    def total(self, count):
        return count * self.world   # every rank's part alike: evaluate computes nothing

    def spread(self):
        return None

    def state_bytes(self):
        return None   # no optimizer state

    def parameter_bytes(self):
        return None

    def replica_bn_states(self):
        return []


def run(spec, started):
    from common.data import load_dataset
    from harness.processes.launch import LOGS_VARIABLE
    from harness.run.worker import progress
    from harness.training.loop import Hooks, steps_per_epoch, train
    data = load_dataset(spec.dataset, spec.data_dir, spec.n_synthetic, spec.seed)
    rank, world = int(os.environ.get("RANK", 0)), spec.processes   # the variables of PyTorch's engine (torchrun's)
    if os.environ.get(ABORT_AT_EXIT_VARIABLE) == str(rank):
        atexit.register(os.abort)
    if os.environ.get(EXIT_MARKERS_VARIABLE):
        mark_the_exit(os.environ[EXIT_MARKERS_VARIABLE], rank)
    runner = Lockstep(rank, world, os.environ.get(LOGS_VARIABLE, "."))
    optimizer = spec.canonical_optimizer(steps_per_epoch(len(data.y_train), spec.batch_size, spec.devices))
    startup_seconds = time.perf_counter() - started
    record = train(runner, data, spec, optimizer, rank, world, hooks=Hooks(progress))
    return {**record, "spec": spec.to_dict(), "rank": rank, "world": world, "fingerprint": data.fingerprint(),
            "exec": None, "compiles": None, "layout": None, "startup_seconds": startup_seconds,
            "device_names": [f"stub {d}" for d in range(spec.per_process)], "peak_rss_bytes": 0,
            "train_memory_bytes": None, "peak_device_memory_bytes": None}
