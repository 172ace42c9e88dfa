"""The config keys of fla-org/flame and torchtitan that flame names otherwise, and flame's name for
each.

Users of those trainers type their keys (`--model.tokenizer_path`, `--checkpoint.enable_checkpoint`);
flame does not accept them, since a second spelling of a key would let one config say a thing
twice, but the loader's "unknown key" message names flame's key from this table
(`flame.config.loader`), and docs/config.md lists it (`markdown_table()`; a test keeps the two
equal). Keys that flame shares with them (`job.dump_folder`, `training.seq_len`, `optimizer.lr`,
...) are not here: they are flame's keys too.
"""

from __future__ import annotations

from dataclasses import dataclass

FLA = "fla-org/flame"
TITAN = "torchtitan"
BOTH = f"{FLA} and {TITAN}"


@dataclass(frozen=True)
class ForeignKey:
    """Another trainer's key, the tools that use it, flame's key and what differs."""

    name: str
    """`section.key` as fla-org/flame or torchtitan spell it."""
    tools: str
    flame_key: str
    """`section.key` of flame's schema (`flame.config.job`)."""
    note: str = ""
    """How flame's key differs (units, form, meaning); empty when it is the same setting."""


_DATA_FILES = 'glob patterns of local files, with data.dataset = "json", "parquet" or "text"'
_NAN = "flame always skips a step whose loss or gradient norm is not finite; this bounds a streak of them"

FOREIGN_KEYS: dict[str, ForeignKey] = {key.name: key for key in (
    ForeignKey("model.name", BOTH, "model.family", "rwkv6, rwkv7 or gsa"),
    ForeignKey("model.flavor", TITAN, "model.family",
               "the size is set by [model]'s keys: hidden_size, num_layers, head_dim, ..."),
    ForeignKey("model.config", FLA, "model.family",
               "[model]'s keys (family, hidden_size, num_layers, ...) take the place of a model config file"),
    ForeignKey("model.tokenizer_path", BOTH, "data.tokenizer",
               "a tokenizer.json or a Hugging Face tokenizer folder"),
    ForeignKey("model.hf_assets_path", TITAN, "data.tokenizer",
               "a tokenizer.json or a Hugging Face tokenizer folder"),
    ForeignKey("training.dataset", BOTH, "data.dataset",
               "for several datasets, data.sources weighted by data.probs"),
    ForeignKey("training.dataset_name", FLA, "data.name"),
    ForeignKey("training.dataset_split", FLA, "data.split"),
    ForeignKey("training.dataset_path", TITAN, "data.data_files", _DATA_FILES),
    ForeignKey("training.data_dir", FLA, "data.data_files", _DATA_FILES),
    ForeignKey("training.data_files", FLA, "data.data_files"),
    ForeignKey("training.data_probs", FLA, "data.probs"),
    ForeignKey("training.streaming", FLA, "data.streaming"),
    ForeignKey("training.num_workers", FLA, "data.num_workers"),
    ForeignKey("training.context_len", FLA, "data.context_len"),
    ForeignKey("training.local_batch_size", TITAN, "training.batch_size",
               "sequences per micro-batch on each data-parallel rank"),
    ForeignKey("training.global_batch_size", TITAN, "training.gradient_accumulation_steps",
               "the global batch is training.batch_size x gradient_accumulation_steps x the "
               "data-parallel ranks"),
    ForeignKey("training.skip_nan_inf", FLA, "training.max_consecutive_nan_steps", _NAN),
    ForeignKey("training.seed", BOTH, "job.seed"),
    ForeignKey("training.deterministic", BOTH, "job.deterministic"),
    ForeignKey("training.data_parallel_shard_degree", FLA, "parallel.data_parallel_shard_degree"),
    ForeignKey("training.data_parallel_replicate_degree", FLA,
               "parallel.data_parallel_replicate_degree"),
    ForeignKey("training.fsdp_reshard_after_forward", FLA, "parallel.reshard_after_forward"),
    ForeignKey("parallelism.data_parallel_shard_degree", TITAN, "parallel.data_parallel_shard_degree"),
    ForeignKey("parallelism.data_parallel_replicate_degree", TITAN,
               "parallel.data_parallel_replicate_degree"),
    ForeignKey("parallelism.fsdp_reshard_after_forward", TITAN, "parallel.reshard_after_forward"),
    ForeignKey("optimizer.beta1", BOTH, "optimizer.betas", "both betas in one list: [beta1, beta2]"),
    ForeignKey("optimizer.beta2", BOTH, "optimizer.betas", "both betas in one list: [beta1, beta2]"),
    ForeignKey("lr_scheduler.min_lr_factor", TITAN, "lr_scheduler.lr_min",
               "an absolute learning rate (optimizer.lr x min_lr_factor), not a factor"),
    ForeignKey("checkpoint.enable_checkpoint", BOTH, "checkpoint.enable"),
    ForeignKey("checkpoint.initial_load_model_weights_only", FLA, "checkpoint.initial_load_model_only"),
    ForeignKey("activation_checkpoint.mode", BOTH, "training.activation_checkpoint",
               "none, full, selective or elementwise"),
    ForeignKey("compile.enable", TITAN, "training.compile"),
    ForeignKey("debug.seed", TITAN, "job.seed"),
    ForeignKey("debug.deterministic", TITAN, "job.deterministic"),
    ForeignKey("comm.init_timeout_seconds", BOTH, "parallel.init_timeout_minutes", "in minutes"),
    ForeignKey("comm.train_timeout_seconds", BOTH, "parallel.collective_timeout_minutes", "in minutes"),
    ForeignKey("profiling.enable_profiling", BOTH, "profiling.enable"),
    ForeignKey("profiling.save_traces_folder", BOTH, "profiling.folder"),
    ForeignKey("profiling.profile_freq", BOTH, "profiling.start_step",
               "flame traces profiling.steps steps once, from profiling.start_step on"),
    ForeignKey("metrics.save_tb_folder", BOTH, "metrics.enable_tensorboard",
               "flame writes the TensorBoard files into the tensorboard folder of job.dump_folder"),
    ForeignKey("validation.enabled", TITAN, "metrics.val_freq", "0 turns validation off"),
    ForeignKey("validation.freq", TITAN, "metrics.val_freq"),
    ForeignKey("validation.steps", TITAN, "metrics.val_steps"),
)}


def foreign_hint(name: str) -> str:
    """The "did you mean" for another trainer's `section.key`, or "" when the table lacks it."""
    key = FOREIGN_KEYS.get(name)
    if key is None:
        return ""
    note = f": {key.note}" if key.note else ""
    return f"did you mean '{key.flame_key}'? flame's key for {name} of {key.tools}{note}"


def markdown_table() -> str:
    """The table as docs/config.md shows it."""
    lines = ["| their key | used by | flame's key | how flame's differs |", "|---|---|---|---|"]
    for key in FOREIGN_KEYS.values():
        lines.append(f"| `{key.name}` | {key.tools} | `{key.flame_key}` | {key.note} |")
    return "\n".join(lines)
