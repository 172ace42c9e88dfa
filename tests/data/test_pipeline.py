"""The data pipeline: mixtures, varlen packing, pre-tokenized shards, hub errors, worker tokenization."""

import json

import numpy as np
import pytest
import torch

from flame.data import DataError, DataLoader, build_dataloader, load_tokenizer
from flame.data.loader import segment_bounds
from flame.data.prepare import main as prepare_main
from flame.data.shards import open_shards

EOD = 10**9


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa"]
    a = [" ".join(rng.choice(words, size=rng.integers(3, 60))) for _ in range(80)]
    b = [" ".join(rng.choice(["one", "two", "three"], size=rng.integers(3, 60))) for _ in range(80)]
    return write_jsonl(folder / "a.jsonl", a), write_jsonl(folder / "b.jsonl", b)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


# --- mixtures ---------------------------------------------------------------------------------

def mixture_loader(probs, seed=0, rank=0):
    streams = [(np.arange(0, 10_001, dtype=np.int64), "a"), (np.arange(100_000, 110_001, dtype=np.int64), "b")]
    return DataLoader(streams, eod_id=EOD, batch_size=8, seq_len=10, split="train", seed=seed,
                      dp_rank=rank, dp_world_size=2, probs=probs)


def test_mixture_follows_probs_deterministically():
    rows = [r for b in take(mixture_loader([0.8, 0.2]), 250) for r in b["input_ids"][:, 0].tolist()]
    share_a = np.mean([r < 100_000 for r in rows])
    assert abs(share_a - 0.8) < 0.03  # 2000 draws: 3 sigma ~ 0.027
    again = [r for b in take(mixture_loader([0.8, 0.2]), 250) for r in b["input_ids"][:, 0].tolist()]
    assert rows == again
    other_seed = [r for b in take(mixture_loader([0.8, 0.2], seed=1), 250) for r in b["input_ids"][:, 0].tolist()]
    assert rows != other_seed


def test_mixture_ranks_disjoint():
    seen = [{r for b in take(mixture_loader([0.5, 0.5], rank=k), 60) for r in b["input_ids"][:, 0].tolist()}
            for k in range(2)]
    assert not seen[0] & seen[1]


def test_mixture_exact_resume():
    reference = take(mixture_loader([0.3, 0.7]), 40)
    loader = mixture_loader([0.3, 0.7])
    take(loader, 17)
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = mixture_loader([0.3, 0.7])
    resumed.load_state_dict(state)
    assert_same_batches(reference[17:], take(resumed, 23))


def test_mixture_from_files(two_corpora, tokenizer):
    a, b = two_corpora
    loader = build_dataloader(sources=[str(a), str(b)], probs=[1, 0], tokenizer=tokenizer,
                              batch_size=4, seq_len=16, seed=0)
    assert [s.description for s in loader.sources] == [f"json:{a}/train", f"json:{b}/train"]
    text = tokenizer.decode(torch.cat([x["input_ids"].flatten() for x in take(loader, 10)]).tolist())
    assert "alpha" in text or "beta" in text
    assert "one" not in text and "two" not in text  # probability 0
    with pytest.raises(DataError, match="data.probs has 3 entries for 2 sources"):
        build_dataloader(sources=[str(a), str(b)], probs=[1, 1, 1], tokenizer=tokenizer,
                         batch_size=4, seq_len=16)


# --- varlen -----------------------------------------------------------------------------------

def test_segment_bounds_split_long_documents():
    assert segment_bounds(np.array([0, 5, 30]), 40, 8).tolist() == [0, 5, 13, 21, 29, 30, 38, 40]
    assert segment_bounds(np.array([3]), 10, 100).tolist() == [0, 3, 10]  # row starts mid-document


def varlen_batches(tokenizer, corpus, n, context_len=24, **kw):
    loader = build_dataloader(dataset="json", data_files=[str(corpus)], tokenizer=tokenizer,
                              batch_size=4, seq_len=16, seed=0, varlen=True,
                              context_len=context_len, **kw)
    return loader, take(loader, n)


def test_varlen_batches_respect_document_boundaries(two_corpora, tokenizer):
    _, batches = varlen_batches(tokenizer, two_corpora[0], 30)
    eod = tokenizer.eod_id
    for b in batches:
        inputs, labels, cu = b["input_ids"][0], b["labels"][0], b["cu_seqlens"].long()
        assert inputs.shape == labels.shape == (64,) and b["input_ids"].shape == (1, 64)
        assert cu[0] == 0 and cu[-1] == 64 and (cu.diff() > 0).all() and (cu.diff() <= 24).all()
        assert torch.equal(labels[:-1], inputs[1:])
        starts = set(cu[:-1].tolist())
        for p in torch.nonzero(inputs == eod).flatten().tolist():
            assert p in starts  # every document starts a segment (its EOD is the first input)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert not (inputs[s + 1:e] == eod).any()  # no input from a second document
            assert torch.equal(b["position_ids"][0, s:e], torch.arange(e - s))
        # the last real token of a document predicts EOD
        for p in torch.nonzero(labels == eod).flatten().tolist():
            assert p + 1 == 64 or p + 1 in starts


