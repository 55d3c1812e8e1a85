"""MXNet's --precision fp16, proved without a GPU. Its fp16 convolution and dense layer are cuDNN's, so here nothing
runs in fp16: the graphs a GPU run would execute are built and read instead (their JSON and their inferred types),
and the dynamic loss scaling, which is independent of the precision, runs at fp32 (an inf pixel forces the overflow,
as tests/test_loss_scaling.py does)."""
import json

import numpy as np
import pytest

from common import models
from common.interface import Network, StepSettings, Unavailable
from common.loss_scaling import LossScaling, Scaler
from common.optim import Optimizer
from common.resnet import BN_STATE_NAMES, CANONICAL_BN, CONVS, PARAM_NAMES
from conftest import framework_or_skip
from harness.loader import load_module

WIDTH, LR, PER_DEVICE = 8, 0.1, 16


@pytest.fixture(scope="module")
def mx():
    framework_or_skip("mxnet")
    import mxnet
    return mxnet


def module(name):
    return load_module("mxnet", name)


def network(name, precision="fp32", loss_scaling=None, sync=False):
    return Network(name, models.init_bn_state(name, WIDTH) if name != "lenet" else None, sync, precision, loss_scaling)


def weights(name):
    return models.init_weights(name, 0, width=WIDTH if name != "lenet" else None)


# ------------------------------------------------------------------------------ the graphs a GPU would run
def amp_nodes(mx, name, sync_devices=None):
    """The engines' graph at fp16 (idiomatic.amp_graph), as JSON nodes with the amp_casts (tojson drops them unless
    told), and each node's output type, inferred from an fp32 input."""
    idiomatic = module("idiomatic")
    net = idiomatic.build(weights(name), network(name), sync_devices)
    data = mx.sym.var("data", dtype="float32")
    graph = idiomatic.amp_graph(net, data, "fp16")
    nodes = json.loads(graph.tojson(remove_amp_cast=False))["nodes"]
    internals = graph.get_internals()
    _, types, _ = internals.infer_type(data="float32")
    dtype = {out[:-len("_output")] if out.endswith("_output") else out: t
             for out, t in zip(internals.list_outputs(), types)}
    return nodes, dtype, graph


def inputs_of(nodes, node):
    return [nodes[i] for i, *_ in node["inputs"]]


def is_cast(node, dtype):
    return node["op"] == "amp_cast" and node["attrs"]["dtype"] == dtype


@pytest.mark.parametrize("name", ["lenet", "resnet18"])
def test_amp_at_fp16_casts_every_convolution_and_dense_layer_and_nothing_else(mx, name):
    """contrib.amp's FP16_FUNCS: each Convolution and FullyConnected takes float16 values (its fp32 weight and bias
    through an amp_cast to float16, its input too unless an earlier op already made it float16) and makes float16;
    no amp_cast to float16 feeds anything else, and the master weights stay float32."""
    nodes, dtype, graph = amp_nodes(mx, name)
    layers = [n for n in nodes if n["op"] in ("Convolution", "FullyConnected")]
    assert len(layers) == (4 if name == "lenet" else len(CONVS) + 1)
    for layer in layers:
        data, *parameters = inputs_of(nodes, layer)
        assert all(is_cast(p, "float16") and inputs_of(nodes, p)[0]["op"] == "null" for p in parameters)
        assert is_cast(data, "float16") or dtype[data["name"]] == np.float16
        assert dtype[layer["name"]] == np.float16
    for node in nodes:
        if node["op"] not in ("Convolution", "FullyConnected"):
            assert not any(is_cast(i, "float16") for i in inputs_of(nodes, node)), node["name"]
    arg_types, _, aux_types = graph.infer_type(data="float32")
    assert set(arg_types) | set(aux_types) == {np.float32}


@pytest.mark.parametrize("name", ["lenet", "resnet18"])
def test_amp_at_fp16_hands_the_loss_fp32_logits(mx, name):
    """The logits leave the graph cast back to float32 (log_softmax and softmax are FP32_FUNCS): the loss, outside
    it, is fp32."""
    nodes, dtype, graph = amp_nodes(mx, name)
    out = json.loads(graph.tojson(remove_amp_cast=False))["heads"][0][0]
    assert is_cast(nodes[out], "float32")
    assert inputs_of(nodes, nodes[out])[0]["op"] == "FullyConnected"
    assert graph.infer_type(data="float32")[1] == [np.float32]


