"""bench/rwkvlm.py's pieces that need no GPU: the arguments and environment it hands RWKV-LM's
trainer of each family beside RWKV-LM's demo scripts, its stand-in for DeepSpeed's bf16 optimizer
and the report; with an RWKV-LM checkout and pytorch_lightning, RWKV-LM's own x060 model,
parameter groups and LR schedule on the CPU beside flame's RWKV6."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch

from bench import rwkvlm
from flame.models import build_model
from flame.ops import naive_rwkv6
from flame.train.lr_schedule import build_lr_scheduler
from flame.train.optimizer import build_optimizer
from flame.weights.load import build_with_weights
from flame.weights.rwkv_names import from_rwkv, model_args_from_rwkv, to_rwkv

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {family: str(REPO / "configs" / f"{family}_rwkvlm_demo.toml") for family in rwkvlm.GENERATIONS}

# RWKV-LM 524481d, `{folder}/demo-training-run.sh` (the `python train.py` line, its shell variables
# substituted): the flags whose values the harness hands RWKV-LM's code; for rwkv6 the script of
# RWKV-v5 run with MODEL_TYPE="x060". Then `{folder}/train.py`'s argparse defaults for the
# arguments its code reads that the script does not set.
DEMO_FLAGS = {
    "rwkv7": {"n_layer": "12", "n_embd": "768", "ctx_len": "512", "micro_bsz": "16", "lr_init": "6e-4",
              "lr_final": "6e-5", "warmup_steps": "10", "beta1": "0.9", "beta2": "0.99", "adam_eps": "1e-18",
              "vocab_size": "65536", "weight_decay": "0.001", "head_size": "64", "precision": "bf16",
              "train_stage": "3", "head_chunk": "0"},
    "rwkv6": {"n_layer": "12", "n_embd": "768", "ctx_len": "512", "micro_bsz": "16", "lr_init": "6e-4",
              "lr_final": "6e-5", "warmup_steps": "10", "beta1": "0.9", "beta2": "0.99", "adam_eps": "1e-18",
              "vocab_size": "65536", "weight_decay": "0.001", "head_size_a": "64", "precision": "bf16",
              "my_pile_stage": "3", "pre_ffn": "0", "head_qk": "0", "my_pile_edecay": "0"},
}
TRAIN_PY_DEFAULTS = {
    "rwkv7": {"grad_clip": "1.0"},
    "rwkv6": {"grad_clip": "1.0", "head_size_divisor": "8", "layerwise_lr": "1", "weight_decay_final": "-1",
              "dropout": "0", "tiny_att_dim": "0", "tiny_att_layer": "-999", "my_pos_emb": "0", "my_qa_mask": "0",
              "my_random_steps": "0", "my_exit": "99999999", "train_type": ""},
}
ENVIRONMENT = {  # what each train.py sets before it imports its model (demo flags, JIT on)
    "rwkv7": {"RWKV_MY_TESTING": "x070", "RWKV_KERNEL": "@rwkv3", "RWKV_CTXLEN": "512", "RWKV_HEAD_SIZE": "64",
              "RWKV_HEAD_L2WRAP_CE_CHUNK": "0", "RWKV_FLOAT_MODE": "bf16", "RWKV_JIT_ON": "1"},
    "rwkv6": {"RWKV_MY_TESTING": "x060", "RWKV_CTXLEN": "512", "RWKV_HEAD_SIZE_A": "64", "RWKV_TRAIN_TYPE": "",
              "RWKV_FLOAT_MODE": "bf16", "RWKV_JIT_ON": "1"},
}


def checkout(family: str) -> Path:
    """`family`'s train.py folder of the RWKV-LM checkout; skips without one."""
    try:
        return rwkvlm.rwkvlm_dir(family)
    except rwkvlm.RwkvLmMissing as err:
        pytest.skip(str(err))


