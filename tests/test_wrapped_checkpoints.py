"""Checkpoints saved from a wrapped model: a DistributedDataParallel or nn.DataParallel model's state_dict has every
key under `module.`. PyTorch's checkpoint.py and the converter read such a file as the plain model's (through
torch.nn.modules.utils.consume_prefix_in_state_dict_if_present), never write the prefix, and name any other
missing or unexpected key in one line."""
import numpy as np
import pytest

from common import FRAMEWORKS, RosettaError
from common.lenet import PARAM_NAMES, init_weights
from harness.training.checkpoints import SUFFIXES, read_weights
from harness.training.convert import main as convert
from harness.loader import load_module
from conftest import framework_or_skip

WEIGHTS = 7   # the seed of the wrapped model's weights


def wrapped_file(tmp_path, wrapper, edit=None):
    """torch.save of a wrapped LeNet's state_dict, as a user of DistributedDataParallel or nn.DataParallel saves it
    (edited by `edit` first, if given)."""
    framework_or_skip("pytorch")
    import torch
    net = wrapper(load_module("pytorch", "lenet").build_model(init_weights(WEIGHTS)))
    state = net.state_dict()
    assert list(state) == [f"module.{name}" for name in PARAM_NAMES]
    if edit:
        edit(state)
    path = str(tmp_path / "wrapped.pt")
    torch.save(state, path)
    return path


@pytest.fixture(params=["DistributedDataParallel", "DataParallel"])
def wrapped(request, tmp_path):
    """A file from a really wrapped model: DDP in a process group of this one process (gloo), or nn.DataParallel
    (on the CPU it runs the plain module, but wraps it and prefixes its keys all the same)."""
    import torch
    if request.param == "DistributedDataParallel":
        request.getfixturevalue("gloo_group")
        return wrapped_file(tmp_path, torch.nn.parallel.DistributedDataParallel)
    return wrapped_file(tmp_path, torch.nn.DataParallel)


def test_a_wrapped_state_dict_loads_into_the_plain_model(wrapped):
    checkpoint = load_module("pytorch", "checkpoint")
    model = checkpoint.load(wrapped)
    want = init_weights(WEIGHTS)
    assert [name for name, _ in model.named_parameters()] == list(PARAM_NAMES)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), want[name], err_msg=name)
    assert sorted(checkpoint.read(wrapped)) == sorted(checkpoint.KEYS.values())
    assert all(np.array_equal(read_weights("pytorch", wrapped)[k], v) for k, v in want.items())


@pytest.mark.parametrize("target", FRAMEWORKS[1:])
def test_a_wrapped_state_dict_converts_and_verifies(wrapped, target, tmp_path, capsys):
    framework_or_skip(target)
    dst = str(tmp_path / f"converted{SUFFIXES[target]}")
    assert convert([wrapped, dst, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "largest |logit difference|" in out, out
    assert all(np.array_equal(read_weights(target, dst)[k], v) for k, v in init_weights(WEIGHTS).items())


def test_the_prefix_is_never_written(wrapped, tmp_path):
    """Converted to PyTorch again (and saved by checkpoint.save, which the training runs use too): plain keys."""
    import torch
    plain = str(tmp_path / "plain.pt")
    assert convert([wrapped, plain]) == 0
    assert list(torch.load(plain, weights_only=True)) == list(PARAM_NAMES)


@pytest.mark.parametrize("edit,named", [
    (lambda state: state.pop("module.fc2.weight"), "fc2.weight"),
    (lambda state: state.update({"module.fc3.weight": state["module.fc2.weight"]}), "fc3.weight"),
], ids=["missing", "unexpected"])
def test_other_missing_or_unexpected_keys_get_one_line(edit, named, tmp_path, capsys):
    """Past the prefix, a wrapped file is checked as any other: the key is named in one error line, by the converter
    (exit status 1, no output file) and by checkpoint.load (a RosettaError, not load_state_dict's paragraph)."""
    import torch
    path = wrapped_file(tmp_path, torch.nn.DataParallel, edit)
    dst = tmp_path / "out" / "converted.params"
    assert convert([path, str(dst)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: not this LeNet's checkpoint") and named in lines[0]
    assert not dst.parent.exists()
    with pytest.raises(RosettaError) as error:
        load_module("pytorch", "checkpoint").load(path)
    assert "\n" not in str(error.value) and f"'{named}'" in str(error.value), error.value
