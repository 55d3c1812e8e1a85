"""The projection past one machine (harness/projection.py): its formulas, its fit, and one real measurement feeding it."""
import numpy as np
import pytest

from harness import projection as scaling
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


def test_efficiency_falls_with_gpus_and_is_perfect_with_free_communication():
    effs = [scaling.efficiency(0.01, 50e6, p, 1e-4, 12e9) for p in scaling.GPUS]
    assert all(a > b for a, b in zip(effs, effs[1:])) and 0 < effs[-1] < effs[0] < 1
    assert scaling.efficiency(0.01, 50e6, 64, 0.0, float("inf")) == 1.0


@pytest.mark.slow
def test_a_measured_allreduce_grows_with_size_and_feeds_the_page():
    framework_or_skip("pytorch")
    results = scaling.measure(["pytorch"], sizes=(2**12, 2**24))
    (small, large) = results["pytorch"]["allreduce"]
    assert 0 < small["median"] < large["median"]
    assert results["pytorch"]["step"]["median"] > 0 and results["pytorch"]["alpha"] > 0
    page = scaling.markdown(results, "test machine", "python -m harness.projection")
    tables = sum(len(times) for _, times in scaling.MODELS.values())   # one per model and step time
    assert "| pytorch | gloo ring all-reduce |" in page
    assert page.count("### ") == page.count("| 64 GPUs |") == tables