def test_amp_at_fp16_runs_batchnorm_on_fp16_values_with_fp32_parameters(mx):
    """nn.BatchNorm is one of FP16_FP32_FUNCS: left as it is, on the convolution's float16 output (not cast), its
    gamma, beta and running statistics float32 (the op's own rule for float16 data: cuDNN's kernel keeps them, and
    its statistics, in float32), its output float16. At bf16 the same comes from BF16_USE_FP32_PARAMS."""
    nodes, dtype, _ = amp_nodes(mx, "resnet18")
    norms = [n for n in nodes if n["op"] == "BatchNorm"]
    assert len(norms) == len(BN_STATE_NAMES) // 2
    for norm in norms:
        data, *parameters = inputs_of(nodes, norm)
        assert data["op"] == "Convolution" and dtype[data["name"]] == np.float16
        assert [p["op"] for p in parameters] == ["null"] * 4
        assert {dtype[p["name"]] for p in parameters} == {np.float32}
        assert dtype[norm["name"]] == np.float16


def test_amp_at_fp16_runs_sync_batchnorm_in_fp32(mx):
    """contrib's SyncBatchNorm is one of FP32_FUNCS: its input is cast to float32, and so is its output."""
    nodes, dtype, _ = amp_nodes(mx, "resnet18", sync_devices=2)
    norms = [n for n in nodes if n["op"] == "_contrib_SyncBatchNorm"]
    assert len(norms) == len(BN_STATE_NAMES) // 2
    for norm in norms:
        data = inputs_of(nodes, norm)[0]
        assert is_cast(data, "float32")
        assert dtype[norm["name"]] == np.float32


@pytest.fixture
def pretend_gpu(mx, monkeypatch):
    """A machine with a GPU, as far as the refusal asks (devices.gpu_count): the Functional can be made at fp16."""
    monkeypatch.setattr(module("devices"), "gpu_count", lambda: 1)


def op_types(mx, symbol, **inputs):
    """(op, output type) of every op node of the symbol, in graph order, types inferred from `inputs`."""
    internals = symbol.get_internals()
    _, types, _ = internals.infer_type(**inputs)
    nodes = json.loads(symbol.tojson(remove_amp_cast=False))["nodes"]
    by_name = {out[:-len("_output")]: t for out, t in zip(internals.list_outputs(), types) if out.endswith("_output")}
    return [(n["op"], by_name.get(n["name"])) for n in nodes if n["op"] != "null"]


def test_the_scratch_lenet_at_fp16_computes_its_layers_in_fp16(mx, pretend_gpu):
    """The scratch forward (lenet.low) traced as hybridize traces it: every convolution and dense layer in float16 on
    float16 casts of its input, weight and bias, every activation after them float16, the weights float32."""
    model = module("lenet").Functional(precision="fp16")
    params = [mx.sym.var(name, dtype="float32") for name in model.param_names]
    X = mx.sym.var("X", dtype="float32")
    ops = op_types(mx, model.forward(params, X, mx.sym), X="float32")
    assert [t for op, t in ops if op == "amp_cast"] == [np.float16] * 9   # X and the 8 parameters
    assert [t for op, t in ops if op in ("Convolution", "FullyConnected")] == [np.float16] * 4
    assert {t for _, t in ops} == {np.float16}   # the logits too: the loss widens them (lenet.loss_sum)


