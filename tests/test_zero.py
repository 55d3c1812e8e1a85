"""Sharded data parallelism (--shard, common/zero.py): ZeRO's stages as the spec writes them, then every framework's
scratch step at stage 1 (the optimizer's state sharded), stage 2 (the gradients too) and stage 3 (the parameters too,
between steps) against its own replicated step. The stages reorder nothing but the clipping norm's sum, so the steps agree to float32 round-off (TOL); a device
updating another's slice, a slice cut in the wrong place or a norm summed from one device's slice alone moves a step
by far more. And the state really is sharded: each device holds its own slices and no more, of the optimizer's
state and at stage 3 of the parameters."""
import os

import numpy as np
import pytest

from common import optim, zero
from common.interface import Unavailable
from common.lenet import PARAM_NAMES, init_weights
from conftest import framework_or_skip
from harness.loader import load_module
from harness.spec import RunSpec

FRAMEWORKS = ["pytorch", "mxnet", "tensorflow", "jax"]
BATCH, SEED, LR = 97, 5, 0.02   # short_digits: 3 batches of 97 and one of 79 (test_accumulation.py's)
TOL = 1e-5
CLIP = 3.5   # the LeNet's mean gradient on digits has a norm of ~2-7: some steps clip (test_optimizers.py)


# ---- the spec (numpy) ----

def random_problem(world, seed=3):
    rng = np.random.default_rng(seed)
    w = {"a": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32),
         "c": rng.normal(size=(2, 2, 3)).astype(np.float32)}
    grads = [[{k: rng.normal(size=v.shape).astype(np.float32) for k, v in w.items()} for _ in range(world)]
             for _ in range(4)]
    return w, grads


@pytest.mark.parametrize("shard", zero.SHARDS)
@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_every_stage_is_the_replicated_step_bit_for_bit(name, shard):
    """Reduce-scatter (or all-reduce), each device's update of its own slice, all-gather: over 4 steps with weight
    decay and clipping, per parameter and in buckets, on 3 devices (padding in every unit), the replicated step's
    weights and state exactly."""
    w, steps = random_problem(3)
    for bucket_bytes in (None, 64):
        o = optim.Optimizer(name, 0.1, weight_decay=1e-2, clip_norm=2.0, total_steps=4, schedule="cosine")
        want, want_state = w, optim.init_state(o, w)
        got, got_state = w, optim.init_state(o, w)
        for grads in steps:
            want, want_state = optim.step(o, want, {k: sum(g[k] for g in grads) for k in w}, want_state)
            got, got_state = zero.step(o, got, grads, got_state, shard, bucket_bytes)
        assert all(np.array_equal(got[k], want[k]) for k in w), (bucket_bytes, shard)
        assert sorted(got_state) == sorted(want_state)
        assert all(np.array_equal(got_state[k], want_state[k]) for k in want_state if k != "step")


