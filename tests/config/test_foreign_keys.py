"""The command line and config files in the conventions of torchtitan and fla-org/flame:
`--job.config_file`, bare boolean flags, and flame's key named for their keys that flame lacks."""

from pathlib import Path

import pytest

from flame.config import ConfigError, load_config
from flame.config import loader
from flame.config.foreign_keys import FOREIGN_KEYS, markdown_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def error_of(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(argv))
    return str(info.value)


def test_every_mapped_key_is_a_flame_key_and_no_foreign_key_is():
    schema = loader.schema()
    for name, key in FOREIGN_KEYS.items():
        section, _, field = key.flame_key.partition(".")
        assert field in schema.get(section, {}), f"{name} -> {key.flame_key}, not a flame key"
        section, _, field = name.partition(".")
        assert field not in schema.get(section, {}), f"{name} is flame's own key"


def test_docs_list_the_table_the_loader_uses():
    assert markdown_table() in DOC.read_text(), (
        "docs/config.md's table of fla-org/flame and torchtitan keys is out of date with "
        "flame/config/foreign_keys.py; regenerate it (see the doc's header)")


def test_job_config_file_is_the_config_option(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nsteps = 7\n")
    assert load_config(["--job.config_file", str(path)]).training.steps == 7
    assert load_config([f"--job.config_file={path}"]).training.steps == 7
    message = error_of("--config", str(path), "--job.config_file", str(path))
    assert "--config given twice" in message and "--job.config_file is the same option" in message
    assert "--job.config_file needs a value" in error_of("--job.config_file")


def test_a_bare_boolean_flag_means_true(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[training]\ncompile = false\n")
    cfg = load_config(["--config", str(path), "--training.compile", "--checkpoint.enable"])
    assert cfg.training.compile is True and cfg.checkpoint.enable is True
    cfg = load_config(["--config", str(path), "--training.compile", "--training.steps", "3"])
    assert cfg.training.compile is True and cfg.training.steps == 3
    path.write_text("[training]\ncompile = true\n")
    assert load_config(["--config", str(path), "--training.compile", "false"]).training.compile is False
    assert "--training.steps needs a value" in error_of("--config", str(path), "--training.steps")


@pytest.mark.parametrize("flag, spelling", [
    ("--no-training.compile", "--training.compile false"),
    ("--training.no_compile", "--training.compile false"),
    ("--training.no-compile", "--training.compile false"),
    ("--checkpoint.no_initial_load_model_weights_only", "--checkpoint.initial_load_model_only false"),
])
def test_another_tools_false_flag_gets_flames_spelling(flag, spelling):
    message = error_of(flag)
    assert message.startswith(f"{flag}: flame turns a boolean key off with {spelling}")


@pytest.mark.parametrize("argv, flame_key, origin", [
    (["--model.tokenizer_path", "tok.json"], "data.tokenizer", "--model.tokenizer_path"),
    (["--checkpoint.enable_checkpoint"], "checkpoint.enable", "--checkpoint.enable_checkpoint"),
    (["--training.skip_nan_inf"], "training.max_consecutive_nan_steps", "--training.skip_nan_inf"),
    (["--compile.enable"], "training.compile", "--compile.enable"),
    (["--optimizer.beta1=0.8"], "optimizer.betas", "--optimizer.beta1"),
])
def test_a_key_of_another_trainer_names_flames_key(argv, flame_key, origin):
    message = error_of(*argv)
    assert f"unknown key '{origin[2:]}' (did you mean '{flame_key}'? flame's key for" in message
    assert f"(from {origin})" in message


def test_a_key_of_another_trainer_in_a_file_names_flames_key(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[model]\ntokenizer_path = 'tok.json'\n[parallelism]\n"
                    "data_parallel_shard_degree = 2\ntensor_parallel_degree = 2\n"
                    "[lr_scheduler]\nmin_lr_factor = 0.1\n")
    message = error_of("--config", str(path))
    assert message.startswith("4 problems in the config:")
    assert "unknown key 'model.tokenizer_path' (did you mean 'data.tokenizer'?" in message
    assert ("unknown key 'parallelism.data_parallel_shard_degree' (did you mean "
            "'parallel.data_parallel_shard_degree'?") in message
    assert "unknown section 'parallelism' (did you mean 'parallel'?)" in message  # tensor_parallel_degree
    assert "an absolute learning rate (optimizer.lr x min_lr_factor), not a factor" in message
    assert f"(in {path})" in message


def test_lr_min_given_as_a_factor_is_explained(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[optimizer]\nlr = 3e-4\n[lr_scheduler]\nlr_min = 0.1\n")
    message = error_of("--config", str(path))
    assert "must be <= optimizer.lr (0.0003): it is an absolute learning rate" in message
