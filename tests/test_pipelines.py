"""Each framework's own input pipeline (its pipeline.py, what the built-in mode trains on) hands every device
exactly the rows of the shared order: the same batches in the same order, every process its contiguous part
of each batch, every device its contiguous shard of that part, the short last batch included."""
import pytest

from common.batches import epoch_batches, process_part
from common.data import load_dataset
from harness.processes.launch import run_workers
from common.sharding import shard_bounds
from conftest import framework_or_skip

# (framework, devices, processes): uneven shards in one process, and devices shared out among processes
# (DistributedDataParallel and MultiWorkerMirroredStrategy on the CPU run one device per process).
CONFIGS = [("pytorch", 2, 2), ("mxnet", 3, 1), ("mxnet", 4, 2), ("tensorflow", 3, 1), ("tensorflow", 2, 2),
           ("jax", 3, 1), ("jax", 4, 2)]
EPOCHS, BATCH, SEED = 2, 97, 4   # digits: 1437 rows, so 14 batches of 97 and a last one of 79 per epoch


def shared_order(n, devices, processes, rank):
    """Per epoch, per step, per device of process `rank`: the row numbers the shared loop would feed it."""
    local = devices // processes
    order = []
    for epoch in range(EPOCHS):
        steps = []
        for batch in epoch_batches(n, BATCH, SEED, epoch, min_size=devices):
            part = process_part(batch, rank, processes)
            steps.append([part[a:b].tolist() for a, b in shard_bounds(len(part), local)])
        order.append(steps)
    return order


@pytest.mark.slow
@pytest.mark.parametrize("framework,devices,processes", CONFIGS)
def test_the_pipeline_feeds_every_device_the_shared_order(framework, devices, processes):
    framework_or_skip(framework)
    spec = {"task": "feed", "framework": framework, "mode": "builtin", "devices": devices, "processes": processes,
            "dataset": "digits", "epochs": EPOCHS, "batch_size": BATCH, "seed": SEED, "threads": 1}
    results = run_workers(spec, timeout=240)
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    n = len(load_dataset("digits").y_train)
    assert sorted(r["rank"] for r in results) == list(range(processes))
    for r in results:
        assert r["fed"] == shared_order(n, devices, processes, r["rank"]), f"rank {r['rank']}"


def test_the_input_cost_is_the_slowest_process_per_epoch_and_shown_with_its_share():
    from harness.publishing.tables import format_table
    from harness.training.loop import summarize
    record = {"epoch_seconds": [2.0, 4.0], "first_step_seconds": 0.1, "images": 20, "first_step_images": 5,
              "epoch_loss_sums": [1.0, 1.0], "epoch_sizes": [5, 5], "step_loss_sums": [1.0], "step_sizes": [5],
              "test_accuracy": 0.5, "replica_spread": None}
    run = summarize([{**record, "epoch_input_seconds": [0.1, 0.3]}, {**record, "epoch_input_seconds": [0.2, 0.1]}])
    assert run["epoch_input_seconds"] == [0.2, 0.3] and run["input_seconds_median"] == pytest.approx(0.25)
    row = {"framework": "mxnet", "mode": "builtin", "devices": 2, "processes": 2, "status": "ok", **run}
    assert "| 0.250 (8.3%) " in format_table([row], timing=True)   # 0.25 s of a 3 s epoch (medians)


# A fresh process makes the built-in row's loader (the strategy's iterator, whose GeneratorDataset runs TensorFlow's
# malloc patch), then asks glibc whether a freed step-sized buffer would be a fresh mapping: mallinfo2's hblkhd (bytes
# in mmapped chunks) across a malloc of 4 MiB. With "as-tensorflow-leaves-it", pipeline.keep_freed_memory does
# nothing. glibc's own threshold starts at 128 KiB and TensorFlow's patch sets it there, so without the fix the buffer
# is a mapping on any glibc; with it (32 MiB) it is reused heap memory.
MALLOC_SCRIPT = r"""
import ctypes, ctypes.util, sys, types
import numpy as np
sys.path.insert(0, sys.argv[1])
from harness.loader import load_framework, load_module
fw = load_framework("tensorflow")
builtin, pipeline = load_module("tensorflow", "builtin"), load_module("tensorflow", "pipeline")
if sys.argv[2] == "as-tensorflow-leaves-it":
    pipeline.keep_freed_memory = lambda: None
from common.batches import Order
from common.lenet import init_weights
devices = fw.get_devices(1)
data = types.SimpleNamespace(X_train=np.zeros((64, 1, 28, 28), np.float32), y_train=np.zeros(64, np.int32))
next(pipeline.batches(pipeline.make_loader(data, Order(64, 32, 0), 0, 1, builtin.get_model(init_weights(0), devices),
                                           devices), 0))

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Mallinfo2, ctypes.c_void_p, [ctypes.c_void_p]
before = libc.mallinfo2().hblkhd
buffer = libc.malloc(4 << 20)
print(libc.mallinfo2().hblkhd - before, flush=True)
libc.free(buffer)
import os
os._exit(0)   # not the interpreter's shutdown with the dataset's generator thread alive: it hung once in 300 s
"""


