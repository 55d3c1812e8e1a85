"""PyTorch's side of the optimizers (pytorch/optimizer.py), beyond tests/test_optimizers.py's trajectories: the rate
torch.optim.lr_scheduler gives every step of every schedule (SequentialLR's switch, the recursive forms), the
scratch state in the replica's memory layout, the stock port, and the scratch update at every exec level; and RMSprop
and Adagrad step by step against the spec, by hand and as torch.optim's classes, their state file read back and
continued by stock torch code, and a stock checkpoint's settings read off its param_groups."""
import numpy as np
import pytest
import torch

from common import optim
from common.lenet import init_weights
from conftest import EXPLICIT_SCHEDULES, framework_or_skip, replicas_of, train_steps, weights_of
from harness.loader import load_module


@pytest.fixture
def pytorch():
    return framework_or_skip("pytorch")


RUNS = [(1, 0), (1, 1), (2, 1), (7, 0), (7, 1), (7, 2), (24, 5), (24, 23), (24, 24), (1000, 37)]   # (total, warm-up)


# Every schedule with its defaults over RUNS, and with its parameters given over a run they fit
CASES = [({"schedule": schedule}, total, warmup) for schedule in optim.SCHEDULES for total, warmup in RUNS] + \
    [(given, 24, warmup) for given in EXPLICIT_SCHEDULES for warmup in (0, 5)]


@pytest.mark.filterwarnings("error")   # e.g. "lr_scheduler.step() before optimizer.step()"
@pytest.mark.parametrize("given,total,warmup", CASES, ids=[
    f"{g['schedule']}{'-given' if len(g) > 1 else ''}-{t}steps-warmup{w}" for g, t, w in CASES])
def test_the_scheduler_gives_the_spec_rate_at_every_step(pytorch, given, total, warmup):
    """The rate of each optimizer.step(), one scheduler.step() after it: LinearLR's, CosineAnnealingLR's and
    PolynomialLR's recursive forms stay within rounding of the spec's closed forms, SequentialLR switches on time,
    and a run that ends with its warm-up still steps the schedule once more."""
    o = optim.Optimizer("momentum", 0.3, warmup_steps=warmup, total_steps=total, **given)
    p = torch.nn.Parameter(torch.zeros(1))
    trainer = load_module("pytorch", "optimizer").get_trainer([p], o)
    for step in range(total):
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(o.learning_rate(step), rel=1e-12), step
        p.grad = torch.zeros(1)
        trainer.step()





def test_the_stock_port_is_the_canonical_one(pytorch, digits):
    """common/optim.py is PyTorch's conventions: a straightforward port trains exactly as the canonical one."""
    idiomatic = load_module("pytorch", "idiomatic")
    o = optim.Optimizer("adamw", 1e-3, weight_decay=1e-2, schedule="cosine", warmup_steps=2, total_steps=4,
                        clip_norm=1.0)
    X, y = digits.X_train[:64], digits.y_train[:64]
    weights = []
    for port in idiomatic.PORTS:
        model = idiomatic.get_model(init_weights(0), pytorch.get_devices(1), o, port=port)
        for _ in range(o.total_steps):
            idiomatic.train_step(model, X, y, pytorch.get_devices(1), 0.0, len(X))
        weights.append(idiomatic.to_numpy(model))
    for name in weights[0]:
        np.testing.assert_array_equal(weights[1][name], weights[0][name])


@pytest.mark.slow   # trains: the slow tier
def test_every_exec_level_updates_with_states(pytorch, digits):
    """The scratch step with states on 2 devices at the graph level (torch.compile of the forward) as eagerly."""
    execution = load_module("pytorch", "execution")
    o = optim.Optimizer("adamw", 1e-3, weight_decay=1e-2, clip_norm=1.0, total_steps=3)
    devices = pytorch.get_devices(2)
    X, y = digits.X_train[:64], digits.y_train[:64]
    weights = {}
    for level in execution.NAMES:
        replicas = replicas_of(pytorch, init_weights(0), devices, level=level)
        states = [pytorch.init_state(r, o) for r in replicas]
        for step in range(o.total_steps):
            train_steps(pytorch, replicas, X, y, devices, o.learning_rate(step), len(X), states, level=level)
        assert [s["step"] for s in states] == [o.total_steps] * 2
        weights[level] = weights_of(pytorch, replicas[1], level=level)
    for name, value in weights["eager"].items():
        np.testing.assert_allclose(weights["graph"][name], value, atol=1e-6, err_msg=name)


# ---- RMSprop and Adagrad: the scratch update, torch.optim's classes and their file, against the spec ----

# Each with L2 weight decay under a warm-up then a cosine rate; rmsprop plain, and with all three of its buffers
NEW_CASES = {"rmsprop": ("rmsprop", {}), "rmsprop-centered-momentum": ("rmsprop", {"centered": True, "momentum": 0.9}),
             "adagrad": ("adagrad", {})}