def test_varlen_resume(two_corpora, tokenizer):
    _, reference = varlen_batches(tokenizer, two_corpora[0], 12)
    loader, _ = varlen_batches(tokenizer, two_corpora[0], 5)
    state = loader.state_dict()
    resumed, _ = varlen_batches(tokenizer, two_corpora[0], 0)
    resumed.load_state_dict(state)
    assert_same_batches(reference[5:], take(resumed, 7))


BACKENDS = [
    pytest.param("torch", "cpu", torch.float64, 1e-10, 1e-6, id="torch-cpu-fp64"),
    pytest.param("triton", "cuda", torch.float32, 1e-4, 1e-3, id="triton-gpu-fp32",
                 marks=pytest.mark.gpu),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend, device, dtype, loss_tol, grad_tol", BACKENDS)
@pytest.mark.parametrize("family", ["rwkv6", "rwkv7", "gsa"])
def test_varlen_equals_documents_alone(family, backend, device, dtype, loss_tol, grad_tol,
                                       two_corpora, tokenizer):
    """Per-document losses and gradients of a packed varlen row equal those of each document
    (segment) run alone through the model: PyTorch backend in float64 on the CPU, the Triton
    kernels in float32 on a GPU. grad_tol is relative to each gradient tensor's scale (GSA's
    output norm reduces in fp32 even in a float64 model)."""
    from flame.config.job import Model
    from flame.models import build_model

    _, batches = varlen_batches(tokenizer, two_corpora[0], 3, context_len=20)
    batch = max(batches, key=lambda b: len(b["cu_seqlens"]))  # the most segments
    batch = {k: v.to(device) for k, v in batch.items()}
    cu = batch["cu_seqlens"].tolist()
    assert len(cu) >= 4
    torch.manual_seed(0)
    model = build_model(Model(family=family, vocab_size=tokenizer.vocab_size, hidden_size=32,
                              num_layers=2, head_dim=16, num_heads=2, num_slots=8,
                              backend=backend)).to(device=device, dtype=dtype)
    with torch.no_grad():  # leave the init, whose zeroed output projections hide the context
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))

    def losses(logits, labels):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(),
                                                 reduction="none")

    packed = losses(model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"]), batch["labels"])
    packed_doc = torch.stack([packed[s:e].sum() for s, e in zip(cu[:-1], cu[1:])])
    packed_doc.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    alone_doc = torch.stack([
        losses(model(batch["input_ids"][:, s:e]), batch["labels"][:, s:e]).sum()
        for s, e in zip(cu[:-1], cu[1:])
    ])
    alone_doc.sum().backward()
    torch.testing.assert_close(packed_doc, alone_doc, rtol=loss_tol, atol=loss_tol)
    assert packed_grads
    for n, p in model.named_parameters():
        if n in packed_grads:
            error = (packed_grads[n] - p.grad).abs().max()
            assert error <= grad_tol * p.grad.abs().max() + 1e-12, (n, float(error))
    # and packing without cu_seqlens would differ: the checks above can fail
    leaked = losses(model(batch["input_ids"]), batch["labels"])
    assert not torch.allclose(leaked, packed, rtol=loss_tol, atol=loss_tol)


# --- shards -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shard_dir(two_corpora, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    a, b = two_corpora
    prepare_main(["--config", "configs/tiny.toml", "--out", str(out), "--data.sources",
                  f"{a},{b}", "--data.val_fraction", "0.1"])
    return out


def test_prepare_writes_manifest_and_index(shard_dir, tokenizer):
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    assert [s["documents"] for s in manifest["sources"]] == [{"train": 72, "validation": 8}] * 2
    tokens = np.memmap(shard_dir / "source0-train.bin", dtype=np.uint16, mode="r")
    starts = np.load(shard_dir / "source0-train.idx.npy")
    assert len(tokens) == manifest["sources"][0]["tokens"]["train"]
    assert tokens[0] == tokenizer.eod_id and (tokens[starts - 1] == tokenizer.eod_id).all()
    assert int((tokens == tokenizer.eod_id).sum()) == 73


@pytest.mark.parametrize("split", ["train", "validation"])
def test_shards_equal_raw_text(shard_dir, two_corpora, tokenizer, split):
    kwargs = dict(sources=[str(p) for p in two_corpora], probs=[0.5, 0.5], tokenizer=tokenizer,
                  batch_size=2, seq_len=16, seed=7, val_fraction=0.1, split=split)
    raw, sharded = build_dataloader(**kwargs), build_dataloader(shard_dir=str(shard_dir), **kwargs)
    n = 15 if split == "train" else len(raw)
    assert_same_batches(take(raw, n), take(sharded, n))


def test_shards_exact_resume(shard_dir, tokenizer):
    kwargs = dict(shard_dir=str(shard_dir), tokenizer=tokenizer, batch_size=3, seq_len=16,
                  seed=1, val_fraction=0.1, probs=[0.2, 0.8])
    reference = take(build_dataloader(**kwargs), 30)
    loader = build_dataloader(**kwargs)
    take(loader, 11)
    resumed = build_dataloader(**kwargs)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert_same_batches(reference[11:], take(resumed, 19))


def test_shards_of_another_tokenizer_are_refused(shard_dir, tmp_path):
    from flame.data.tokenizer import EMBEDDED_TOKENIZER

    data = json.loads(EMBEDDED_TOKENIZER.read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]  # a different tokenizer, same size
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    other = load_tokenizer(str(path))
    with pytest.raises(DataError, match="were made with the tokenizer .*Re-create them"):
        open_shards(shard_dir, other, "train")


def test_missing_or_mismatched_shards(shard_dir, tokenizer, tmp_path):
    with pytest.raises(DataError, match="no shard manifest .*flame.data.prepare"):
        open_shards(tmp_path, tokenizer, "train")
    with pytest.raises(DataError, match="hold out val_fraction = 0.1, this run asks for 0.01"):
        open_shards(shard_dir, tokenizer, "train", 0.01)


def test_prepare_refuses_model_vocab_mismatch(tmp_path, capsys):
    with pytest.raises(SystemExit, match="model.vocab_size is 100"):
        prepare_main(["--config", "configs/tiny.toml", "--out", str(tmp_path), "--model.vocab_size", "100"])


# --- sources ----------------------------------------------------------------------------------

def test_hub_dataset_offline_is_a_clear_error():
    """In a fresh process: huggingface_hub and datasets read HF_HUB_OFFLINE once, at import, as a
    user's run does; in a process that imported them earlier they would retry the network first."""
    import os
    import subprocess
    import sys

    script = (
        "from flame.data import DataError, build_dataloader, load_tokenizer\n"
        "try:\n"
        "    build_dataloader(dataset='flame-test/does-not-exist-anywhere', tokenizer=load_tokenizer(),\n"
        "                     batch_size=1, seq_len=8)\n"
        "except DataError as err:\n"
        "    print(err)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert "not in the local cache and there is no network; download it first" in proc.stdout, (
        proc.stdout + proc.stderr[-2000:])


def test_text_and_parquet_files(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(f"line one of file {i}\nline two\n" * 20)
    loader = build_dataloader(dataset=str(tmp_path / "*.txt"), tokenizer=tokenizer, batch_size=1,
                              seq_len=8, val_fraction=0)
    assert int((loader.sources[0].stream == tokenizer.eod_id).sum()) == 4  # one document per file
    pq.write_table(pa.table({"content": [f"parquet document {i} " * 10 for i in range(5)]}),
                   tmp_path / "d.parquet")
    loader = build_dataloader(dataset="parquet", data_files=[str(tmp_path / "*.parquet")],
                              text_field="content", tokenizer=tokenizer, batch_size=1, seq_len=8,
                              val_fraction=0)
    assert "parquet document 3" in tokenizer.decode(loader.sources[0].stream.tolist())


def test_worker_processes_tokenize_identically(two_corpora, tokenizer):
    from flame.data.sources import load_documents
    from flame.data.tokens import ids_to_numpy, tokenize_dataset, token_dtype

    import datasets

    ds, field, _ = load_documents(str(two_corpora[1]))
    datasets.disable_caching()  # really run both, not load one from the other's cache
    try:
        one = tokenize_dataset(ds, field, tokenizer, num_workers=0)
        two = tokenize_dataset(ds, field, tokenizer, num_workers=2)
    finally:
        datasets.enable_caching()
    assert len(two.cache_files) == 2  # written by two worker processes
    dtype = token_dtype(tokenizer.vocab_size)
    for x, y in zip(ids_to_numpy(one.data.column("ids"), dtype), ids_to_numpy(two.data.column("ids"), dtype)):
        assert np.array_equal(x, y)


# --- streaming --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def numbered_corpus(tmp_path_factory):
    """Documents "<k> w w w ..." whose number can be read back from decoded windows."""
    rng = np.random.default_rng(1)
    docs = [f"<{k}> " + " ".join(["la"] * int(rng.integers(2, 30))) for k in range(120)]
    return write_jsonl(tmp_path_factory.mktemp("numbered") / "docs.jsonl", docs)


def stream_loader(tokenizer, corpus, *, split="train", rank=0, world=1, seed=0, **kw):
    return build_dataloader(dataset="json", data_files=[str(corpus)], streaming=True,
                            tokenizer=tokenizer, batch_size=2, seq_len=16, split=split, seed=seed,
                            dp_rank=rank, dp_world_size=world, val_fraction=0.1, **kw)


def doc_numbers(tokenizer, batches):
    import re

    text = tokenizer.decode(torch.cat([b["input_ids"].flatten() for b in batches]).tolist())
    return {int(m) for m in re.findall(r"<(\d+)>", text)}


def test_streaming_splits_and_ranks_are_disjoint(numbered_corpus, tokenizer):
    from flame.data.streaming import is_validation

    val = doc_numbers(tokenizer, list(stream_loader(tokenizer, numbered_corpus, split="validation")))
    expected_val = {k for k in range(120) if is_validation(k, 0.1)}
    assert 8 <= len(expected_val) <= 16 and val <= expected_val and len(val) >= len(expected_val) - 1
    ranks = [doc_numbers(tokenizer, take(stream_loader(tokenizer, numbered_corpus, rank=r, world=2), 20))
             for r in range(2)]
    assert ranks[0] and ranks[1]
    assert not ranks[0] & ranks[1] and not (ranks[0] | ranks[1]) & expected_val
    assert all(k % 2 == 0 for k in ranks[0]) and all(k % 2 == 1 for k in ranks[1])


def test_streaming_packs_with_eod(numbered_corpus, tokenizer):
    from flame.data.streaming import is_validation

    docs = [json.loads(line)["text"] for line in numbered_corpus.read_text().splitlines()]
    expected = [tokenizer.eod_id]
    for k, doc in enumerate(docs):
        if is_validation(k, 0.1):
            expected += tokenizer.encode(doc) + [tokenizer.eod_id]
    batches = list(stream_loader(tokenizer, numbered_corpus, split="validation"))
    inputs = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert inputs.flatten().tolist() == expected[:inputs.numel()]
    assert inputs.numel() == (len(expected) - 1) // 16 * 16


@pytest.mark.parametrize("stop", [3, 40])  # 40 batches cross the end of the stream (an epoch)
def test_streaming_exact_resume(numbered_corpus, tokenizer, stop):
    reference = take(stream_loader(tokenizer, numbered_corpus, seed=2), stop + 10)
    loader = stream_loader(tokenizer, numbered_corpus, seed=2)
    take(loader, stop)
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = stream_loader(tokenizer, numbered_corpus, seed=2)
    resumed.load_state_dict(state)
    assert_same_batches(reference[stop:], take(resumed, 10))
    other_seed = take(stream_loader(tokenizer, numbered_corpus, seed=3), stop + 10)
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(reference, other_seed))


def test_streaming_missing_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ["a b c"] * 20, field="body")
    with pytest.raises(DataError, match="field 'text' not found"):
        take(stream_loader(tokenizer, path), 1)


