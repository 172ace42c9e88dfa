"""The decoding step of a fixed batch over static buffers, captured once as a CUDA graph.

A `Decoder` owns, for B sequences of one model: the input tokens [B], the recurrent state (one
`LayerState` per layer, every field allocated: flame.models.state) and the stacked weights that
`CausalLM.decode_step` reads. `step()` runs the model's decode step on them and returns the
logits [B, vocab]; the state is updated in place. On CUDA the step over all layers is captured once
(`torch.cuda.CUDAGraph`) and each `step()` replays it: one launch from the host per token instead
of one per kernel, and no host sync. Elsewhere (CPU) the same step runs eagerly on the same
buffers, so tests on CPU exercise the buffer logic the graph replays.

    decoder = decoder_for(model, batch_size)   # cached per model, batch size, device and dtype
    logits, state = prefill(model, prompts)    # the prompts through the chunked kernels
    decoder.load(state)                        # copy the prefill's state into the buffers
    decoder.tokens.copy_(next_tokens)
    logits = decoder.step()                    # a static buffer, overwritten by the next step

The graph reads the model's parameters where they are and the stacked copies in `weights`;
`refresh()` copies changed parameters (tracked by their in-place version counters) into those
copies, and `decoder_for` builds a new decoder when the parameters were replaced (e.g. moved).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from flame.inference.compiled import compilation_failed, compiled_blocks
from flame.models.state import LayerState

WARMUP_STEPS = 2
"""Eager steps before the capture: Triton compiles its kernels and cuBLAS picks its own outside
the graph."""

_DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _parameter_versions(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(p._version for p in model.parameters())


def _parameter_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())


class Decoder:
    """One model's decoding step for `batch_size` sequences over static buffers (module docstring).

    graph: capture the step as a CUDA graph (default: on CUDA). A capture that fails (an op that
    syncs with the host, say) warns and leaves the decoder eager; `graphed` says which it is.
    """

    def __init__(self, model, batch_size: int, graph: bool | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        weight = model.embeddings.weight
        self._model = weakref.ref(model)
        self.batch_size = batch_size
        self.device, self.dtype = weight.device, weight.dtype
        self.tokens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.state: list[LayerState] = model.new_decode_state(batch_size)
        self.weights = model.decode_weights()
        self._versions = _parameter_versions(model)
        self.logits: torch.Tensor | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        if graph is None:
            graph = self.device.type == "cuda"
        if graph:
            if self.device.type != "cuda":
                raise ValueError(f"a CUDA graph needs a CUDA model, this one is on {self.device}")
            self._capture()

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("the decoder's model no longer exists")
        return model

    def _run(self) -> torch.Tensor:
        return self.model.decode_step(self.tokens, self.state, self.weights)

    def _capture(self) -> None:
        """Warm up on a side stream, then capture the step. The warm-up steps overwrite the state
        buffers; `load` fills them before any real step."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self._run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    logits = self._run()
            except Exception as err:  # noqa: BLE001 - the step ran eagerly just above; eager decoding still works
                warnings.warn(f"flame decoding: the CUDA graph capture of the decode step failed, decoding runs "
                              f"eagerly ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
                              RuntimeWarning, stacklevel=3)
                torch.cuda.synchronize()
                return
        self._graph, self.logits = graph, logits

    def refresh(self) -> None:
        """Copy the model's parameters into the stacked weights if any changed in place since the
        last copy (cheap when none did: one version counter per parameter)."""
        versions = _parameter_versions(self.model)
        if versions == self._versions:
            return
        for mine, fresh in zip(self.weights, self.model.decode_weights()):
            for name, tensor in mine.items():
                tensor.copy_(fresh[name])
        self._versions = versions

    @torch.no_grad()
    def load(self, state: list[LayerState]) -> None:
        """Copy a state of `batch_size` rows (e.g. from `forward_with_state`) into the buffers."""
        if len(state) != len(self.state):
            raise ValueError(f"state has {len(state)} layer states for a model of {len(self.state)} layers")
        for mine, theirs in zip(self.state, state):
            mine.copy_(theirs)

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """The logits [batch_size, vocab] of `tokens` continuing the state, which moves one token
        on. The returned tensor is the decoder's buffer: the next step overwrites it."""
        if self._graph is not None:
            self._graph.replay()
        else:
            self.logits = self._run()
        return self.logits


PREFILL_SEGMENT = 2048
"""Tokens per compiled prefill call: a [B, T] prompt runs as T // PREFILL_SEGMENT segments of this
length through the compiled blocks (one graph per batch size, flame.inference.compiled), and the rest
of T eagerly. Shorter prompts run eagerly: compiling a graph costs far more than they take."""


@torch.no_grad()
def prefill(model, prompts: torch.Tensor | list[torch.Tensor], compile=True
            ) -> tuple[torch.Tensor, list[LayerState]]:
    """(last logits [B, vocab], state) of B prompts through the chunked kernels: a [B, T] tensor in
    one batched call, or a list of B 1-D tensors of any lengths packed into one varlen call
    (`forward_with_state` with cu_seqlens).

    compile (True, False or a torch.compile backend: `compiled_blocks`): a [B, T] prompt of at least
    PREFILL_SEGMENT tokens runs its whole segments through the model's compiled blocks, each segment
    of the same shape: the first from no state (the chunked kernels' fastest path), each later one
    continuing the state of the one before (a second graph); the rest of the prompt, and packed
    prompts, run eagerly."""
    if not isinstance(prompts, torch.Tensor):
        lengths = torch.tensor([0] + [p.numel() for p in prompts])
        cu_seqlens = lengths.cumsum(0).to(prompts[0].device)
        logits, state = model.forward_with_state(torch.cat(prompts)[None], last_only=True, cu_seqlens=cu_seqlens)
        return logits[:, -1], state
    segments = prompts.shape[1] // PREFILL_SEGMENT if prompts.dim() == 2 else 0
    state, done = None, 0
    if segments:
        with compiled_blocks(model, compile) as compiled:
            if compiled:
                for _ in range(segments):
                    logits, state = model.forward_with_state(prompts[:, done:done + PREFILL_SEGMENT], state,
                                                             last_only=True)
                    done += PREFILL_SEGMENT
        if compilation_failed(model, compile):
            state, done = None, 0  # a part of a block may have run twice: the whole prompt eagerly
    if done == 0:
        logits, state = model.forward_with_state(prompts, last_only=True)
    elif done < prompts.shape[1]:
        logits, state = model.forward_with_state(prompts[:, done:], state, last_only=True)
    return logits[:, -1], state


def decoder_for(model, batch_size: int, graph: bool | None = None) -> Decoder:
    """The model's cached `Decoder` for batch_size sequences (built, and on CUDA captured, on first
    use; rebuilt when the parameters moved), with its stacked weights refreshed. One decoder per
    model and batch size: two generations of the same batch size cannot interleave."""
    weight = model.embeddings.weight
    addresses = _parameter_addresses(model)
    graph = weight.device.type == "cuda" if graph is None else graph
    cache = _DECODERS.setdefault(model, {})
    for key in [k for k in cache if k[-1] != addresses]:
        del cache[key]  # the parameters were replaced: those graphs read freed memory
    key = (batch_size, weight.device, weight.dtype, graph, addresses)
    decoder = cache.get(key)
    if decoder is None:
        decoder = cache[key] = Decoder(model, batch_size, graph=graph)
    else:
        decoder.refresh()
    return decoder


def release_decoders(model) -> None:
    """Drop the model's cached decoders (their buffers, stacked weights and graphs)."""
    _DECODERS.pop(model, None)
