"""A PyTorch program's own checkpoint: one torch.save of a dict of state_dicts, as PyTorch's tutorial "saving and
loading a general checkpoint" writes it ({"epoch", "model_state_dict", "optimizer_state_dict", "loss"}) and as its
AMP recipe does ({"model", "optimizer", "scaler"}). The converter reads the weights, torch.optim's state (the optimizer
told by its param_groups) and GradScaler's scale out of it; stock Keras and Optax code continue the run as PyTorch's
own continuation does. Both ends are written as the tutorials write them: nothing of the project but the network's
definition and the converter's command."""
import json

import numpy as np
import pytest

from conftest import framework_or_skip
from harness.training import convert
from test_stock_gluon_states import (ADAM_TOLERANCE, AFTER, BEFORE, batches, keras_program, networks,  # noqa: F401
                                     optax_program)


# torch.optim's settings, and Keras's and Optax's for the same program (Keras's weight_decay is decoupled, so the
# Keras program adds torch's L2 to its loss, and the Optax program chains optax.add_decayed_weights; Keras's Adam adds
# epsilon to the uncorrected sqrt(v), MXNet's convention, so Adam is continued by Optax alone)
CASES = {
    "momentum": ("SGD", {"lr": 0.005, "momentum": 0.9, "weight_decay": 1e-4},
                 {"learning_rate": 0.005, "momentum": 0.9}),
    "adam": ("Adam", {"lr": 1e-3, "weight_decay": 1e-4}, {"learning_rate": 1e-3}),
}


def torch_program(batches, path, optimizer, params, save):
    """Trains BEFORE steps with a stock torch.optim optimizer, saves `save(model, optimizer)` with torch.save, and
    trains AFTER more: the losses of those."""
    framework_or_skip("pytorch")
    import torch
    import torch.nn.functional as F
    from common.lenet import init_weights
    from pytorch_lenet import build_model
    model = build_model(init_weights())
    optimizer = getattr(torch.optim, optimizer)(model.parameters(), **params)
    losses = []
    for step, (X, y) in enumerate(batches):
        if step == BEFORE:
            torch.save(save(model, optimizer), path)
        loss = F.cross_entropy(model(torch.from_numpy(X)), torch.from_numpy(y).long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[BEFORE:]


def tutorial(model, optimizer):
    """What "saving and loading a general checkpoint for inference and/or resuming training" saves."""
    return {"epoch": 1, "model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
            "loss": 0.5}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "adam" else case
                                  for case in CASES])
def test_stock_keras_and_optax_code_continue_a_pytorch_program_s_general_checkpoint(case, batches, tmp_path, networks,
                                                                                   capsys):
    optimizer, torch_params, target_params = CASES[case]
    torch_losses = torch_program(batches, tmp_path / "lenet-epoch1.pt", optimizer, torch_params, tutorial)
    targets = ["lenet-epoch1.orbax"] + (["lenet-epoch1.weights.h5"] if case == "momentum" else [])
    for converted in targets:
        assert convert.main([str(tmp_path / "lenet-epoch1.pt"), str(tmp_path / converted)]) == 0
        out = capsys.readouterr()
        assert f"with {case}'s state after {BEFORE if case == 'adam' else 0} steps" in out.out
        assert f"lr {torch_params['lr']:g}" in out.out and "weight decay 0.0001" in out.out
    kind = None
    if case == "adam":
        import optax
        kind = optax.adam
    optax_losses = optax_program(batches[BEFORE:], tmp_path, target_params, torch_params["weight_decay"], kind)
    # Adam turns the kernels' round-off into more than 1e-5 of these losses on some machines (1.5e-5 on an AMD EPYC,
    # 2026-11-29): ADAM_TOLERANCE, which an Adam step count off by one exceeds 37 times (3.7e-3)
    np.testing.assert_allclose(optax_losses, torch_losses, rtol=ADAM_TOLERANCE if case == "adam" else 1e-5,
                               err_msg=f"{case}: Optax's continued losses")
    if case == "momentum":
        keras_losses = keras_program(batches[BEFORE:], tmp_path, target_params, torch_params["weight_decay"])
        np.testing.assert_allclose(keras_losses, torch_losses, rtol=1e-5, err_msg="Keras's continued losses")
    else:   # across the epsilon gap the converter's note names: near, not equal
        import keras
        assert convert.main([str(tmp_path / "lenet-epoch1.pt"), str(tmp_path / "lenet-epoch1.weights.h5")]) == 0
        assert "keras.optimizers.Adam adds epsilon" in capsys.readouterr().err
        keras_losses = keras_program(batches[BEFORE:], tmp_path, {**target_params, "epsilon": 1e-8},
                                     torch_params["weight_decay"], keras.optimizers.Adam)
        np.testing.assert_allclose(keras_losses, torch_losses, rtol=ADAM_TOLERANCE, err_msg="Keras's continued losses")


