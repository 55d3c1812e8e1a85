"""Every memory layout computes the same step as the default one, the layout a run asks for is the one it
gets (PyTorch: the strides of its batches and kernels), and the table names it on every row."""
import json
import subprocess
import sys
import os

import numpy as np
import pytest

from common.batches import Order, epoch_batches
from common.interface import Unavailable
from harness.loader import load_module
from common.lenet import init_weights
from conftest import ROOT, framework_or_skip, replicas_of, run_compare, scratch, train_steps, weights_of

ALL_LAYOUTS = ("nchw", "nhwc")


@pytest.fixture
def execution(fw):
    return load_module(fw.name, "execution")


def one_step(fw, execution, layout, data, n_devices):
    devices = fw.get_devices(n_devices)
    replicas = replicas_of(fw, init_weights(0), devices, layout=layout)
    rows = epoch_batches(len(data.y_train), 256, 0, 0)[0]
    loss = train_steps(fw, replicas, data.X_train[rows], data.y_train[rows], devices, 0.2, layout=layout)
    return loss, [weights_of(fw, r, layout=layout) for r in replicas]


@pytest.mark.parametrize("n_devices", [1, 2])
def test_every_layout_computes_the_default_step(fw, execution, digits, n_devices):
    assert execution.DEFAULT_LAYOUT in execution.LAYOUTS and set(execution.LAYOUTS) <= set(ALL_LAYOUTS)
    ref_loss, ref_replicas = one_step(fw, execution, "default", digits, n_devices)
    for layout in execution.LAYOUTS:
        loss, replicas = one_step(fw, execution, layout, digits, n_devices)
        assert abs(loss - ref_loss) <= 1e-5, (fw.name, layout)
        for replica in replicas:
            for name, value in ref_replicas[0].items():
                assert replica[name].flags.c_contiguous, (fw.name, layout, name)
                assert np.max(np.abs(replica[name] - value)) <= 1e-5, (fw.name, layout, name)


def test_a_functional_starts_in_the_default_layout_and_no_module_holds_one(fw):
    """execution.py's DEFAULT_LAYOUT is the layout the LeNet's Functional gets when none is asked for (builtin.py's
    and idiomatic.py's too; PyTorch's ResNet defaults to NCHW, its resnet.py says why); the layout is the model's
    field, never a global of lenet.py or resnet.py that a step reads."""
    execution = load_module(fw.name, "execution")
    assert load_module(fw.name, "lenet").Functional().layout == execution.DEFAULT_LAYOUT
    assert load_module(fw.name, "resnet").Functional().layout == ("nchw" if fw.name == "pytorch"
                                                                  else execution.DEFAULT_LAYOUT)
    for name in ("lenet", "resnet"):
        assert not hasattr(load_module(fw.name, name), "layout"), name


def test_a_layout_a_framework_lacks_is_a_skip_with_its_reason(fw, execution):
    assert execution.layout("default") == execution.DEFAULT_LAYOUT
    for layout in set(ALL_LAYOUTS) - set(execution.LAYOUTS):
        with pytest.raises(Unavailable, match=f"has no '{layout}' layout here"):
            execution.layout(layout)
    if fw.name == "mxnet":
        with pytest.raises(Unavailable, match="takes NCHW only"):
            execution.layout("nhwc")
    if fw.name == "tensorflow":   # NCHW pooling needs oneDNN on the CPU: on where TensorFlow turns it on
        assert ("nchw" in execution.LAYOUTS) == (execution.onednn_enabled() or fw.gpu_count() > 0)


@pytest.mark.slow
def test_tensorflow_runs_nchw_with_onednn_on():
    """Where TensorFlow leaves oneDNN off by default (an AMD EPYC), NCHW is a skipped layout; TF_ENABLE_ONEDNN_OPTS=1
    makes it a layout again, and it computes the default step (the test above, in a process with oneDNN on)."""
    framework_or_skip("tensorflow")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "tensorflow and (every_layout_computes or lacks)"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"}, timeout=280)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-3000:]


