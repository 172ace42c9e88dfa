"""The config system: TOML + overrides -> JobConfig, every error path, printing and round trips."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import flame
from flame.config import ConfigError, JobConfig, config_from_dict, load_config, to_dict, to_toml
from flame.config import loader

REPO = Path(flame.__file__).parents[1]
CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


@pytest.fixture
def write(tmp_path):
    """write(text) -> path of a TOML file holding text."""

    def _write(text: str, name: str = "job.toml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return _write


def load(path: Path, *args: str) -> JobConfig:
    return load_config(["--config", str(path), *args])


def error_of(path: Path, *args: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(path, *args)
    return str(info.value)


# ----------------------------------------------------------------------------------------------
# Defaults, file values, overrides


def test_empty_file_gives_the_defaults(write):
    assert load(write("")) == JobConfig()
    assert config_from_dict({}) == JobConfig()


def test_every_default_satisfies_its_constraints():
    for keys in loader.schema().values():
        for key in keys.values():
            assert loader.check_constraints(key, key.default) == [], key.path


def test_every_field_has_a_docstring():
    for keys in loader.schema().values():
        for key in keys.values():
            assert key.doc.strip(), f"{key.path} has no docstring in job.py"


def test_file_values_are_applied_and_the_rest_defaults(write):
    cfg = load(write('[training]\nsteps = 10\n[model]\nfamily = "gsa"\nnum_heads = 8\n'))
    assert cfg.training.steps == 10
    assert cfg.model.family == "gsa" and cfg.model.num_heads == 8
    assert cfg.training.batch_size == JobConfig().training.batch_size
    assert cfg.optimizer == JobConfig().optimizer


def test_overrides_win_over_the_file_in_both_spellings(write):
    path = write(
        "[training]\nsteps = 10\nbatch_size = 4\n[parallel]\ndata_parallel_shard_degree = 2\n"
    )
    cfg = load(
        path,
        "--training.steps",
        "100",
        "--training.batch_size=2",
        "--parallel.data_parallel_shard_degree",
        "-1",
        "--checkpoint.load_step=7",
    )
    assert cfg.training.steps == 100
    assert cfg.training.batch_size == 2
    assert cfg.parallel.data_parallel_shard_degree == -1
    assert cfg.checkpoint.load_step == 7


def test_config_flag_may_come_after_the_overrides(write):
    path = write("[training]\nsteps = 10\n")
    cfg = load_config(["--training.batch_size", "3", "--config", str(path)])
    assert (cfg.training.steps, cfg.training.batch_size) == (10, 3)


def test_default_config_path_is_used_without_config(write, monkeypatch):
    path = write("[job]\nname = 'from-default'\n", name="tiny.toml")
    monkeypatch.setattr(loader, "default_config_path", lambda: path)
    assert load_config([]).job.name == "from-default"


def test_missing_default_config_says_to_pass_config(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "default_config_path", lambda: tmp_path / "configs" / "tiny.toml")
    with pytest.raises(ConfigError, match=r"pass --config"):
        load_config([])


def test_default_config_path_is_the_repository_tiny_toml():
    assert loader.default_config_path() == REPO / "configs" / "tiny.toml"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("false", False), ("1", True), ("0", False), ("yes", True), ("no", False),
     ("TRUE", True), ("No", False)],
)
def test_bool_overrides(write, text, expected):
    assert load(write(""), "--training.compile", text).training.compile is expected


def test_list_overrides_as_toml_array_or_comma_separated(write):
    path = write("")
    assert load(path, "--optimizer.betas", "[0.8,0.99]").optimizer.betas == [0.8, 0.99]
    assert load(path, "--optimizer.betas=0.85, 0.9").optimizer.betas == [0.85, 0.9]
    files = load(path, "--data.data_files", "a/*.jsonl,b.jsonl").data.data_files
    assert files == ["a/*.jsonl", "b.jsonl"]
    assert load(path, "--data.data_files", '["x,y.jsonl"]').data.data_files == ["x,y.jsonl"]
    assert load(path, "--data.data_files=").data.data_files == []


def test_string_overrides_are_verbatim(write):
    cfg = load(write(""), "--job.name=a=b c", "--data.tokenizer", " spaced/tokenizer.json")
    assert cfg.job.name == "a=b c"
    assert cfg.data.tokenizer == " spaced/tokenizer.json"


def test_int_accepts_integral_floats_and_float_accepts_ints(write):
    cfg = load(write("[training]\nsteps = 1e4\n[optimizer]\nlr = 1\n"), "--training.seq_len", "2e2")
    assert cfg.training.steps == 10000 and type(cfg.training.steps) is int
    assert cfg.training.seq_len == 200 and type(cfg.training.seq_len) is int
    assert cfg.optimizer.lr == 1.0 and type(cfg.optimizer.lr) is float


def test_warmup_longer_than_training_is_not_an_error(write):
    cfg = load(write("[training]\nsteps = 10\n[lr_scheduler]\nwarmup_steps = 100\n"))
    assert cfg.lr_scheduler.warmup_steps == 100


# ----------------------------------------------------------------------------------------------
# Unknown names


def test_unknown_section_in_file_names_it_and_suggests(write):
    message = error_of(write("[trainin]\nsteps = 1\n"))
    assert "unknown section 'trainin'" in message
    assert "did you mean 'training'?" in message
    assert "valid sections: job, model, data, training" in message
    assert "job.toml" in message


def test_unknown_key_in_file_names_it_and_suggests(write):
    message = error_of(write("[training]\nstpes = 1\n"))
    assert "unknown key 'training.stpes' (did you mean 'steps'?)" in message
    assert "valid keys of [training]:" in message


def test_unknown_section_and_key_in_overrides(write):
    path = write("")
    message = error_of(path, "--trainin.steps", "1")
    assert "--trainin.steps" in message and "unknown section 'trainin'" in message
    assert "did you mean 'training'?" in message
    message = error_of(path, "--training.stpes=1")
    assert "unknown key 'training.stpes' (did you mean 'steps'?)" in message


def test_unknown_name_without_a_close_match_has_no_suggestion(write):
    message = error_of(write("[training]\nzzzzzz = 1\n"))
    assert "unknown key 'training.zzzzzz'" in message and "did you mean" not in message


def test_top_level_key_must_be_in_a_section(write):
    message = error_of(write("steps = 1\n"))
    assert "top-level key 'steps' must be inside a section" in message and "[training]" in message


def test_section_that_is_not_a_table(write):
    assert "'training' must be a section" in error_of(write("training = 5\n"))


def test_nested_table_is_an_unknown_key(write):
    assert "unknown key 'training.sub'" in error_of(write("[training.sub]\nx = 1\n"))


# ----------------------------------------------------------------------------------------------
# Types


def test_wrong_type_names_key_type_and_value(write):
    assert error_of(write(""), "--training.steps", "ten") == (
        "training.steps: expected int, got str 'ten' (from --training.steps)"
    )
    message = error_of(write('[training]\nsteps = "ten"\n'))
    assert message.startswith("training.steps: expected int, got str 'ten'")
    assert "job.toml" in message


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[training]\nsteps = true", "training.steps: expected int, got bool True"),
        ("[training]\nsteps = 1.5", "training.steps: expected int, got float 1.5"),
        ("[optimizer]\nlr = 'high'", "optimizer.lr: expected float, got str 'high'"),
        ("[optimizer]\nlr = true", "optimizer.lr: expected float, got bool True"),
        ("[training]\ncompile = 1", "training.compile: expected bool, got int 1"),
        ("[job]\nname = 3", "job.name: expected str, got int 3"),
        ("[optimizer]\nbetas = 0.9", "optimizer.betas: expected list of float, got float 0.9"),
        ("[optimizer]\nbetas = [0.9, 'x']", "optimizer.betas[1]: expected float, got str 'x'"),
        ("[data]\ndata_files = 'a.jsonl'", "data.data_files: expected list of str, got str"),
        ("[training]\nsteps = {a = 1}", "training.steps: expected int, got table"),
        ("[optimizer]\nlr = inf", "optimizer.lr: expected a finite float, got inf"),
    ],
)
def test_wrong_types_in_file(write, toml, expected):
    assert expected in error_of(write(toml + "\n"))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--training.compile", "maybe"], "training.compile: expected bool, got str 'maybe'"),
        (["--training.steps", "1.5"], "training.steps: expected int, got float 1.5"),
        (["--optimizer.lr", "nan"], "optimizer.lr: expected a finite float, got nan"),
        (["--optimizer.lr", "fast"], "optimizer.lr: expected float, got str 'fast'"),
        (["--optimizer.betas", "0.9,x"], "optimizer.betas[1]: expected float, got str 'x'"),
        (["--optimizer.betas", "[0.9,"], "optimizer.betas: cannot parse '[0.9,' as a TOML array"),
    ],
)
def test_wrong_types_in_overrides(write, args, expected):
    assert expected in error_of(write(""), *args)


# ----------------------------------------------------------------------------------------------
# Ranges, choices, cross-field facts


def test_out_of_range_and_bad_choice_messages(write):
    path = write("")
    assert error_of(path, "--training.batch_size", "0") == (
        "training.batch_size must be >= 1, got 0 (from --training.batch_size)"
    )
    assert error_of(path, "--model.family", "rwkv8") == (
        "model.family must be one of rwkv6, rwkv7, gsa, got 'rwkv8' (from --model.family)"
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.backend=cuda", "model.backend must be one of auto, triton, torch, got 'cuda'"),
        ("lr_scheduler.decay_type=step", "decay_type must be one of cosine, linear, wsd"),
        ("training.activation_checkpoint=some", "training.activation_checkpoint must be one of"),
        ("checkpoint.async_mode=sync", "checkpoint.async_mode must be one of disabled, async"),
        ("optimizer.implementation=apex", "optimizer.implementation must be one of fused, foreach"),
        ("training.device=tpu", "training.device must be one of auto, cuda, cpu, got 'tpu'"),
        ("optimizer.name=SGD", "optimizer.name must be one of AdamW, got 'SGD'"),
        ("training.mixed_precision_param=fp16", "must be one of bfloat16, float16, float32"),
        ("training.mixed_precision_reduce=half", "training.mixed_precision_reduce must be one of"),
        ("data.val_fraction=1", "data.val_fraction must be < 1, got 1.0"),
        ("data.val_fraction=-0.1", "data.val_fraction must be >= 0, got -0.1"),
        ("lr_scheduler.decay_ratio=1.5", "lr_scheduler.decay_ratio must be <= 1, got 1.5"),
        ("optimizer.betas=0.9,1.0", "optimizer.betas values must each be in [0.0, 1.0)"),
        ("optimizer.betas=0.9,0.95,0.99", "optimizer.betas must have 2 values, got 3"),
        ("optimizer.lr=0", "optimizer.lr must be > 0, got 0.0"),
        ("optimizer.eps=-1e-8", "optimizer.eps must be > 0"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay must be >= 0"),
        ("training.max_norm=-1", "training.max_norm must be >= 0, got -1.0"),
        ("training.seq_len=0", "training.seq_len must be >= 1, got 0"),
        ("training.gradient_accumulation_steps=0", "gradient_accumulation_steps must be >= 1"),
        ("training.steps=-5", "training.steps must be >= 1, got -5"),
        ("model.vocab_size=0", "model.vocab_size must be >= 1"),
        ("model.norm_eps=0", "model.norm_eps must be > 0"),
        ("model.num_kv_heads=-1", "model.num_kv_heads must be >= 0"),
        ("job.seed=-1", "job.seed must be >= 0, got -1"),
        ("job.seed=4294967296", "job.seed must be <= 4294967295"),
        ("job.name=", "job.name must not be empty"),
        ("checkpoint.interval=0", "checkpoint.interval must be >= 1"),
        ("checkpoint.load_step=-2", "checkpoint.load_step must be >= -1, got -2"),
        ("metrics.log_freq=0", "metrics.log_freq must be >= 1"),
        ("parallel.data_parallel_shard_degree=0", "data_parallel_shard_degree must be != 0"),
        ("parallel.data_parallel_replicate_degree=0", "replicate_degree must be >= 1"),
    ],
)
def test_constraints(write, override, expected):
    assert expected in error_of(write(""), f"--{override}")


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[model]\nfamily = 'rwkv7'\nhidden_size = 1000\nhead_dim = 64",
         "model.hidden_size (1000) must be divisible by model.head_dim (64) for rwkv7"),
        ("[model]\nfamily = 'rwkv6'\nhidden_size = 100\nhead_dim = 64",
         "model.hidden_size (100) must be divisible by model.head_dim (64) for rwkv6"),
        ("[model]\nfamily = 'gsa'\nhidden_size = 1000\nnum_heads = 3",
         "model.hidden_size (1000) must be divisible by model.num_heads (3) for gsa"),
        ("[model]\nfamily = 'gsa'\nnum_heads = 4\nnum_kv_heads = 3",
         "model.num_heads (4) must be divisible by model.num_kv_heads (3)"),
        ("[optimizer]\nlr = 1e-4\n[lr_scheduler]\nlr_min = 1e-3",
         "lr_scheduler.lr_min (0.001) must be <= optimizer.lr (0.0001)"),
        ("[data]\ndataset = 'json'", "data.data_files must name at least one file"),
        ("[metrics]\nval_freq = 10\n[data]\nval_fraction = 0", "data.val_fraction = 0 disables"),
        ("[training]\nnan_recovery = true\n[checkpoint]\nenable = false",
         "training.nan_recovery needs checkpoint.enable = true"),
        ("[parallel]\nfsdp_hold_weights = true\nreshard_after_forward = 'always'",
         "parallel.reshard_after_forward = 'always' applies only to freed weights, not with "
         "parallel.fsdp_hold_weights = true"),
    ],
)
def test_cross_field_checks(write, toml, expected):
    assert expected in error_of(write(toml + "\n"))


def test_cross_field_checks_accept_valid_combinations(write):
    gsa = load(write("[model]\nfamily = 'gsa'\nhidden_size = 1000\nnum_heads = 8\nhead_dim = 64\n"))
    assert gsa.model.hidden_size == 1000  # head_dim does not apply to gsa
    rwkv = load(write("[model]\nfamily = 'rwkv7'\nhidden_size = 192\nhead_dim = 64\nnum_heads = 5"))
    assert rwkv.model.num_heads == 5  # num_heads does not apply to rwkv
    local = load(write("[data]\ndataset = 'json'\ndata_files = ['a.jsonl']\n"))
    assert local.data.data_files == ["a.jsonl"]
    freed = load(write("[parallel]\nfsdp_hold_weights = false\nreshard_after_forward = 'never'\n"))
    assert freed.parallel.reshard_after_forward == "never"
    # "auto" may choose freed weights, to which the setting applies
    auto = load(write("[parallel]\nreshard_after_forward = 'never'\n"))
    assert (auto.parallel.fsdp_hold_weights, auto.parallel.reshard_after_forward) == ("auto", "never")


@pytest.mark.parametrize(("toml", "args", "expected"), [
    ("", (), "auto"),
    ("[parallel]\nfsdp_hold_weights = true", (), True),
    ("[parallel]\nfsdp_hold_weights = false", (), False),
    ("[parallel]\nfsdp_hold_weights = 'auto'", (), "auto"),
    ("[parallel]\nfsdp_hold_weights = true", ("--parallel.fsdp_hold_weights", "auto"), "auto"),
    ("", ("--parallel.fsdp_hold_weights", "false"), False),
    ("", ("--parallel.fsdp_hold_weights=yes",), True),
])
def test_fsdp_hold_weights_is_a_bool_or_auto(write, toml, args, expected):
    value = load(write(toml + "\n"), *args).parallel.fsdp_hold_weights
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(("toml", "args", "expected"), [
    ("[parallel]\nfsdp_hold_weights = 1", (), "parallel.fsdp_hold_weights: expected bool or str, got int 1"),
    ("[parallel]\nfsdp_hold_weights = 'sometimes'", (),
     "parallel.fsdp_hold_weights must be one of auto, true, false, got 'sometimes'"),
    ("", ("--parallel.fsdp_hold_weights", "Auto"),
     "parallel.fsdp_hold_weights must be one of auto, true, false, got 'Auto' (from --parallel.fsdp_hold_weights)"),
    ("[parallel]\nfsdp_hold_weights = 'false'", (),
     "parallel.fsdp_hold_weights must be one of auto, true, false, got 'false' (a string; write true or "
     "false without quotes)"),
])
def test_fsdp_hold_weights_errors_name_the_values(write, toml, args, expected):
    assert expected in error_of(write(toml + "\n"), *args)


def test_a_bool_or_auto_key_round_trips_and_is_documented(capsys):
    for value in ("auto", True, False):
        cfg = JobConfig()
        cfg.parallel.fsdp_hold_weights = value
        assert config_from_dict(tomllib.loads(to_toml(cfg))) == cfg
    assert 'fsdp_hold_weights (bool or str, default "auto"; one of auto/true/false)' in loader.help_text()


def test_every_problem_is_reported_at_once(write):
    message = error_of(write("[training]\nbatch_size = 0\nstpes = 3\n"), "--model.family=rwkv8")
    assert message.startswith("3 problems in the config:")
    assert "training.batch_size must be >= 1" in message
    assert "unknown key 'training.stpes'" in message
    assert "model.family must be one of" in message


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------------------------
# Files and the command line


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "configs" / "x.toml"
    with pytest.raises(ConfigError) as info:
        load(missing)
    assert str(info.value) == f"config file not found: {missing}"


def test_toml_syntax_error_names_file_and_line(write):
    path = write("[training]\nsteps = 10\nbatch_size = = 2\n")
    message = error_of(path)
    assert str(path) in message and "invalid TOML" in message and "line 3" in message


def test_key_given_twice_in_file_names_the_line(write):
    message = error_of(write("[training]\nsteps = 1\nsteps = 2\n"))
    assert "invalid TOML" in message and "line 3" in message


def test_override_given_twice(write):
    message = error_of(write(""), "--training.steps", "1", "--training.steps=2")
    assert "--training.steps given twice" in message and "'1'" in message and "'2'" in message


@pytest.mark.parametrize(
    "args", [["--training.steps"], ["--training.steps", "--print-config"], ["--config"]]
)
def test_option_without_a_value(write, args):
    path = write("")
    argv = args if args == ["--config"] else ["--config", str(path), *args]
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    name = args[0]
    assert f"{name} needs a value" in str(info.value)


def test_config_given_twice(write):
    path = write("")
    with pytest.raises(ConfigError, match="--config given twice"):
        load_config(["--config", str(path), "--config", str(path)])


def test_unknown_option_and_stray_argument(write):
    path = write("")
    assert "unknown option '--confg' (did you mean 'config'?)" in error_of(path, "--confg", "x")
    assert "unknown option '--print_config' (did you mean 'print-config'?)" in error_of(
        path, "--print_config"
    )
    assert "--print-config takes no value" in error_of(path, "--print-config=yes")
    assert "unexpected argument 'steps'" in error_of(path, "steps")


def test_print_config_prints_toml_that_parses_and_exits(write, capsys):
    path = write("[training]\nsteps = 10\n")
    with pytest.raises(SystemExit) as info:
        load(path, "--print-config", "--optimizer.betas", "0.8,0.9", "--job.name", 'say "hi"')
    assert info.value.code == 0
    printed = capsys.readouterr().out
    cfg = config_from_dict(tomllib.loads(printed))
    assert cfg == load(path, "--optimizer.betas", "0.8,0.9", "--job.name", 'say "hi"')
    assert cfg.training.steps == 10 and cfg.optimizer.betas == [0.8, 0.9]


def test_help_lists_every_section_key_and_docstring(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for section, keys in loader.schema().items():
        assert f"[{section}]" in text
        for key in keys.values():
            assert f"  {key.name} (" in text, key.path
    assert "Optimizer steps to train." in text
    assert "family (str, default \"rwkv7\"; one of rwkv6/rwkv7/gsa)" in text
    assert "batch_size (int, default 8; >= 1)" in text


# ----------------------------------------------------------------------------------------------
# Output


def test_to_toml_round_trips_exactly():
    cfg = JobConfig()
    cfg.job.name = 'quote " backslash \\ newline \n tab \t ctrl \x01 del \x7f unicode é 😀'
    cfg.job.dump_folder = "C:\\runs\\x"
    cfg.data.data_files = ["a,b.jsonl", "[x].json", "", "'single'"]
    cfg.optimizer.lr = 1 / 3
    cfg.optimizer.eps = 5e-324
    cfg.optimizer.betas = [0.1 + 0.2, 0.999999999999]
    cfg.model.norm_eps = 1e300
    cfg.model.gate_logit_normalizer = 16.0
    cfg.checkpoint.load_step = -1
    cfg.training.compile = True
    text = to_toml(cfg)
    data = tomllib.loads(text)
    assert data == to_dict(cfg)
    assert config_from_dict(data) == cfg
    assert set(data) == {f.name for f in dataclasses.fields(JobConfig)}


def test_to_toml_writes_floats_as_floats():
    data = tomllib.loads(to_toml(JobConfig()))
    assert type(data["training"]["max_norm"]) is float
    assert type(data["optimizer"]["betas"][0]) is float
    assert type(data["training"]["steps"]) is int


def test_to_dict_is_a_deep_copy():
    cfg = JobConfig()
    d = to_dict(cfg)
    assert d["training"]["steps"] == cfg.training.steps
    d["optimizer"]["betas"].append(0.5)
    assert cfg.optimizer.betas == [0.9, 0.95]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_every_shipped_config_loads_and_round_trips(path):
    cfg = load(path)
    assert config_from_dict(tomllib.loads(to_toml(cfg))) == cfg


# ----------------------------------------------------------------------------------------------
# The module entry and the import rule


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_python_m_flame_config(write):
    path = write("[training]\nsteps = 10\n")
    ok = run_python("-m", "flame.config", "--config", str(path), "--training.batch_size=2")
    assert ok.returncode == 0, ok.stderr
    cfg = config_from_dict(tomllib.loads(ok.stdout))
    assert (cfg.training.steps, cfg.training.batch_size) == (10, 2)
    bad = run_python("-m", "flame.config", "--config", str(path), "--training.stpes=2")
    assert bad.returncode == 2
    assert "did you mean 'steps'?" in bad.stderr and bad.stdout == ""


def test_config_imports_only_the_standard_library():
    code = (
        "import sys, flame.config; "
        "bad = {'torch', 'triton', 'numpy', 'datasets', 'wandb', 'tokenizers'} & set(sys.modules); "
        "assert not bad, bad"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


def test_key_in_the_wrong_section_points_to_its_section(write):
    message = error_of(write("[training]\nlr = 1e-3\n"))
    assert "unknown key 'training.lr' (did you mean 'optimizer.lr'?)" in message
    message = error_of(write(""), "--optimizer.seq_len=1")
    assert "did you mean 'training.seq_len'?" in message


def test_huge_int_for_a_float_field(write):
    message = error_of(write("[optimizer]\nlr = 1" + "0" * 400 + "\n"))
    assert "optimizer.lr: expected a finite float, got an int too large" in message


def test_schema_rejects_field_types_the_loader_cannot_parse(monkeypatch):
    @dataclasses.dataclass
    class Odd:
        limit: int | None = None
        """A field type the loader does not support."""

    @dataclasses.dataclass
    class OddConfig:
        odd: Odd = dataclasses.field(default_factory=Odd)

    monkeypatch.setattr(loader, "JobConfig", OddConfig)
    loader.schema.cache_clear()
    try:
        with pytest.raises(TypeError, match="odd.limit: field type"):
            loader.schema()
    finally:
        monkeypatch.undo()
        loader.schema.cache_clear()


def test_unknown_overrides_are_reported_with_the_other_problems(write):
    message = error_of(write(""), "--training.lr=3", "--model.backend=x", "--trainin.steps=4")
    assert message.startswith("3 problems in the config:")
    assert "unknown key 'training.lr' (did you mean 'optimizer.lr'?)" in message
    assert "(from --training.lr)" in message
    assert "model.backend must be one of auto, triton, torch, got 'x' (from --model.backend)" in message
    assert "unknown section 'trainin' (did you mean 'training'?)" in message
