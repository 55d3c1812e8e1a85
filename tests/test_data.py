import functools
import gzip
import hashlib
import http.server
import os
import threading

import numpy as np
import pytest

from common import RosettaError
from common import data as data_module
from common.data import load_dataset, make_synthetic, read_idx_pair, write_idx


def test_digits_split_is_fixed_stratified_and_normalised(digits):
    again = load_dataset("digits")
    assert digits.fingerprint() == again.fingerprint()
    assert digits.X_train.shape == (1437, 1, 28, 28) and digits.X_test.shape == (360, 1, 28, 28)
    assert digits.X_train.dtype == np.float32 and digits.y_train.dtype == np.int64
    assert 0.0 <= digits.X_train.min() and digits.X_train.max() <= 1.0
    counts = np.bincount(digits.y_test, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37                          # stratified: ~36 per class
    # The split itself, pinned: these labels come from the fixed random_state.
    assert digits.y_test[:12].tolist() == [7, 6, 3, 7, 7, 3, 2, 8, 9, 3, 2, 6]
    assert digits.fingerprint() == "5436588296f1b099"   # pixels too (pinned scipy/scikit-learn)


def test_digits_are_made_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    """The cached copy is exactly what make_digits makes; one that is damaged or altered is made again."""
    monkeypatch.setenv("ROSETTA_CACHE", str(tmp_path))
    made = []
    monkeypatch.setattr(data_module, "make_digits", lambda real=data_module.make_digits: made.append(1) or real())
    first = load_dataset("digits")
    (cached,) = (tmp_path / "digits").iterdir()
    assert load_dataset("digits").fingerprint() == first.fingerprint() == "5436588296f1b099" and len(made) == 1
    with np.load(cached) as f:   # altered: a pixel changed, the old fingerprint kept
        arrays = dict(f)
    arrays["X_train"][0, 0, 0, 0] += 1
    np.savez(cached, **arrays)
    assert load_dataset("digits").fingerprint() == "5436588296f1b099" and len(made) == 2
    cached.write_bytes(cached.read_bytes()[:1000])   # truncated
    assert load_dataset("digits").fingerprint() == "5436588296f1b099" and len(made) == 3
    assert [p.name for p in (tmp_path / "digits").iterdir()] == [cached.name]   # no temporary left


def test_digits_load_where_the_cache_cannot_be_written(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("ROSETTA_CACHE", str(tmp_path / "file"))
    assert load_dataset("digits").fingerprint() == "5436588296f1b099"


def make_idx_dir(tmp_path, n_train=30, n_test=10, gz=True):
    rng = np.random.default_rng(0)
    ext = ".gz" if gz else ""
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        write_idx(str(tmp_path / f"{split}-images-idx3-ubyte{ext}"), images)
        write_idx(str(tmp_path / f"{split}-labels-idx1-ubyte{ext}"), labels)
        arrays[split] = (images, labels)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, gz):
    arrays = make_idx_dir(tmp_path, gz=gz)
    data = load_dataset("fashion-mnist", data_dir=str(tmp_path))
    assert data.X_train.shape == (30, 1, 28, 28) and data.X_test.shape == (10, 1, 28, 28)
    np.testing.assert_allclose(data.X_train[:, 0] * 255, arrays["train"][0], atol=1e-3)
    np.testing.assert_array_equal(data.y_test, arrays["t10k"][1])


def test_truncated_file_is_named(tmp_path):
    make_idx_dir(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(RosettaError, match="train-images-idx3-ubyte: truncated"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_corrupt_gzip_is_named(tmp_path):
    make_idx_dir(tmp_path)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(RosettaError, match="t10k-labels-idx1-ubyte.gz: cannot be read"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_swapped_files_fail_on_the_magic_number(tmp_path):
    make_idx_dir(tmp_path, gz=False)
    images, labels = tmp_path / "train-images-idx3-ubyte", tmp_path / "train-labels-idx1-ubyte"
    with pytest.raises(RosettaError, match="not an IDX image file"):
        read_idx_pair(str(labels), str(images))


def test_mismatched_counts_and_sizes(tmp_path):
    make_idx_dir(tmp_path, gz=False)
    write_idx(str(tmp_path / "train-labels-idx1-ubyte"), np.zeros(29, np.uint8))
    with pytest.raises(RosettaError, match="30 images but .* 29 labels"):
        load_dataset("mnist", data_dir=str(tmp_path))
    write_idx(str(tmp_path / "train-images-idx3-ubyte"), np.zeros((29, 32, 32), np.uint8))
    with pytest.raises(RosettaError, match="32x32, expected 28x28"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_missing_files_and_directories(tmp_path):
    with pytest.raises(RosettaError, match="does not exist"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path / "nowhere"))
    make_idx_dir(tmp_path)
    os.remove(tmp_path / "t10k-images-idx3-ubyte.gz")
    with pytest.raises(RosettaError, match="lacks t10k-images-idx3-ubyte"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_synthetic_is_seeded_balanced_and_any_size():
    a, b = make_synthetic(600, seed=1), make_synthetic(600, seed=1)
    assert a.fingerprint() == b.fingerprint() != make_synthetic(600, seed=2).fingerprint()
    assert a.X_train.shape == (600, 1, 28, 28) and len(a.y_test) == 100
    assert np.bincount(a.y_train, minlength=10).min() > 30
    # learnable: the nearest class mean already beats chance by far
    means = np.stack([a.X_train[a.y_train == c].mean(0).ravel() for c in range(10)])
    pred = np.argmin(((a.X_test.reshape(len(a.X_test), -1)[:, None] - means) ** 2).sum(-1), axis=1)
    assert (pred == a.y_test).mean() > 0.5


@pytest.mark.parametrize("name", ["digits", "synthetic", "mnist"])
def test_images_have_plain_strides_and_so_do_their_batches(name, tmp_path):
    """Plain C strides for every image array and every batch gathered from one: an inserted channel axis
    of stride 0 made fancy-indexed batches look channels-last to PyTorch, which then ran another (faster)
    convolution path by accident."""
    if name == "mnist":
        make_idx_dir(tmp_path)
    data = load_dataset(name, data_dir=str(tmp_path) if name == "mnist" else None, n_synthetic=300)
    plain = (3136, 3136, 112, 4)
    for X in (data.X_train, data.X_test, data.X_train[np.array([5, 0, 3])], data.X_train[2:7]):
        assert X.dtype == np.float32 and X.flags.c_contiguous and X.strides == plain, name


DEBIAN = data_module.DEBIAN_DIRS["fashion-mnist"]


@pytest.mark.skipif(not os.path.isdir(DEBIAN), reason="Debian's Fashion-MNIST absent")
def test_debian_fashion_mnist_is_the_standard_set():
    data = load_dataset("fashion-mnist")
    assert data.X_train.shape == (60000, 1, 28, 28) and data.X_test.shape == (10000, 1, 28, 28)
    assert np.bincount(data.y_train).tolist() == [6000] * 10
    # Debian re-compressed the files; their content is upstream's (decompressed MD5s, notes section 7)
    content = {f[:-3]: hashlib.md5(gzip.open(os.path.join(DEBIAN, f)).read()).hexdigest() for f in os.listdir(DEBIAN)}
    assert content == {"train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
                       "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
                       "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
                       "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965"}
    assert data.fingerprint() == "6c0eefea1869f4e6"   # what compare.py reports for the standard set


@pytest.fixture
def mirrors(tmp_path, monkeypatch):
    """Two local mirrors of a small MNIST: the first serves a wrong (re-packed) training-images file,
    the second the published bytes; the cache is a fresh folder. Yields the arrays and the request log."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    arrays = make_idx_dir(good)
    (bad / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(gzip.decompress(
        (good / "train-images-idx3-ubyte.gz").read_bytes()), compresslevel=1))
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    handler = functools.partial(Handler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    md5 = {f.name[:-3]: hashlib.md5(f.read_bytes()).hexdigest() for f in good.iterdir()}
    monkeypatch.setitem(data_module.MIRRORS, "mnist", [url + "bad/", url + "good/"])
    monkeypatch.setitem(data_module.PUBLISHED_MD5, "mnist", md5)
    monkeypatch.setenv("ROSETTA_CACHE", str(tmp_path / "cache"))
    yield arrays, requests
    server.shutdown()


def test_download_checks_the_published_md5_and_caches(mirrors, tmp_path):
    arrays, requests = mirrors
    data = load_dataset("mnist")
    np.testing.assert_array_equal(data.y_train, arrays["train"][1])
    np.testing.assert_allclose(data.X_train[:, 0] * 255, arrays["train"][0], atol=1e-3)
    # the re-packed file was fetched and refused; the next mirror's published bytes were kept
    assert any(r.startswith("/bad/train-images") for r in requests)
    cached = tmp_path / "cache" / "mnist" / "train-images-idx3-ubyte.gz"
    assert cached.read_bytes() == (tmp_path / "good" / "train-images-idx3-ubyte.gz").read_bytes()
    assert sorted(os.listdir(cached.parent)) == sorted(os.listdir(tmp_path / "good"))   # no .part left
    asked = len(requests)
    assert load_dataset("mnist").fingerprint() == data.fingerprint() and len(requests) == asked   # from the cache


def test_download_from_no_good_mirror_fails_clearly(mirrors, tmp_path, monkeypatch):
    monkeypatch.setitem(data_module.MIRRORS, "mnist", data_module.MIRRORS["mnist"][:1])   # only the bad one
    with pytest.raises(RosettaError, match=r"could not be downloaded \(.*MD5 .* not the published one\); .*--data-dir"):
        load_dataset("mnist")
    assert not any(f.endswith((".part", "train-images-idx3-ubyte.gz")) for f in os.listdir(tmp_path / "cache" / "mnist"))
