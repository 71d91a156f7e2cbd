"""Shared pytest fixtures and the `gpu` marker's skip rule."""

import pytest


@pytest.fixture(scope="module")
def launcher():
    """Starts `kvshare serve` processes for one test module (tier_helpers: forked from a
    pre-loaded zygote unless KVSHARE_TIER_TEST_NO_FORK=1)."""
    from tier_helpers import make_launcher

    la = make_launcher()
    yield la
    la.close()


def _have_gpu() -> bool:
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