def demo_flags(script: str) -> dict[str, str]:
    """The `--flag value` pairs of a demo script's `python train.py` command (up to a comment), its
    `NAME="value"` variables substituted."""
    variables = dict(re.findall(r'^(\w+)="?([^"\s]*)"?', script, flags=re.M))
    command = script[script.index("python train.py"):]
    command = re.sub(r"\\\n", " ", command).split("\n")[0].split(" #")[0]
    pairs = re.findall(r"--(\w+) (\S+)", command)
    return {name: re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], value).strip('"') for name, value in pairs}


def argparse_defaults(train_py: str) -> dict[str, str]:
    """`--name`: default of each `parser.add_argument` of a train.py, as written there."""
    found = re.findall(r'add_argument\("--(\w+)", default=("[^"]*"|\'[^\']*\'|[^,]+)', train_py)
    return {name: value.strip("\"'") for name, value in found}


def args_value(args, name: str):
    """The harness's value of RWKV-LM's flag `name` (beta1/beta2 are its `betas`)."""
    if name in ("beta1", "beta2"):
        return args.betas[int(name[-1]) - 1]
    return getattr(args, name)


def same(value, text: str) -> bool:
    """`value` (the harness's) equals RWKV-LM's flag `text`, read as its type."""
    return value == (type(value)(float(text)) if isinstance(value, (int, float)) else text)


@pytest.mark.parametrize("family", rwkvlm.GENERATIONS)
def test_the_demo_config_gives_rwkv_lms_demo_arguments(family):
    cfg = rwkvlm.job_config(CONFIGS[family], [])
    assert cfg.model.family == family
    args = rwkvlm.rwkvlm_args(cfg.model, cfg.training, cfg.optimizer, cfg.lr_scheduler, 2000)
    assert args.my_testing == rwkvlm.GENERATIONS[family].my_testing
    for name, text in {**DEMO_FLAGS[family], **TRAIN_PY_DEFAULTS[family]}.items():
        assert same(args_value(args, name), text), (name, args_value(args, name), text)
    assert (args.real_bsz, args.grad_cp, args.dim_att, args.dim_ffn) == (16, 0, 768, 2688)
    assert args.my_exit_tokens == 2000 * 512 * 16


@pytest.mark.parametrize("family", rwkvlm.GENERATIONS)
def test_each_family_sets_its_train_pys_environment(family):
    assert rwkvlm.rwkvlm_environment(family, 64, 512, "@rwkv3", jit=True) == ENVIRONMENT[family]
    assert rwkvlm.rwkvlm_environment(family, 32, 2048, "", jit=False)["RWKV_JIT_ON"] == "0"


def test_a_family_without_an_rwkv_lm_trainer_is_named():
    with pytest.raises(rwkvlm.RwkvLmMissing, match="model.family = 'gsa'"):
        rwkvlm.generation("gsa")


@pytest.mark.parametrize("family", rwkvlm.GENERATIONS)
def test_the_demo_values_are_rwkv_lms_scripts(family):
    """DEMO_FLAGS, TRAIN_PY_DEFAULTS and ENVIRONMENT against the checkout's demo script and train.py."""
    folder = checkout(family)
    flags = demo_flags((folder / "demo-training-run.sh").read_text())
    assert {name: flags.get(name) for name in DEMO_FLAGS[family]} == DEMO_FLAGS[family]
    train_py = (folder / "train.py").read_text()
    defaults = argparse_defaults(train_py)
    assert {name: defaults.get(name) for name in TRAIN_PY_DEFAULTS[family]} == TRAIN_PY_DEFAULTS[family]
    assert set(re.findall(r'^\s*os\.environ\["(\w+)"\] = ', train_py, flags=re.M)) == set(ENVIRONMENT[family])


def test_a_missing_checkout_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAME_RWKVLM_DIR", str(tmp_path))
    for family in rwkvlm.GENERATIONS:
        with pytest.raises(rwkvlm.RwkvLmMissing, match="FLAME_RWKVLM_DIR"):
            rwkvlm.rwkvlm_dir(family)


TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.head_dim", "32",
        "--model.vocab_size", "128", "--training.seq_len", "16", "--training.batch_size", "2"]


@pytest.fixture(scope="module")
def x060():
    """RWKV-LM's x060 `src.model` and `src.trainer`, imported without building its CUDA extension
    and with its JIT off, so that its time mix calls `RUN_CUDA_RWKV6` through the module, where a
    test puts a CPU recurrence. Skips without the checkout or pytorch_lightning (which its model
    imports)."""
    checkout("rwkv6")
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("needs pytorch_lightning, which RWKV-LM's model imports")
    return rwkvlm.import_rwkvlm("rwkv6", 32, 16, jit=False, extensions=False)


def wkv6_in_fp64(r, k, v, w, u):
    """RWKV-LM's RUN_CUDA_RWKV6 (r, k, v, w [B, T, C], u [H, N]; its cuda/wkv6_cuda.cu decays the
    state by exp(-exp(w)) and adds the current token with the bonus u) by flame's float64 recurrence."""
    B, T, C = r.shape
    H, N = u.shape
    o, _ = naive_rwkv6(*(t.double().view(B, T, H, N) for t in (r, k, v)),
                       -torch.exp(w.double()).view(B, T, H, N), u.double())
    return o.view(B, T, C).to(r.dtype)


