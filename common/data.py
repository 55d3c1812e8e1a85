"""The data sets: numpy arrays N x 1 x 28 x 28 float32 in [0, 1] and int64 labels, identical for
every framework. Files are verified as they are read; a bad file gets an error that names it."""
import gzip
import hashlib
import importlib.metadata
import inspect
import os
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass

import numpy as np

from .interface import RosettaError
from .lenet import IMAGE_SHAPE

DATASETS = ("digits", "fashion-mnist", "mnist", "synthetic")
SYNTHETIC_SIZE = 60000   # training images of the synthetic set, as many as (Fashion-)MNIST has
DEBIAN_DIRS = {"fashion-mnist": "/usr/share/datasets/fashion-mnist"}   # apt-get install dataset-fashion-mnist
MIRRORS = {
    "fashion-mnist": ["https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
                      "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
    "mnist": ["https://ossci-datasets.s3.amazonaws.com/mnist/",
              "https://storage.googleapis.com/cvdf-datasets/mnist/"],
}
PUBLISHED_MD5 = {   # of the published .gz files (torchvision's list); a mirror serving anything else is skipped
    "fashion-mnist": {"train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                      "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
                      "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
                      "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310"},
    "mnist": {"train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
              "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
              "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
              "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c"},
}
IDX_FILES = {  # split: (images file, labels file), standard names without .gz
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049   # 0x00000803 and 0x00000801: unsigned bytes, 3 or 1 dims


@dataclass
class Dataset:
    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray

    def fingerprint(self):
        """A short hash of all four arrays: equal fingerprints mean identical data."""
        h = hashlib.sha256()
        for a in (self.X_train, self.y_train, self.X_test, self.y_test):
            h.update(str(a.shape).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def summary(self):
        return {"name": self.name, "n_train": len(self.y_train), "n_test": len(self.y_test),
                "fingerprint": self.fingerprint()}


def as_images(a):
    """(N, 28, 28) -> a new (N, 1, 28, 28) float32 array with plain C strides (3136, 3136, 112, 4 bytes).
    Not `a.astype(np.float32)[:, None]`: the inserted axis gets stride 0, which numpy still calls
    contiguous (np.ascontiguousarray keeps it), and batches gathered from it (X[rows]) get strides that
    PyTorch reads as channels-last: the convolution path then depends on how the data was built, not on
    the layout chosen in execution.py."""
    return np.array(a, dtype=np.float32).reshape(len(a), *IMAGE_SHAPE)


def load_dataset(name, data_dir=None, n_synthetic=SYNTHETIC_SIZE, seed=0):
    if name == "digits":
        return load_digits()
    if name == "synthetic":
        return make_synthetic(n_synthetic, seed=seed)
    if name in MIRRORS:
        return load_idx_dataset(name, data_dir)
    raise RosettaError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


# --- digits: the embedded default ------------------------------------------------------------------

def load_digits():
    """scikit-learn's 1797 real 8x8 digits, resized to 28x28 and split 80/20 (make_digits), kept in the cache
    folder once made: importing scikit-learn costs every worker process about 1.5 s, and a test run starts
    hundreds. The cached copy is named after what made it (the scikit-learn and SciPy versions, make_digits'
    own code) and used only if it holds exactly what it held when written (its fingerprint)."""
    recipe = hashlib.sha256(inspect.getsource(make_digits).encode()).hexdigest()[:8]
    versions = "-".join(importlib.metadata.version(dist) for dist in ("scikit-learn", "scipy"))
    path = os.path.join(cache_dir("digits"), f"digits-{versions}-{recipe}.npz")
    try:
        with np.load(path, allow_pickle=False) as f:
            data = Dataset("digits", *(f[k] for k in ("X_train", "y_train", "X_test", "y_test")))
            if data.fingerprint() == str(f["fingerprint"]):
                return data
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):   # not there yet, unreadable, or not ours
        pass
    data = make_digits()
    try:   # written whole or not at all: workers that start together may all write it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npz.part")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, X_train=data.X_train, y_train=data.y_train, X_test=data.X_test, y_test=data.y_test,
                     fingerprint=data.fingerprint())
        os.replace(tmp, path)
    except OSError:   # a read-only home: every process makes its own copy, as before
        pass
    return data


def make_digits():
    """scikit-learn's 1797 real 8x8 digits, resized to 28x28 (bilinear) and split 80/20, stratified,
    with a fixed seed: the same split on every machine."""
    from scipy.ndimage import zoom
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split
    digits = sklearn_digits()
    images = zoom(digits.images.astype(np.float32) / 16.0, (1, 3.5, 3.5), order=1)
    images = as_images(np.clip(images, 0.0, 1.0))
    labels = digits.target.astype(np.int64)
    X_train, X_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=0)
    return Dataset("digits", X_train, y_train, X_test, y_test)


# --- synthetic: any size, for throughput runs --------------------------------------------------------

