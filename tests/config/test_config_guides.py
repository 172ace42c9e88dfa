"""Every shipped config opens with a user's guide whose numbers agree with the config's values."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))
TOKENS = re.compile(r"ranks: (\d+) x (\d+) x (\d+) x (\d+) (?:GPUs|process) = ([\d,]+) tokens; "
                    r"(\d+) steps = ([\d.,]+)(B?) tokens")


def guide(path: Path) -> str:
    """The comment lines before the first table, joined."""
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("["):
            break
        lines.append(line.removeprefix("#").strip())
    return " ".join(lines)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_guide_states_tokens_launch_measurement_and_memory_advice(path):
    text = guide(path)
    cfg = tomllib.loads(path.read_text())["training"]
    found = TOKENS.search(text)
    assert found, f"{path.name}: no 'ranks: B x L x GA x N GPUs = T tokens; S steps = X tokens' line"
    batch, seq_len, accum, ranks, per_step, steps, total, billions = found.groups()
    assert (int(batch), int(seq_len), int(accum), int(steps)) == (
        cfg["batch_size"], cfg["seq_len"], cfg["gradient_accumulation_steps"], cfg["steps"])
    assert int(per_step.replace(",", "")) == int(batch) * int(seq_len) * int(accum) * int(ranks)
    tokens = int(per_step.replace(",", "")) * int(steps)
    if billions:
        assert abs(float(total) * 1e9 - tokens) <= 0.05e9
    else:
        assert int(total.replace(",", "")) == tokens
    assert "python -m flame.train" in text and f"torchrun --nproc-per-node 8 -m flame.train --config configs/{path.name}" in text
    assert "H100" in text  # the measured numbers on one H100, or that there are none
    assert "memory" in text.lower()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_guide_has_no_placeholder_for_a_measurement(path):
    """A guide gives measured numbers or says that there are none; never a slot left to fill."""
    text = guide(path)
    for placeholder in ("TO BE MEASURED", "TBD", "TODO", "XXX", "FIXME"):
        assert placeholder not in text, f"{path.name}: {placeholder!r} in the guide"
