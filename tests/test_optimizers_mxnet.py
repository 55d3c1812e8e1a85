"""MXNet's own optimizer and schedule classes (mxnet/optimizer.py) against the spec, one piece at a time: the parity
tests of test_optimizers.py run them through LeNet, whose ReLUs and Adam's sign-like steps can turn a rounding into
a visible difference; here only rounding is left, and the stock classes' conventions show."""
import numpy as np
import pytest

from common import RosettaError, optim
from common.lenet import PARAM_NAMES, init_weights
from conftest import EXPLICIT_SCHEDULES, framework_or_skip
from harness.loader import load_module


@pytest.fixture(scope="module")
def mx_optimizer():
    framework_or_skip("mxnet")
    return load_module("mxnet", "optimizer")


RATE_CASES = [({"schedule": schedule}, warmup) for schedule in optim.SCHEDULES for warmup in (0, 5, 24)] + \
    [(given, warmup) for given in EXPLICIT_SCHEDULES for warmup in (0, 5)]   # given: a warm-up they fit


@pytest.mark.parametrize("given,warmup", RATE_CASES, ids=[
    f"{g['schedule']}{'-given' if len(g) > 1 else ''}-warmup{w}" for g, w in RATE_CASES])
def test_the_schedules_give_the_spec_rate_at_every_update(mx_optimizer, given, warmup):
    """The optimizer asks for the rate of num_update, 1 for the first update (step 0)."""
    o = optim.Optimizer("momentum", 0.1, warmup_steps=warmup, total_steps=24, **given)
    rates = mx_optimizer.get_schedule(o)
    assert [rates(step + 1) for step in range(24)] == pytest.approx([o.learning_rate(s) for s in range(24)], abs=1e-12)


def test_the_stock_cosine_decays_one_update_early(mx_optimizer):
    o = optim.Optimizer("momentum", 0.1, schedule="cosine", warmup_steps=5, total_steps=24)
    stock = mx_optimizer.get_schedule(o, "stock")
    assert [stock(step + 1) for step in range(5)] == pytest.approx([o.learning_rate(s) for s in range(5)])
    assert stock(6) == pytest.approx(o.learning_rate(6)) and stock(6) < o.learning_rate(5)


@pytest.mark.parametrize("given,warmup", RATE_CASES, ids=[
    f"{g['schedule']}{'-given' if len(g) > 1 else ''}-warmup{w}" for g, w in RATE_CASES])
def test_the_stock_schedule_is_said_to_differ_exactly_where_it_does(mx_optimizer, given, warmup):
    """save_state pickles MXNet's stock schedules, so that stock Gluon code loads the file alone; the converter's note
    (schedule_gap) speaks where the stock one's rates leave the spec's, and only there."""
    o = optim.Optimizer("momentum", 0.1, warmup_steps=warmup, total_steps=24, **given)
    stock = mx_optimizer.get_optimizer(o, "stock")
    same = [stock.lr_scheduler(step + 1) for step in range(24)] == pytest.approx([o.learning_rate(s) for s in range(24)])
    assert (mx_optimizer.schedule_gap(stock, o) is None) == same


def random_problem(scale):
    rng = np.random.default_rng(2)
    w = rng.normal(size=(6, 7)).astype(np.float32)
    return w, [(scale * rng.normal(size=w.shape)).astype(np.float32) for _ in range(8)]


def run_classes(mx_optimizer, o, port, w0, grads, batch_size=4):
    """The mx.optimizer as the Trainer drives it: summed gradients, rescale_grad 1 / batch, one update a step."""
    from mxnet import nd
    mx_opt = mx_optimizer.get_optimizer(o, port)
    mx_opt.rescale_grad = 1 / batch_size
    weight = nd.array(w0)
    state = mx_opt.create_state(0, weight)
    for g in grads:
        mx_opt.update(0, weight, nd.array(g * batch_size), state)
    return weight.asnumpy()


def run_spec(o, w0, grads):
    w, state = {"w": w0}, optim.init_state(o, {"w": w0})
    for g in grads:
        w, state = optim.step(o, w, {"w": g}, state)
    return w["w"]


