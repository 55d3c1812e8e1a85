"""Each framework's GPU-only branches, exercised without a GPU: the framework calls a GPU run would make
are replaced by recorders (monkeypatch), and where the framework allows it the GPU choice runs for real
on the CPU (MXNet's dist_device_sync kvstore)."""
from common.training import summarize


def test_peak_gpu_memory_is_summed_over_processes():
    """Each process reports its own GPUs' peak; the run's is their sum (not rank 0's alone)."""
    record = {"epoch_seconds": [1.0], "first_step_seconds": 0.1, "images": 10, "first_step_images": 5,
              "epoch_loss_sums": [1.0], "epoch_sizes": [5], "step_loss_sums": [1.0], "step_sizes": [5],
              "test_accuracy": 0.5, "replica_spread": None}
    peaks = [300, 500, 200, 100]
    assert summarize([{**record, "peak_device_memory_bytes": p} for p in peaks])["peak_device_memory_bytes"] == 1100
    assert summarize([{**record, "peak_device_memory_bytes": None}] * 2)["peak_device_memory_bytes"] is None