def by_rwkvlm_name(flame_tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """RWKV-LM's name of each flame parameter name (flame.weights.rwkv_names)."""
    rwkv = to_rwkv(flame_tensors, "rwkv6", False)
    flame_of = {t.data_ptr(): n for n, t in flame_tensors.items()}
    return {name: flame_of[t.data_ptr()] for name, t in rwkv.items()}


def test_rwkvlm_x060_model_equals_flames_rwkv6_on_cpu(x060, monkeypatch):
    """RWKV-LM's x060 model (its code in fp32, flame's recurrence for its kernel) and flame's RWKV6
    holding its weights through the .pth import: the same names and shapes both ways, the same
    loss, the same gradient of every tensor (L2Wrap included) to fp32 rounding."""
    model_module, _ = x060
    monkeypatch.setattr(model_module, "RUN_CUDA_RWKV6", wkv6_in_fp64)
    cfg = rwkvlm.job_config(CONFIGS["rwkv6"], TINY)
    torch.manual_seed(0)
    reference = model_module.RWKV(rwkvlm.rwkvlm_args(cfg.model, cfg.training, cfg.optimizer, cfg.lr_scheduler, 10))
    generator = torch.Generator().manual_seed(1)
    # Every tensor off its init: at RWKV-LM's init the zero output projections stop every
    # gradient inside the time and channel mixes.
    state = {n: p + 0.05 * torch.randn(p.shape, generator=generator) for n, p in reference.state_dict().items()}
    reference.load_state_dict(state)

    model_args = model_args_from_rwkv(state)
    assert (model_args.family, model_args.head_dim, model_args.mix_low_rank_dim, model_args.decay_low_rank_dim,
            model_args.ffn_hidden_size, model_args.l2wrap) == ("rwkv6", 32, 32, 64, 224, True)
    _, flame_state = from_rwkv({n: t.clone() for n, t in state.items()}, "rwkv6")
    model = build_with_weights(model_args, flame_state, torch.float32).train()
    assert {n: t.shape for n, t in to_rwkv(model.state_dict(), "rwkv6", False).items()} == {
        n: t.shape for n, t in state.items()}

    input_ids, labels = torch.randint(0, 128, (2, 2, 16), generator=generator)
    loss_reference = reference.training_step((input_ids, labels), 0)  # cross-entropy with L2Wrap
    loss_reference.backward()
    loss = model(input_ids, labels=labels, loss_scale=1.0 / labels.numel())
    loss.backward()
    assert loss.item() == pytest.approx(loss_reference.item(), rel=1e-6)
    grads = to_rwkv({n: p.grad for n, p in model.named_parameters()}, "rwkv6", False)
    for name, p in reference.named_parameters():
        assert p.grad.abs().max() > 0, name
        assert rwkvlm.relative_rms(grads[name], p.grad) <= 1e-5, (name, rwkvlm.relative_rms(grads[name], p.grad))


def test_rwkvlm_x060_parameter_groups_equal_flames_for_the_demo_config(x060):
    """Weight decay and LR multiplier of every tensor: RWKV-LM's configure_optimizers (decay on the
    `.weight` matrices, the embedding and head included; time_decay at 2x) and flame's
    build_optimizer for configs/rwkv6_rwkvlm_demo.toml."""
    model_module, _ = x060
    cfg = rwkvlm.job_config(CONFIGS["rwkv6"], TINY)
    reference = model_module.RWKV(rwkvlm.rwkvlm_args(cfg.model, cfg.training, cfg.optimizer, cfg.lr_scheduler, 10))
    optimizer = rwkvlm.rwkvlm_optimizer(model_module, reference, rwkvlm.lightning_stand_in())
    names = {id(p): n for n, p in reference.named_parameters()}
    theirs = {names[id(p)]: (group["weight_decay"], group["my_lr_scale"])
              for params, group in zip(optimizer.model_params, optimizer.param_groups) for p in params}
    model = build_model(cfg.model)
    ours = {n: (group["weight_decay"], group["lr_multiplier"]) for group in build_optimizer(model, cfg.optimizer).param_groups
            for n in group["param_names"]}
    rwkv_names = by_rwkvlm_name(dict(model.named_parameters()))
    assert {name: ours[flame_name] for name, flame_name in rwkv_names.items()} == theirs
    assert theirs["emb.weight"] == (0.001, 1.0) and theirs["blocks.0.att.time_decay"] == (0.0, 2.0)


def test_rwkvlm_x060_lr_callback_beside_flames_schedule(x060):
    """RWKV-LM's train_callback and flame's scheduler for the demo config: the same warmup, and
    afterwards within one update's change of each other (docs/rwkv-lm.md: flame's cosine is
    RWKV-LM's shifted by at most one update)."""
    _, trainer_module = x060
    cfg = rwkvlm.job_config(CONFIGS["rwkv6"], [])
    steps = cfg.training.steps
    args = rwkvlm.rwkvlm_args(cfg.model, cfg.training, cfg.optimizer, cfg.lr_scheduler, steps)
    callback, lightning = trainer_module.train_callback(args), rwkvlm.lightning_stand_in()
    lightning.optimizers = [SimpleNamespace(param_groups=[{"weight_decay": 0.0, "my_lr_scale": 1.0}])]
    theirs = [rwkvlm.callback_lr(callback, lightning, s) for s in range(steps)]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, steps, cfg.optimizer.lr)
    ours = []
    for _ in range(steps):
        ours.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    warmup = args.warmup_steps
    assert ours[:warmup + 1] == pytest.approx(theirs[:warmup + 1], rel=1e-12)
    one_update = max(abs(a - b) for a, b in zip(theirs, theirs[1:]))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= one_update
    assert ours[-1] == pytest.approx(cfg.lr_scheduler.lr_min) and theirs[-1] > ours[-1]


def test_master_weight_adamw_is_adamw_on_fp32_masters_of_a_bf16_model():
    torch.manual_seed(0)
    decayed, free = torch.nn.Parameter(torch.randn(16, 8).bfloat16()), torch.nn.Parameter(torch.randn(8).bfloat16())
    groups = [{"params": [free], "weight_decay": 0.0, "my_lr_scale": 2.0},
              {"params": [], "weight_decay": 0.0, "my_lr_scale": 3.0},  # as x060's lr_3x
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
