"""Export (hf, fla, RWKV-LM) and import of tiny trained checkpoints of the three families.

One module fixture trains each family for a few steps (the trainer writes a real DCP checkpoint)
and exports it to every format that family has; the tests compare what comes back with the
trainer's own model.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flame.export import ExportError, find_step_dir, load_model, read_model_state_dict
from flame.export.__main__ import main as export_main
from flame.export.fla import fla_group_norm_eps
from flame.export.formats import read_exported
from flame.train.checkpoint import CheckpointError
from tests.export.helpers import (
    FAMILIES,
    MODEL,
    STEPS,
    batches,
    make_tokenizer,
    run_config,
    train_run,
    with_model_fields,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[2]
FORMATS = {"rwkv6": ("hf", "fla", "rwkv"), "rwkv7": ("hf", "fla", "rwkv"), "gsa": ("hf", "fla")}
FLA_EPS = {family: fla_group_norm_eps(family, MODEL[family]["head_dim"], 1e-5) for family in ("rwkv6", "rwkv7")}
"""The GroupNorm eps of fla's RWKV models at the test's head size: an fla export needs it."""


def out_path(root: Path, family: str, fmt: str) -> Path:
    return root / "exports" / (f"{family}.pth" if fmt == "rwkv" else f"{family}-{fmt}")


def export(checkpoint, out, *args) -> int:
    return export_main(["--checkpoint", str(checkpoint), "--out", str(out), *args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"root", "tokenizer", family: trained Trainer}; each family exported to its formats (the
    RWKV families' fla exports from a copy of the run that computes with fla's GroupNorm eps)."""
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


def reference(runs, family, fmt="hf"):
    """The trained model, in eval mode; for an RWKV family's fla export, a copy that computes with
    fla's GroupNorm eps, as that export does."""
    model = runs[family].model
    model.eval()
    if fmt == "fla" and family in FLA_EPS:
        model = copy.deepcopy(model)
        for layer in model.layers:
            layer.attn.ln_x.eps = FLA_EPS[family]
    return model


def sample_ids(rows=2, length=24, seed=5):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def assert_same_weights(expected: dict, actual: dict, label: str) -> None:
    assert expected.keys() == actual.keys(), f"{label}: names differ: {set(expected) ^ set(actual)}"
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype and torch.equal(actual[name], value), f"{label}: {name}"


# ---- reading the checkpoint ------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_reader_gives_the_trained_weights_and_the_run_config(runs, family):
    step_dir = find_step_dir(runs["root"] / family)
    assert step_dir.name == f"step-{STEPS}"
    assert find_step_dir(step_dir.parent) == step_dir == find_step_dir(step_dir)
    state = read_model_state_dict(step_dir)
    assert_same_weights(runs[family].model.state_dict(), state, family)
    model, args, tokenizer = load_model(runs["root"] / family)
    assert args.family == family and args.vocab_size == 256 and tokenizer == str(runs["tokenizer"])
    assert_same_weights(runs[family].model.state_dict(), model.state_dict(), family)


