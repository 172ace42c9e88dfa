"""Loading the tokenizer: the embedded one, a tokenizer.json file, a HF tokenizer directory, or
the RWKV World tokenizer (the vocabulary of RWKV-LM and the official RWKV models)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from flame.data.errors import DataError

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
EMBEDDED_TOKENIZER = EMBEDDED_DIR / "tokenizer.json"

# End-of-document tokens recognised by name when a tokenizer directory does not name its EOS.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class Tokenizer:
    """A `tokenizers.Tokenizer` with the end-of-document id and the full vocabulary size.

    `encode` never adds the tokenizer's own special tokens (BOS/EOS post-processing); the data
    pipeline appends `eod_id` after every document itself.
    """

    def __init__(self, backend, eod_id: int, source: str):
        self.backend = backend
        self.eod_id = int(eod_id)
        self.source = source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(backend.to_str().encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def check_vocab_size(self, model_vocab_size: int) -> None:
        """Raise DataError unless the model's vocabulary holds every id of this tokenizer. A larger
        model vocabulary is a padded one (e.g. rounded up to a multiple of 64 for the head's matmul,
        or a benchmark at a standard size): its extra rows are never a label."""
        if int(model_vocab_size) < self.vocab_size:
            raise DataError(
                f"model.vocab_size is {model_vocab_size} but the tokenizer {self.source} has "
                f"{self.vocab_size} tokens (added tokens included); set model.vocab_size >= "
                f"{self.vocab_size}"
            )

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


RWKV_WORLD = "rwkv-world"
"""`data.tokenizer` value of the RWKV World tokenizer that the `rwkv` package ships."""
RWKV_WORLD_VOCAB_SIZE = 65536
"""The model vocabulary of RWKV-LM's World models: ids 1-65529 are the vocabulary file's, 0 is the
end of document, the rest is padding."""


class RwkvWorldTokenizer(Tokenizer):
    """The RWKV World tokenizer: greedy longest match over the UTF-8 bytes of the text, from a
    `rwkv_vocab_v*.txt` file, through the `rwkv` package's TRIE_TOKENIZER (as RWKV-LM tokenizes
    its data). Id 0 ends a document."""

    def __init__(self, vocab_file: Path, source: str):
        try:
            from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
        except ImportError as err:
            raise DataError(
                f"data.tokenizer = {source!r} needs the rwkv package (pip install rwkv): {err}"
            ) from err
        self.vocab_file = vocab_file
        self.backend = TRIE_TOKENIZER(str(vocab_file))
        self.eod_id = 0
        self.source = source
        self.vocab_size = RWKV_WORLD_VOCAB_SIZE
        self.fingerprint = hashlib.sha256(vocab_file.read_bytes()).hexdigest()

    def __reduce__(self):
        # Rebuilt from its vocabulary file: worker processes get it cheaply, and `datasets` hashes
        # the same tokenizer to the same fingerprint (so its tokenization cache is reused).
        return (type(self), (self.vocab_file, self.source))

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.backend.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return self.backend.decodeBytes(list(ids)).decode("utf-8", errors="replace")


def rwkv_world_vocab_file(path: str) -> Path | None:
    """The vocabulary file that `path` names as the RWKV World tokenizer, or None: "rwkv-world"
    (the file the `rwkv` package ships) or a path to a `rwkv_vocab_*.txt` file."""
    if path == RWKV_WORLD:
        try:
            import rwkv
        except ImportError as err:
            raise DataError(f"data.tokenizer = {RWKV_WORLD!r} needs the rwkv package (pip install rwkv)") from err
        return Path(rwkv.__file__).resolve().parent / "rwkv_vocab_v20230424.txt"
    name = Path(path).name
    if name.startswith("rwkv_vocab_") and name.endswith(".txt"):
        if not Path(path).is_file():
            raise DataError(f"RWKV World vocabulary file {path} does not exist")
        return Path(path)
    return None


def load_tokenizer(path: str = "") -> Tokenizer:
    """Load a tokenizer: "" is the embedded one; "rwkv-world" or a `rwkv_vocab_*.txt` path is the
    RWKV World tokenizer; else a tokenizer.json or a directory holding one.

    A directory's tokenizer_config.json names the end-of-document token (`eos_token`); otherwise
    the first of EOD_CANDIDATES present in the vocabulary is used.
    """
    world_vocab = rwkv_world_vocab_file(path) if path else None
    if world_vocab is not None:
        return RwkvWorldTokenizer(world_vocab, path)

    from tokenizers import Tokenizer as Backend

    file = Path(path) if path else EMBEDDED_TOKENIZER
    eos_name = None
    if file.is_dir():
        config = file / "tokenizer_config.json"
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            eos_name = eos.get("content") if isinstance(eos, dict) else eos
        file = file / "tokenizer.json"
        if not file.is_file():
            raise DataError(f"tokenizer directory {path} has no tokenizer.json")
    elif not file.is_file():
        raise DataError(
            f"tokenizer file {file} does not exist (data.tokenizer takes a tokenizer.json path, a "
            "HF tokenizer directory, or '' for the embedded tokenizer)"
        )
    try:
        backend = Backend.from_file(str(file))
    except Exception as err:
        raise DataError(f"{file} is not a valid tokenizers JSON file: {err}") from err

    for name in ([eos_name] if eos_name else []) + list(EOD_CANDIDATES):
        eod_id = backend.token_to_id(name)
        if eod_id is not None:
            return Tokenizer(backend, eod_id, str(file))
    raise DataError(
        f"tokenizer {file} has no end-of-document token: looked for "
        f"{', '.join(([eos_name] if eos_name else []) + list(EOD_CANDIDATES))}"
    )
