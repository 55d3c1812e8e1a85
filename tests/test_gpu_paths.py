"""Each framework's GPU-only branches, exercised without a GPU: the framework calls a GPU run would make
are replaced by recorders (monkeypatch), and where the framework allows it the GPU choice runs for real
on the CPU (MXNet's dist_device_sync kvstore)."""
import json
import os
import sys
import types

import numpy as np
import pytest

from common.interface import RosettaError
from harness.loader import load_module
from harness.processes.cluster import engine_env
from harness.training.loop import summarize
from conftest import framework_or_skip, run_processes


def distributed(framework):
    framework_or_skip(framework)
    return load_module(framework, "distributed")


# PyTorch

def test_pytorch_binds_each_process_to_its_gpu_before_nccl(monkeypatch):
    module = distributed("pytorch")
    import torch
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(module.dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init_process_group", backend, kw["device_id"])))
    monkeypatch.setattr(module.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(module.dist, "get_world_size", lambda: 4)
    assert module.init_process([1]) == (3, 4)   # local slot 1 of its machine
    gpu = torch.device("cuda", 1)
    assert calls == [("set_device", gpu), ("init_process_group", "nccl", gpu)]
    calls.clear()
    module.init_process([])   # the CPU: gloo, no device to bind
    assert calls == [("init_process_group", "gloo", None)]


# TensorFlow

@pytest.fixture
def tf_gpus(monkeypatch):
    """n pretend physical GPUs; returns the list that memory-growth calls are recorded in."""
    framework_or_skip("tensorflow")
    import tensorflow as tf
    real = tf.config.list_physical_devices
    grown = []

    def pretend(n):
        gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(n)]
        monkeypatch.setattr(tf.config, "list_physical_devices",
                            lambda kind=None: gpus if kind == "GPU" else real(kind))
        monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                            lambda device, on: grown.append((device.name, on)))
        return grown
    return pretend


def test_tensorflow_grows_gpu_memory_before_it_places_anything(tf_gpus):
    grown = tf_gpus(4)
    devices = load_module("tensorflow", "devices")
    assert devices.get_devices(2) == ["/device:GPU:0", "/device:GPU:1"]
    assert grown == [(f"/physical_device:GPU:{i}", True) for i in range(4)]


class FakeStrategy:
    """Records how MultiWorkerMirroredStrategy was built, and what had happened by then."""

    def __init__(self, communication_options, grown):
        self.options, self.grown_before = communication_options, list(grown)
        self.cluster_resolver = types.SimpleNamespace(
            task_id=1, cluster_spec=lambda: types.SimpleNamespace(num_tasks=lambda kind: 2))


def test_tensorflow_workers_use_nccl_on_gpus_and_ring_on_the_cpu(tf_gpus, monkeypatch):
    import tensorflow as tf
    module = distributed("tensorflow")
    grown = tf_gpus(1)   # the launcher showed this worker its one GPU (CUDA_VISIBLE_DEVICES)
    made = []
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy",
                        lambda communication_options: made.append(FakeStrategy(communication_options, grown))
                        or made[-1])
    monkeypatch.setattr(module, "STRATEGY", None)
    assert module.init_process([0]) == (1, 2)
    implementation = tf.distribute.experimental.CommunicationImplementation
    assert made[0].options.implementation == implementation.NCCL
    assert made[0].grown_before == [("/physical_device:GPU:0", True)]   # before the runtime starts
    assert module.backend([]) == implementation.RING


def test_tensorflow_refuses_a_worker_that_sees_other_workers_gpus(tf_gpus, monkeypatch):
    """Its strategy would replicate onto all 4: two workers would train on the same GPUs."""
    module = distributed("tensorflow")
    tf_gpus(4)
    monkeypatch.setattr(module, "STRATEGY", None)
    with pytest.raises(RosettaError, match="sees 4 and owns 1; start each worker with CUDA_VISIBLE_DEVICES"):
        module.init_process([1])


def test_tensorflow_s_engine_skips_more_devices_than_its_cpu_workers_replicate(monkeypatch):
    """On a CPU, MultiWorkerMirroredStrategy makes one replica per worker whatever it is given: 4 devices on 2
    processes is a framework limit (a skipped row, as MXNet's fp16), not a failure of the run."""
    import tensorflow as tf
    from common.interface import Unavailable
    from common.lenet import init_weights
    framework_or_skip("tensorflow")
    monkeypatch.setattr(distributed("tensorflow"), "STRATEGY", tf.distribute.OneDeviceStrategy("/cpu:0"))
    with pytest.raises(Unavailable, match=r"runs 1 replica\(s\) per process here, not 2 \(on a CPU, one\)"):
        load_module("tensorflow", "builtin").get_model(init_weights(0), ["/cpu:0", "/cpu:1"])


# MXNet

def test_mxnet_sums_on_the_gpus_across_processes(monkeypatch):
    module = distributed("mxnet")
    made = []
    monkeypatch.setattr(module.mx.kv, "create",
                        lambda kind: made.append(kind) or types.SimpleNamespace(rank=1, num_workers=2))
    monkeypatch.setattr(module, "KV", None)
    assert module.init_process([0, 1]) == (1, 2)
    module.init_process([])
    assert made == ["dist_device_sync", "dist_sync"]