# ---- hf: transformers' from_pretrained, generate, tokenizer -----------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_hf_export_loads_with_automodel_and_gives_flames_logits(runs, family):
    folder = out_path(runs["root"], family, "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    ids = sample_ids()
    with torch.no_grad():
        got = model(ids).logits
        want = reference(runs, family)(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with torch.no_grad():  # the loss of HF's convention: shifted labels, token mean
        loss = model(ids, labels=ids).loss
    expected = F.cross_entropy(want[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_greedy_generate_equals_greedy_decoding_by_flames_model(runs, family):
    """32 greedy tokens from transformers' generate against an argmax loop on flame's model that
    recomputes the whole prefix for each token."""
    folder = out_path(runs["root"], family, "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    prompt = sample_ids(rows=1, length=6, seed=11)
    flame_model, tokens = reference(runs, family), prompt
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        for _ in range(32):
            tokens = torch.cat([tokens, flame_model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert generated.shape == (1, 6 + 32)
    assert generated.tolist() == tokens.tolist()


def test_hf_padding_is_left_out_of_the_recurrence(runs):
    """A padded row (left or right) gets the logits of its unpadded tokens."""
    folder = out_path(runs["root"], "rwkv7", "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    ids = sample_ids(rows=1, length=10)
    padded = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids, torch.zeros(1, 2, dtype=ids.dtype)], dim=1)
    mask = torch.zeros_like(padded)
    mask[:, 3:13] = 1
    with torch.no_grad():
        got = model(padded, attention_mask=mask).logits[:, 3:13]
        want = reference(runs, "rwkv7")(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_hf_folder_has_the_tokenizer_and_generation_config(runs):
    from flame.data import load_tokenizer

    folder = out_path(runs["root"], "rwkv7", "hf")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    flame_tokenizer = load_tokenizer(str(runs["tokenizer"]))
    text = "ROMEO: But soft, what light through yonder window breaks?"
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == flame_tokenizer.encode(text)
    assert hf_tokenizer.eos_token_id == flame_tokenizer.eod_id
    assert load_tokenizer(str(folder)).eod_id == flame_tokenizer.eod_id  # flame reads it too
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id == flame_tokenizer.eod_id


def test_large_exports_are_sharded(runs, tmp_path):
    out = tmp_path / "sharded"
    assert export(runs["root"] / "rwkv7", out, "--max-shard-size", "150KB") == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = sample_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(runs, "rwkv7")(ids), rtol=1e-5, atol=1e-6)


def test_bfloat16_export(runs, tmp_path):
    out = tmp_path / "bf16"
    assert export(runs["root"] / "gsa", out, "--dtype", "bfloat16") == 0
    _, state, _ = read_exported(out)
    for name, value in runs["gsa"].model.state_dict().items():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], value.to(torch.bfloat16)), name
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.dtype == torch.bfloat16


# ---- every format back into flame ------------------------------------------------------------

ROUND_TRIPS = [(family, fmt) for family in FAMILIES for fmt in FORMATS[family]]


@pytest.mark.parametrize("family,fmt", ROUND_TRIPS)
def test_export_then_import_is_bitwise_equal(runs, family, fmt, tmp_path):
    from flame.train.trainer import Trainer

    out = out_path(runs["root"], family, fmt)
    trained = runs[family].model.state_dict()
    _, state, _ = read_exported(out, family)
    assert_same_weights(trained, state, f"{family} {fmt} read")
    cfg = run_config(family, tmp_path / "continued", runs["tokenizer"],
                     checkpoint={"enable": False, "initial_load_path": str(out)})
    continued = Trainer(cfg, dataloader=[])
    assert continued.state.step == 0
    assert_same_weights(trained, continued.model.state_dict(), f"{family} {fmt} trainer import")


def test_import_shape_mismatch_names_the_tensor_and_both_shapes(runs, tmp_path):
    from flame.train.trainer import Trainer

    cfg = run_config("rwkv7", tmp_path / "wider", runs["tokenizer"], model={"gate_low_rank_dim": 48},
                     checkpoint={"enable": False, "initial_load_path": str(out_path(runs["root"], "rwkv7", "fla"))})
    with pytest.raises(CheckpointError) as err:
        Trainer(cfg, dataloader=[])
    message = str(err.value)
    assert "\n" not in message
    assert "layers.0.attn.g1 has shape (64, 32)" in message and "(64, 48) in the model" in message


def test_import_of_a_pth_missing_a_tensor_names_it(runs, tmp_path):
    from flame.train.trainer import Trainer

    weights = torch.load(out_path(runs["root"], "rwkv7", "rwkv"), weights_only=True)
    del weights["blocks.1.att.w0"]
    torch.save(weights, tmp_path / "partial.pth")
    cfg = run_config("rwkv7", tmp_path / "run", runs["tokenizer"],
                     checkpoint={"enable": False, "initial_load_path": str(tmp_path / "partial.pth")})
    with pytest.raises(CheckpointError, match=r"partial.pth: no tensor layers.1.attn.w0 \(shape \(64,\) in the model\)$"):
        Trainer(cfg, dataloader=[])


def test_import_of_another_familys_pth_is_refused(runs, tmp_path):
    from flame.train.trainer import Trainer

    cfg = run_config("rwkv6", tmp_path / "other", runs["tokenizer"],
                     checkpoint={"enable": False, "initial_load_path": str(out_path(runs["root"], "rwkv7", "rwkv"))})
    with pytest.raises(CheckpointError, match=r"^checkpoint.initial_load_path: the .pth holds an RWKV7 model .*not rwkv6$"):
        Trainer(cfg, dataloader=[])


def test_import_needs_model_only(runs, tmp_path):
    from flame.train.trainer import Trainer

    cfg = run_config("gsa", tmp_path / "full", runs["tokenizer"],
                     checkpoint={"enable": False, "initial_load_model_only": False,
                                 "initial_load_path": str(out_path(runs["root"], "gsa", "hf"))})
    with pytest.raises(CheckpointError, match="holds model weights only.*initial_load_model_only = true"):
        Trainer(cfg, dataloader=[])


def test_tied_embeddings(runs, tmp_path):
    """A tied head is not written to hf (the loader ties it). A config that ties the head over
    weights whose head differs from the embedding exports untied (the weights decide), and such
    weights are refused by a run that ties."""
    from flame.train.trainer import Trainer

    trainer = train_run("gsa", tmp_path / "tied", runs["tokenizer"], model={"tie_word_embeddings": True})
    trained = trainer.model.state_dict()
    ids = sample_ids()
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(ids)
    assert export(tmp_path / "tied", tmp_path / "tied-hf") == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tied-hf", trust_remote_code=True)
    untied = not torch.equal(trained["lm_head.weight"], trained["embeddings.weight"])
    assert hf_model.config.tie_word_embeddings is not untied
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, want, rtol=1e-5, atol=1e-6)
    # truly tied weights: the head is the embedding, written once, tied again when loaded
    tied_state = {k: v for k, v in trained.items() if k != "lm_head.weight"}
    from flame.export.hf import FlameConfig, FlameForCausalLM
    from flame.export.writer import write_safetensors

    config = FlameConfig(**{**hf_model.config.to_dict(), "tie_word_embeddings": True})
    folder = tmp_path / "truly-tied"
    folder.mkdir()
    config.save_pretrained(folder)
    write_safetensors({"model." + k: v for k, v in tied_state.items()}, folder, "5GB")
    loaded = FlameForCausalLM.from_pretrained(folder)
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.embeddings.weight.data_ptr()
    cfg = run_config("gsa", tmp_path / "continued", runs["tokenizer"], model={"tie_word_embeddings": True},
                     checkpoint={"enable": False, "initial_load_path": str(folder)})
    continued = Trainer(cfg, dataloader=[]).model.state_dict()
    for name, value in tied_state.items():
        assert torch.equal(continued[name], value), name
    assert torch.equal(continued["lm_head.weight"], tied_state["embeddings.weight"])
    if untied:
        cfg = run_config("gsa", tmp_path / "refused", runs["tokenizer"], model={"tie_word_embeddings": True},
                         checkpoint={"enable": False, "initial_load_path": str(tmp_path / "tied-hf")})
        with pytest.raises(CheckpointError, match="differs from its embedding"):
            Trainer(cfg, dataloader=[])


def test_load_model_reads_every_export(runs):
    ids = sample_ids()
    for family, fmt in ROUND_TRIPS:
        model, args, tokenizer = load_model(out_path(runs["root"], family, fmt))
        assert args.family == family and (tokenizer is None) == (fmt == "rwkv")
        with torch.no_grad():
            torch.testing.assert_close(model(ids), reference(runs, family, fmt)(ids), rtol=1e-5, atol=1e-6)


# ---- fla's layouts, checked on CPU with fla's formulas (fla itself runs in the GPU test) -------

def fla_weights(runs, family: str) -> dict:
    from flame.export.formats import read_safetensors

    return read_safetensors(out_path(runs["root"], family, "fla"))


def lora(weights: dict, prefix: str, x: torch.Tensor, activation) -> torch.Tensor:
    """fla's LoRA module: Linear -> activation -> Linear (with its bias when it has one)."""
    hidden = activation(F.linear(x, weights[prefix + "lora.0.weight"]))
    return F.linear(hidden, weights[prefix + "lora.2.weight"], weights.get(prefix + "lora.2.bias"))


def test_fla_rwkv6_layout_gives_flames_token_mixes_and_decay(runs):
    """fla's data-dependent lerp (branches r, w, k, v, g; x_proj.2 read as [C, 5, r]) and its
    decay LoRA on the exported tensors equal flame's on flame's."""
    ours = runs["rwkv6"].model.layers[1].attn
    theirs = fla_weights(runs, "rwkv6")
    p = "model.layers.1.attn."
    x, previous = torch.randn(3, 64), torch.randn(3, 64)
    delta = previous - x
    with torch.no_grad():
        hidden = torch.tanh(F.linear(x + delta * theirs[p + "x_proj.0.mu"], theirs[p + "x_proj.0.linear.weight"]))
        rank = hidden.shape[-1] // 5
        mixes = torch.einsum("bnr,hnr->bnh", hidden.view(3, 5, rank), theirs[p + "x_proj.2.weight"].view(64, 5, rank))
        mixes = mixes + theirs[p + "x_bias"]
        xi = torch.tanh((x + delta * ours.mu_x) @ ours.mix_w1).view(3, 5, rank)
        for j, branch in enumerate("rwkvg"):
            flame_index = "wkvrg".index(branch)
            want = x + delta * (getattr(ours, f"mu_{branch}") + xi[:, flame_index] @ ours.mix_w2[flame_index])
            torch.testing.assert_close(x + delta * mixes[:, j], want, rtol=1e-5, atol=1e-6, msg=branch)
        xw = torch.randn(3, 64)
        torch.testing.assert_close(lora(theirs, p + "w_proj.linear.", xw, torch.tanh),
                                   ours.time_decay + torch.tanh(xw @ ours.decay_w1) @ ours.decay_w2)


def test_fla_rwkv7_layout_gives_flames_loras(runs):
    ours = runs["rwkv7"].model.layers[1].attn
    theirs = fla_weights(runs, "rwkv7")
    p = "model.layers.1.attn."
    x = torch.randn(3, 64)
    identity = torch.nn.Identity()
    with torch.no_grad():
        cases = {
            "w": (torch.tanh, ours.w0 + torch.tanh(x @ ours.w1) @ ours.w2),
            "a": (identity, ours.a0 + (x @ ours.a1) @ ours.a2),
            "v": (identity, ours.v0 + (x @ ours.v1) @ ours.v2),
            "g": (torch.sigmoid, torch.sigmoid(x @ ours.g1) @ ours.g2),
        }
        for name, (activation, want) in cases.items():
            torch.testing.assert_close(lora(theirs, p + f"{name}_lora.", x, activation), want, msg=name)
    assert theirs[p + "x_r"].shape == (1, 1, 64) and theirs["model.layers.1.ffn.x_k"].shape == (64,)
    assert "model.layers.0.attn.v_lora.lora.0.weight" not in theirs  # layer 0 has no value residual
    assert theirs[p + "g_norm.weight"].shape == (64,) and "lm_head.weight" in theirs


# ---- RWKV-LM's layout (the official code runs the .pth in test_target_code.py) -----------------

def test_rwkv_lm_layout_of_vectors_and_layer0_value_lora(runs):
    weights = torch.load(out_path(runs["root"], "rwkv7", "rwkv"), weights_only=True)
    assert weights["blocks.0.att.x_r"].shape == (1, 1, 64) and weights["blocks.1.ffn.x_k"].shape == (1, 1, 64)
    assert weights["blocks.0.att.w1"].shape == (64, 32) and weights["blocks.0.att.r_k"].shape == (2, 32)
    assert not weights["blocks.0.att.v1"].any()  # unused by RWKV-LM at layer 0, written as zeros


# ---- lm-evaluation-harness -------------------------------------------------------------------

def test_lm_eval_hflm_loglikelihood_equals_flames(runs):
    pytest.importorskip("lm_eval", reason="lm_eval is not installed (it is in the dev extra)")
    pytest.importorskip("accelerate", reason="lm_eval's HF model needs accelerate (lm_eval[hf])")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from flame.data import load_tokenizer

    folder = out_path(runs["root"], "rwkv7", "hf")
    lm = HFLM(pretrained=str(folder), trust_remote_code=True, batch_size=2, device="cpu", dtype="float32")
    requests = [("To be, or not", " to be, that is the question"), ("ROMEO:", " But soft, what light")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(requests)])
    tokenizer, model = load_tokenizer(str(runs["tokenizer"])), reference(runs, "rwkv7")
    for (context, continuation), (logprob, _) in zip(requests, got):
        whole, start = tokenizer.encode(context + continuation), len(tokenizer.encode(context))
        with torch.no_grad():
            logits = model(torch.tensor([whole]))[0].log_softmax(-1)
        want = sum(logits[t - 1, whole[t]].item() for t in range(start, len(whole)))
        assert logprob == pytest.approx(want, rel=1e-5)


# ---- a checkpoint saved by two processes -----------------------------------------------------

def two_rank_run(rank: int, root: str, tokenizer: str) -> None:
    """2 FSDP ranks train on the rows of the 1-process run and save step 3; rank 0 exports it;
    both then start a new run from that export (a sharded import) and save its step 0."""
    import torch.distributed as dist

    from flame.export.writer import export_checkpoint
    from flame.train.trainer import Trainer
    from tests.train.test_distributed import full_params

    root = Path(root)
    trainer = Trainer(run_config("rwkv7", root / "ranks2", Path(tokenizer)),
                      dataloader=batches(rows=slice(rank, rank + 1)))
    trainer.train()
    trained = full_params(trainer.model)
    if rank == 0:
        torch.save(trained, root / "ranks2.pt")
        export_checkpoint(root / "ranks2", root / "ranks2-hf")
    dist.barrier()
    cfg = run_config("rwkv7", root / "ranks2-continued", Path(tokenizer), model={"group_norm_eps": FLA_EPS["rwkv7"]},
                     checkpoint={"initial_load_path": str(root / "ranks2-hf")})
    continued = Trainer(cfg, dataloader=[])
    imported = full_params(continued.model)
    assert imported.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(imported[name], value), name
    continued.save_checkpoint()


def test_two_process_checkpoint_exports_the_same_weights(runs, tmp_path):
    """The export of a 2-rank checkpoint holds the weights the ranks held (every shard in its
    place); the same weights saved by 2 ranks and by 1 rank export bitwise equal (as fla folders:
    the continued runs compute with fla's GroupNorm eps)."""
    from flame.train.trainer import Trainer
    from tests.train.test_distributed import spawn

    spawn(two_rank_run, str(tmp_path), str(runs["tokenizer"]))
    gathered = torch.load(tmp_path / "ranks2.pt")
    _, exported, _ = read_exported(tmp_path / "ranks2-hf")
    assert_same_weights(gathered, exported, "2-rank export")
    cfg = run_config("rwkv7", tmp_path / "ranks1-continued", runs["tokenizer"],
                     model={"group_norm_eps": FLA_EPS["rwkv7"]}, checkpoint={"initial_load_path": str(tmp_path / "ranks2-hf")})
    Trainer(cfg, dataloader=[]).save_checkpoint()
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}-step0"
        assert export(tmp_path / f"ranks{ranks}-continued", out, "--step", "0", "--format", "fla") == 0
        _, weights, _ = read_exported(out)
        assert_same_weights(gathered, weights, f"{ranks}-rank checkpoint")


# ---- bad input: one line, nothing left behind ------------------------------------------------

def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def run_export(capsys, *args) -> tuple[int, str]:
    code = export(*args)
    err = capsys.readouterr().err.strip()
    return code, err


def test_checkpoint_without_complete_marker(runs, tmp_path, capsys):
    dump = tmp_path / "dump"
    shutil.copytree(runs["root"] / "rwkv7", dump)
    (dump / "checkpoint" / f"step-{STEPS}" / "COMPLETE").unlink()
    for source in (dump, dump / "checkpoint" / f"step-{STEPS}"):
        code, err = run_export(capsys, source, tmp_path / "out")
        assert code == 1 and "\n" not in err and "COMPLETE" in err, err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_missing_step(runs, tmp_path, capsys):
    code, err = run_export(capsys, runs["root"] / "rwkv7", tmp_path / "new" / "out", "--step", "7")
    assert code == 1 and "\n" not in err and "no checkpoint of step 7" in err and f"[{STEPS}]" in err
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite(runs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_export(capsys, runs["root"] / "gsa", out)
    assert code == 1 and "already exists" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"
    assert export(runs["root"] / "gsa", out, "--overwrite") == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert leftovers(tmp_path) == []


def test_gsa_has_no_rwkv_lm_format(runs, tmp_path, capsys):
    code, err = run_export(capsys, runs["root"] / "gsa", tmp_path / "gsa.pth", "--format", "rwkv")
    assert code == 1 and "RWKV6 and RWKV7 models only" in err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_nothing_and_keeps_the_old_output(runs, tmp_path, monkeypatch):
    from flame.export import writer

    out = tmp_path / "out"
    assert export(runs["root"] / "rwkv7", out) == 0
    before = (out / "model.safetensors").read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_safetensors", disk_full)
    assert export(runs["root"] / "gsa", out, "--overwrite") == 1
    assert (out / "model.safetensors").read_bytes() == before and leftovers(tmp_path) == []


def test_other_pth_is_a_clear_error(tmp_path):
    weights = {"emb.weight": torch.zeros(4, 8), "blocks.0.att.time_first": torch.zeros(8)}
    torch.save(weights, tmp_path / "rwkv5.pth")
    with pytest.raises(ExportError, match="RWKV-4/5"):
        read_exported(tmp_path / "rwkv5.pth")


def test_command_line_error_is_one_line_without_traceback(runs, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "flame.export", "--checkpoint", str(tmp_path / "nowhere"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"flame.export: error: checkpoint path {tmp_path / 'nowhere'} does not exist"]