def test_a_stock_keras_adam_gets_a_note_of_its_epsilon_gap(tmp_path, networks, capsys):
    """Stock keras.optimizers.Adam loads the converter's file as it is and adds epsilon to the uncorrected sqrt(v):
    the converter says by how much its next update differs (common.optim.epsilon_hat_gap), here checked against both
    frameworks' update rules on the torch file's moments, after 2 steps, where the bias corrections still move by a
    fifth a step. Optax's Adam computes torch's: no note."""
    framework_or_skip("pytorch")
    import torch
    import torch.nn.functional as F
    from common.lenet import init_weights
    from pytorch_lenet import build_model
    model = build_model(init_weights())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    for _ in range(2):
        X, y = rng.standard_normal((8, 1, 28, 28), dtype=np.float32), np.arange(8) % 10
        loss = F.cross_entropy(model(torch.from_numpy(X)), torch.from_numpy(y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(tutorial(model, optimizer), tmp_path / "adam.pt")
    assert convert.main([str(tmp_path / "adam.pt"), str(tmp_path / "adam.weights.h5")]) == 0
    # the next update (t = 3) per unit rate, as torch.optim.Adam and keras.optimizers.Adam write it
    t, eps, (b1, b2) = 3, 1e-8, (0.9, 0.999)
    torch_step, keras_step = [], []
    for b in optimizer.state_dict()["state"].values():
        m, v = b["exp_avg"].numpy().astype(np.float64), b["exp_avg_sq"].numpy().astype(np.float64)
        torch_step.append(m / (1 - b1 ** t) / (np.sqrt(v / (1 - b2 ** t)) + eps))
        keras_step.append(np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(v) + eps))
    want = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(torch_step, keras_step))
                   / sum(np.sum(a ** 2) for a in torch_step))
    assert 1e-4 < want < 1   # a gap worth a note
    assert f"differs by {want:.1e} of its size" in capsys.readouterr().err
    assert convert.main([str(tmp_path / "adam.pt"), str(tmp_path / "adam.orbax")]) == 0
    assert "note:" not in capsys.readouterr().err


def amp_recipe(path, init_scale, steps):
    """PyTorch's AMP recipe on the CPU (autocast to fp16, GradScaler), saved as its "saving/resuming" section does:
    the GradScaler's state_dict beside the model's and the optimizer's. Returns what the scaler saved."""
    import torch
    import torch.nn.functional as F
    from common.lenet import init_weights
    from pytorch_lenet import build_model
    torch.manual_seed(0)
    model = build_model(init_weights())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    X, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(X), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
               path)
    return scaler.state_dict(), optimizer.state_dict()["state"]


def test_the_amp_recipe_s_checkpoint_carries_its_grad_scaler(tmp_path, networks, capsys):
    """The GradScaler's scale and finite-step count go into the loss scaler the converter writes beside the target,
    which the project's own fp16 run resumes from; a run whose every step overflowed (torch.optim has made no buffer
    yet) converts with zero buffers, the state before the first update."""
    framework_or_skip("pytorch")
    from harness.training.checkpoints import read_scaler, read_state
    saved, buffers = amp_recipe(tmp_path / "amp.pt", 2.0 ** 24, 12)
    assert saved["scale"] < 2.0 ** 24 and buffers   # backed off, and updated: the run's scale, not the first one
    assert convert.main([str(tmp_path / "amp.pt"), str(tmp_path / "amp.orbax")]) == 0
    assert f"loss scaler (scale {saved['scale']:g}, {saved['_growth_tracker']} finite steps" in capsys.readouterr().out
    state, _ = read_scaler("jax", str(tmp_path / "amp.orbax"))
    assert (state.scale, state.good_steps) == (saved["scale"], saved["_growth_tracker"])
    assert json.loads((tmp_path / "amp.loss-scale.json").read_text())["scale"] == saved["scale"]
    saved, buffers = amp_recipe(tmp_path / "skipped.pt", 2.0 ** 40, 3)
    assert saved["scale"] == 2.0 ** 37 and not buffers   # every step skipped
    assert convert.main([str(tmp_path / "skipped.pt"), str(tmp_path / "skipped.orbax")]) == 0
    converted = read_state("jax", str(tmp_path / "skipped.orbax"))
    assert converted["step"] == 0 and all(not np.any(v) for k, v in converted.items() if k != "step")
    assert {k.split(".", 1)[0] for k in converted if k != "step"} == {"momentum_buffer"}


