"""Mixed precision, written once: which tensors of the step are held in a low precision, how a value is rounded to
it, and how close a framework's low-precision step can come to the numpy reference (common/backprop.py).

--precision fp32 is the recipe as it always ran. --precision bf16 (and fp16, in the same places) is what every
framework's own mixed precision (torch.autocast, Keras's mixed_bfloat16 policy, MXNet's contrib.amp, JAX's casts
by hand) computes:
- the master weights stay fp32; the convolutions and dense layers take their inputs and weights (and biases) cast
  to bf16, accumulate in fp32 and round their output to bf16, so every activation between them is bf16 (ReLU,
  pooling and the residual add run on bf16 values and round what they make);
- BatchNorm takes its bf16 input into fp32: statistics, normalisation and the running statistics in fp32, its
  output rounded to bf16 (the statistics of bf16 values summed in bf16 lose ~3 digits: a convention slip the tests
  catch);
- the loss (log-softmax and its sum) in fp32 from the bf16 logits;
- the backward mirrors it: a gradient reaching a bf16 tensor is rounded to bf16, so a convolution's or dense
  layer's weight gradient is a bf16 value when it is widened to fp32 for its master weight (BatchNorm's gamma and
  beta get fp32 gradients); the all-reduce and the update run in fp32;
- the scratch step's test accuracy is the fp32 master weights', evaluated in fp32 (so are PyTorch's and MXNet's
  engines'; a Keras or Flax network, which carries its precision, evaluates in bf16).
--precision fp16 holds the same tensors in fp16 instead, whose 5 bits of exponent overflow above 65504 and flush
below 6e-8: its step scales the loss (common/loss_scaling.py).
What each framework's own mixed precision runs in which precision, op by op: docs/usage.md ("Mixed precision").
"""
import ml_dtypes
import numpy as np

from .interface import RosettaError

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}

# bf16 keeps 8 significant bits (7 stored): a value rounded to it is off by up to 2**-9 of itself. Each op rounds
# its output, and where a framework sums in another order than the reference, a few of its outputs round to the
# neighbouring bf16 value. On the LeNet that leaves the loss within 3e-6 and the gradients within 1e-3; through the
# ResNet's 17 BatchNorms the flips grow: the reference's own bf16 step, with one BatchNorm weight moved by 1e-6 of
# itself, moves its loss by up to 4e-4 and all its gradients by 2e-2 in norm (64 images; 4e-2 at 16). A framework's
# bf16 step must come within BOUND (the loss, relative) and GRADIENT_BOUND (every gradient at once, relative in
# norm) of the reference's: tests/test_precision.py, where each framework's measured distance is given.
# fp16 keeps 11 significant bits (2**-12 of a value), 8 times bf16's: its loss's bound is bf16's scaled down. Its
# gradients' is bf16's: most of their distance is a ReLU whose input lies within a rounding of zero and flips, which
# fp16 shrinks only about twice (TensorFlow's ResNet at fp16: 1.8e-2 from the reference; the reference's own
# gradients move 1.7e-2 to 2.4e-2 when its weights move 1e-6 of themselves).
BOUND = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 1e-3}
GRADIENT_BOUND = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}


def check(precision):
    if precision not in PRECISIONS:
        raise RosettaError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")


def is_low(precision):
    """Whether the step computes in a precision below its fp32 master weights."""
    check(precision)
    return precision != "fp32"


def rounded(x, precision):
    """x (any float array) as the precision holds it, in float64: rounded to bf16 or fp16 through fp32 (the frameworks
    round from an fp32 accumulator, and rounding float64 directly differs where fp32's rounding lands on a tie; past
    fp16's range a value becomes inf, as it does in the frameworks); fp32 values are the reference's float64 ones,
    unrounded."""
    x = np.asarray(x, np.float64)
    if not is_low(precision):
        return x
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(DTYPES[precision]).astype(np.float64)


# --allreduce-dtype: the precision of the gradients on the wire. fp32 is the recipe; bf16 halves the bytes each
# all-reduce moves (DDP's bf16_compress_hook): every device's gradient rounded to bf16, summed in bf16, widened back.
WIRE_DTYPES = ("fp32", "bf16")
# The engines that can put bf16 on the wire: DDP's communication hook, JAX's psum written by hand. Keras's
# MirroredStrategy and MXNet's kvstore all-reduce in their variables' dtype, with no option for another.
WIRE_ENGINES = ("pytorch", "jax")


def check_wire(dtype):
    if dtype not in WIRE_DTYPES:
        raise RosettaError(f"unknown all-reduce dtype {dtype!r}; choose from {', '.join(WIRE_DTYPES)}")


def summed_on_the_wire(arrays, dtype):
    """The all-reduce's sum of `arrays` (one per device, in device order) as it runs with `dtype` on the wire: each
    rounded to it, the running sum rounded after every addition, widened back to fp32. Past two devices a ring or a
    tree adds in another order, and the bf16 sums may differ by a rounding; at two they are one addition."""
    check_wire(dtype)
    total = None
    for a in arrays:
        a = rounded(np.asarray(a, np.float32), dtype)
        total = a if total is None else rounded(total + a, dtype)
    return total.astype(np.float32)


def wire_bytes(elements, dtype):
    """The bytes one device sends into the all-reduce of `elements` gradient values per step, in `dtype`."""
    check_wire(dtype)
    return elements * np.dtype(DTYPES[dtype]).itemsize


def needs_loss_scaling(precision):
    """fp16's narrow exponent needs the loss scaled (common/loss_scaling.py); bf16 has fp32's."""
    check(precision)
    return precision == "fp16"


def is_representable(x, precision):
    """Whether every value of x is exactly a value of the precision: what a gradient made by a bf16 op must be."""
    x = np.asarray(x, np.float32)
    return bool(np.array_equal(x.astype(DTYPES[precision]).astype(np.float32), x))

