"""bench/rwkvlm.py's pieces that need neither a GPU nor RWKV-LM: the arguments it hands RWKV-LM's
code, its stand-in for DeepSpeed's bf16 optimizer, and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import rwkvlm

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "rwkv7_rwkvlm_demo.toml")


def test_the_demo_config_gives_rwkv_lms_demo_arguments():
    cfg = rwkvlm.job_config(CONFIG, [])
    args = rwkvlm.rwkvlm_args(cfg.model, cfg.training, cfg.optimizer, cfg.lr_scheduler, 2000)
    assert (args.n_layer, args.n_embd, args.head_size, args.vocab_size) == (12, 768, 64, 65536)
    assert (args.ctx_len, args.micro_bsz, args.real_bsz, args.grad_cp) == (512, 16, 16, 0)
    assert (args.lr_init, args.lr_final, args.warmup_steps) == (6e-4, 6e-5, 10)
    assert (args.betas, args.adam_eps, args.weight_decay, args.grad_clip) == ((0.9, 0.99), 1e-18, 0.001, 1.0)
    assert args.my_exit_tokens == 2000 * 512 * 16


def test_a_missing_checkout_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAME_RWKVLM_DIR", str(tmp_path))
    with pytest.raises(rwkvlm.RwkvLmMissing, match="FLAME_RWKVLM_DIR"):
        rwkvlm.rwkvlm_dir()


def test_master_weight_adamw_is_adamw_on_fp32_masters_of_a_bf16_model():
    torch.manual_seed(0)
    decayed, free = torch.nn.Parameter(torch.randn(16, 8).bfloat16()), torch.nn.Parameter(torch.randn(8).bfloat16())
    groups = [{"params": [free], "weight_decay": 0.0, "my_lr_scale": 2.0},
              {"params": [decayed], "weight_decay": 0.1, "my_lr_scale": 1.0}]
    optimizer = rwkvlm.MasterWeightAdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-18,
                                         bias_correction=True, adam_w_mode=True, amsgrad=False)
    optimizer.grad_clip = 1.0
    for group in optimizer.param_groups:
        group["lr"] = 1e-2 * group["my_lr_scale"]
    reference = [p.detach().float().clone().requires_grad_() for p in (free, decayed)]
    check = torch.optim.AdamW([{"params": [reference[0]], "weight_decay": 0.0, "lr": 2e-2},
                               {"params": [reference[1]], "weight_decay": 0.1, "lr": 1e-2}],
                              betas=(0.9, 0.99), eps=1e-18)
    for _ in range(3):
        grads = [torch.randn(p.shape).bfloat16() * 3 for p in (free, decayed)]
        for p, r, g in zip((free, decayed), reference, grads):
            p.grad, r.grad = g.clone(), g.float()
        norm = optimizer.step()
        assert norm == pytest.approx(torch.nn.utils.clip_grad_norm_(reference, 1.0).item(), rel=1e-6)
        check.step()
        for p, r in zip((free, decayed), reference):
            assert p.grad is None
            assert torch.equal(p.detach(), r.detach().bfloat16())
    masters = optimizer.masters()
    torch.testing.assert_close(masters[0], reference[0].detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(masters[1], reference[1].detach(), rtol=1e-6, atol=1e-7)


def test_report_compares_the_last_tenth_and_draws_the_curves(tmp_path):
    pytest.importorskip("matplotlib")
    for name, offset in (("a", 0.0), ("b", 0.5)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "loss": 10.0 / s + offset, "tokens": 100 * s, "tokens_per_s_per_device": 1000.0}
                for s in range(1, 101)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = tmp_path / "curves.png"
    table = rwkvlm.report([tmp_path / "a", tmp_path / "b"], png, max_step=50)
    expected = sum(10.0 / s for s in range(46, 51)) / 5
    assert f"| a | 50 | 5,000 | {expected:.4f} | 1,000 |" in table
    assert f"| b | 50 | 5,000 | {expected + 0.5:.4f} |" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