# Every optimizer, and rmsprop also centered with momentum: all three of its buffers
VARIANTS = {**{name: {} for name in optim.OPTIMIZERS}, "rmsprop-centered": {"centered": True, "momentum": 0.9}}


def variant(key, **fields):
    name = key.split("-")[0]
    return optim.Optimizer(name, **{"lr": optim.DEFAULT_LR[name], **VARIANTS[key], **fields})


@pytest.mark.parametrize("name", VARIANTS)
def test_the_classes_compute_the_spec_and_the_stock_ones_do_not(mx_optimizer, name):
    """A warm-up changes the rate every step (the stock warm-up is the spec's): momentum, NAG and centered RMSProp
    with the rate inside the buffer, Adam's epsilon on the uncorrected moments and RMSProp's inside the root (visible
    with gradients near epsilon), adamw as L2 and AdaGrad's decay outside its accumulation differ; plain sgd is the
    stock class in both."""
    tiny = name in ("adam", "rmsprop")   # gradients of 1e-7, no decay: the epsilon matters
    o = variant(name, weight_decay=0.0 if tiny else 0.1, warmup_steps=6, total_steps=8)
    w0, grads = random_problem(1e-7 if tiny else 1.0)
    want = run_spec(o, w0, grads)
    np.testing.assert_allclose(run_classes(mx_optimizer, o, "canonical", w0, grads), want, rtol=0, atol=2e-6)
    stock_error = np.max(np.abs(run_classes(mx_optimizer, o, "stock", w0, grads) - want))
    assert stock_error < 1e-6 if name == "sgd" else stock_error > 1e-4, stock_error