def test_a_device_owns_one_equal_padded_slice_of_every_unit():
    assert [zero.bounds(10, 4, g) for g in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert zero.owner_index(rank=1, devices=2, device=1) == 3
    assert zero.groups([15, 7, 12], None) == [[0], [1], [2]]
    assert zero.groups([15, 7, 12], 100) == [[0, 1], [2]]   # 88 bytes, then 48
    buffers = [zero.flat([np.full(5, d, np.float32)], 2) for d in (1.0, 2.0)]
    assert [s.tolist() for s in zero.reduce_scatter(buffers)] == [[3, 3, 3], [3, 3, 0]]   # padded with a zero


def test_what_a_device_holds_and_sends_by_stage():
    """The LeNet's units (its 8 parameters: 129,068 elements) on 2 devices with Adam's 2 buffers a parameter: stage 1
    halves the optimizer's state, stage 2 the gradients too, stage 3 the parameters too; the volume a device sends is
    the all-reduce's at stage 2, 1.5 times it at stages 1 and 3."""
    sizes = [init_weights(0)[n].size for n in PARAM_NAMES]
    assert sum(sizes) == 129068
    held = {shard: zero.memory(sizes, 2, 2, shard) for shard in zero.SHARDS}
    whole, half = 129068 * 4, sum(-(-n // 2) for n in sizes) * 4
    assert half == 129068 * 2   # every LeNet parameter has an even size: no padding on 2 devices
    assert held["none"] == {"parameters": whole, "gradients": whole, "optimizer state": 2 * whole}
    assert held["optimizer"] == {"parameters": whole, "gradients": whole, "optimizer state": 2 * half}
    assert held["gradients"] == {"parameters": whole, "gradients": half, "optimizer state": 2 * half}
    assert held["parameters"] == {"parameters": half, "gradients": half, "optimizer state": 2 * half}
    sent = {shard: zero.volume(sizes, 2, shard) for shard in zero.SHARDS}
    assert sent == {"none": whole, "optimizer": whole * 3 // 2, "gradients": whole, "parameters": whole * 3 // 2}
    assert zero.volume(sizes, 1, "gradients") == 0


# ---- every framework's scratch step ----

def run_spec(framework, shard, name="momentum", devices=2, allreduce="per-tensor", **fields):
    return RunSpec(framework=framework, devices=devices, shard=shard, allreduce=allreduce, dataset="digits", epochs=1,
                   batch_size=BATCH, lr=LR, seed=SEED, threads=1, optimizer=name, **fields)


def optimizer(name, steps=4):
    return optim.Optimizer(name, LR, weight_decay=1e-2 if name == "adamw" else 5e-4, clip_norm=CLIP,
                           schedule="cosine", total_steps=steps)


def assert_same_run(got, want, what):
    (got_weights, _, got_record), (want_weights, _, want_record) = got, want
    losses = lambda r: [s / n for s, n in zip(r["step_loss_sums"], r["step_sizes"])]   # noqa: E731
    assert losses(got_record) == pytest.approx(losses(want_record), rel=TOL), what
    for key, value in want_weights.items():
        assert abs(got_weights[key] - value).max() <= TOL, (what, key)


CASES = [("momentum", 2, "per-tensor"), ("adamw", 3, "bucketed")]   # 3 devices: every unit padded


@pytest.mark.parametrize("name,devices,allreduce", CASES)
@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_sharded_epoch_is_the_replicated_one(framework, shard, name, devices, allreduce, recipe_runs, short_digits):
    """An epoch of the LeNet (4 steps under a cosine schedule, weight decay and clipping), sharded and replicated:
    the same losses and weights (gathered, at stage 3, for the evaluation and the digest); and one device holds its
    slices alone of the optimizer's state, and at stage 3 of the parameters, as common.zero.memory says."""
    framework_or_skip(framework)
    want = recipe_runs(run_spec(framework, "none", name, devices, allreduce), optimizer(name), short_digits)
    got = recipe_runs(run_spec(framework, shard, name, devices, allreduce), optimizer(name), short_digits)
    assert_same_run(got, want, f"{framework} {shard}")
    sizes = [init_weights(0)[n].size for n in PARAM_NAMES]
    units = [sum(sizes[i] for i in unit) for unit in zero.groups(sizes, 25 * 2**20 if allreduce == "bucketed" else None)]
    slots = len(optimizer(name).slots)
    for key, what in (("optimizer_state_bytes_per_device", "optimizer state"), ("parameter_bytes_per_device",
                                                                               "parameters")):
        assert got[2][key] == zero.memory(units, slots, devices, shard)[what], key
        assert want[2][key] == zero.memory(units, slots, devices, "none")[what], key
    assert got[2]["replica_spread"] == 0.0, "every device gathers the same weights"


def numpy_of(t):
    return np.asarray(t.asnumpy() if hasattr(t, "asnumpy") else t.detach().cpu().numpy() if hasattr(t, "detach")
                      else t)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_device_keeps_its_own_slices_and_gathers_them_back(framework, digits):
    """After sharded steps (stage 3, Adam's two buffers, 3 devices), device d holds slice d of every unit, and no
    more, of the whole parameters gather_params rebuilds and of the whole state gather_states rebuilds (each array
    flattened in the framework's own element order, padded); both read back (to_numpy, state_to_numpy) as the
    replicated run's, and every device gathers the same parameters."""
    from conftest import replicas_of, scratch
    fw = framework_or_skip(framework)
    devices, o = fw.get_devices(3), optimizer("adam")
    X, y = digits.X_train[:BATCH], digits.y_train[:BATCH]
    model, settings = scratch(framework)
    runs = {}
    for shard in ("none", "parameters"):
        replicas = replicas_of(fw, init_weights(SEED), devices)
        states = [fw.init_state(r, o) for r in replicas]
        for t in range(3):
            fw.train_step(model, replicas, [None] * 3, X, y, devices, o.learning_rate(t), None, states,
                          settings._replace(shard=shard))
        runs[shard] = replicas, states
    replicas, states = runs["parameters"]
    params = fw.gather_params(replicas)
    whole = fw.gather_states(states, params)
    units = zero.groups([numpy_of(p).size for p in params[0]])
    for d, replica in enumerate(replicas):
        assert replica["shard"] == states[d]["shard"] == (d, 3)
        assert len(replica["slices"]) == len(units)
        for u, unit in enumerate(units):
            buffer = zero.flat([numpy_of(params[d][i]) for i in unit], 3)
            assert np.array_equal(numpy_of(replica["slices"][u]), zero.cut(buffer, 3)[d]), ("weights", d, u)
            for slot in o.slots:
                buffer = zero.flat([numpy_of(whole[d][slot][i]) for i in unit], 3)
                assert np.array_equal(numpy_of(states[d][slot][u]), zero.cut(buffer, 3)[d]), (slot, d, u)
    weights = [model.to_numpy(p) for p in params]
    want = model.to_numpy(runs["none"][0][0])
    for key in want:
        assert all(np.array_equal(w[key], weights[0][key]) for w in weights[1:]), key
        assert abs(weights[0][key] - want[key]).max() <= TOL, key
    got, want = fw.state_to_numpy(whole[0], model), fw.state_to_numpy(runs["none"][1][0], model)
    assert got["step"] == want["step"] == 3
    for key in want:
        if key != "step":
            assert abs(got[key] - want[key]).max() <= TOL, key


@pytest.mark.slow   # three runs of 2 processes
@pytest.mark.parametrize("framework, mode", [("pytorch", "scratch"), ("pytorch", "builtin"), ("jax", "builtin")])
def test_a_sharded_checkpoint_resumes_on_two_processes_bit_for_bit_and_on_one(framework, mode, tmp_path, capsys):
    """A stage-3 run of 2 processes saves each epoch its weights and Adam's state. PyTorch's scratch step gathers
    both ranks' slices and rank 0 writes them whole. The engines write their framework's sharded checkpoint, each
    process its own shards, nothing gathered: FSDP2 a Distributed Checkpoint (two .distcp files of about half each,
    every tensor in two pieces), JAX's jitted step Orbax's files of its sharded global arrays (each process its
    ocdbt.process_<i>). Resumed after epoch 1 on 2 processes the run ends with the uninterrupted run's weights bit
    for bit; on one process of 2 devices too where that is the same program (the scratch step, whose cut is the same;
    JAX's jitted step over the same mesh of 2 devices), FSDP2's checkpoint (resumed by the scratch step, FSDP2 being
    one process per device) within float32 round-off. The engines' checkpoints convert to another framework's files,
    which compute their logits; JAX's, read on one process by Flax's checkpointing guide's own code, is the run's."""
    from harness.processes.launch import run_workers
    from harness.training import convert
    from harness.training.checkpoints import checkpoint_name
    framework_or_skip(framework)

    def run(folder, processes, mode, **extra):
        folder.mkdir()
        spec = RunSpec(framework=framework, mode=mode, devices=2, processes=processes, shard="parameters",
                       dataset="digits", epochs=2, batch_size=256, seed=2, threads=1, optimizer="adam", lr=1e-3,
                       weight_decay=5e-4, weights_out=str(folder / "final.npz"), **extra)
        records = run_workers(spec, timeout=300)
        assert all(r["status"] == "ok" for r in records), records[0].get("error")
        return spec, dict(np.load(folder / "final.npz")), records[0]
    whole = tmp_path / "whole"
    spec, weights, record = run(whole, 2, mode, checkpoint_dir=str(whole), checkpoint_every=1)
    assert record["parameter_bytes_per_device"] * 2 == 4 * 129068
    saved = whole / checkpoint_name(spec, 1)
    if (framework, mode) == ("pytorch", "builtin"):
        shards = [os.path.getsize(saved / f) for f in sorted(os.listdir(saved)) if f.endswith(".distcp")]
        assert saved.suffix == ".dcp" and len(shards) == 2 and max(shards) < 0.6 * sum(shards), shards
        assert sum(shards) > 3 * 4 * 129068   # the weights and Adam's two moments
        assert shard_counts(saved) == {2}   # every parameter and buffer in two pieces, one each rank's (DTensor shards)
    if framework == "jax":   # every process wrote its part of both directories
        for folder in (saved, whole / saved.name.replace(".orbax", ".optimizer.orbax")):
            assert all(os.listdir(folder / f"ocdbt.process_{rank}" / "d") for rank in (0, 1)), folder
    resumed_on_one = "builtin" if framework == "jax" else "scratch"
    for processes, resumed_mode in ((2, mode), (1, resumed_on_one)):
        _, again, resumed = run(tmp_path / f"on{processes}", processes, resumed_mode, resume_from=str(saved))
        assert resumed["first_epoch"] == 1
        for name, value in weights.items():
            if resumed_mode == mode:
                np.testing.assert_array_equal(again[name], value, err_msg=f"{processes} processes: {name}")
            else:
                np.testing.assert_allclose(again[name], value, rtol=0, atol=1e-6, err_msg=f"the scratch step: {name}")
    if mode == "builtin":
        from common.data import load_dataset
        from harness.training.loop import steps_per_epoch
        last, target = whole / checkpoint_name(spec, 2), "lenet-epoch2.pt" if framework == "jax" else "lenet-epoch2.orbax"
        assert convert.main([str(last), str(tmp_path / target), "--verify", "--dataset", "digits"]) == 0
        steps = 2 * steps_per_epoch(len(load_dataset("digits").y_train), 256)
        assert f"with adam's state after {steps} steps" in capsys.readouterr().out
        if framework == "jax":
            assert_flax_s_guide_restores_it_on_one_process(last, weights, steps, spec)


def assert_flax_s_guide_restores_it_on_one_process(path, weights, steps, spec):
    """Stock code reads the files the 2 processes wrote, each its shards, as Flax's checkpointing guide restores a
    model and an nnx.Optimizer (tests/test_stock_gluon_states.py): a user's nnx LeNet and Optax's Adam after the L2
    term, on one process. The run's final weights bit for bit, and Adam's count and moments as the converter reads
    them."""
    import optax
    from flax import nnx
    from common.layouts import to_canonical
    from harness.training.checkpoints import read_state
    from test_stock_gluon_states import restore_as_flax_guide
    model = load_module("jax", "lenet").build_model(init_weights())   # the user's own Flax LeNet
    adam = optax.chain(optax.add_decayed_weights(spec.weight_decay), optax.adam(spec.lr))
    optimizer = nnx.Optimizer(model, adam, wrt=nnx.Param)
    restore_as_flax_guide(model, optimizer, path)
    state = read_state("jax", str(path))   # the converter's reading of the same files (canonical)
    moments = optimizer.opt_state[1][0]
    assert int(moments.count.value) == int(state["step"]) == steps
    trees = {"weights": nnx.to_pure_dict(nnx.state(model, nnx.Param)), "exp_avg": nnx.to_pure_dict(moments.mu),
             "exp_avg_sq": nnx.to_pure_dict(moments.nu)}
    want = {"weights": weights, **{slot: {name: state[f"{slot}.{name}"] for name in weights}
                                   for slot in ("exp_avg", "exp_avg_sq")}}
    for what, tree in trees.items():
        for name, value in want[what].items():
            layer, part = name.split(".")
            got = to_canonical(name, np.asarray(tree[layer]["kernel" if part == "weight" else "bias"]))
            np.testing.assert_array_equal(got, value, err_msg=f"{what}: {name}")


def shard_counts(path):
    """How many pieces DCP's metadata has of each tensor in the checkpoint: 2 where each of 2 ranks wrote its
    own shard, 1 where a tensor whole on every rank was written by one of them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata.values()
    return {len(entry.chunks) for entry in entries if isinstance(entry, TensorStorageMetadata) and entry.size.numel() > 1}


@pytest.mark.slow   # a worker process a device, 8 rows
def test_compare_s_sharded_rows_across_processes_are_the_replicated_ones(tmp_path):
    """The command a user runs: every framework's scratch step on 2 devices in 2 processes, replicated and at stage
    3. Stage 3 crosses the processes with both of sharding's collectives, the all-gather and the reduce-scatter;
    stages 1 and 2 call the same two functions in other places of the step (their steps are tested in every framework
    above, on 2 and 3 devices). At fp16 (MXNet, which has none on a CPU, at fp32) from the default loss scale, at which
    the LeNet's first steps overflow: each process unscales and checks only the slices it owns, so whether to skip is
    summed across the processes (an all-reduce of one flag, in the traced step). Each sharded row's per-step losses,
    final weights (its digest) and loss scale are its framework's replicated row's bit for bit (no clipping: the same
    sums; compare.py fails a row whose processes end at different scales), and its optimizer state and parameters per
    device are half the replicated one's (the LeNet's parameters are all of even size: no padding on 2 devices)."""
    import json
    from conftest import installed_frameworks, run_compare
    names = [fw.name for fw in installed_frameworks()]
    rows = []
    for precision in ("fp16", "fp32"):
        chosen = [name for name in names if (name == "mxnet") == (precision == "fp32")]
        if not chosen:   # a machine without MXNet (or with MXNet alone)
            continue
        out = tmp_path / f"{precision}.json"
        outputs = ["--json", str(out)]
        if precision == "fp16":   # the other outputs too, once
            outputs += ["--csv", str(tmp_path / "shard.csv"), "--plot", str(tmp_path / "shard.png")]
        proc = run_compare("--frameworks", ",".join(chosen), "--mode", "scratch", "--devices", "2", "--processes", "2",
                           "--shard", "none,parameters", "--optimizer", "momentum", "--epochs", "1", "--precision",
                           precision, "--loss-scale-interval", "2", *outputs, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows += json.loads(out.read_text())["runs"]
    assert len(rows) == 2 * len(names) and all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    for name in names:
        mine = {r["shard"]: r for r in rows if r["framework"] == name}
        assert mine["parameters"]["step_losses"] == mine["none"]["step_losses"], name
        assert mine["parameters"]["digest"] == mine["none"]["digest"], name
        assert mine["parameters"]["final_loss_scale"] == mine["none"]["final_loss_scale"], name
        if name != "mxnet":   # steps skipped: the scale fell from 65,536
            assert mine["none"]["final_loss_scale"] < 2.0 ** 16, name
        for held in ("optimizer_state_bytes_per_device", "parameter_bytes_per_device"):
            assert 2 * mine["parameters"][held] == mine["none"][held] == 4 * 129068, (name, held)


@pytest.mark.slow   # three worker processes, 2 devices each: about a minute
def test_jax_s_engine_shards_its_state_as_the_scratch_step_does(tmp_path):
    """JAX's built-in engine at --shard optimizer, gradients and parameters (stages 1 to 3: the Optax state, and at
    stage 3 the parameters too, placed with NamedSharding and kept so by the compiled step; stage 2 in shard_map's
    form, its gradients reduce-scattered), as a user runs it, on 2 devices in one process
    (how JAX's engine runs fastest): AdamW with weight decay and clipping (whose global norm XLA sums from the
    slices). Each sharded row's per-step losses are the replicated row's within 1e-5, and its first device holds the
    bytes common.zero.memory says: half the Adam state (every LeNet parameter has an axis of even size), and at stage
    3 half the parameters."""
    import json
    from conftest import run_compare
    framework_or_skip("jax")
    out = tmp_path / "jax.json"
    proc = run_compare("--frameworks", "jax", "--mode", "builtin", "--devices", "2", "--processes", "1",
                       "--shard", "none,optimizer,gradients,parameters", "--optimizer", "adamw",
                       "--weight-decay", "0.01", "--clip-norm", "1.0", "--epochs", "1", "--json", str(out),
                       "--csv", str(tmp_path / "jax.csv"), "--plot", str(tmp_path / "jax.png"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["shard"]: r for r in json.loads(out.read_text())["runs"]}
    assert sorted(rows) == sorted(zero.SHARDS)
    assert all(r["status"] == "ok" for r in rows.values()), {s: r["error"] for s, r in rows.items()}
    want = np.array(rows["none"]["step_losses"])
    sizes = [init_weights(0)[n].size for n in PARAM_NAMES]
    assert rows["gradients"]["exec"] == "jax.jit+shard_map"
    for shard in zero.SHARDS[1:]:
        got = np.array(rows[shard]["step_losses"])
        assert got.shape == want.shape and np.all(np.abs(got - want) <= 1e-5 * np.abs(want)), shard
        held = zero.memory(sizes, 2, 2, shard)
        assert rows[shard]["optimizer_state_bytes_per_device"] == held["optimizer state"] \
            < zero.memory(sizes, 2, 2, "none")["optimizer state"], shard
        assert rows[shard]["parameter_bytes_per_device"] == held["parameters"], shard
    assert rows["parameters"]["parameter_bytes_per_device"] < rows["optimizer"]["parameter_bytes_per_device"]


# What XLA compiles for JAX's engine at each stage (the LeNet on 2 devices, AdamW clipped: the norm's 8 scalar sums)
ENGINE_COLLECTIVES = {"none": {"all-reduce": 8}, "optimizer": {"all-reduce": 16, "all-gather": 8},
                      "gradients": {"reduce-scatter": 8, "all-reduce": 8, "all-gather": 8},
                      "parameters": {"all-reduce": 16, "all-gather": 8}}


@pytest.mark.parametrize("shard", [pytest.param("optimizer", marks=pytest.mark.slow), "gradients",
                                   pytest.param("parameters", marks=pytest.mark.slow)])   # stages 1, 3: a compare row
def test_jax_s_engine_compiles_each_stage_s_collectives_and_steps_as_replicated(shard, digits):
    """JAX's engine in the program XLA compiles: the replicated step all-reduces the 8 gradients; stages 1 and 3 (jit)
    all-reduce them too, then each device reads its slice (XLA's CPU compiler makes no reduce-scatter), and
    all-gather the parameters; stage 2 is shard_map's, whose psum_scatter is a reduce-scatter of each gradient, and
    all-gathers the updated parameters. Each stage steps as the replicated step, three steps within TOL, and holds
    half the Adam state (stage 3 half the parameters too)."""
    import collections
    import re
    import jax.numpy as jnp
    devices = framework_or_skip("jax").get_devices(2)
    builtin, pipeline = load_module("jax", "builtin"), load_module("jax", "pipeline")
    o = optim.Optimizer("adamw", 0.01, weight_decay=0.01, clip_norm=1.0, total_steps=3)
    X, y = digits.X_train[:BATCH], digits.y_train[:BATCH]
    sizes = [init_weights(0)[n].size for n in PARAM_NAMES]
    runs = {}
    for stage in ("none", shard):
        model = builtin.get_model(init_weights(0), devices, o, shard=stage)
        batch = pipeline.global_batch(model.placement, devices, X, y, BATCH)
        hlo = model.trainer.lower(model.net, model.trainer.opt_state, *batch[:3], jnp.float32(1.0)).compile().as_text()
        collectives = re.findall(r" (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", hlo)
        assert dict(collections.Counter(collectives)) == ENGINE_COLLECTIVES[stage], stage
        assert builtin.EXEC(model) == ("jax.jit+shard_map" if stage == "gradients" else "jax.jit+NamedSharding")
        runs[stage] = [builtin.train_step(model, batch, 1.0, BATCH) for _ in range(3)], builtin.to_numpy(model)
        held = zero.memory(sizes, 2, 2, stage)
        assert builtin.state_bytes(model) == held["optimizer state"], stage
        assert builtin.parameter_bytes(model) == held["parameters"], stage
    assert runs[shard][0] == pytest.approx(runs["none"][0], rel=TOL)
    for key, value in runs["none"][1].items():
        assert abs(runs[shard][1][key] - value).max() <= TOL, key
    if shard == "gradients":   # asked for under jit, where XLA would all-reduce it: one clear refusal, no stage 1
        with pytest.raises(Unavailable, match="needs shard_map's psum_scatter"):
            builtin.get_model(init_weights(0), devices, o, shard=shard, form="jit")


def most_owned(sizes, world):
    """The most elements any rank owns under ZeroRedundancyOptimizer's partition: whole parameters, the largest
    first, each to the rank that owns the fewest elements so far (the lowest such rank)."""
    owned = [0] * world
    for size in sorted(sizes, reverse=True):
        owned[owned.index(min(owned))] += size
    return max(owned)


@pytest.mark.slow   # a worker process a device, 4 rows
def test_pytorch_s_engines_shard_as_the_scratch_step_does(tmp_path):
    """compare.py's PyTorch built-in rows on 2 devices in 2 processes, an epoch of the LeNet under AdamW with weight
    decay, clipping and a cosine schedule: replicated (DDP), and sharded by PyTorch's own engines, DDP with
    ZeroRedundancyOptimizer (stage 1) and FSDP2's fully_shard (2, 3). Each sharded row's per-step losses are the
    replicated row's within 1e-5 (ZeroRedundancyOptimizer's weights bit for bit: DDP's all-reduce and the same
    clipping); FSDP2 keeps common.zero.memory's slices of the optimizer state and of the parameters (it frees the
    whole parameters after the backward at stage 2 too); ZeroRedundancyOptimizer keeps whole parameters' state, the
    most on the rank that owns the LeNet's largest, fewer bytes than replicated but more than a half."""
    import json
    from conftest import run_compare
    framework_or_skip("pytorch")
    out = tmp_path / "engines.json"
    proc = run_compare("--frameworks", "pytorch", "--mode", "builtin", "--devices", "2", "--processes", "2",
                       "--shard", "none,optimizer,gradients,parameters", "--optimizer", "adamw", "--weight-decay",
                       "0.01", "--clip-norm", "1.0", "--lr-schedule", "cosine", "--dataset", "digits", "--epochs", "1",
                       "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["shard"]: r for r in json.loads(out.read_text())["runs"]}
    assert sorted(rows) == sorted(zero.SHARDS) and all(r["status"] == "ok" for r in rows.values()), \
        {s: (r["status"], r["error"]) for s, r in rows.items()}
    assert [rows[s]["exec"] for s in zero.SHARDS] == ["eager+DDP", "eager+DDP+ZeroRedundancyOptimizer",
                                                      "eager+FSDP2", "eager+FSDP2"]
    assert [rows[s]["layout"].split(" ")[0] for s in zero.SHARDS] == ["NHWC", "NHWC", "NCHW", "NCHW"]   # FSDP2's
    want = rows["none"]["step_losses"]
    for shard in zero.SHARDS[1:]:
        assert rows[shard]["step_losses"] == pytest.approx(want, rel=TOL), shard
    assert rows["optimizer"]["digest"] == rows["none"]["digest"]
    sizes = [init_weights(0)[n].size for n in PARAM_NAMES]
    memory = {shard: zero.memory(sizes, 2, 2, shard) for shard in zero.SHARDS}   # AdamW: 2 slots; per parameter
    for shard in ("gradients", "parameters"):
        assert rows[shard]["optimizer_state_bytes_per_device"] == memory[shard]["optimizer state"], shard
        assert rows[shard]["parameter_bytes_per_device"] == memory["parameters"]["parameters"], shard
    state = rows["optimizer"]["optimizer_state_bytes_per_device"]
    assert state == 2 * zero.ITEMSIZE * most_owned(sizes, 2)
    assert memory["optimizer"]["optimizer state"] < state < memory["none"]["optimizer state"]
    assert rows["optimizer"]["parameter_bytes_per_device"] == memory["none"]["parameters"]
