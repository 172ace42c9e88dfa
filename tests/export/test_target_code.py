"""Each export, run by its target's own code, computes flame's function, or the export refuses.

The targets: the official `rwkv` package (strategy "cpu fp32") for the RWKV-LM `.pth`,
transformers for the `hf` folder, fla's model classes for the `fla` folder (GPU, where fla is
installed). One model per family and head size of the shipped configs (configs/*.toml), its
weights the initial ones plus noise so that every tensor shapes the logits, and one more per RWKV
family with the GroupNorm eps of fla when it is not the official one: a format that cannot hold a
model's eps refuses it (docs/initialization.md, "The GroupNorm of the RWKV attention output").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flame.config import load_config
from flame.export import ExportError, export_checkpoint
from flame.export.__main__ import main as export_main
from flame.weights import load_model, read_exported
from flame.weights.fla_names import fla_group_norm_eps
from flame.weights.rwkv_names import OFFICIAL_EPS
from tests.export.helpers import VOCAB, make_tokenizer, run_config, with_model_fields

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[2]
TOKENS = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
OFFICIAL = OFFICIAL_EPS["group_norm_eps"]


def shipped_cases() -> list[tuple[str, int]]:
    """(family, head size) of every shipped config."""
    cases = set()
    for path in sorted((REPO / "configs").glob("*.toml")):
        m = load_config(["--config", str(path)]).model
        cases.add((m.family, m.hidden_size // m.num_heads if m.family == "gsa" else m.head_dim))
    return sorted(cases)


def variants(family: str, head: int) -> dict[str, float]:
    """The GroupNorm eps to test: the official one and, where it differs, fla's."""
    out = {"official": OFFICIAL}
    fla_eps = fla_group_norm_eps(family, head, OFFICIAL_EPS["norm_eps"])
    if fla_eps is not None and not math.isclose(fla_eps, OFFICIAL):
        out["fla"] = fla_eps
    return out


CASES = shipped_cases()
MODELS = [(family, head, variant) for family, head in CASES for variant in variants(family, head)]
RWKV_MODELS = [m for m in MODELS if m[0] != "gsa"]


def model_section(family: str, head: int) -> dict:
    """Two heads of the shipped size (one for GSA's wide heads), two layers."""
    if family == "gsa":
        return {"hidden_size": head, "num_heads": 1, "num_slots": 16}
    section = {"hidden_size": 2 * head, "head_dim": head}
    return section | ({"mix_low_rank_dim": 8, "decay_low_rank_dim": 16} if family == "rwkv6" else {})


def out_path(root: Path, name: str, fmt: str) -> Path:
    return root / "exports" / (f"{name}.pth" if fmt == "rwkv" else f"{name}-{fmt}")


