"""MXNet's own optimizer and schedule classes (mxnet/optimizer.py) against the spec, one piece at a time: the parity
tests of test_optimizers.py run them through LeNet, whose ReLUs and Adam's sign-like steps can turn a rounding into
a visible difference; here only rounding is left, and the stock classes' conventions show."""
import numpy as np
import pytest

from common import RosettaError, optim
from common.lenet import init_weights
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
def test_a_file_for_stock_gluon_code_is_written_only_where_its_schedule_is_the_spec_s(mx_optimizer, given, warmup):
    """save_state writes MXNet's stock classes where they compute the state's optimizer (stock_port), so that stock
    Gluon code continues the run: only on a stock schedule that gives the spec's rates at every update."""
    o = optim.Optimizer("momentum", 0.1, warmup_steps=warmup, total_steps=24, **given)
    if mx_optimizer.stock_port(o):
        stock = mx_optimizer.get_schedule(o, "stock")
        assert [stock(step + 1) for step in range(24)] == pytest.approx([o.learning_rate(s) for s in range(24)])


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


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_the_classes_compute_the_spec_and_the_stock_ones_do_not(mx_optimizer, name):
    """A warm-up changes the rate every step (the stock warm-up is the spec's): momentum and NAG with the rate
    inside the buffer, Adam's epsilon on the uncorrected moments (visible with gradients near epsilon) and adamw as
    L2 differ; plain sgd is the stock class in both."""
    tiny = name == "adam"   # gradients of 1e-7, no decay: Adam's epsilon matters
    o = optim.Optimizer(name, optim.DEFAULT_LR[name], weight_decay=0.0 if tiny else 0.1, warmup_steps=6,
                        total_steps=8)
    w0, grads = random_problem(1e-7 if tiny else 1.0)
    want = run_spec(o, w0, grads)
    np.testing.assert_allclose(run_classes(mx_optimizer, o, "canonical", w0, grads), want, rtol=0, atol=2e-6)
    stock_error = np.max(np.abs(run_classes(mx_optimizer, o, "stock", w0, grads) - want))
    assert stock_error < 1e-6 if name == "sgd" else stock_error > 1e-4, stock_error


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


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
@pytest.mark.parametrize("schedule,warmup,total,explicit", SCHEDULES,
                         ids=[f"{s}-{w}-{t}{'-given' if e else ''}" for s, w, t, e in SCHEDULES])
def test_an_optimizer_a_trainer_pickles_is_told_back_as_it_was_built(mx_optimizer, name, schedule, warmup, total,
                                                                     explicit):
    """What a converter reads from a save_states file (optimizer.told) is the common.optim.Optimizer the classes
    were built from: its name, rate, decay, momentum or betas and eps, and its schedule, rate for rate (a step
    schedule's milestones fit two run lengths, 36 and 37 steps alike), with its parameters given or not."""
    o = optim.Optimizer(name, 0.05, momentum=0.8, weight_decay=1e-4, warmup_steps=warmup, total_steps=total,
                        betas=(0.85, 0.99), eps=1e-7, **{"schedule": schedule, **explicit})
    told = mx_optimizer.told(mx_optimizer.get_optimizer(o))
    same = ("name", "schedule", "warmup_steps", "lr", "weight_decay") + \
        (("betas", "eps") if name in ("adam", "adamw") else ("momentum",) if name != "sgd" else ())
    for k in same:
        want = getattr(o, k)
        assert getattr(told, k) == (want if isinstance(want, (str, int)) else pytest.approx(want, rel=1e-6)), k
    assert [told.learning_rate(t) for t in range(total)] == pytest.approx([o.learning_rate(t) for t in range(total)])
