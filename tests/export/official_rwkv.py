"""Logits of RWKV-LM `.pth` files computed by the official `rwkv` package (strategy "cpu fp32").

It runs in a process of its own: the package picks its RWKV6 or RWKV7 code from an environment
variable read at import (so it is imported once per family here), and sets torch's global flags
(TF32, cuDNN benchmark, the JIT's autocast) when imported.

`python -m tests.export.official_rwkv TOKENS OUT FAMILY:PTH [FAMILY:PTH ...]`: TOKENS is a
comma-separated list of token ids; OUT receives `torch.save({pth: logits [T, vocab] fp32})`.
"""

from __future__ import annotations

import importlib
import os
import sys


def main(argv: list[str]) -> int:
    tokens, out, *models = argv
    os.environ["RWKV_JIT_ON"] = "0"  # plain modules for RWKV6 (the package scripts its RWKV7 code regardless)
    os.environ["RWKV_CUDA_ON"] = "0"  # no CUDA kernel to compile: the package's PyTorch code on the CPU
    import torch

    ids = [int(token) for token in tokens.split(",")]
    logits = {}
    for family in ("rwkv6", "rwkv7"):
        paths = [model.split(":", 1)[1] for model in models if model.split(":", 1)[0] == family]
        if not paths:
            continue
        os.environ["RWKV_V7_ON"] = "1" if family == "rwkv7" else "0"
        package = importlib.reload(importlib.import_module("rwkv.model"))
        for path in paths:
            model = package.RWKV(path.removesuffix(".pth"), "cpu fp32")  # the package appends .pth
            output, _ = model.forward(ids, None, full_output=True)
            logits[path] = output.float()
    torch.save(logits, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