def model_name(family: str, head: int, variant: str) -> str:
    return f"{family}-{head}-{variant}"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"root": Path, name: {"dump": run folder, fmt: export path or the ExportError's message}}."""
    from flame.train.trainer import Trainer

    root = tmp_path_factory.mktemp("target-code")
    tokenizer = make_tokenizer(root / "tokenizer.json")
    out = {"root": root}
    for family, head in CASES:
        dump = root / model_name(family, head, "official")
        trainer = Trainer(run_config(family, dump, tokenizer, model=model_section(family, head)), dataloader=[])
        generator = torch.Generator().manual_seed(head)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
        trainer.save_checkpoint()
        for variant, eps in variants(family, head).items():
            name = model_name(family, head, variant)
            if variant != "official":
                with_model_fields(dump, root / name, group_norm_eps=eps)
            out[name] = {"dump": root / name}
            for fmt in ("hf", "fla") + (("rwkv",) if family != "gsa" else ()):
                try:
                    out[name][fmt] = export_checkpoint(root / name, out_path(root, name, fmt), fmt=fmt)
                except ExportError as err:
                    out[name][fmt] = str(err)
    return out


def flame_logits(exports, name: str) -> torch.Tensor:
    model, _, _ = load_model(exports[name]["dump"])
    with torch.no_grad():
        return model(TOKENS)[0]


def assert_same_function(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """Equal to fp32 rounding: the max difference within 1e-5 of the logits' scale."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{label}: {m}")


@pytest.fixture(scope="module")
def official_logits(exports, tmp_path_factory):
    """{.pth path: logits} from the official rwkv package, in a process of its own."""
    pytest.importorskip("rwkv", reason="the official rwkv package is not installed (it is in the dev extra)")
    out = tmp_path_factory.mktemp("official") / "logits.pt"
    models = [f"{m[0]}:{exports[model_name(*m)]['rwkv']}" for m in RWKV_MODELS
              if isinstance(exports[model_name(*m)]["rwkv"], Path)]
    tokens = ",".join(map(str, TOKENS[0].tolist()))
    result = subprocess.run([sys.executable, "-m", "tests.export.official_rwkv", tokens, str(out), *models],
                            capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("family,head,variant", RWKV_MODELS)
def test_rwkv_pth_gives_flames_logits_in_the_official_rwkv_package(exports, official_logits, family, head, variant):
    name = model_name(family, head, variant)
    exported = exports[name]["rwkv"]
    if variant != "official":
        eps = variants(family, head)[variant]
        assert exported == (f"the RWKV-LM .pth format cannot hold model.group_norm_eps = {eps:g}: RWKV-LM and the "
                            f"rwkv package hard-code 0.00064, so the export would compute another function; "
                            f"export as hf instead")
        return
    assert_same_function(official_logits[str(exported)], flame_logits(exports, name), name)


@pytest.mark.parametrize("family,head,variant", MODELS)
def test_hf_folder_gives_flames_logits_in_transformers(exports, family, head, variant):
    name = model_name(family, head, variant)
    folder = exports[name]["hf"]
    assert json.loads((folder / "config.json").read_text())["group_norm_eps"] == variants(family, head)[variant]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        got = model(TOKENS).logits[0]
    assert_same_function(got, flame_logits(exports, name), name)


@pytest.mark.parametrize("family,head,variant", MODELS)
def test_fla_folder_carries_the_group_norm_eps_or_is_refused(exports, family, head, variant):
    """fla derives its GroupNorm eps from norm_eps (RWKV7: head_dim x norm_eps, RWKV6: norm_eps):
    the export writes a config whose eps is the model's, or refuses; read back, the folder gives
    the model's eps."""
    name = model_name(family, head, variant)
    exported = exports[name]["fla"]
    eps = variants(family, head)[variant]
    fla_eps = fla_group_norm_eps(family, head, OFFICIAL_EPS["norm_eps"])
    if fla_eps is not None and not math.isclose(eps, fla_eps):
        assert isinstance(exported, str) and exported.startswith(
            f"the fla format cannot hold model.group_norm_eps = {eps:g}: fla's {family} computes that GroupNorm with ")
        assert f"= {fla_eps:g}, so the export would compute another function" in exported
        return
    config = json.loads((exported / "config.json").read_text())
    if fla_eps is not None:
        assert fla_group_norm_eps(family, head, config["norm_eps"]) == pytest.approx(eps)
    args, _, _ = read_exported(exported)
    assert args.group_norm_eps == pytest.approx(eps) and args.norm_eps == config["norm_eps"]


def test_rwkv_export_refuses_another_layer_norm_eps_naming_the_key(exports, tmp_path, capsys):
    dump = with_model_fields(exports[model_name("rwkv7", 64, "official")]["dump"], tmp_path / "norm-eps", norm_eps=1e-6)
    assert export_main(["--checkpoint", str(dump), "--out", str(tmp_path / "out.pth"), "--format", "rwkv"]) == 1
    assert capsys.readouterr().err.strip() == (
        "flame.export: error: the RWKV-LM .pth format cannot hold model.norm_eps = 1e-06: RWKV-LM and the rwkv "
        "package hard-code 1e-05, so the export would compute another function; export as hf instead")
    assert not (tmp_path / "out.pth").exists()


@pytest.mark.gpu
@pytest.mark.fla
@pytest.mark.parametrize("family,head,variant", MODELS)
def test_fla_folder_gives_flames_logits_in_fla(exports, family, head, variant):
    """fla's model classes on the `fla` export against flame's model, both bf16 on CUDA."""
    pytest.importorskip("fla", reason="fla is not installed")
    import fla  # noqa: F401  (registers fla's model types with transformers)

    name = model_name(family, head, variant)
    folder = exports[name]["fla"]
    if isinstance(folder, str):
        pytest.skip(f"the fla export refuses this model: {folder}")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    ours, _, _ = load_model(exports[name]["dump"], dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        got, want = theirs(ids).logits.float(), ours(ids).float()
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)