@pytest.mark.parametrize("name", VARIANTS)
def test_the_scratch_update_computes_the_spec(mx_optimizer, name):
    """apply, the scratch step's update by hand, on two parameters: summed gradients, weight decay, clipping on some
    steps, a warm-up then a cosine. Each step from the spec's own weights and state, so only rounding is left."""
    from mxnet import nd
    o = variant(name, weight_decay=0.1, warmup_steps=3, total_steps=8, schedule="cosine", clip_norm=3.0)
    rng = np.random.default_rng(3)
    weights = {"a": rng.normal(size=(6, 7)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    spec, batch = optim.init_state(o, weights), 4
    replica = [nd.array(w) for w in weights.values()]
    state = mx_optimizer.init_state(replica, o)
    clipped = 0
    for t in range(8):
        grads = {k: rng.normal(scale=0.3 * (t + 1), size=w.shape).astype(np.float32) for k, w in weights.items()}
        clipped += o.clip_coefficient(grads) < 1
        mx_optimizer.apply(replica, [nd.array(g * batch) for g in grads.values()], state, o.learning_rate(t), batch)
        weights, spec = optim.step(o, weights, grads, spec)
        for (k, want), got in zip(weights.items(), replica):
            assert_close(got.asnumpy(), want, 1e-6, f"step {t}, {k}")
        for slot in o.slots:
            for k, got in zip(weights, state[slot]):
                assert_close(got.asnumpy(), spec[f"{slot}.{k}"], 1e-6, f"step {t}, {slot}.{k}")
    assert 0 < clipped < 8


def assert_close(got, want, rtol, what):
    """Within rtol of the array's largest element: a buffer's rounding follows its largest terms, not each element."""
    error = np.max(np.abs(got - want))
    assert error <= rtol * np.max(np.abs(want)), f"{what}: {error:.2e}"


def lenet_batches(digits, steps, size=16):
    return [(digits.X_train[size * k:size * (k + 1)], digits.y_train[size * k:size * (k + 1)]) for k in range(steps)]


def grads_of(net, batch_size):
    """The mean gradient of the last backward (Gluon keeps the sums in .grad), by canonical name."""
    return {name: p.grad().asnumpy() / batch_size for name, p in zip(PARAM_NAMES, net.collect_params().values())}


NEW = ("rmsprop", "rmsprop-centered", "adagrad")


@pytest.mark.parametrize("name", NEW)
def test_the_trainer_computes_the_spec_on_lenet(name, digits):
    """The canonical classes under the idiomatic mode's gluon.Trainer, each step checked against the spec's step from
    the same weights, mean gradient and state (the Trainer's, read as canonical_state reads it: its slots' order)."""
    fw = framework_or_skip("mxnet")
    idiomatic = load_module("mxnet", "idiomatic")
    o = variant(name, weight_decay=5e-4, warmup_steps=3, total_steps=6)
    devices = fw.get_devices(1)
    model = idiomatic.get_model(init_weights(0), devices, o)
    for X, y in lenet_batches(digits, 6):
        weights, state = idiomatic.to_numpy(model), idiomatic.optimizer_state(model)
        idiomatic.train_step(model, X, y, devices, None)
        want, want_state = optim.step(o, weights, grads_of(model.net, len(y)), state)
        assert_moved_as(idiomatic.to_numpy(model), want, weights)
        got_state = idiomatic.optimizer_state(model)
        assert got_state.keys() == want_state.keys() and got_state["step"] == want_state["step"]
        for key in set(want_state) - {"step"}:
            assert_close(got_state[key], want_state[key], 1e-6, key)


def assert_moved_as(got, want, before, rtol=1e-5):
    """Each parameter's step (its change from `before`) is the spec's within rtol of the step's largest element:
    float32's rounding of weights ~0.1 is ~1e-8, these steps 1e-3 to 1e-2."""
    for k in want:
        step, want_step = got[k] - before[k], want[k] - before[k]
        assert np.max(np.abs(step - want_step)) <= rtol * np.max(np.abs(want_step)), k


def test_the_rate_advances_once_a_step_on_several_contexts(digits):
    """With 2 contexts the Trainer has an updater per context sharing one optimizer: num_update, the schedule's
    count, is the largest count of any context's updates, one a step; Adam's t is each context's own count."""
    fw = framework_or_skip("mxnet")
    builtin = load_module("mxnet", "builtin")
    o = optim.Optimizer("adam", 1e-3, schedule="cosine", warmup_steps=2, total_steps=6, clip_norm=1.0)
    devices = fw.get_devices(2)
    model = builtin.get_model(init_weights(0), devices, o)
    dp = load_module("mxnet", "data_parallel")
    for step in range(3):
        X, y = digits.X_train[64 * step:64 * step + 64], digits.y_train[64 * step:64 * step + 64]
        builtin.train_step(model, (dp.split_and_load(X, devices), dp.split_and_load(y, devices)), None, 64)
    trainer = model.trainer
    assert trainer.optimizer.num_update == 3
    assert trainer.learning_rate == pytest.approx(o.learning_rate(2))
    assert all(counts == {i: 3 for i in range(8)} for counts in trainer.optimizer._all_index_update_counts.values()
               if counts)


def test_the_idiomatic_loop_builds_a_stock_port(mx_optimizer):
    fw = framework_or_skip("mxnet")
    idiomatic = load_module("mxnet", "idiomatic")
    o = optim.Optimizer("nesterov", 0.02, schedule="cosine", total_steps=10)
    stock = idiomatic.get_model(init_weights(0), fw.get_devices(1), o, port="stock").trainer
    canonical = idiomatic.get_model(init_weights(0), fw.get_devices(1), o).trainer
    assert type(stock.optimizer) is mx_optimizer.mx.optimizer.NAG
    assert type(canonical.optimizer) is mx_optimizer.Nesterov
    with pytest.raises(RosettaError, match="port"):
        idiomatic.get_model(init_weights(0), fw.get_devices(1), o, port="naive")


SCHEDULES = [("constant", 0, 1, {}), ("constant", 5, 24, {}), ("step", 5, 24, {}), ("step", 0, 37, {}),
             ("cosine", 5, 24, {}), ("factor", 5, 24, {}), ("poly", 5, 24, {})] + \
    [(explicit["schedule"], 5, 24, explicit) for explicit in EXPLICIT_SCHEDULES]


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("schedule,warmup,total,explicit", SCHEDULES,
                         ids=[f"{s}-{w}-{t}{'-given' if e else ''}" for s, w, t, e in SCHEDULES])
def test_an_optimizer_a_trainer_pickles_is_told_back_as_it_was_built(mx_optimizer, name, schedule, warmup, total,
                                                                     explicit):
    """What a converter reads from a save_states file (optimizer.told) is the common.optim.Optimizer the classes
    were built from: its name, rate, decay, momentum or betas and eps (rmsprop's alpha, momentum, eps and whether
    centered; adagrad's eps), and its schedule, rate for rate (a step schedule's milestones fit two run lengths, 36
    and 37 steps alike), with its parameters given or not."""
    o = optim.Optimizer(name.split("-")[0], 0.05, weight_decay=1e-4, warmup_steps=warmup, total_steps=total,
                        betas=(0.85, 0.99), eps=1e-7, alpha=0.95,
                        **{"momentum": 0.8, **VARIANTS[name], "schedule": schedule, **explicit})
    told = mx_optimizer.told(mx_optimizer.get_optimizer(o))
    own = {"sgd": (), "adam": ("betas", "eps"), "adamw": ("betas", "eps"), "rmsprop": ("alpha", "momentum", "eps",
           "centered"), "adagrad": ("eps",)}
    same = ("name", "schedule", "warmup_steps", "lr", "weight_decay") + own.get(o.name, ("momentum",))
    for k in same:
        want = getattr(o, k)
        assert getattr(told, k) == (want if isinstance(want, (str, int)) else pytest.approx(want, rel=1e-6)), k
    assert [told.learning_rate(t) for t in range(total)] == pytest.approx([o.learning_rate(t) for t in range(total)])


def test_the_stock_classes_that_keep_the_rate_inside_their_momentum(mx_optimizer):
    """SGD's and NAG's momentum and a centered RMSProp's delta hold the rate; a plain RMSProp has no momentum. A file
    this project writes pickles the stock classes, and rate_inside names these for the converter's --lr."""
    mx = mx_optimizer.mx
    checkpoint = load_module("mxnet", "checkpoint")
    assert [mx_optimizer.momentum_inside(o) for o in (
        mx.optimizer.SGD(momentum=0.9), mx.optimizer.NAG(momentum=0.8), mx.optimizer.RMSProp(gamma2=0.7, centered=True),
        mx.optimizer.RMSProp(gamma2=0.7), mx.optimizer.RMSProp(gamma2=0.0, centered=True), mx.optimizer.SGD(),
        mx_optimizer.RMSProp(gamma2=0.7, centered=True), mx.optimizer.AdaGrad())] == [0.9, 0.8, 0.7, 0, 0, 0, 0, 0]
    assert [checkpoint.rate_inside(variant(name, lr=0.01)) for name in ("momentum", "nesterov", "sgd",
                                                                      "rmsprop-centered")] == \
        ["MXNet's stock SGD", "MXNet's stock NAG", None, "MXNet's stock RMSProp"]


def pickled_modules(path):
    """The modules whose classes the pickle at `path` names: what unpickling it imports (pickle's find_class)."""
    import pickle
    modules = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            modules.add(module)
            return super().find_class(module, name)

    with open(path, "rb") as file:
        Recording(file).load()
    return modules


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("schedule,warmup,total,explicit", SCHEDULES[1:5:3],
                         ids=[f"{s}-{w}-{t}" for s, w, t, _ in SCHEDULES[1:5:3]])
def test_a_file_this_project_writes_pickles_only_mxnet_s_own_classes(mx_optimizer, name, schedule, warmup, total,
                                                                     explicit, tmp_path):
    """save_state pickles MXNet's stock optimizer and schedule, whatever the optimizer (AdamW and an RMSProp with
    momentum but not centered have no stock class: the nearest, Adam and the plain RMSProp), so that stock Gluon code
    loads the file with nothing of this project; and the file reads back as it was written, optimizer and buffers
    exactly, from the canonical copy it carries. Stock code that trained on and saved it again leaves that copy stale
    (its step is not the file's): then the stock classes are read."""
    checkpoint = load_module("mxnet", "checkpoint")
    o = optim.Optimizer(name.split("-")[0], 0.05, weight_decay=1e-4, warmup_steps=warmup, total_steps=total,
                        schedule=schedule, **{"momentum": 0.8, **VARIANTS[name], **explicit})
    rng = np.random.default_rng(0)
    state = {"step": 7, **{f"{slot}.{p}": np.abs(rng.normal(size=a.shape)).astype(np.float32)
                           for slot in o.slots for p, a in init_weights(0).items()}}
    path = str(tmp_path / "lenet.states")
    checkpoint.save_state(state, o, path)
    modules = pickled_modules(path)
    assert {m.split(".")[0] for m in modules} <= {"builtins", "numpy", "mxnet"}, modules
    assert "mxnet.optimizer.optimizer" in modules
    read = checkpoint.read_state(path)
    assert sorted(read) == sorted(state) and all(np.array_equal(read[k], state[k]) for k in state if k != "step")
    assert checkpoint.read_optimizer(path) == (o, None)
    updater = checkpoint.saved_updater(path)
    updater.optimizer.num_update += 1   # as if stock code had trained on
    assert mx_optimizer.exact_optimizer(updater.optimizer) is None
    assert type(updater.optimizer).__module__.startswith("mxnet.optimizer")


def stock_gluon_run(digits, optimizer, params, scheduler=None, steps=4):
    """A stock Gluon program's LeNet and Trainer (MXNet's own class by its name) after a few steps, and each update's
    (mean gradient, weights before it, rate) by canonical name."""
    import mxnet as mx
    from mxnet import autograd, gluon
    lenet = load_module("mxnet", "lenet")
    net = lenet.build_model(init_weights(0))
    trainer = gluon.Trainer(net.collect_params(), optimizer,
                            {**params, "lr_scheduler": scheduler(mx)} if scheduler else params)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    history = []
    for X, y in lenet_batches(digits, steps):
        weights = lenet.to_numpy([p.data() for p in net.collect_params().values()])
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(X)), mx.nd.array(y))
        loss.backward()
        trainer.step(len(y))
        history.append((grads_of(net, len(y)), weights, trainer.learning_rate))
    return trainer, history


