"""The loader on known token streams (np.arange: a token's value is its position) and
end-to-end through datasets on local files and the embedded corpus."""

import json

import numpy as np
import pytest
import torch

from flame.data import DataError, DataLoader, build_dataloader, load_tokenizer
from flame.data.tokens import build_stream, split_indices

EOD = 10**9  # never a position of the arange streams


def arange_loader(n=1000, *, batch_size=2, seq_len=10, split="train", seed=0, rank=0, world=1, **kw):
    stream = np.arange(n, dtype=np.int64)
    return DataLoader([(stream, "range")], eod_id=EOD, batch_size=batch_size, seq_len=seq_len,
                      split=split, seed=seed, dp_rank=rank, dp_world_size=world, **kw)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def window_starts(batches):
    return [int(row[0]) for b in batches for row in b["input_ids"]]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A jsonl corpus of 60 short, distinct documents."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    docs = [f"Document number {i}: " + " ".join(["word"] * (i % 7 + 3)) + f" end{i}."
            for i in range(60)]
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path, docs


def test_packing_and_label_shift():
    batches = take(arange_loader(seq_len=10), 50)
    for b in batches:
        assert b["input_ids"].dtype == b["labels"].dtype == torch.long
        assert b["input_ids"].shape == b["labels"].shape == (2, 10)
        for row_in, row_lab in zip(b["input_ids"], b["labels"]):
            assert int(row_in[0]) % 10 == 0  # windows start at multiples of seq_len
            assert torch.equal(row_in, torch.arange(int(row_in[0]), int(row_in[0]) + 10))
            assert torch.equal(row_lab, row_in + 1)


def test_epochs_cover_every_window_once_and_reshuffle():
    loader = arange_loader(n=201, batch_size=4, seq_len=10)  # 20 windows = 5 batches per epoch
    starts = window_starts(take(loader, 10))
    first, second = starts[:20], starts[20:]
    assert sorted(first) == sorted(second) == list(range(0, 200, 10))
    assert first != second


def test_determinism_from_seed():
    a = window_starts(take(arange_loader(seed=3), 20))
    b = window_starts(take(arange_loader(seed=3), 20))
    c = window_starts(take(arange_loader(seed=4), 20))
    assert a == b
    assert a != c


def test_ranks_read_disjoint_parts():
    world, n = 3, 1001  # 100 windows: 33 per rank, one dropped
    per_rank = [set(window_starts(take(arange_loader(n=n, batch_size=3, rank=r, world=world), 11)))
                for r in range(world)]
    assert all(len(s) == 33 for s in per_rank)
    assert not (per_rank[0] & per_rank[1] or per_rank[0] & per_rank[2] or per_rank[1] & per_rank[2])


@pytest.mark.parametrize("stop", [1, 7, 10, 23])  # 10 batches per epoch: stops cross epochs
def test_exact_resume(stop):
    reference = take(arange_loader(n=201, batch_size=2, seed=5), 30)
    first = arange_loader(n=201, batch_size=2, seed=5)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoint-serializable
    resumed = arange_loader(n=201, batch_size=2, seed=5)
    resumed.load_state_dict(state)
    rest = take(resumed, 30 - stop)
    for expected, got in zip(reference[stop:], rest):
        assert torch.equal(expected["input_ids"], got["input_ids"])
        assert torch.equal(expected["labels"], got["labels"])


def test_validation_is_one_ordered_pass_each_time():
    loader = arange_loader(n=101, batch_size=3, seq_len=10, split="validation")
    passes = [window_starts(list(loader)) for _ in range(2)]
    assert passes[0] == passes[1] == list(range(0, 100, 10))
    assert len(loader) == 4  # 10 windows, batches of 3: the last one short
    assert list(loader)[-1]["input_ids"].shape == (1, 10)


def test_resume_with_other_rank_count_is_refused_unless_resplit():
    loader = arange_loader(world=2)
    take(loader, 3)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="ran on 2 data-parallel ranks, this run has 4"):
        arange_loader(world=4).load_state_dict(state)
    resplit = arange_loader(world=4, allow_dp_resplit=True)
    resplit.load_state_dict(state)
    # 2 ranks x 3 batches x 2 rows = the first 12 windows of the epoch -> 3 per rank of 4
    assert resplit.sources[0].position == 3
    seen = {int(w) for w in resplit.sources[0].order(0)[:12] * 10}
    after = set(window_starts(take(resplit, 5)))
    assert not seen & after


def test_resume_refuses_other_layout():
    state = arange_loader(seq_len=10).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        arange_loader(seq_len=20).load_state_dict(state)