def make_synthetic(n, seed=0, n_test=None):
    """n training images (and n // 6 test images) drawn around 10 smooth random class prototypes:
    learnable, but not trivially (noise and random shifts)."""
    if n < 1:
        raise RosettaError(f"synthetic data needs at least one image, got {n}")
    rng = np.random.default_rng(seed)
    grid = np.linspace(-1, 1, 28)
    yy, xx = np.meshgrid(grid, grid, indexing="ij")
    prototypes = []
    for _ in range(10):
        img = np.zeros((28, 28))
        for _ in range(3):   # three Gaussian blobs per class
            cy, cx = rng.uniform(-0.6, 0.6, 2)
            img += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / rng.uniform(0.02, 0.1))
        prototypes.append(img / img.max())
    prototypes = np.stack(prototypes)

    def draw(count):
        labels = rng.integers(0, 10, count)
        images = prototypes[labels]
        shifts = rng.integers(-2, 3, (count, 2))
        images = np.stack([np.roll(im, tuple(s), axis=(0, 1)) for im, s in zip(images, shifts)])
        images = images + rng.normal(0, 0.3, images.shape)
        return as_images(np.clip(images, 0, 1)), labels.astype(np.int64)

    X_train, y_train = draw(n)
    X_test, y_test = draw(n_test if n_test is not None else max(n // 6, 100))
    return Dataset("synthetic", X_train, y_train, X_test, y_test)


# --- IDX files: MNIST and Fashion-MNIST ----------------------------------------------------------------

def cache_dir(name):
    root = os.environ.get("ROSETTA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rosetta-dp"))
    return os.path.join(root, name)


def find_idx_file(directory, base):
    """The file `base` or `base.gz` in directory (also the `base.idx3-ubyte` spelling), or None."""
    for candidate in (base, base + ".gz", base.replace("-idx", ".idx"), base.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(directory, candidate)
        if os.path.isfile(path):
            return path
    return None


def load_idx_dataset(name, data_dir=None):
    """Look in --data-dir (only there, if given), else Debian's folder, else the cache; download into
    the cache when none has the files."""
    if data_dir is not None:
        if not os.path.isdir(data_dir):
            raise RosettaError(f"data directory {data_dir} does not exist")
        places = [data_dir]
    else:
        places = [d for d in (DEBIAN_DIRS.get(name), cache_dir(name)) if d and os.path.isdir(d)]
    for directory in places:
        paths = {split: [find_idx_file(directory, base) for base in files] for split, files in IDX_FILES.items()}
        found = [p for pair in paths.values() for p in pair]
        if all(found):
            return Dataset(name, *read_idx_pair(*paths["train"]), *read_idx_pair(*paths["test"]))
        if data_dir is not None:
            missing = [base for pair in IDX_FILES.values() for base in pair if not find_idx_file(directory, base)]
            raise RosettaError(f"{data_dir} lacks {', '.join(missing)} (raw or .gz)")
    download(name)
    return load_idx_dataset(name, cache_dir(name))


def download(name):
    """Into the cache, each file from the first mirror that serves the published bytes (MD5 checked:
    a proxy's error page or a re-packed file must not become the data set). Local copies, such as
    Debian's re-compressed ones, are checked by their headers and counts instead."""
    target = cache_dir(name)
    hint = (" or install Debian's dataset-fashion-mnist package" if name in DEBIAN_DIRS else "")
    os.makedirs(target, exist_ok=True)
    for base in (b for pair in IDX_FILES.values() for b in pair):
        if find_idx_file(target, base):
            continue
        errors = []
        for mirror in MIRRORS[name]:
            try:
                with urllib.request.urlopen(mirror + base + ".gz", timeout=20) as response:
                    blob = response.read()
            except OSError as err:
                errors.append(f"{mirror}: {err}")
                continue
            md5 = hashlib.md5(blob).hexdigest()
            if md5 == PUBLISHED_MD5[name][base]:
                break
            errors.append(f"{mirror}{base}.gz: MD5 {md5} is not the published one")
        else:
            raise RosettaError(f"{name} not found locally and could not be downloaded ({errors[-1]}); "
                               f"put the IDX files in a folder and pass --data-dir{hint}")
        with open(os.path.join(target, base + ".gz.part"), "wb") as f:
            f.write(blob)
        os.replace(os.path.join(target, base + ".gz.part"), os.path.join(target, base + ".gz"))


def read_idx(path, magic):
    """One IDX file as a uint8 array, its header checked against its size."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            blob = f.read()
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise RosettaError(f"{path}: cannot be read ({err})") from err
    ndim = magic - 2048
    header = 4 + 4 * ndim
    if len(blob) < header:
        raise RosettaError(f"{path}: truncated IDX file ({len(blob)} bytes, no full header)")
    found = int.from_bytes(blob[:4], "big")
    if found != magic:
        raise RosettaError(f"{path}: not an IDX {'image' if ndim == 3 else 'label'} file "
                           f"(magic number {found:#010x}, expected {magic:#010x})")
    dims = [int.from_bytes(blob[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims))
    if len(blob) != expected:
        raise RosettaError(f"{path}: {'truncated' if len(blob) < expected else 'oversized'} IDX file "
                           f"(header says {dims}, {expected} bytes; file has {len(blob)})")
    return np.frombuffer(blob, dtype=np.uint8, offset=header).reshape(dims)


def read_idx_pair(images_path, labels_path):
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if images.shape[1:] != (28, 28):
        raise RosettaError(f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, expected 28x28")
    if len(images) != len(labels):
        raise RosettaError(f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels")
    if labels.size and labels.max() >= 10:
        raise RosettaError(f"{labels_path}: label {labels.max()} out of range 0-9")
    return as_images(images) / 255.0, labels.astype(np.int64)


def write_idx(path, array):
    """Write a uint8 array as an IDX file (gzip if path ends in .gz): for tests and for making subsets."""
    array = np.asarray(array, dtype=np.uint8)
    blob = (2048 + array.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    blob += array.tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(blob)