def test_the_scratch_resnet_at_fp16_computes_its_layers_in_fp16_and_batchnorm_in_fp32(mx, pretend_gpu):
    """The scratch ResNet's forward traced at fp16 (what resnet.traced_replica compiles): its 20 convolutions and the
    dense layer in float16, every BatchNorm's statistics and normalisation in float32 (its depthwise affines and
    sums), the global mean float32, the logits float16, the new running statistics float32."""
    resnet = module("resnet")
    assert resnet.Functional(precision="fp16").precision == "fp16"
    p = {name: mx.sym.var(name, dtype="float32") for name in PARAM_NAMES}
    state = [mx.sym.var(name, dtype="float32") for name in BN_STATE_NAMES]
    X = mx.sym.var("X", dtype="float32")
    run = resnet.replica_forward(mx.sym, p, {}, X, True, WIDTH, CANONICAL_BN, "nchw", "fp16")
    (logits,), (new_state,) = resnet.lock_step(mx.sym, resnet.generators([run]), [state], False, CANONICAL_BN, WIDTH)
    ops = op_types(mx, mx.sym.Group([logits, *new_state]), X="float32")
    convolutions = [t for op, t in ops if op == "Convolution"]
    norms = len(BN_STATE_NAMES) // 2
    assert convolutions.count(np.float16) == len(CONVS)
    assert convolutions.count(np.float32) == 2 * norms   # BatchNorm's affines (resnet.affine), two each in training
    assert [t for op, t in ops if op in ("FullyConnected", "mean")] == [np.float32, np.float16]   # pool, fc
    _, types, _ = mx.sym.Group([logits, *new_state]).infer_type(X="float32")
    assert types == [np.float16] + [np.float32] * len(BN_STATE_NAMES)


def test_fp16_on_cpu_contexts_is_refused_in_one_line_by_every_mode(mx):
    """On the CPU every mode refuses fp16 before it builds anything; a GPU is what it asks for."""
    devices = [mx.cpu(0)]
    refusals = []
    for make in (lambda: module("lenet").Functional(precision="fp16"),
                 lambda: module("resnet").Functional(precision="fp16"),
                 lambda: module("builtin").get_model(weights("lenet"), devices, network=network("lenet", "fp16")),
                 lambda: module("idiomatic").get_model(weights("lenet"), devices, network=network("lenet", "fp16"))):
        with pytest.raises(Unavailable) as err:
            make()
        refusals.append(str(err.value))
    assert len(set(refusals)) == 1 and "fp16" in refusals[0] and "GPU" in refusals[0] and "\n" not in refusals[0]


# ---------------------------------------------------------------------------------- the loss scaling, at fp32
def batch(digits, contexts, inf_row=None):
    X, y = digits.X_train[:PER_DEVICE * contexts].copy(), digits.y_train[:PER_DEVICE * contexts]
    if inf_row is not None:
        X[inf_row, 0, 0, 0] = np.inf
    return X, y


def shards(mx, X, y, devices):
    split = module("data_parallel").split_and_load
    return split(X, devices), split(y, devices)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_trainer_s_scaler_sees_an_overflow_on_the_last_context(mx, digits, accumulate, precision):
    """contrib.amp's LossScaler checks the first context's gradients only (p._grad[0]): after the kvstore's
    all-reduce, inside trainer.step, they are every context's sum, so an inf on the last context (in its first
    micro-batch: the accumulation, Gluon's grad_req 'add' at fp32 or by hand at a low precision, carries it) skips
    the update on every context. MXNet's scale changes one step late: the next step runs at the same scale, the one
    after at half. (bf16 stands for fp16 here: the by-hand accumulation is the low precisions'.)"""
    builtin = module("builtin")
    devices = [mx.cpu(0), mx.cpu(1)]
    model = builtin.get_model(weights("lenet"), devices,
                              network=network("lenet", precision, loss_scaling=LossScaling(2.0 ** 10)))
    before = [p.list_data()[1].asnumpy() for p in model.net.collect_params().values()]
    X, y = batch(digits, 2, inf_row=PER_DEVICE)
    builtin.train_step(model, shards(mx, X, y, devices), LR, len(X), accumulate)
    if accumulate == 1:   # (accumulated gradients are zeroed after the step)
        first = [p.list_grad()[0].asnumpy() for p in model.net.collect_params().values()]
        assert not all(np.all(np.isfinite(g)) for g in first)   # the sum reached the first context
    after = [p.list_data()[1].asnumpy() for p in model.net.collect_params().values()]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    scales = [builtin.scaler_state(model).scale]
    X, y = batch(digits, 2)
    for _ in range(2):
        builtin.train_step(model, shards(mx, X, y, devices), LR, len(X), accumulate)
        scales.append(builtin.scaler_state(model).scale)
    assert scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_scratch_step_skips_on_an_overflow_on_the_last_device(mx, digits, accumulate):
    """unscale_gradients checks the first device's summed gradients: an inf on the last device skips the update of
    every replica and of its optimizer state (the step count stays), and halves the scale."""
    fw = framework_or_skip("mxnet")
    devices = fw.get_devices(2)
    model = module("lenet").Functional()
    optimizer = Optimizer("momentum", LR)
    replicas = [model.get_params(weights("lenet"), d) for d in devices]
    states = [fw.init_state(r, optimizer) for r in replicas]
    scaler = Scaler(LossScaling(2.0 ** 10))
    X, y = batch(digits, 2, inf_row=PER_DEVICE)   # the last device's first image
    fw.train_step(model, replicas, [None, None], X, y, devices, LR, None, states,
                  StepSettings(accumulate=accumulate, scaler=scaler))
    assert scaler.scale == 2.0 ** 9
    for replica, state in zip(replicas, states):
        assert all(np.array_equal(model.to_numpy(replica)[n], w) for n, w in weights("lenet").items())
        assert fw.state_to_numpy(state, model)["step"] == 0


