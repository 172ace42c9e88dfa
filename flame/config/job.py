"""The job configuration: one typed dataclass per TOML section.

A job is one TOML file whose top-level tables are exactly the fields of `JobConfig`. Every field
has a default, so a file only names what it changes. `flame.config.loader` parses the file and
command-line overrides (`--training.steps 100`) into these classes and validates them.

Field docstrings (the string right after a field) are the config reference: `--help` and the
README's reference table are generated from them, so keep them short and exact.

Each field's constraints live in its `metadata`, read by the loader: `ge`, `gt`, `le`, `lt`,
`ne` (numeric bounds), `choices` (allowed values), `nonempty` (strings and lists), `length`,
`item_range` and `item_choices` (lists: exact length; each item in [low, high); each item one of
the choices, none twice). Facts that involve several fields
are checked in `flame.config.loader.cross_field_problems`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_NAMES = ("bfloat16", "float16", "float32")
"""The dtypes a config may name (`flame.config.torch_types.DTYPES` maps them to torch's)."""
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def one_of(*choices: str) -> dict:
    """Field metadata: the value must be one of `choices`."""
    return {"choices": choices}


@dataclass
class Job:
    name: str = field(default="flame", metadata={"nonempty": True})
    """Run name, used for the dump folder default and the wandb run name."""
    dump_folder: str = field(default="outputs/flame", metadata={"nonempty": True})
    """Where the run writes config.toml, metrics.jsonl, its checkpoints (each step-N with the
    config.toml it was trained with) and, when enabled, tensorboard/, wandb/, profiler traces and
    the compiled code (compile_cache/, training.compile_cache_dir). The console log goes to stdout
    only: launch/train.sh keeps each rank's in logs/<date-time>."""
    seed: int = field(default=42, metadata={"ge": 0, "le": 2**32 - 1})
    """Seed for model init, data order (unless data.seed is set) and dropout-free determinism."""
    deterministic: bool = False
    """Use deterministic algorithms (slower); needed for bitwise-reproducible GPU runs."""
    force_unlock: bool = False
    """Take over the dump folder's lock (.flame.lock) whoever holds it. A run refuses a folder
    locked by a run that may be alive; use this only when that run is known to be gone (for
    example killed on another host)."""


@dataclass
class Model:
    family: str = field(default="rwkv7", metadata=one_of("rwkv6", "rwkv7", "gsa"))
    """Model family: "rwkv6", "rwkv7" or "gsa"."""
    vocab_size: int = field(default=32000, metadata={"ge": 1})
    """Vocabulary size; must equal the tokenizer's (added tokens included)."""
    hidden_size: int = field(default=1024, metadata={"ge": 1})
    """Model width."""
    num_layers: int = field(default=24, metadata={"ge": 1})
    """Number of blocks."""
    head_dim: int = field(default=64, metadata={"ge": 1})
    """Per-head key/value dimension for RWKV6 and RWKV7 (heads = hidden_size / head_dim)."""
    num_heads: int = field(default=4, metadata={"ge": 1})
    """GSA only: number of attention heads (head dim = hidden_size / num_heads)."""
    num_kv_heads: int = field(default=0, metadata={"ge": 0})
    """GSA only: key/value heads for grouped queries; 0 means num_heads."""
    num_slots: int = field(default=64, metadata={"ge": 1})
    """GSA only: number of memory slots M."""
    gate_logit_normalizer: float = field(default=8.0, metadata={"gt": 0})
    """GSA only: g = logsigmoid(f) / gate_logit_normalizer."""
    ffn_hidden_size: int = field(default=0, metadata={"ge": 0})
    """FFN width; 0 picks the family default (RWKV6 3.5x rounded to 32, RWKV7 4x, GSA SwiGLU)."""
    mix_low_rank_dim: int = field(default=32, metadata={"ge": 1})
    """RWKV6 only: rank of the data-dependent token-shift LoRA."""
    decay_low_rank_dim: int = field(default=0, metadata={"ge": 0})
    """Rank of the decay LoRA; 0 picks the official formula for the family."""
    a_low_rank_dim: int = field(default=0, metadata={"ge": 0})
    """RWKV7 only: rank of the in-context learning-rate LoRA; 0 picks the official formula."""
    v_low_rank_dim: int = field(default=0, metadata={"ge": 0})
    """RWKV7 only: rank of the value-residual LoRA; 0 picks the official formula."""
    gate_low_rank_dim: int = field(default=0, metadata={"ge": 0})
    """RWKV7 only: rank of the output-gate LoRA; 0 picks the official formula."""
    norm_eps: float = field(default=1e-5, metadata={"gt": 0})
    """Epsilon of the LayerNorm / RMSNorm layers."""
    group_norm_eps: float = field(default=64e-5, metadata={"gt": 0})
    """RWKV6 and RWKV7: epsilon of the per-head GroupNorm of the attention output (ln_x). The
    official value, 64e-5 whatever the head size, is what RWKV-LM and the rwkv package compute
    and what an RWKV-LM .pth export requires. fla uses head_dim x norm_eps for RWKV7
    (head_dim x 1e-5 by default, equal at head_dim 64) and norm_eps for RWKV6."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output head."""
    l2wrap: bool = True
    """RWKV6 and RWKV7: add the L2Wrap logit penalty to the gradient, as RWKV-LM's trainers do (the
    reported loss is unchanged)."""
    backend: str = field(default="auto", metadata=one_of("auto", "triton", "torch"))
    """Attention kernels: "auto" (Triton on CUDA, PyTorch on CPU), "triton" or "torch"."""
    cache_intermediates: bool = False
    """RWKV7 only, Triton kernels: keep the chunk forward's per-chunk intermediates for the backward
    instead of recomputing them: a faster attention backward for more activation memory (the trade
    is measured in bench/RESULTS.md, whole training step)."""
    recompute_states: bool = False
    """RWKV7 only, Triton kernels: the chunk forward does not keep its per-chunk states for the
    backward, which runs the forward scan again for them in the launch of its own scan: less
    activation memory for a slightly slower step (measured in bench/RESULTS.md, whole training step)."""


TRAINING_MEMORY_FIELDS = ("cache_intermediates", "recompute_states")
"""`Model` fields that only trade a training step's memory for its speed: a model loaded for
inference or export resets them to their defaults (off)."""


@dataclass
class Data:
    dataset: str = field(default="embedded", metadata={"nonempty": True})
    """"embedded" (the shipped corpus), a HF hub dataset name, or a local dataset type
    ("json", "parquet", "text") used with data_files."""
    name: str = ""
    """HF dataset configuration name."""
    split: str = field(default="train", metadata={"nonempty": True})
    """Dataset split to train on."""
    data_files: list[str] = field(default_factory=list)
    """Glob patterns of local files (jsonl, json, parquet, text)."""
    streaming: bool = False
    """Stream the dataset instead of downloading it whole."""
    text_field: str = field(default="text", metadata={"nonempty": True})
    """Name of the text column."""
    tokenizer: str = ""
    """Path to a tokenizer.json or a HF tokenizer directory; empty means the embedded tokenizer."""
    val_fraction: float = field(default=0.01, metadata={"ge": 0, "lt": 1})
    """Fraction of documents held out for validation (0 disables the validation split)."""
    num_workers: int = field(default=0, metadata={"ge": 0})
    """Data-loader worker processes for online tokenization."""
    sources: list[str] = field(default_factory=list)
    """Sources to mix, each written like data.dataset ("embedded", a local glob such as
    "data/*.jsonl", or a HF hub name, "name:config" for a configuration); empty reads
    data.dataset alone."""
    probs: list[float] = field(default_factory=list)
    """Sampling probabilities of data.sources (normalized to sum 1); empty samples uniformly."""
    context_len: int = field(default=0, metadata={"ge": 0})
    """Varlen only: longest segment; longer documents are cut into pieces; 0 means training.seq_len."""
    shard_dir: str = ""
    """Read the pre-tokenized shards of this folder (`python -m flame.data.prepare`) instead of
    raw text; its manifest must match the tokenizer."""
    allow_dp_resplit: bool = False
    """Resume on a different number of data-parallel ranks by re-splitting the data position
    (each source continues at the same fraction of its epoch)."""
    seed: int = field(default=-1, metadata={"ge": -1, "le": 2**32 - 1})
    """Seed of the data order (window shuffling, source sampling); -1 uses job.seed. Set it to
    vary the model's init (job.seed) over runs that read the same batches."""


@dataclass
class Training:
    batch_size: int = field(default=8, metadata={"ge": 1})
    """Sequences per micro-batch per data-parallel rank."""
    seq_len: int = field(default=2048, metadata={"ge": 1})
    """Tokens per sequence."""
    gradient_accumulation_steps: int = field(default=1, metadata={"ge": 1})
    """Micro-batches per optimizer step."""
    steps: int = field(default=10000, metadata={"ge": 1})
    """Optimizer steps to train."""
    max_norm: float = field(default=1.0, metadata={"ge": 0})
    """Global gradient-norm clip; 0 disables clipping (the norm is still logged)."""
    mixed_precision_param: str = field(default="bfloat16", metadata=one_of(*DTYPE_NAMES))
    """Compute dtype on GPUs: "bfloat16", "float16" or "float32". Weights, gradients and the
    optimizer state stay fp32; replicated ranks compute under torch.autocast to this dtype, FSDP
    gathers the weights in it."""
    mixed_precision_reduce: str = field(default="float32", metadata=one_of(*DTYPE_NAMES))
    """The dtype in which gradients are summed over data-parallel ranks on GPUs (the replicas'
    all-reduce, FSDP's reduce-scatter); CPUs (gloo) always sum in fp32."""
    compile: bool = False
    """torch.compile each block."""
    compile_cache_dir: str = ""
    """With training.compile: the folder of the compiled code (Inductor's compiled graphs, Triton's
    kernels: TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point into it), so that a restart on any
    node that sees the folder loads the code instead of compiling it again. "" is
    <job.dump_folder>/compile_cache; "none" leaves the caches in torch's and Triton's default
    folders on the node, which every version of flame shares (graphs traced through another
    version's custom ops can load there). Each version of flame's source gets a subfolder of a
    folder of flame's own; either variable set in the environment wins. The log says whether
    the cache was warm and how long the first step took."""
    cuda_graphs: bool = True
    """With training.compile on CUDA, a model that FSDP does not shard and fixed-length batches:
    replay each compiled block as a CUDA graph (torch.compile's "reduce-overhead" mode), so that
    the host launches one graph per block instead of every kernel. Off under FSDP and varlen,
    whose blocks change their inputs' addresses or shapes from call to call."""
    activation_checkpoint: str = field(default="none",
                                       metadata=one_of("none", "full", "selective", "elementwise"))
    """Recomputation in the backward, per block: "none"; "full" (the whole block); "selective"
    (torchtitan's op policy: every second matmul); "elementwise" (keep the matmul and attention
    outputs, RWKV6's data-dependent lerps and autocast's bf16 copies of the weights; recompute
    norms, the static token-shift lerps, gates and activations: about half the activation memory
    for a few percent of GPU time with training.compile)."""
    max_consecutive_nan_steps: int = field(default=5, metadata={"ge": 1})
    """Stop after this many non-finite steps in a row."""
    nan_recovery: bool = False
    """On that stop, reload the last good checkpoint and skip the data window that caused it."""
    varlen: bool = False
    """Pack documents into one row per micro-batch and pass cu_seqlens to the kernels."""
    device: str = field(default="auto", metadata=one_of("auto", "cuda", "cpu"))
    """"auto" (CUDA if available), "cuda" or "cpu"."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"],
                                    metadata={"item_choices": STOP_SIGNALS})
    """Signals that make every rank finish the current step, save a checkpoint there and exit with
    code 75 (preempted, resumable); one rank's signal is enough. A second signal while stopping
    aborts at once with code 76 (the previous complete checkpoint stays). [] keeps the signals'
    default actions."""


@dataclass
class Optimizer:
    name: str = field(default="AdamW", metadata=one_of("AdamW"))
    """Optimizer; AdamW is supported."""
    lr: float = field(default=3e-4, metadata={"gt": 0})
    """Peak learning rate."""
    betas: list[float] = field(
        default_factory=lambda: [0.9, 0.95], metadata={"length": 2, "item_range": (0.0, 1.0)}
    )
    """Adam betas."""
    eps: float = field(default=1e-8, metadata={"gt": 0})
    """Adam epsilon."""
    weight_decay: float = field(default=0.1, metadata={"ge": 0})
    """Decoupled weight decay of the linear layers' weights (the head included); never applied to
    norms, biases, mixing and decay vectors or LoRA matrices, nor to embeddings unless
    decay_embeddings."""
    decay_embeddings: bool = False
    """Apply weight_decay to the input embedding too, as RWKV-LM does (docs/rwkv-lm.md)."""
    implementation: str = field(default="foreach", metadata=one_of("fused", "foreach", "for-loop"))
    """"fused", "foreach" or "for-loop"."""
    decay_lr_multiplier: float = field(default=2.0, metadata={"ge": 0})
    """LR multiplier for the RWKV decay bias (time_decay / w0), as in RWKV practice."""


@dataclass
class LRScheduler:
    warmup_steps: int = field(default=200, metadata={"ge": 0})
    """Linear warmup steps: the multiplier rises linearly to 1 at update warmup_steps."""
    warmup_start: float = field(default=0.0, metadata={"ge": 0, "le": 1})
    """LR multiplier of the first update; 0 means 1 / warmup_steps (the multiplier of update n is
    n / warmup_steps). RWKV-LM's warmup of w steps is warmup_steps = w + 1, warmup_start = 0.01."""
    decay_type: str = field(default="cosine", metadata=one_of("cosine", "linear", "wsd"))
    """"cosine", "linear" or "wsd" (stable, then decay over the last decay_ratio of training)."""
    decay_ratio: float = field(default=0.1, metadata={"ge": 0, "le": 1})
    """WSD only: fraction of training spent decaying."""
    lr_min: float = field(default=0.0, metadata={"ge": 0})
    """Learning rate at the end of training (absolute)."""


@dataclass
class Checkpoint:
    enable: bool = True
    """Write checkpoints."""
    folder: str = field(default="checkpoint", metadata={"nonempty": True})
    """Sub-folder of dump_folder holding step-N checkpoints."""
    interval: int = field(default=500, metadata={"ge": 1})
    """Save every this many steps (and at the end)."""
    interval_minutes: float = field(default=0.0, metadata={"ge": 0})
    """Also save when this many minutes have passed since the last save began (whichever of steps
    or minutes comes first), so that a crash never costs more; 0 turns it off."""
    on_save_error: str = field(default="stop", metadata=one_of("stop", "continue"))
    """A save that fails (disk full, unwritable folder) has its partial folder removed and leaves
    the previous checkpoints intact; then "stop" ends the run with the error, "continue" warns and
    trains on (the next save tries again). The final save and a stop signal's save always stop."""
    keep_latest_k: int = field(default=3, metadata={"ge": 0})
    """Keep only the newest k checkpoints; 0 keeps all."""
    async_mode: str = field(default="disabled", metadata=one_of("disabled", "async"))
    """"disabled" or "async"."""
    io_threads: int = field(default=8, metadata={"ge": 1})
    """Threads per rank that write a checkpoint's files (one file each) and read them back on a
    resume; 1 writes one file per rank and reads one file at a time."""
    load_step: int = field(default=-1, metadata={"ge": -1})
    """Resume from this step; -1 picks the latest complete checkpoint."""
    initial_load_path: str = ""
    """Start a new run from this checkpoint folder, or from the model weights of an exported hf/fla
    folder or an RWKV-LM .pth (python -m flame.export writes them)."""
    initial_load_model_only: bool = True
    """With initial_load_path: load only the model weights."""


@dataclass
class Metrics:
    log_freq: int = field(default=10, metadata={"ge": 1})
    """Log every this many steps."""
    enable_wandb: bool = False
    """Log to wandb: online with an API key (WANDB_API_KEY or `wandb login`), else offline into
    <job.dump_folder>/wandb; the log names the offline run's folder and its `wandb sync` command."""
    wandb_project: str = field(default="flame", metadata={"nonempty": True})
    """wandb project name."""
    wandb_init_timeout_seconds: float = field(default=20.0, metadata={"gt": 0})
    """How long wandb's online start waits for the server (wandb.init's init_timeout; wandb's own
    login checks add up to 10 s) before the run logs to wandb offline instead and trains on."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files into <job.dump_folder>/tensorboard."""
    val_freq: int = field(default=0, metadata={"ge": 0})
    """Evaluate the validation loss every this many steps (0 disables)."""
    val_steps: int = field(default=10, metadata={"ge": 1})
    """Micro-batches per validation evaluation."""


@dataclass
class Parallel:
    data_parallel_shard_degree: int = field(default=-1, metadata={"ge": -1, "ne": 0})
    """How data-parallel ranks split the model. -1: flame chooses by memory: every rank holds a
    replica when the estimated peak of a replica's step (fp32 weights, gradients and AdamW state,
    compute copies, one micro-batch's activations at this config's batch, sequence length and
    activation checkpointing) takes at most 90% of the free memory of the GPU with the least
    (always on CPUs), else FSDP shards over every rank; the log gives the estimates and the choice
    (with data_parallel_replicate_degree > 1, -1 instead fills the ranks that replication leaves
    with shards). 1: replicas on every rank (the one-GPU step, CUDA graphs included, and the
    gradients all-reduced in buckets during the backward). N > 1: FSDP over N ranks (HSDP with
    data_parallel_replicate_degree replicas of them), for models that do not fit."""
    data_parallel_replicate_degree: int = field(default=1, metadata={"ge": 1})
    """Replicas of the FSDP shard group (HSDP), across nodes; equal to the number of ranks, or
    with data_parallel_shard_degree = 1, the model is replicated without FSDP."""
    fsdp_hold_weights: bool | str = field(default="auto", metadata={"choices": ("auto", True, False)})
    """Under FSDP: true gathers each block's bf16 weights once per step and keeps them on every
    rank (2 bytes per parameter, in buffers that every step reuses, so the compiled blocks replay
    as CUDA graphs), with the step's gradients unsharded in the reduce dtype until its last
    micro-batch reduce-scatters them: one gather and one reduction per block and step. false:
    FSDP frees a block's weights after use (parallel.reshard_after_forward) and reduce-scatters
    after every micro-batch, without CUDA graphs: the least memory. "auto": held when the
    estimated peak of a rank's step with held weights takes at most 90% of the free memory of the
    GPU with the least, else freed (held on CPUs); the log gives both estimates and the choice."""
    reshard_after_forward: str = field(default="default", metadata=one_of("default", "always", "never"))
    """Under FSDP with freed weights (parallel.fsdp_hold_weights false, or "auto" choosing them; a
    config error with true, and a warning when "auto" holds them), whether a block frees its
    gathered weights after its forward and gathers them again for the backward: "default" (every
    block but the last, whose weights the backward needs at once), "always", or "never" (one
    gather per block and micro-batch, the gathered weights of every block held from the forward to
    the backward; the freed estimate counts them)."""
    init_timeout_minutes: float = field(default=20.0, metadata={"gt": 0})
    """Collective timeout from the process-group start to the end of the first step (setup, data,
    checkpoint load, compile)."""
    collective_timeout_minutes: float = field(default=5.0, metadata={"gt": 0})
    """Collective timeout after the first step: when a rank dies or hangs, the others stop after
    this long at the latest, each with an error naming itself and the last step it finished,
    instead of waiting forever."""


@dataclass
class Profiling:
    enable: bool = False
    """Trace `steps` optimizer steps with torch.profiler (host and GPU activity) into
    `<job.dump_folder>/<folder>/rank<R>.json`, a Chrome trace (chrome://tracing, Perfetto)."""
    start_step: int = field(default=10, metadata={"ge": 1})
    """The first traced step: later than the compile and warm-up steps."""
    steps: int = field(default=2, metadata={"ge": 1})
    """Optimizer steps to trace."""
    folder: str = field(default="profile", metadata={"nonempty": True})
    """Folder of the traces, inside job.dump_folder."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    parallel: Parallel = field(default_factory=Parallel)
    profiling: Profiling = field(default_factory=Profiling)
