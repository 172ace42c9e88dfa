"""bench/activation_memory.py's fit on hand-made runs: from activations measured at two depths
and two widths it recovers the a + b C figures of `flame.train.memory_estimate`'s table, and an
RWKV7 flag's change of what a block keeps."""

from __future__ import annotations

import pytest

from bench.activation_memory import fit

TOKENS = 4096


def run(family, policy, flag, width, depth, saved, working, head=10**8):
    """A run whose activations follow the formula that `fit` inverts."""
    activations = depth * TOKENS * saved(width) + TOKENS * working(width) + head
    return {"family": family, "policy": policy, "flag": flag, "width": width, "depth": depth,
            "tokens": TOKENS, "head": head, "activations": activations}


def test_the_fit_recovers_the_per_token_figures_and_a_flag():
    def saved(width):
        return 1000 + 30 * width

    def working(width):
        return 500 + 50 * width

    def cached(width):
        return saved(width) + 23 * width

    runs = [run("rwkv7", "elementwise", "", w, d, saved, working) for w in (1024, 2048) for d in (2, 4)]
    runs += [run("rwkv7", "elementwise", "cache_intermediates", w, d, cached, working)
             for w in (1024, 2048) for d in (2, 4)]
    runs.append({"family": "gsa", "policy": "full", "flag": "", "error": "exit 1"})  # a failed run is left out
    table, flags = fit(runs)
    assert list(table) == [("rwkv7", "elementwise")]
    (sa, sb), (wa, wb) = table["rwkv7", "elementwise"]
    assert (sa, sb, wa, wb) == pytest.approx((1000, 30, 500, 50))
    assert flags["cache_intermediates"] == pytest.approx((0, 23), abs=1e-6)


def test_one_width_gives_a_figure_proportional_to_it():
    runs = [run("gsa", "none", "", 1024, d, lambda w: 40 * w, lambda w: 40 * w) for d in (2, 6)]
    table, _ = fit(runs)
    assert table["gsa", "none"] == (pytest.approx((0.0, 40.0)), pytest.approx((0.0, 40.0)))
