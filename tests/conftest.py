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


@pytest.fixture(scope="module")
def cold(launcher):
    """Reference outputs from a `kvshare serve` with every cache off (tier_helpers.ColdRuns)."""
    from tier_helpers import COLD_ARGS, ColdRuns, Server

    s = Server(launcher, *COLD_ARGS)
    yield ColdRuns(s)
    s.kill9()


@pytest.fixture(scope="module")
def redis_server():
    """A real `redis-server` on a loopback port for one test module (redis_helpers)."""
    from redis_helpers import RedisServer, require_redis

    require_redis()
    r = RedisServer()
    yield r
    r.close()


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