STEPS, SIZE = 5, 32    # a batch of a power of two: the mean gradient is the sum times 1 / SIZE, exactly
RELATIVE = 1e-6        # measured <= 3.5e-7; eps inside the square root moves a step by 0.7 of its size, Adagrad's
                       # own eps (1e-10) by 1e-2, the rate inside RMSprop's momentum buffer the buffer by 1


def new_optimizer(case, schedule="cosine", warmup_steps=2):
    name, variant = NEW_CASES[case]
    return optim.Optimizer(name, optim.DEFAULT_LR[name], weight_decay=5e-4, schedule=schedule,
                           warmup_steps=warmup_steps, total_steps=STEPS, **variant)


def small_batches(digits):
    return [(digits.X_train[k * SIZE:(k + 1) * SIZE], digits.y_train[k * SIZE:(k + 1) * SIZE]) for k in range(STEPS)]


def relative_error(got, want, reference):
    """|got - want| / |want - reference| over the whole model (float64): a step's rounding as a fraction of the step
    (reference: the weights before it), or a state's as a fraction of the state (reference: zeros)."""
    difference = sum(np.sum((got[k].astype(np.float64) - want[k]) ** 2) for k in want)
    size = sum(np.sum((want[k].astype(np.float64) - reference.get(k, 0)) ** 2) for k in want)
    return float(np.sqrt(difference / size))


def assert_steps_follow_the_spec(o, params, batches, update, state_of, state=None):
    """Each update(X, y) of the torch `params` (PARAM_NAMES order; it returns the mean gradients it took) against the
    spec's step from the same weights with those gradients, its state following them from `state` (None: zeros);
    `state_of()` gives the torch side's canonical state after each step."""
    to_numpy = load_module("pytorch", "lenet").to_numpy
    state = optim.init_state(o, to_numpy(params)) if state is None else state
    for k, (X, y) in enumerate(batches):
        before = to_numpy(params)
        grads = update(X, y)
        want, state = optim.step(o, before, grads, state)
        assert relative_error(to_numpy(params), want, before) < RELATIVE, f"{o.name}: step {k}'s weights"
        got = state_of()
        assert got["step"] == state["step"] and sorted(got) == sorted(state), (k, sorted(got))
        buffers = {key: value for key, value in state.items() if key != "step"}
        assert relative_error(got, buffers, {}) < RELATIVE, f"{o.name}: the state after step {k}"


@pytest.mark.parametrize("case", NEW_CASES)
def test_the_scratch_rmsprop_and_adagrad_are_the_spec(pytorch, case, digits):
    """optimizer.apply by hand, on a channels-last replica (the default layout) from the summed gradients."""
    lenet, optimizer = load_module("pytorch", "lenet"), load_module("pytorch", "optimizer")
    o = new_optimizer(case)
    params = lenet.get_params(init_weights(0), torch.device("cpu"))
    state = optimizer.init_state(params, o)

    def update(X, y):
        _, grads = lenet.loss_and_grads(params, lenet.to_layout(torch.from_numpy(X)), torch.from_numpy(y))
        mean = {name: g / np.float32(len(y)) for name, g in lenet.to_numpy(grads).items()}
        optimizer.apply(params, grads, state, o.learning_rate(state["step"]), len(y))
        return mean

    def state_of():
        return {"step": state["step"], **{f"{slot}.{name}": value for slot in o.slots
                                          for name, value in lenet.to_numpy(state[slot]).items()}}
    assert_steps_follow_the_spec(o, params, small_batches(digits), update, state_of)