def trained(mx, digits, mode, loss_scaling, optimizer=None, steps=3, name="lenet"):
    """The network's weights after `steps` steps of a mode on the first batch, with the loss scaling given."""
    net = network(name, loss_scaling=loss_scaling)
    contexts = 1 if mode == "idiomatic" else 2
    devices = [mx.cpu(i) for i in range(contexts)]
    X, y = batch(digits, contexts)
    if mode == "scratch":
        fw = framework_or_skip("mxnet")
        model = module("lenet").Functional() if name == "lenet" else module("resnet").Functional()
        replicas = [model.get_params(weights(name), d) for d in devices]
        bn_states = [model.get_bn_state(net.bn_state, d) for d in devices]
        scaler = None if loss_scaling is None else Scaler(loss_scaling)
        units = module("execution").compile("default", model)
        for _ in range(steps):
            fw.train_step(model, replicas, bn_states, X, y, devices, LR, None, None,
                          StepSettings(units=units, scaler=scaler))
        return model.to_numpy(replicas[0])
    engine = module(mode)
    model = engine.get_model(weights(name), devices, optimizer, network=net)
    for _ in range(steps):
        if mode == "builtin":
            engine.train_step(model, shards(mx, X, y, devices), LR, len(X))
        else:
            engine.train_step(model, X, y, devices, LR, len(X))
    return engine.to_numpy(model)


@pytest.mark.parametrize("name", ["lenet", pytest.param("resnet18", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["scratch", "builtin", "idiomatic"])
def test_a_power_of_two_scale_changes_no_weight_where_nothing_overflows(mx, digits, mode, name):
    """The loss times 2**10, the gradients divided by it: exact in fp32, so the steps are the unscaled steps, to the
    bit (the scale doubling every step on the way, as the rule says). The ResNet's too: BatchNorm's backward is
    linear in the gradient that reaches it, so a power of two passes through it exactly."""
    scaled = trained(mx, digits, mode, LossScaling(2.0 ** 10, 1), name=name)
    plain = trained(mx, digits, mode, None, name=name)
    assert not all(np.array_equal(plain[n], w) for n, w in weights(name).items())   # the steps moved them
    assert all(np.array_equal(scaled[n], plain[n]) for n in plain)


def test_clipping_by_global_norm_clips_the_unscaled_gradients(mx, digits):
    """optimizer.Trainer clips the summed gradients before update() rescales them: under a loss scale they are the
    scaled sums, and the threshold scales with them, so the clipped step is the unscaled one (but for the 1e-8 that
    clip_global_norm adds to the norm)."""
    optimizer = Optimizer("sgd", LR, clip_norm=0.01)   # far below the LeNet's gradient norm: every step clips
    start = weights("lenet")
    scaled = trained(mx, digits, "idiomatic", LossScaling(2.0 ** 10), optimizer, steps=1)
    plain = trained(mx, digits, "idiomatic", None, optimizer, steps=1)
    moved = np.sqrt(sum(np.sum((plain[n] - start[n]) ** 2) for n in start))
    assert moved == pytest.approx(LR * 0.01, rel=1e-4)   # clipped: the step is lr times the clip norm
    assert all(np.allclose(scaled[n], plain[n], rtol=0, atol=1e-7) for n in plain)   # a step moves ~5e-6
