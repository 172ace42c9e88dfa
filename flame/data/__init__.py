"""flame.data: the tokenizer, text sources, token streams and the resumable data loader."""

from flame.data.build import build_dataloader, build_job_dataloader
from flame.data.loader import DataLoader
from flame.data.errors import DataError
from flame.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["DataError", "DataLoader", "Tokenizer", "build_dataloader", "build_job_dataloader", "load_tokenizer"]
