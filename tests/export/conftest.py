"""The tests' shared runs: each family trained for a few steps (the trainer writes a real DCP
checkpoint) and exported to every format that family has, once per test session."""

from __future__ import annotations

import pytest

from tests.export.helpers import (
    FAMILIES,
    FLA_EPS,
    FORMATS,
    export,
    make_tokenizer,
    out_path,
    train_run,
    with_model_fields,
)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """{"root", "tokenizer", family: trained Trainer}; each family exported to its formats (the
    RWKV families' fla exports from a copy of the run that computes with fla's GroupNorm eps)."""
    pytest.importorskip("transformers")  # the hf and fla folders hold a transformers tokenizer
    pytest.importorskip("safetensors")
    root = tmp_path_factory.mktemp("export")
    tokenizer = make_tokenizer(root / "tokenizer.json")
    out = {"root": root, "tokenizer": tokenizer}
    for family in FAMILIES:
        out[family] = train_run(family, root / family, tokenizer)
        for fmt in FORMATS[family]:
            source = root / family
            if fmt == "fla" and family in FLA_EPS:
                source = with_model_fields(source, root / f"{family}-fla-eps", group_norm_eps=FLA_EPS[family])
            assert export(source, out_path(root, family, fmt), "--format", fmt) == 0
    return out