# A worker whose MXNet engine uses the GPU kvstore type whatever its devices: dist_device_sync also runs on
# CPU contexts, so the GPU choice is exercised for real (its pushpull, and the Trainer over it).
GPU_KVSTORE_WORKER = """
import sys
from harness.loader import load_module
engine = load_module("mxnet", "distributed")
engine.backend = lambda gpus: "dist_device_sync"


def create(kind, mxnet_create=engine.mx.kv.create):
    kv = mxnet_create(kind)
    print("kvstore", kv.type, file=sys.stderr)
    return kv


engine.mx.kv.create = create
from harness.run.worker import main
sys.exit(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["scratch", "builtin"])
def test_mxnet_gpu_kvstore_computes_the_dist_sync_step(mode, tmp_path):
    framework_or_skip("mxnet")
    spec = {"framework": "mxnet", "mode": mode, "devices": 2, "processes": 2, "dataset": "digits", "epochs": 1,
            "batch_size": 97, "lr": 0.2, "seed": 5, "threads": 1, "max_steps": 2}
    runs = {}
    for name, code in (("dist_sync", None), ("dist_device_sync", GPU_KVSTORE_WORKER)):
        workers, helpers = engine_env("mxnet", 2, devices=2, gpus=[])
        out = str(tmp_path / f"{name}-{{rank}}.json")
        worker = [sys.executable, "-m", "harness.run.worker"] if code is None else [sys.executable, "-c", code]
        errors = run_processes([([sys.executable, "-m", "harness.run.worker", json.dumps(spec), os.devnull], env)
                                for _, env in helpers] + [(worker + [json.dumps(spec), out], env) for env in workers])
        if code:
            assert all("kvstore dist_device_sync" in e for e in errors[len(helpers):])
        runs[name] = [json.load(open(out.replace("{rank}", str(r)))) for r in range(2)]
    for a, b in zip(runs["dist_sync"], runs["dist_device_sync"]):
        np.testing.assert_allclose(a["step_loss_sums"], b["step_loss_sums"], atol=1e-5)
        assert a["digest"] == b["digest"]   # the same final weights, bit for bit


# JAX

@pytest.fixture
def jax_gpus(monkeypatch):
    """A machine with JAX's CUDA plugin and 4 GPUs, as far as counting goes (JAX's backend never starts)."""
    module = distributed("jax")
    devices = load_module("jax", "devices")
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: name == "jax_cuda12_plugin" or None)
    monkeypatch.setattr(devices, "machine_gpus", lambda: ["0", "1", "2", "3"])
    calls = []
    monkeypatch.setattr(module.jax.distributed, "initialize", lambda **kw: calls.append(("initialize", kw)))
    monkeypatch.setattr(module.jax.config, "update", lambda *a: calls.append(("config",) + a))
    monkeypatch.setattr(module.jax, "process_index", lambda: 1)
    monkeypatch.setattr(module.jax, "process_count", lambda: 2)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    return module, devices, calls


def test_jax_counts_gpus_without_starting_its_backend(jax_gpus, monkeypatch):
    _, devices, _ = jax_gpus
    assert devices.gpu_count() == 4
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "2,3")   # JAX's own way to give a process its GPUs
    assert devices.gpu_count() == 2
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: None)   # jax[cpu]: no plugin
    assert devices.gpu_count() == 0


def test_jax_uses_nccl_on_gpus_and_gloo_on_the_cpu(jax_gpus, monkeypatch):
    module, _, calls = jax_gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(module, "gpu_count", lambda: 2)   # what the launcher left it: its own two
    assert module.init_process([0, 1]) == (1, 2)
    assert module.backend([0, 1]) == "nccl" and [c[0] for c in calls] == ["initialize"]   # no CPU collectives
    calls.clear()
    monkeypatch.setattr(module, "gpu_count", lambda: 0)
    module.init_process([])
    assert module.backend([]) == "gloo" and calls[0] == ("config", "jax_cpu_collectives_implementation", "gloo")
    assert calls[1][1]["num_processes"] == 2 and calls[1][1]["process_id"] == 1


def test_jax_refuses_a_process_that_sees_other_processes_gpus(jax_gpus):
    module, _, calls = jax_gpus
    with pytest.raises(RosettaError, match="sees 4 and owns 2"):
        module.init_process([2, 3])   # local slot 1 of 2 on a 4-GPU machine, with every GPU visible
    assert calls == []


# Every framework

def test_peak_gpu_memory_is_summed_over_processes():
    """Each process reports its own GPUs' peak; the run's is their sum (not rank 0's alone)."""
    record = {"epoch_seconds": [1.0], "first_step_seconds": 0.1, "images": 10, "first_step_images": 5,
              "epoch_loss_sums": [1.0], "epoch_sizes": [5], "step_loss_sums": [1.0], "step_sizes": [5],
              "test_accuracy": 0.5, "replica_spread": None}
    peaks = [300, 500, 200, 100]
    assert summarize([{**record, "peak_device_memory_bytes": p} for p in peaks])["peak_device_memory_bytes"] == 1100
    assert summarize([{**record, "peak_device_memory_bytes": None}] * 2)["peak_device_memory_bytes"] is None
