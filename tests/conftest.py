"""Session-scoped engines on the built-in models: each model loads once per test session."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    from tests.interpreter_calls import install

    install()  # cheaper nested jit calls under TRITON_INTERPRET=1 (see the module)


@pytest.fixture(scope="session")
def gemma_engine():
    from swaserve import Engine

    return Engine(model="gemma-3-270m", device="cpu", kv_cache_gb=1)


@pytest.fixture(scope="session")
def smollm_engine():
    from swaserve import Engine

    return Engine(model="smollm2-135m-instruct", device="cpu", kv_cache_gb=1)


@pytest.fixture(autouse=True)
def _integrity_after(request):
    """Every test that used a built-in engine leaves its memory consistent and empty."""
    yield
    for name in ("gemma_engine", "smollm_engine"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            engine.core.memory.check_integrity()
            assert not engine.core.has_unfinished()
