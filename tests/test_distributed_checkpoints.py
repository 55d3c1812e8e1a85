"""Sharded checkpoints as users' programs write them, each process its own shard of every parameter and optimizer
buffer: PyTorch's Distributed Checkpoint (DCP) from a stock FSDP2 program (stock_fsdp2_program.py, written as
PyTorch's FSDP2 tutorial and DCP recipe write one, launched by torchrun on 2 processes), and Orbax's checkpoint of
sharded jax.Arrays from a stock multi-process JAX program (stock_sharded_jax_program.py: jax.distributed, NamedSharding,
Flax's checkpointing guide). The converter reads each whole on one process and writes the other frameworks' files,
from which their stock code goes on as the sharded program itself goes on."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from common.lenet import init_weights
from conftest import framework_or_skip
from harness.processes.cluster import free_ports
from harness.training import convert
from test_pytorch_general_checkpoints import CASES
from test_zero import shard_counts
from test_stock_gluon_states import (ADAM_TOLERANCE, AFTER, BEFORE, batches, keras_program, networks,  # noqa: F401
                                     optax_program, torch_program)

pytestmark = pytest.mark.slow   # programs of 2 processes
HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "stock_fsdp2_program.py")
JAX_PROGRAM = os.path.join(HERE, "stock_sharded_jax_program.py")


def fsdp2_program(batches, folder, optimizer, params):
    """torchrun's 2 processes train on the batches, saving a DCP checkpoint (folder/checkpoint) before step BEFORE:
    the losses from there on (each the mean of the ranks' halves, the whole batch's)."""
    framework_or_skip("pytorch")
    np.savez(folder / "batches.npz", X=np.stack([X for X, _ in batches]), y=np.stack([y for _, y in batches]))
    np.savez(folder / "initial.npz", **init_weights())
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_ports(1)[0]), PROGRAM, "--data", str(folder / "batches.npz"), "--weights",
               str(folder / "initial.npz"), "--save-at", str(BEFORE), "--checkpoint", str(folder / "checkpoint"),
               "--losses", str(folder / "losses.json"), "--optimizer", optimizer, "--params", json.dumps(params)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 or exited_in_gloo_s_race(proc.stderr), proc.stderr[-3000:]
    losses = json.loads((folder / "losses.json").read_text())
    assert len(losses) == len(batches)   # the program's last step done, whatever its exit
    return losses[BEFORE:]


def exited_in_gloo_s_race(stderr):
    """PyTorch 2.13's gloo can abort a process of this program as its interpreter exits, after the program's last
    line: a gloo thread frees the last collective's tensors while Python finalizes (a core dump's stack:
    ProcessGroupGloo::runLoop, ~AsyncWork, decref, take_gil, pthread_exit, std::terminate; pytorch/pytorch#179291).
    Measured on an AMD EPYC (2026-11-29): 4 of 52 runs, none of 22 without dcp.save. The files the program wrote are
    what the test reads; a failure before the exit (a Python traceback) still fails it."""
    return "terminate called without an active exception" in stderr and "Traceback" not in stderr.split(
        "terminate called")[0]


@pytest.mark.parametrize("case", CASES)
def test_stock_keras_and_optax_code_continue_a_stock_fsdp2_program_s_distributed_checkpoint(case, batches, tmp_path,
                                                                                          networks, capsys):
    """Each rank wrote its own shard (two .distcp files, neither the whole); the directory's name says nothing, its
    .metadata says DCP; the optimizer is told by the param_groups get_state_dict keeps, its buffers by parameter
    name. A rank's shard lost is one line."""
    optimizer, torch_params, target_params = CASES[case]
    torch_losses = fsdp2_program(batches, tmp_path, optimizer, torch_params)
    shards = sorted(f for f in os.listdir(tmp_path / "checkpoint") if f.endswith(".distcp"))
    sizes = [os.path.getsize(tmp_path / "checkpoint" / f) for f in shards]
    assert len(shards) == 2 and max(sizes) < 0.6 * sum(sizes), sizes   # 129,068 parameters, and their buffers, cut in two
    assert shard_counts(tmp_path / "checkpoint") == {2}   # every tensor in two pieces, each rank's own
    targets = ["lenet-epoch1.orbax"] + (["lenet-epoch1.weights.h5"] if case == "momentum" else [])
    for converted in targets:
        assert convert.main([str(tmp_path / "checkpoint"), str(tmp_path / converted), "--verify"]) == 0
        out = capsys.readouterr().out
        assert f"with {case}'s state after {BEFORE if case == 'adam' else 0} steps" in out, out
        assert f"lr {torch_params['lr']:g}" in out and "weight decay 0.0001" in out
        assert "largest |logit difference|" in out
    kind = None
    if case == "adam":
        import optax
        kind = optax.adam
    optax_losses = optax_program(batches[BEFORE:], tmp_path, target_params, torch_params["weight_decay"], kind)
    # Adam's normalised step turns the round-off of two ways of summing the halves' gradients into more than 1e-5
    np.testing.assert_allclose(optax_losses, torch_losses, rtol=ADAM_TOLERANCE if case == "adam" else 1e-5,
                               err_msg=f"{case}: Optax's continued losses")
    if case == "momentum":
        keras_losses = keras_program(batches[BEFORE:], tmp_path, target_params, torch_params["weight_decay"])
        np.testing.assert_allclose(keras_losses, torch_losses, rtol=1e-5, err_msg="Keras's continued losses")
        # a rank's shard lost: one line naming the directory, nothing written
        os.remove(tmp_path / "checkpoint" / "__1_0.distcp")
        assert convert.main([str(tmp_path / "checkpoint"), str(tmp_path / "lost-epoch1.orbax")]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {tmp_path / 'checkpoint'}: not a readable") and "\n" not in err, err
        assert "FileNotFoundError" in err and "FrameSummary" not in err, err
        assert not os.path.exists(tmp_path / "lost-epoch1.orbax")


def sharded_jax_program(batches, folder, params):
    """Two jax.distributed processes train on the batches, saving both states with Orbax before step BEFORE:
    (the losses from there on, how many of the optimizer's buffers are sharded and how many whole)."""
    framework_or_skip("jax")
    np.savez(folder / "batches.npz", X=np.stack([X for X, _ in batches]), y=np.stack([y for _, y in batches]))
    np.savez(folder / "initial.npz", **init_weights())
    coordinator = f"127.0.0.1:{free_ports(1)[0]}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    processes = [subprocess.Popen([sys.executable, JAX_PROGRAM, "--process", str(rank), "--coordinator", coordinator,
                                   "--data", str(folder / "batches.npz"), "--weights", str(folder / "initial.npz"),
                                   "--save-at", str(BEFORE), "--folder", str(folder), "--losses",
                                   str(folder / "losses.json"), "--params", json.dumps(params)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert all(p.returncode == 0 for p in processes), outputs[0][-3000:] + outputs[1][-3000:]
    result = json.loads((folder / "losses.json").read_text())
    return result["losses"][BEFORE:], result["sharded"], result["replicated"]


def test_stock_torch_code_continues_a_multi_process_jax_program_s_sharded_orbax_checkpoint(batches, tmp_path,
                                                                                         networks, capsys):
    """Every momentum buffer was sharded across the 2 processes when saved, and each process wrote its own part of
    the checkpoint (ocdbt.process_0 and _1). Read whole on one process (restored into a target of the file's own
    shapes), converted to PyTorch's files, continued by stock torch.optim code: the JAX program's own losses."""
    params = {"learning_rate": 0.005, "momentum": 0.9}
    jax_losses, sharded, replicated = sharded_jax_program(batches, tmp_path, params)
    assert sharded == 8 and replicated == 0
    saved = tmp_path / "lenet-epoch1.optimizer.orbax"
    assert all(os.listdir(saved / f"ocdbt.process_{rank}" / "d") for rank in (0, 1))
    assert convert.main([str(tmp_path / "lenet-epoch1.orbax"), str(tmp_path / "lenet-epoch1.pt"), "--optimizer",
                         "momentum", "--lr", "0.005", "--verify", "--dataset", "digits"]) == 0
    out = capsys.readouterr().out
    assert f"with momentum's state after {BEFORE} steps" in out and "largest |logit difference|" in out, out
    torch_losses = torch_program(batches[BEFORE:], tmp_path, {"lr": 0.005, "momentum": 0.9})
    np.testing.assert_allclose(torch_losses, jax_losses, rtol=1e-5, err_msg="PyTorch's continued losses")
