"""Each framework's own input pipeline (its pipeline.py, what the built-in mode trains on) hands every device
exactly the rows of the shared order: the same batches in the same order, every process its contiguous part
of each batch, every device its contiguous shard of that part, the short last batch included."""
import pytest

from common.batches import epoch_batches, process_part
from common.data import load_dataset
from harness.launch import run_workers
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
    from harness.report import format_table
    from harness.training import summarize
    record = {"epoch_seconds": [2.0, 4.0], "first_step_seconds": 0.1, "images": 20, "first_step_images": 5,
              "epoch_loss_sums": [1.0, 1.0], "epoch_sizes": [5, 5], "step_loss_sums": [1.0], "step_sizes": [5],
              "test_accuracy": 0.5, "replica_spread": None}
    run = summarize([{**record, "epoch_input_seconds": [0.1, 0.3]}, {**record, "epoch_input_seconds": [0.2, 0.1]}])
    assert run["epoch_input_seconds"] == [0.2, 0.3] and run["input_seconds_median"] == pytest.approx(0.25)
    row = {"framework": "mxnet", "mode": "builtin", "devices": 2, "processes": 2, "status": "ok", **run}
    assert "| 0.250 (8.3%) " in format_table([row], timing=True)   # 0.25 s of a 3 s epoch (medians)