def test_a_general_checkpoint_it_cannot_carry_is_one_line(tmp_path, networks, capsys):
    framework_or_skip("pytorch")
    import torch
    from common.lenet import init_weights
    from pytorch_lenet import build_model
    model = build_model(init_weights())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.conv1.parameters():   # fine-tuning: conv1 frozen, so Adam makes no state for it
        p.requires_grad = False
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.nn.functional.cross_entropy(model(torch.zeros(2, 1, 28, 28)), torch.tensor([0, 1])).backward()
    adam.step()
    cases = {
        "scheduler": ({"model": model.state_dict(), "optimizer": sgd.state_dict(),
                       "scheduler": torch.optim.lr_scheduler.StepLR(sgd, 10).state_dict()}, "scheduler's state"),
        "two models": ({"model": model.state_dict(), "ema": model.state_dict()},
                       "2 model state_dicts ('model', 'ema')"),
        "amsgrad": ({"model": model.state_dict(),
                     "optimizer": torch.optim.Adam(model.parameters(), amsgrad=True).state_dict()}, "amsgrad=True"),
        "no model": ({"epoch": 3, "optimizer": sgd.state_dict()}, "no model state_dict in it"),
        "nadam": ({"model": model.state_dict(), "optimizer": torch.optim.NAdam(model.parameters()).state_dict()},
                  "with betas that is not Adam or AdamW (Adamax, NAdam or RAdam"),
        "adagrad's own": ({"model": model.state_dict(),
                           "optimizer": torch.optim.Adagrad(model.parameters(), lr_decay=0.1).state_dict()},
                          "a torch.optim.Adagrad with lr_decay=0.1"),
        # the head's group first, as fine-tuning code writes it: buffer 0 is fc2's, not conv1's (on the ResNet, where
        # parameters share shapes, read by position it converted silently wrong)
        "groups out of order": ({"model": model.state_dict(), "optimizer": torch.optim.SGD(
            [{"params": list(model.fc2.parameters())},
             {"params": [p for n, p in model.named_parameters() if not n.startswith("fc2")]}],
            lr=0.1, momentum=0.9).state_dict()}, "2 parameter groups: torch numbers the buffers in the groups' order"),
        "no decay on biases": ({"model": model.state_dict(), "optimizer": torch.optim.SGD(
            [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 5e-4},
             {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}],
            lr=0.1, momentum=0.9).state_dict()}, "with different settings (as no weight decay on the biases makes)"),
        "frozen adam": ({"model": model.state_dict(), "optimizer": adam.state_dict()},
                        "a fine-tuning state (parameters frozen, with requires_grad=False): no exp_avg, exp_avg_sq "
                        "for 2 of the network's parameters (conv1.weight, ...)"),
        # the optimizer given the trainable ones alone, before any update: the file says neither which nor their shapes
        "fewer parameters": ({"model": model.state_dict(), "optimizer": torch.optim.SGD(
            list(model.parameters())[2:], lr=0.1, momentum=0.9).state_dict()},
            "a fine-tuning state (parameters frozen, with requires_grad=False): its optimizer was given 6 parameters"),
        "whole model": (model, "a whole pickled model (torch.save(model)), which is read only by running its code: "
                               "save model.state_dict() and convert that"),
        "optimizer alone": (sgd.state_dict(), "a torch.optim state_dict alone (optimizer.state_dict()), not a model's: "
                                              "convert the model's state_dict file and give this one with --state PATH"),
    }
    for name, (content, says) in cases.items():
        path = tmp_path / f"{name.replace(' ', '-')}.pt"
        torch.save(content, path)
        assert convert.main([str(path), str(tmp_path / "out.orbax")]) == 1, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and says in err, (name, err)
        assert not (tmp_path / "out.orbax").exists()