def stock_buffers(kind, params, history):
    """The canonical buffers of a stock run's history, by MXNet's formulas (its epsilon inside the root, its L2 in
    RMSProp's gradient, none in AdaGrad's history): RMSProp's n and g_avg are torch's square_avg and grad_avg, its
    delta (the rate inside) is -lr * torch's momentum buffer at a constant rate lr, and -delta / the last rate is the
    canonical buffer whatever the rates (canonical_buffer's definition); AdaGrad's history is torch's sum."""
    wd = params.get("wd", 0.0)
    a, mu, centered = params.get("gamma1", 0.9), params.get("gamma2", 0.9), params.get("centered", False)
    eps = params.get("epsilon", 1e-8)
    buffers = {}
    for grads, weights, rate in history:
        for k, g in grads.items():
            g = g.astype(np.float64)
            if kind == "adagrad":
                buffers[f"sum.{k}"] = buffers.get(f"sum.{k}", 0) + g * g
                continue
            g = g + wd * weights[k]
            n = buffers[f"square_avg.{k}"] = a * buffers.get(f"square_avg.{k}", 0) + (1 - a) * g * g
            if centered:
                c = buffers[f"grad_avg.{k}"] = a * buffers.get(f"grad_avg.{k}", 0) + (1 - a) * g
                delta = buffers[f"delta.{k}"] = mu * buffers.get(f"delta.{k}", 0) - rate * g / np.sqrt(n - c * c + eps)
                buffers[f"momentum_buffer.{k}"] = mu * buffers.get(f"momentum_buffer.{k}", 0) + g / np.sqrt(
                    n - c * c + eps)   # the rate outside: the spec's buffer of the same normalised gradients
    rates = {rate for _, _, rate in history}
    for key in [key for key in buffers if key.startswith("delta.")]:
        delta = buffers.pop(key)
        if len(rates) > 1:   # under a changing rate the converted buffer is -delta / the last rate, by definition
            buffers[key.replace("delta.", "momentum_buffer.")] = delta / -history[-1][2]
    return buffers