@pytest.mark.parametrize("case", NEW_CASES)
def test_torch_optim_rmsprop_and_adagrad_are_the_spec(pytorch, case, digits):
    """get_trainer's stock classes and scheduler, stepped as the built-in and idiomatic modes step them; their
    canonical state (each parameter's step count the scheduler's) after every step."""
    import torch.nn.functional as F
    lenet, optimizer = load_module("pytorch", "lenet"), load_module("pytorch", "optimizer")
    o = new_optimizer(case)
    model = lenet.build_model(init_weights(0))
    trainer = optimizer.get_trainer(model.parameters(), o)
    assert type(trainer.optimizer) is {"rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad}[o.name]

    def update(X, y):
        trainer.zero_grad()
        F.cross_entropy(model(torch.from_numpy(X)), torch.from_numpy(y), reduction="sum").backward()
        mean = lenet.to_numpy([p.grad / len(y) for p in model.parameters()])
        trainer.step(to_mean=1 / len(y))
        return mean
    assert_steps_follow_the_spec(o, list(model.parameters()), small_batches(digits), update,
                                 lambda: optimizer.canonical_state(trainer.state_dict()))


def spec_state(o, weights, steps=3, seed=5):
    """A canonical state the spec reaches after `steps` random gradients: distinct buffers, and the ones a real run
    has (a centered average of squares above the average's square, a sum of squares at least 0)."""
    rng, state = np.random.default_rng(seed), optim.init_state(o, weights)
    for _ in range(steps):
        grads = {name: rng.normal(scale=0.1, size=w.shape).astype(np.float32) for name, w in weights.items()}
        weights, state = optim.step(o, weights, grads, state)
    return state


# rmsprop's four sets of buffers (centered, momentum) and adagrad's
FILE_CASES = [("rmsprop", {"centered": centered, "momentum": momentum}) for centered in (False, True)
              for momentum in (0.0, 0.9)] + [("adagrad", {})]


@pytest.mark.parametrize("name,variant", FILE_CASES, ids=[f"{n}-{'-'.join(f'{k}{v:g}' for k, v in variant.items())}"
                                                         for n, variant in FILE_CASES])
def test_an_rmsprop_or_adagrad_state_file_reads_back_exactly(pytorch, name, variant, tmp_path):
    checkpoint = load_module("pytorch", "checkpoint")
    o = optim.Optimizer(name, 1e-3, weight_decay=5e-4, schedule="cosine", warmup_steps=2, total_steps=10, **variant)
    state = spec_state(o, init_weights(0))
    path = str(tmp_path / f"lenet{checkpoint.STATE_SUFFIX}")
    checkpoint.save_state(state, o, path)
    read = checkpoint.read_state(path)
    assert sorted(read) == sorted(state) and read["step"] == state["step"] == 3
    assert all(np.array_equal(read[key], state[key]) and read[key].dtype == np.float32
               for key in state if key != "step")


@pytest.mark.parametrize("case", ["rmsprop-centered-momentum", "adagrad"])
def test_stock_torch_code_goes_on_from_an_rmsprop_or_adagrad_state_file(pytorch, case, digits, tmp_path):
    """The file save_state writes, loaded as a PyTorch tutorial loads an optimizer (torch.load, load_state_dict)
    into torch.optim's class built with the same settings, at a constant rate: its next steps are the spec's."""
    import torch.nn.functional as F
    checkpoint, lenet, optimizer = (load_module("pytorch", module) for module in ("checkpoint", "lenet", "optimizer"))
    o = new_optimizer(case, schedule="constant", warmup_steps=0)
    weights = init_weights(0)
    state = spec_state(o, weights)
    path = tmp_path / f"lenet{checkpoint.STATE_SUFFIX}"
    checkpoint.save_state(state, o, str(path))

    model = lenet.build_model(weights)
    if o.name == "rmsprop":
        stock = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.99, eps=1e-8, weight_decay=5e-4,
                                    momentum=0.9, centered=True)
    else:
        stock = torch.optim.Adagrad(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=5e-4)
    stock.load_state_dict(torch.load(path)["optimizer"])

    def update(X, y):
        stock.zero_grad()
        F.cross_entropy(model(torch.from_numpy(X)), torch.from_numpy(y)).backward()
        mean = lenet.to_numpy([p.grad for p in model.parameters()])
        stock.step()
        return mean

    def state_of():   # the count each parameter's state carries on from the file's
        saved = stock.state_dict()
        return optimizer.canonical_state({"optimizer": saved,
                                          "scheduler": {"last_epoch": int(saved["state"][0]["step"])}})
    assert_steps_follow_the_spec(o, list(model.parameters()), small_batches(digits)[:3], update, state_of, state)


def test_a_stock_rmsprop_or_adagrad_checkpoint_says_its_settings(pytorch, tmp_path):
    """read_optimizer tells RMSprop and Adagrad from torch's param_groups, with their settings (RMSprop's
    differentiable computes the same numbers); Adagrad's lr_decay and initial_accumulator_value, which the spec has
    not, are one line."""
    checkpoint, lenet = load_module("pytorch", "checkpoint"), load_module("pytorch", "lenet")
    model = lenet.build_model(init_weights(0))
    told = {
        "rmsprop": (torch.optim.RMSprop(model.parameters(), lr=0.01, alpha=0.9, eps=1e-6, weight_decay=1e-4,
                                        momentum=0.5, centered=True, differentiable=True),
                    optim.Optimizer("rmsprop", 0.01, 0.5, 1e-4, eps=1e-6, alpha=0.9, centered=True)),
        "rmsprop-defaults": (torch.optim.RMSprop(model.parameters()), optim.Optimizer("rmsprop", 0.01, 0.0)),
        "adagrad": (torch.optim.Adagrad(model.parameters(), lr=0.05, weight_decay=1e-4),
                    optim.Optimizer("adagrad", 0.05, weight_decay=1e-4, eps=1e-10)),   # Adagrad's own eps
    }
    for name, (stock, want) in told.items():
        path = tmp_path / f"{name}.pt"
        torch.save({"model": model.state_dict(), "optimizer": stock.state_dict()}, path)
        assert checkpoint.read_optimizer(str(path)) == (want, None), name
    for settings in ({"lr_decay": 0.01}, {"initial_accumulator_value": 0.1}):
        path = tmp_path / "refused.pt"
        torch.save({"model": model.state_dict(), "optimizer": torch.optim.Adagrad(model.parameters(),
                                                                                  **settings).state_dict()}, path)
        with pytest.raises(ValueError) as refused:
            checkpoint.read_optimizer(str(path))
        assert "\n" not in str(refused.value) and all(key in str(refused.value) for key in settings), refused.value
