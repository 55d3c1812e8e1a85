"""MXNet's bf16 on the wire (across processes: tests/test_wire_processes.py). Its kvstore's server refuses bf16 arrays ("Unknown type enum 12"), so the
scratch step's processes send their bf16 sums widened to fp32 and round the kvstore's sum to bf16
(mxnet/data_parallel.py, across_processes): with two processes that is the one bf16 addition, and the step is the
in-process bf16 step to the bit; with three the server's fp32 additions would skip a rounding, and the row is refused
in one line. Inside one process the casts and the sums are amp_cast's and elemwise_add's: mshadow's bf16_t (astype,
`+`) truncates, and the sums would be off by a bf16 step where it does."""
import numpy as np
import pytest

from common import precision
from conftest import framework_or_skip
from harness.loader import load_module


@pytest.mark.parametrize("op", ["astype", "+"])
def test_mxnet_s_truncating_bf16_ops_would_miss_the_wire_s_sum(op):
    """Why on_the_wire casts with amp_cast and adds with elemwise_add: astype (Cast) and `+` (broadcast_add) on bf16
    keep a float's upper 16 bits, and a tenth of random sums come out a bf16 step off summed_on_the_wire's."""
    framework_or_skip("mxnet")
    from mxnet import nd
    bf16 = load_module("mxnet", "lenet").DTYPES["bf16"]
    a, b = np.random.default_rng(0).standard_normal((2, 10_000)).astype(np.float32)
    want = precision.summed_on_the_wire([a, b], "bf16")
    A, B = nd.array(a), nd.array(b)
    if op == "astype":
        got = nd.elemwise_add(A.astype(bf16), B.astype(bf16))
    else:
        got = nd.amp_cast(A, dtype=bf16) + nd.amp_cast(B, dtype=bf16)
    assert np.mean(nd.amp_cast(got, dtype=np.float32).asnumpy() != want) > 0.1
    exact = nd.elemwise_add(nd.amp_cast(A, dtype=bf16), nd.amp_cast(B, dtype=bf16))
    np.testing.assert_array_equal(nd.amp_cast(exact, dtype=np.float32).asnumpy(), want)
