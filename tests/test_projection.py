"""The projection past one machine (harness/studies/projection.py): its formulas, its fit, and one real measurement feeding it."""
import numpy as np
import pytest

from common import zero
from harness.studies import projection as scaling
from conftest import framework_or_skip


@pytest.mark.parametrize("framework", ["pytorch", "mxnet"])   # a ring, and the one-server push-pull
def test_the_fit_recovers_the_latency_and_bandwidth_it_was_made_from(framework):
    alpha, bandwidth = 150e-6, 2e9
    sizes = list(scaling.SIZES)
    seconds = [scaling.allreduce_seconds(n, 2, alpha, bandwidth, framework) for n in sizes]
    fitted_alpha, fitted_bandwidth = scaling.fit(sizes, seconds, framework)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6) and fitted_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_the_fitted_latency_is_never_negative():
    """MXNet's measured points (ms at 0.49, 1, 16, 100 MB) once gave a free fit alpha of -123 us."""
    sizes = [0.49 * 2**20, 2**20, 16 * 2**20, 100 * 2**20]
    alpha, bandwidth = scaling.fit(sizes, [1.12e-3, 1.95e-3, 37.41e-3, 352.30e-3], "mxnet")
    assert alpha == 0.0 and 0.3e9 < bandwidth < 3e9


def test_the_ring_and_the_parameter_server_formulas():
    n, alpha, bandwidth = 8e6, 1e-4, 1e9
    assert scaling.allreduce_seconds(n, 2, alpha, bandwidth) == pytest.approx(2 * alpha + n / bandwidth)
    # a ring's bandwidth term tends to 2 n / B; its latency term grows with p
    assert scaling.allreduce_seconds(n, 64, alpha, bandwidth) == pytest.approx(126 * alpha + 126 / 64 * n / bandwidth)
    # one parameter server carries every worker's push and pull: linear in p
    ps = [scaling.allreduce_seconds(n, p, alpha, bandwidth, "mxnet") for p in (2, 4, 8)]
    assert np.allclose(np.diff(ps), [2 * n / bandwidth, 4 * n / bandwidth])


def test_a_step_pays_a_latency_per_collective_and_its_bytes_once():
    n, alpha, bandwidth = 8e6, 1e-4, 1e9
    one = scaling.allreduce_seconds(n, 4, alpha, bandwidth)
    assert scaling.allreduce_seconds(n, 4, alpha, bandwidth, k=8) == pytest.approx(one + 7 * 6 * alpha)
    assert scaling.allreduce_seconds(n, 4, alpha, bandwidth, "mxnet", k=8) == pytest.approx(16 * alpha + 4 * n / bandwidth)
    lenet, d2l = scaling.gradient_sizes("lenet"), scaling.gradient_sizes("resnet18", 64)
    assert [scaling.collectives(lenet, a) for a in scaling.ALLREDUCE_MODES] == [8, 1]
    assert [scaling.collectives(d2l, a) for a in scaling.ALLREDUCE_MODES] == [76, 2]
    # d2l's ResNet-18 at 100 TFLOP/s: 2.73 GFLOP per image x 256 images
    assert scaling.gpu_step_times("resnet18", 64)[0] == pytest.approx(2.7348e9 * 256 / 100e12, rel=1e-3)


def test_efficiency_falls_with_gpus_and_is_perfect_with_free_communication():
    effs = [scaling.efficiency(0.01, 50e6, p, 1e-4, 12e9) for p in scaling.GPUS]
    assert all(a > b for a, b in zip(effs, effs[1:])) and 0 < effs[-1] < effs[0] < 1
    assert scaling.efficiency(0.01, 50e6, 64, 0.0, float("inf")) == 1.0


def test_zero_s_stages_cost_the_all_reduce_or_half_as_much_again_and_hold_less_each():
    """Stage 0's communication is the ring all-reduce's (common/zero.py's volume and the latencies of its two
    halves); stages 1 and 3 add an all-gather, half an all-reduce; a parameter holds 16 bytes replicated with AdamW,
    8 + 8/p, 4 + 12/p and 16/p at stages 1 to 3 (ZeRO's paper's table, in float32)."""
    sizes, alpha, bandwidth, p = [4096, 1000, 10], 1e-4, 1e9, 8
    padded = 4 * sum(zero.chunk(s, p) * p for s in sizes)
    ring = scaling.allreduce_seconds(padded, p, alpha, bandwidth, k=3)
    assert scaling.stage_seconds(sizes, p, alpha, bandwidth, "none", k=3) == pytest.approx(ring)
    assert scaling.stage_seconds(sizes, p, alpha, bandwidth, "gradients", k=3) == pytest.approx(ring)
    for shard in ("optimizer", "parameters"):
        assert scaling.stage_seconds(sizes, p, alpha, bandwidth, shard, k=3) == pytest.approx(1.5 * ring)
    got = [scaling.bytes_per_parameter(p, shard) for shard in zero.SHARDS]
    assert got == pytest.approx([16, 8 + 8 / p, 4 + 12 / p, 16 / p])
    page = "\n".join(scaling.stages_markdown({"pytorch": {"alpha": alpha}}))
    assert "| 3 (parameters) | 2 / 1 | 40.0 B parameters | 80.0 B parameters |" in page


@pytest.mark.slow
def test_a_measured_allreduce_grows_with_size_and_feeds_the_page():
    framework_or_skip("pytorch")
    results = scaling.measure(["pytorch"], sizes=(2**12, 2**24))
    (small, large) = results["pytorch"]["allreduce"]
    assert 0 < small["median"] < large["median"]
    assert results["pytorch"]["step"]["median"] > 0 and results["pytorch"]["alpha"] > 0
    page = scaling.markdown(results, "test machine", "python -m harness.studies.projection")
    tables = sum(len(scaling.gpu_step_times(*m)) for m in scaling.MODELS.values())   # one per model and step time
    assert results["pytorch"]["steps"]["resnet18 w8"]["median"] > results["pytorch"]["steps"]["lenet"]["median"]
    assert "| pytorch | gloo ring all-reduce |" in page
    assert page.count("### ") == page.count("| 64 GPUs |") == tables