STOCK_CASES = {
    "rmsprop": ("rmsprop", {"learning_rate": 1e-3, "gamma1": 0.9, "wd": 1e-4}, None,
                {"alpha": 0.9, "momentum": 0.0, "centered": False, "eps": 1e-8},
                ["MXNet's stock RMSProp adds epsilon (1e-08) inside the square root, sqrt(n + eps)"]),
    "rmsprop-centered": ("rmsprop", {"learning_rate": 1e-3, "gamma1": 0.95, "gamma2": 0.9, "centered": True,
                                     "wd": 1e-4}, None,
                         {"alpha": 0.95, "momentum": 0.9, "centered": True, "eps": 1e-8},
                         ["sqrt(n - g_avg^2 + eps) (torch.optim's RMSprop outside: sqrt(n - g_avg^2) + eps)"]),
    "rmsprop-centered-warmup": (   # saved inside its warm-up: the rate changes after it
        "rmsprop", {"learning_rate": 1e-3, "gamma1": 0.95, "gamma2": 0.9, "centered": True, "wd": 1e-4},
        lambda mx: mx.lr_scheduler.FactorScheduler(step=1000, factor=1.0, base_lr=1e-3, warmup_steps=10),
        {"alpha": 0.95, "momentum": 0.9, "centered": True, "warmup_steps": 10},
        ["sqrt(n - g_avg^2 + eps)", "MXNet's stock RMSProp keeps the rate inside its momentum buffer (torch.optim's "
         "RMSprop outside)", "Keras's and Optax's RMSprop compute MXNet's"]),
    "adagrad": ("adagrad", {"learning_rate": 1e-2, "wd": 1e-4}, None, {"eps": 1e-7, "weight_decay": 1e-4},
                ["MXNet's stock AdaGrad adds eps (1e-07) inside the square root, sqrt(history + eps)",
                 "MXNet's stock AdaGrad decays the weights outside its accumulation"]),
    "adagrad-no-decay": ("adagrad", {"learning_rate": 1e-2}, None, {"eps": 1e-7, "weight_decay": 0.0},
                         ["MXNet's stock AdaGrad adds eps (1e-07) inside the square root"]),
}


