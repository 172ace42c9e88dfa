"""Inference tests run PyTorch on one CPU thread: their tensors are tiny, and on a shared machine
the threads of a small op cost more than they save."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
