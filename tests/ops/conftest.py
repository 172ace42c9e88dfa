"""Fixtures of the kernel tests."""

import pytest


@pytest.fixture
def walk_states(monkeypatch):
    """The chunk core's state passes take the walk over chunks (flame.ops.common.chunk_triton.state.walks), which small
    test shapes would otherwise not fill: the other tests then cover the split pass (local terms + scan)."""
    from flame.ops.common.chunk_triton import state

    monkeypatch.setattr(state, "WALK_MIN_PROGRAMS", 0)