@pytest.mark.parametrize("case", STOCK_CASES)
def test_a_stock_rmsprop_or_adagrad_trainer_is_told_refused_and_converted_when_told(case, digits, tmp_path):
    """A stock Gluon program's save_states file (the migration case): told from the pickled optimizer, refused in one
    line that says what differs and by how much, and with accept_gap read as the canonical state (RMSProp's delta
    divided by minus the last rate)."""
    framework_or_skip("mxnet")
    checkpoint = load_module("mxnet", "checkpoint")
    kind, params, scheduler, fields, says = STOCK_CASES[case]
    trainer, history = stock_gluon_run(digits, kind, params, scheduler)
    path = str(tmp_path / "lenet.states")
    trainer.save_states(path)
    with pytest.raises(ValueError) as refused:
        checkpoint.read_optimizer(path)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and message.endswith("(--accept-gap converts it anyway)"), message
    assert all(line in message for line in says) and ("decays" in message) == bool(params.get("wd") and
                                                                                     kind == "adagrad"), message
    optimizer, gap = checkpoint.read_optimizer(path, accept_gap=True)
    assert len(gap.splitlines()) == 1 and all(line in gap for line in says), gap
    assert 0 < float(gap.split("differs by ")[1].split()[0]) < 1, gap
    assert optimizer.name == kind and optimizer.lr == pytest.approx(params["learning_rate"])
    for field, want in {"weight_decay": params.get("wd", 0.0), **fields}.items():
        assert getattr(optimizer, field) == pytest.approx(want), field
    state, want = checkpoint.read_state(path), stock_buffers(kind, params, history)
    assert state["step"] == len(history)
    assert set(state) - {"step"} == set(want) == {f"{slot}.{k}" for slot in optimizer.slots for k in PARAM_NAMES}
    for key in want:
        assert_close(state[key], want[key], 1e-5, key)


CONTINUED = [("rmsprop", {}), ("rmsprop", {"centered": True, "momentum": 0.9}),
             ("rmsprop", {"centered": True, "momentum": 0.0}), ("adagrad", {})]