def test_hub_path_with_a_local_dataset_folder(tmp_path, tokenizer):
    """A name without a file extension goes through the hub branch (load_dataset(name, config,
    split=...)); a local folder of data files answers it without any network."""
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [f"train document {i} " * 5 for i in range(30)])
    write_jsonl(folder / "test.jsonl", [f"test document {i} " * 5 for i in range(30)])
    for split, word in (("train", "train"), ("test", "test")):
        loader = build_dataloader(dataset=str(folder), dataset_split=split, tokenizer=tokenizer,
                                  batch_size=1, seq_len=8, val_fraction=0)
        assert loader.sources[0].description == f"hub:{folder}[{split}]/train"
        text = tokenizer.decode(loader.sources[0].stream.tolist())
        assert f"{word} document 29" in text and ("test" in text) == (word == "test")
    with pytest.raises(DataError, match="cannot load HF dataset"):
        build_dataloader(dataset=str(folder), dataset_split="nope", tokenizer=tokenizer,
                         batch_size=1, seq_len=8)


class BigVocabTokenizer:
    """A character tokenizer with ids above 65535: its shards must be uint32."""

    vocab_size, eod_id, source, fingerprint = 70_000, 69_999, "big-vocab", "big-vocab-v1"

    def encode_batch(self, texts):
        return [[66_000 + ord(c) % 1000 for c in t] for t in texts]


def test_uint32_shards_for_big_vocabularies(two_corpora, tmp_path):
    from flame.data.shards import write_shards

    tok = BigVocabTokenizer()
    manifest = write_shards(tmp_path, [str(two_corpora[0])], tok, val_fraction=0.1, log=lambda *_: None)
    assert manifest["dtype"] == "uint32"
    (stream, _), = open_shards(tmp_path, tok, "train", 0.1)
    assert stream.dtype == np.uint32 and stream[0] == 69_999 and stream[1:].max() == 69_999
    assert stream[1:][stream[1:] != 69_999].min() >= 66_000
