"""The `hf` export (flame.export.hf, flame.export.writer) in transformers: from_pretrained,
generate, padding, tokenizer, sharding, dtype, tied heads, and lm-evaluation-harness."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flame.weights import WeightsError, read_exported
from tests.export.helpers import FAMILIES, export, out_path, reference, run_config, sample_ids, train_run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


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
        with pytest.raises(WeightsError, match="differs from its embedding"):
            Trainer(cfg, dataloader=[])


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