def test_named_parameter_groups_in_any_order_carry_each_buffer_to_its_parameter(tmp_path, networks):
    """torch 2.6+ keeps each group's param_names when the optimizer is given named_parameters(): the buffers are then
    named whatever order the groups put them in (weights first, then biases), and two groups that differ only in their
    names are one setting."""
    framework_or_skip("pytorch")
    import torch
    from common import optim
    from common.lenet import init_weights
    from harness.training.checkpoints import read_state
    from pytorch_lenet import build_model
    model = build_model(init_weights())
    named = list(model.named_parameters())
    sgd = torch.optim.SGD([{"params": [(n, p) for n, p in named if n.endswith("weight")]},
                           {"params": [(n, p) for n, p in named if n.endswith("bias")]}], lr=0.1, momentum=0.9)
    X = torch.from_numpy(np.random.default_rng(0).normal(size=(8, 1, 28, 28)).astype(np.float32))
    torch.nn.functional.cross_entropy(model(X), torch.arange(8) % 10).backward()
    sgd.step()
    path = tmp_path / "named.pt"
    torch.save({"epoch": 1, "model_state_dict": model.state_dict(), "optimizer_state_dict": sgd.state_dict()}, path)
    state = read_state("pytorch", str(path), optim.Optimizer("momentum", 0.1))
    for name, p in named:
        np.testing.assert_array_equal(state[f"momentum_buffer.{name}"], sgd.state[p]["momentum_buffer"].numpy(),
                                      err_msg=name)


@pytest.mark.parametrize("save", ["general checkpoint", "state_dicts apart"])
def test_a_fine_tuning_run_s_frozen_layer_continues_as_torch_s_own_once_unfrozen(save, batches, tmp_path, networks,
                                                                                 capsys):
    """Fine-tuning with conv1 frozen: torch.optim's SGD makes no momentum buffer for a parameter without a gradient,
    and at its first gradient sets buf = grad, which is mu * 0 + grad: the converter's zero buffer. Stock torch code
    unfreezes conv1 and goes on; stock Optax code from the converted files, over every parameter, follows it. The
    optimizer given the trainable parameters alone (filter, as fine-tuning tutorials write it) or all of them, saved in
    a general checkpoint, or as the tutorial's two state_dicts apart, the optimizer's given with --state."""
    framework_or_skip("pytorch")
    import torch
    import torch.nn.functional as F
    from common.lenet import init_weights
    from pytorch_lenet import build_model
    model = build_model(init_weights())
    for p in model.conv1.parameters():
        p.requires_grad = False
    trainable = filter(lambda p: p.requires_grad, model.parameters())
    optimizer = torch.optim.SGD(trainable if save == "general checkpoint" else model.parameters(), lr=0.005,
                                momentum=0.9)
    losses = []
    for step, (X, y) in enumerate(batches[:BEFORE + AFTER]):
        if step == BEFORE:
            if save == "general checkpoint":
                torch.save({"epoch": 1, "model_state_dict": model.state_dict(),
                            "optimizer_state_dict": optimizer.state_dict()}, tmp_path / "lenet-epoch1.pt")
                optimizer.add_param_group({"params": list(model.conv1.parameters())})
            else:
                torch.save(model.state_dict(), tmp_path / "lenet-epoch1.pt")
                torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
            for p in model.conv1.parameters():   # unfrozen: its buffer is made at its first gradient
                p.requires_grad = True
        loss = F.cross_entropy(model(torch.from_numpy(X)), torch.from_numpy(y).long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    given = [] if save == "general checkpoint" else ["--state", str(tmp_path / "optimizer.pt")]
    assert convert.main([str(tmp_path / "lenet-epoch1.pt"), str(tmp_path / "lenet-epoch1.orbax"), *given]) == 0, \
        capsys.readouterr().err
    assert "with momentum's state" in capsys.readouterr().out
    optax_losses = optax_program(batches[BEFORE:BEFORE + AFTER], tmp_path, {"learning_rate": 0.005, "momentum": 0.9},
                                 0)
    np.testing.assert_allclose(optax_losses, losses[BEFORE:], rtol=1e-5, err_msg="Optax's continued losses")