@pytest.mark.parametrize("name,fields", CONTINUED, ids=["rmsprop", "centered-momentum", "centered", "adagrad"])
def test_a_canonical_state_continues_a_stock_trainer_on_the_spec_s_trajectory(name, fields, digits):
    """A canonical run's state given to MXNet's stock class (mx_state: RMSProp's delta = -lr * the momentum buffer, a
    centered one's delta of zeros without momentum) goes on along the spec's steps while the rate stays, and reads
    back as the spec's state. Epsilon 1e-30, below every square, where inside and outside the root agree; AdaGrad
    without decay (its stock decay is another: convention_gaps)."""
    import mxnet as mx
    fw = framework_or_skip("mxnet")
    idiomatic = load_module("mxnet", "idiomatic")
    o = optim.Optimizer(name, optim.DEFAULT_LR[name], weight_decay=0.0 if name == "adagrad" else 5e-4, eps=1e-30,
                        total_steps=6, **fields)
    devices, batches = fw.get_devices(1), lenet_batches(digits, 6)
    canonical = idiomatic.get_model(init_weights(0), devices, o)
    for X, y in batches[:3]:
        idiomatic.train_step(canonical, X, y, devices, None)
    spec = idiomatic.optimizer_state(canonical)
    stock = idiomatic.get_model(idiomatic.to_numpy(canonical), devices, o, state=spec, port="stock")
    assert type(stock.trainer.optimizer) is {"rmsprop": mx.optimizer.RMSProp, "adagrad": mx.optimizer.AdaGrad}[name]
    for X, y in batches[3:]:
        before = idiomatic.to_numpy(stock)
        idiomatic.train_step(stock, X, y, devices, None)
        want, spec = optim.step(o, before, grads_of(stock.net, len(y)), spec)
        assert_moved_as(idiomatic.to_numpy(stock), want, before)
    back = idiomatic.optimizer_state(stock)
    assert back.keys() == spec.keys() and back["step"] == spec["step"] == 6
    for key in set(spec) - {"step"}:
        assert_close(back[key], spec[key], 1e-5, key)


def test_another_network_s_stock_states_file_is_refused_for_what_it_is(tmp_path):
    """A stock Gluon MLP's Adam states (6 parameters) given with a LeNet: one line that says the file is another
    network's, before any convention gap of its optimizer is weighed (it blamed Adam's epsilon, then counted 76)."""
    framework_or_skip("mxnet")
    import mxnet as mx
    from mxnet import autograd, gluon
    checkpoint = load_module("mxnet", "checkpoint")
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3})
    X, y = mx.nd.random.normal(shape=(8, 64)), mx.nd.array(np.arange(8) % 10)
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(X), y)
    loss.backward()
    trainer.step(8)
    trainer.save_states(str(tmp_path / "mlp.states"))
    with pytest.raises(ValueError, match=r"^states for 6 parameters: neither the LeNet's 8 nor a ResNet-18's 76 "):
        checkpoint.read_optimizer(str(tmp_path / "mlp.states"))


def test_a_stock_trainer_s_clip_gradient_is_refused_then_named_when_told(digits, tmp_path):
    """Gluon's clip_gradient clips each gradient element (GluonNLP's usual Trainer option): the canonical update has no
    such step, so a continuation without it drifts (0.12 in loss after 5 steps, measured); it was dropped silently."""
    framework_or_skip("mxnet")
    checkpoint = load_module("mxnet", "checkpoint")
    trainer, _ = stock_gluon_run(digits, "sgd", {"learning_rate": 0.05, "momentum": 0.9, "clip_gradient": 0.01})
    path = str(tmp_path / "lenet.states")
    trainer.save_states(path)
    with pytest.raises(ValueError, match=r"clips every gradient element to \+-0.01 .*clip_grad_value_.*--accept-gap"):
        checkpoint.read_optimizer(path)
    optimizer, gap = checkpoint.read_optimizer(path, accept_gap=True)
    assert optimizer.name == "momentum" and "clip_gradient" in gap