@pytest.mark.slow
def test_tensorflow_s_dataset_leaves_the_step_reusing_its_freed_buffers():
    """Making the strategy's iterator sets glibc's mmap threshold to 128 KiB for the whole process (TensorFlow's
    Python 3.11 patch in its GeneratorDataset); pipeline.keep_freed_memory sets it back to 32 MiB. Without it each of
    the step's large buffers is a fresh mapping every step, page-faulted in (what that costs depends on the machine:
    docs/profiling.md). Asserted here: the setting holds once the loader is made, a 4 MiB buffer is heap memory; and
    without the fix it is a mapping (the test can tell the two apart on any glibc)."""
    import os
    import subprocess
    import sys
    framework_or_skip("tensorflow")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    mapped = {}
    for how in ("fixed", "as-tensorflow-leaves-it"):
        out = subprocess.run([sys.executable, "-c", MALLOC_SCRIPT, root, how], capture_output=True, text=True,
                             env=env, timeout=120, cwd=root)
        assert out.returncode == 0, out.stderr[-2000:]
        mapped[how] = int(out.stdout.strip().splitlines()[-1])
    assert mapped == {"fixed": 0, "as-tensorflow-leaves-it": mapped["as-tensorflow-leaves-it"]}, mapped
    assert mapped["as-tensorflow-leaves-it"] >= 4 << 20, mapped


def test_tensorflow_s_pipeline_makes_its_iterator_once_a_run_not_once_an_epoch(monkeypatch):
    """Making the strategy's iterator takes 0.2-0.4 s, which made at every epoch's first batch was most of the
    built-in rows' wait for input: one iterator runs through every epoch, made before the loop, and made again only
    where the loop asks for another epoch than the next (a resumed run, an epoch cut short by max_steps)."""
    import types
    import numpy as np
    from common.batches import Order
    from common.lenet import init_weights
    from harness.loader import load_module
    fw = framework_or_skip("tensorflow")
    builtin, pipeline = load_module("tensorflow", "builtin"), load_module("tensorflow", "pipeline")
    devices = fw.get_devices(2)
    n, batch = 45, 8   # 5 batches of 8 and a last one of 5 an epoch
    data = types.SimpleNamespace(X_train=np.zeros((n, 1, 28, 28), np.float32), y_train=np.arange(n, dtype=np.int32))
    made, start = [], pipeline.start
    monkeypatch.setattr(pipeline, "start", lambda loader, epoch: made.append(epoch) or start(loader, epoch))
    loader = pipeline.make_loader(data, Order(n, batch, 0, 2), 0, 1, builtin.get_model(init_weights(0), devices),
                                  devices)

    def fed(epoch, steps=None):
        feed = pipeline.batches(loader, epoch)
        return [[y.tolist() for _, y in pipeline.per_device(next(feed))] for _ in range(steps or 6)]

    def expected(epoch):
        return [[b[i:j].tolist() for i, j in shard_bounds(len(b), 2)] for b in epoch_batches(n, batch, 0, epoch, 2)]
    for epoch in range(3):
        assert fed(epoch) == expected(epoch), epoch
    assert made == [0]
    # endless, and known to be (its length infinite, not unknown): no agreement on an optional at every next()
    assert loader.iterator._enable_get_next_as_optional is False
    list(pipeline.batches(loader, 3))   # the rest of epoch 3 ...
    assert fed(4, steps=2) == expected(4)[:2]   # ... then 2 steps of epoch 4, and a resumed run's epoch 7
    assert fed(5) == expected(5) and fed(7) == expected(7) and made == [0, 5, 7]