# element strides of a (N, 1, 28, 28) batch, a conv1 (20, 1, 3, 3) and a conv2 (50, 20, 5, 5) kernel
STRIDES = {"nchw": ((784, 784, 28, 1), (9, 9, 3, 1), (500, 25, 5, 1)),
           "nhwc": ((784, 1, 28, 1), (9, 1, 3, 1), (500, 1, 100, 20))}


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_pytorch_shards_and_kernels_have_the_layouts_strides(digits, layout):
    """With one channel both stride patterns pass is_contiguous for either format: the strides themselves say which
    convolution path PyTorch takes. The model lays out its kernels and, inside its step, each shard."""
    fw = framework_or_skip("pytorch")
    lenet = load_module("pytorch", "lenet")
    images, conv1, conv2 = STRIDES[layout]
    model, _ = scratch("pytorch", layout=layout)
    devices = fw.get_devices(2)
    shards = fw.split_and_load(digits.X_train[np.arange(256)], devices)
    assert [lenet.to_layout(s, model.layout).stride() for s in shards] == [images, images]
    assert [s.stride() for s in fw.split_and_load(digits.y_train[:256], devices)] == [(1,), (1,)]
    replica = model.get_params(init_weights(0), devices[0])
    assert (replica[0].stride(), replica[2].stride()) == (conv1, conv2)
    seen = []
    conv2d = lenet.F.conv2d
    try:   # what the step's first convolution is handed
        lenet.F.conv2d = lambda X, *rest: seen.append(X.stride()) or conv2d(X, *rest)
        train_steps(fw, [replica], digits.X_train[:256], digits.y_train[:256], devices[:1], 0.2, layout=layout,
                    level="eager")
    finally:
        lenet.F.conv2d = conv2d
    assert seen[0] == images
    assert (replica[0].stride(), replica[2].stride()) == (conv1, conv2)   # the update keeps them


def test_pytorch_builtin_and_idiomatic_run_the_default_layout(digits):
    """DistributedDataParallel's model and batches (pipeline.py) and the reference loop's, by design."""
    fw = framework_or_skip("pytorch")
    execution, pipeline = load_module("pytorch", "execution"), load_module("pytorch", "pipeline")
    images, conv1, conv2 = STRIDES[execution.DEFAULT_LAYOUT]
    model = load_module("pytorch", "idiomatic").get_model(init_weights(0), fw.get_devices(1))
    assert load_module("pytorch", "idiomatic").LAYOUT == execution.LAYOUTS[execution.DEFAULT_LAYOUT]
    assert load_module("pytorch", "builtin").LAYOUT(model) == execution.LAYOUTS[execution.DEFAULT_LAYOUT]   # DDP's
    net = model.net
    assert (net.conv1.weight.stride(), net.conv2.weight.stride()) == (conv1, conv2)
    loader = pipeline.make_loader(digits, Order(len(digits.y_train), 256, 0), 0, 1, None, fw.get_devices(1))
    X, _ = next(iter(pipeline.batches(loader, 0)))
    assert X.stride() == images


@pytest.mark.slow
def test_every_row_names_its_layout(tmp_path):
    """--layout multiplies the scratch rows; other modes run in their engine's own layout, and ask for none."""
    for name in ("pytorch", "mxnet"):
        framework_or_skip(name)
    out = tmp_path / "layouts.json"
    proc = run_compare("--frameworks", "pytorch,mxnet", "--mode", "scratch,idiomatic", "--layout", "default,nchw,nhwc",
                       "--devices", "1", "--epochs", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["framework"], r["mode"], r["row"].split("(")[1].split(")")[0]): r
            for r in json.loads(out.read_text())["runs"]}
    shown = {key: (r["status"], r["layout"]) for key, r in rows.items()}
    assert shown == {
        ("pytorch", "scratch", "default"): ("ok", "NHWC (channels_last)"),
        ("pytorch", "scratch", "default, nchw"): ("ok", "NCHW (contiguous)"),
        ("pytorch", "scratch", "default, nhwc"): ("ok", "NHWC (channels_last)"),
        ("mxnet", "scratch", "default"): ("ok", "NCHW (the only one)"),
        ("mxnet", "scratch", "default, nchw"): ("ok", "NCHW (the only one)"),
        ("mxnet", "scratch", "default, nhwc"): ("skipped", "nhwc"),
        ("pytorch", "idiomatic", "default"): ("ok", "NHWC (channels_last)"),
        ("pytorch", "idiomatic", "default, nchw"): ("skipped", "nchw"),
        ("pytorch", "idiomatic", "default, nhwc"): ("skipped", "nhwc"),
        ("mxnet", "idiomatic", "default"): ("ok", "NCHW (Gluon)"),
        ("mxnet", "idiomatic", "default, nchw"): ("skipped", "nchw"),
        ("mxnet", "idiomatic", "default, nhwc"): ("skipped", "nhwc"),
    }
    assert "takes NCHW only" in rows["mxnet", "scratch", "default, nhwc"]["error"]
    assert "layouts apply to the scratch mode" in rows["pytorch", "idiomatic", "default, nhwc"]["error"]
    assert all(r["step1_loss_diff"] <= 1e-5 for r in rows.values() if r["status"] == "ok")
    header = proc.stdout.splitlines()[0]
    assert "| exec" in header and "| layout" in header and "| NCHW (contiguous)" in proc.stdout
