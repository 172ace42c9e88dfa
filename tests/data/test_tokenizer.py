import json
from pathlib import Path

import pytest

from flame.data import DataError, load_tokenizer
from flame.data.tokenizer import EMBEDDED_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_embedded_tokenizer_has_8192_tokens_and_eod(tokenizer):
    assert tokenizer.vocab_size == 8192
    assert tokenizer.backend.id_to_token(tokenizer.eod_id) == "<|endoftext|>"
    assert max(tokenizer.backend.get_vocab(with_added_tokens=True).values()) == 8191


@pytest.mark.parametrize("text", [
    "To be, or not to be: that is the question.",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "Ünïcödé, emoji \U0001F600 and 漢字 survive the byte-level round trip",
    "",
])
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.eod_id not in ids
    assert tokenizer.decode(ids) == text


def test_bpe_merges_common_words(tokenizer):
    # a trained BPE, not a byte fallback: frequent words are single tokens
    assert len(tokenizer.encode(" the king")) == 2


def test_path_and_directory_forms(tmp_path, tokenizer):
    by_file = load_tokenizer(str(EMBEDDED_DIR / "tokenizer.json"))
    by_dir = load_tokenizer(str(EMBEDDED_DIR))
    assert by_file.fingerprint == by_dir.fingerprint == tokenizer.fingerprint
    # a HF directory whose tokenizer_config.json names the EOS token
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    data = json.loads((EMBEDDED_DIR / "tokenizer.json").read_text())
    data["added_tokens"].append({"id": 8192, "content": "<eos>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": True})
    (hf_dir / "tokenizer.json").write_text(json.dumps(data))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    hf = load_tokenizer(str(hf_dir))
    assert hf.eod_id == 8192
    assert hf.vocab_size == 8193  # added tokens count


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="tokenizer file .*nope.json does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_tokenizer_without_eod_is_refused(tmp_path):
    data = json.loads((EMBEDDED_DIR / "tokenizer.json").read_text())
    data["added_tokens"] = []
    del data["model"]["vocab"]["<|endoftext|>"]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no end-of-document token"):
        load_tokenizer(str(path))


def test_model_vocab_smaller_than_the_tokenizer_is_an_error(tokenizer):
    tokenizer.check_vocab_size(8192)
    tokenizer.check_vocab_size(32000)  # a padded vocabulary: extra rows are never a label
    with pytest.raises(ValueError, match="model.vocab_size is 8000 .* 8192 tokens"):
        tokenizer.check_vocab_size(8000)


def test_rwkv_world_tokenizer_round_trips_and_ends_documents_with_zero(tmp_path):
    pytest.importorskip("rwkv")
    world = load_tokenizer("rwkv-world")
    assert (world.vocab_size, world.eod_id) == (65536, 0)
    text = "def f(x):\n    return x ** 2  # squares ünïcode 中文\n"
    ids = world.encode(text)
    assert ids and all(1 <= i <= 65529 for i in ids)
    assert world.decode(ids) == text
    assert world.encode_batch([text, "a"]) == [ids, world.encode("a")]
    world.check_vocab_size(65536)
    with pytest.raises(DataError, match="65536"):
        world.check_vocab_size(32000)
    # the same vocabulary file named by path is the same tokenizer
    import rwkv

    vocab = Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"
    assert load_tokenizer(str(vocab)).fingerprint == world.fingerprint
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "rwkv_vocab_v20230424.txt"))
    # pickled as its vocabulary file (worker processes, the datasets cache key), not as its trie
    import pickle

    data = pickle.dumps(world)
    assert len(data) < 1000 and pickle.loads(data).encode(text) == ids