def test_split_indices_partition_documents():
    train, val = split_indices(1000, 0.05, "train"), split_indices(1000, 0.05, "validation")
    assert len(val) == 50 and len(train) == 950
    assert set(train.tolist()).isdisjoint(val.tolist())
    assert len(split_indices(10, 0.01, "validation")) == 1  # at least one held out
    with pytest.raises(ValueError, match="validation split is empty"):
        split_indices(10, 0.0, "validation")


def test_eod_after_every_document():
    tokens = np.array([5, 6, 0, 7, 0, 8, 9, 9, 0], dtype=np.uint16)  # docs with EOD (0) appended
    offsets = np.array([0, 3, 5, 9])
    assert build_stream(tokens, offsets, np.array([0, 2]), 0).tolist() == [0, 5, 6, 0, 8, 9, 9, 0]


def test_end_to_end_local_jsonl(corpus, tokenizer):
    path, docs = corpus
    kwargs = dict(dataset="json", data_files=[str(path)], tokenizer=tokenizer, batch_size=2,
                  seq_len=8, seed=0, val_fraction=0.1)
    train_docs = split_indices(len(docs), 0.1, "train")
    val_docs = split_indices(len(docs), 0.1, "validation")
    expected = {}
    for split, indices in (("train", train_docs), ("validation", val_docs)):
        stream = [tokenizer.eod_id]
        for i in indices:
            stream += tokenizer.encode(docs[i]) + [tokenizer.eod_id]
        expected[split] = stream

    val = build_dataloader(split="validation", **kwargs)
    got = [t for b in val for t in b["input_ids"].flatten().tolist()]
    assert got == expected["validation"][:len(got)]
    assert len(got) == (len(expected["validation"]) - 1) // 8 * 8

    train = build_dataloader(split="train", **kwargs)
    stream = expected["train"]
    n_windows = (len(stream) - 1) // 8
    rows = [r for b in take(train, n_windows // 2) for r in zip(b["input_ids"].tolist(), b["labels"].tolist())]
    windows = {tuple(stream[i * 8:i * 8 + 9]) for i in range(n_windows)}
    for inputs, labels in rows:
        assert tuple(inputs + labels[-1:]) in windows
        assert labels[:-1] == inputs[1:]
    # the held-out documents never appear in training text
    train_text = tokenizer.decode(stream)
    for i in val_docs:
        assert f"end{i}." not in train_text and f"end{i}." in tokenizer.decode(expected["validation"])


def test_embedded_corpus_loader(tokenizer):
    train = build_dataloader(dataset="embedded", tokenizer=tokenizer, batch_size=4, seq_len=64,
                             split="train", seed=0)
    val = build_dataloader(dataset="embedded", tokenizer=tokenizer, batch_size=4, seq_len=64,
                           split="validation", seed=0)
    assert train.sources[0].num_windows > 20000  # ~1.5M tokens
    assert 0 < len(val) < 200
    batch = next(iter(train))
    assert batch["input_ids"].shape == (4, 64)
    assert int(batch["input_ids"].max()) < tokenizer.vocab_size
    eods = int((train.sources[0].stream == tokenizer.eod_id).sum())
    assert eods == 207 - 2 + 1  # one per training document plus the leading one


def test_missing_data_file_is_a_clear_error(tokenizer, tmp_path):
    with pytest.raises(DataError, match="no files match .*missing"):
        build_dataloader(dataset="json", data_files=[str(tmp_path / "missing*.jsonl")],
                         tokenizer=tokenizer, batch_size=1, seq_len=8)


def test_missing_text_field_and_empty_data(tokenizer, tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(DataError, match=r"field 'text' not found.*\['body'\]"):
        build_dataloader(dataset="json", data_files=[str(path)], tokenizer=tokenizer,
                         batch_size=1, seq_len=8)
    empty = tmp_path / "empty.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match="is empty"):
        build_dataloader(dataset="parquet", data_files=[str(empty)], tokenizer=tokenizer,
                         batch_size=1, seq_len=8)


def test_too_little_data_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one window"):
        arange_loader(n=30, seq_len=10, world=4)


def test_data_seed_sets_the_order_whatever_the_job_seed(corpus, tokenizer):
    from flame.config import Data, Training
    from flame.data import build_job_dataloader

    path, _ = corpus
    training = Training(batch_size=2, seq_len=8)

    def first_batches(data, job_seed):
        loader = build_job_dataloader(data, training, tokenizer=tokenizer, split="train", job_seed=job_seed)
        return torch.cat([b["input_ids"] for b in take(loader, 4)])

    pinned = Data(dataset="json", data_files=[str(path)], val_fraction=0.0, seed=7)
    assert torch.equal(first_batches(pinned, 1), first_batches(pinned, 2))
    following = Data(dataset="json", data_files=[str(path)], val_fraction=0.0)
    assert torch.equal(first_batches(following, 7), first_batches(pinned, 123))
    assert not torch.equal(first_batches(following, 1), first_batches(following, 2))
