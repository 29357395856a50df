"""transformers' continuous-batching runner, driven one batch at a time.

This module drives what every supported release from 5.4 shares: the manager
(`init_continuous_batching`), its batch processor, the IO object that pads and stages a batch
(`prepare_batch_tensors`), the part that pads a batch's sizes and captures or replays its graph (the model runner from 5.9, the
batch processor before) and the graph store keyed by padded sizes. Where the releases differ in how
the paged KV cache is laid out and where a request's block table lives, `Engine` leaves the work to
a subclass per layout (`pytest_graphmode.hf.paged_tensors`, `pytest_graphmode.hf.sector_cache`);
where they differ in the calls around a step (the options they take, where sizes are padded),
`pytest_graphmode.hf.versions.has` says which release has what. 5.0 to 5.3, which build their batch
processor only inside the generation loop, are driven by `pytest_graphmode.hf.continuous_api`
through the methods that build the engine (`_build`), make a request's scheduled state
(`_future`), stage and run a batch (`_step`), and read its tokens and graphs (`_tokens`,
`_graph_store`, `_graph_key`).

The engine is transformers' own: its padding, its graph keys, its warm-up and its capture. This
module replaces only the scheduler (the caller chooses each batch and its blocks) and adds one
forward hook that copies the model's logits out, since transformers keeps its logits inside the
captured graph and hands out only the sampled tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_graphmode.hf.versions import (
    LAYOUTS,
    Layout,
    UnsupportedTransformers,
    check_version,
    has,
    layout_of,
    split_trash,
)


@dataclass(frozen=True)
class EngineConfig:
    """A random-weight Llama and the continuous-batching sizes it is served with."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    block_size: int = 8  # transformers' smallest is 4
    num_blocks: int = 32  # allocatable blocks; transformers adds its two trash blocks to them
    max_batch_tokens: int = 32
    max_requests: int = 4
    q_padding: int = (
        16  # query tokens are padded to a multiple of this (the graph key's first size)
    )
    kv_padding: int = 32  # cached tokens read are padded to a multiple of this (its second size)
    # From 5.3 transformers stages a batch on the current stream and runs its forward on a compute
    # stream that never waits for it (docs/targets-hf.md). True adds that one wait before each
    # step, the ordering transformers leaves commented out: transformers as it would be fixed.
    order_streams: bool = False

    @property
    def max_position(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class EngineRequest:
    """One request of a batch as the engine takes it."""

    request_id: int
    tokens: tuple[int, ...]
    context_len: int
    block_ids: tuple[int, ...]


@dataclass
class EngineStep:
    logits: Tensor  # [num_requests, vocab] float32, the caller's own copy
    tokens: Tensor  # [num_requests] int64, transformers' greedy tokens
    graph_key: Hashable | None  # the padded sizes keying the graph; None with graphs off
    captured: bool  # this step captured its graph (its results come from the eager run before)


class Engine(ABC):
    """One continuous-batching model runner of transformers, with CUDA graphs requested or not.

    A subclass serves one layout of the paged KV cache: it names the option that sets the block
    size, finds the block table and the trash blocks, and exposes the cache slot-major."""

    # The layout of the releases this subclass serves (`pytest_graphmode.hf.versions`).
    layout: Layout
    # The ContinuousBatchingConfig field that sets how many tokens a block holds.
    block_size_option: str

    def __init__(
        self, config: EngineConfig, *, seed: int, graphs: bool, device: torch.device
    ) -> None:
        self.version = check_version()
        if layout_of(self.version) != self.layout:
            oldest, beyond = LAYOUTS[self.layout]
            raise UnsupportedTransformers(
                f"{type(self).__name__} drives transformers {oldest[0]}.{oldest[1]} to "
                f"{beyond[0]}.{beyond[1] - 1}, whose cache is laid out as {self.layout!r}; "
                f"transformers {self.version} is installed: make the engine of its layout, "
                f"{layout_of(self.version)!r}"
            )
        self.config = config
        # transformers seeds the global generator while it builds its batch processor: the
        # caller's generator is left as it was, and a twin made after another draws the same.
        with _own_generators():
            self._build(config, seed=seed, graphs=graphs, device=device)
        if device.type == "cuda":  # the warm-up ran on transformers' own compute stream
            torch.cuda.synchronize(device)
        # The warm-up wrote its fake requests into the cache: both twins start from zeros, as
        # transformers' read-trash block must stay.
        with torch.no_grad():
            self._clear_cache()

    def _build(
        self, config: EngineConfig, *, seed: int, graphs: bool, device: torch.device
    ) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        attention, attention_options = self._attention(
            {field.name for field in dataclasses.fields(ContinuousBatchingConfig)}
        )
        self._build_model(config, seed=seed, device=device, attention=attention)
        # The options only some releases take.
        optional: dict[str, Any] = {}
        if has(self.version, "seed_option"):
            optional["seed"] = seed
        if has(self.version, "max_requests_per_batch"):
            optional["max_requests_per_batch"] = config.max_requests
        # Greedy, no EOS, synchronous, no prefix sharing (it would tie blocks to token contents the
        # caller does not know), no decode fast path (it needs flash attention on a GPU): the
        # varlen path, whose graphs are keyed by padded query and KV sizes, serves every batch.
        cb_config = ContinuousBatchingConfig(
            num_blocks=config.num_blocks,
            max_batch_tokens=config.max_batch_tokens,
            max_blocks_per_request=0,
            use_cuda_graph=graphs,
            use_async_batching=False,
            allow_block_sharing=False,
            q_padding_interval_size=config.q_padding,
            kv_padding_interval_size=config.kv_padding,
            **{self.block_size_option: config.block_size},
            **optional,
            **attention_options,
        )
        generation = GenerationConfig(do_sample=False, eos_token_id=-1)
        self._manager: Any = self.model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=cb_config
        )
        # The warm-up builds the batch processor only where there is none: built first, it is
        # the same one, and the streams are ordered (`order_streams`) before the first forward.
        self._manager.batch_processor = self._manager._create_batch_processor()
        self._processor: Any = self._manager.batch_processor
        self._cache: Any = self._processor.cache
        self._io: Any = self._processor.inputs_and_outputs
        self._order_streams()
        # Its warm-up captures the largest graph first, so later captures fit in its pool. 5.4
        # has none: each graph is captured by the first batch of its sizes.
        if has(self.version, "self_sized_warmup"):
            self._manager.warmup()
        elif has(self.version, "warmup"):
            # The sizes later releases choose: their defaults here ask for more pages than the
            # cache has, and the warm-up would capture nothing.
            queries = config.max_batch_tokens
            self._manager.warmup(queries, config.max_position - queries)
        # What pads a batch's sizes, and captures or replays its graph.
        self._runner: Any = (
            self._processor.model_runner if has(self.version, "model_runner") else self._processor
        )
        self._check_layout()
        # One flag for both paths up to 5.5, a (varlen, decode) pair from 5.6.
        flag = self._processor.cb_config.use_cuda_graph
        self.graphs = bool(flag[0] if has(self.version, "graph_flag_per_path") else flag)

    def _build_model(
        self, config: EngineConfig, *, seed: int, device: torch.device, attention: str
    ) -> None:
        """The model of `seed` on `device` with `attention`, hooked to copy its logits out."""
        self.model = llama(config, seed).to(device).eval()
        self.model.set_attn_implementation(attention)
        # Hooked before the warm-up, so the graphs it captures copy the logits out too.
        self._logits = torch.zeros(
            config.max_requests, config.vocab_size, dtype=self.model.dtype, device=device
        )
        self._hook = self.model.register_forward_hook(self._keep_logits, with_kwargs=True)

    def _attention(self, cb_fields: set[str]) -> tuple[str, dict[str, Any]]:
        """The attention implementation to set on the model, and the ContinuousBatchingConfig
        options (among `cb_fields`) that keep transformers on it."""
        # Paged SDPA named outright: left to choose, transformers switches to flash attention
        # where a flash package or kernel is installed, and the path under test would vary by host.
        return "paged|sdpa", {}

    @abstractmethod
    def _check_layout(self) -> None:
        """Check the cache is laid out as this subclass reads it; raise `UnsupportedTransformers`
        otherwise."""

    @abstractmethod
    def _clear_cache(self) -> None:
        """Zero the whole cache, trash blocks included."""

    @abstractmethod
    def _block_table(self) -> dict[str, list[int]]:
        """The block table transformers reads a request's block ids from, keyed by request id."""

    @property
    @abstractmethod
    def read_trash_block(self) -> int:
        """The zeroed block padding tokens read from."""

    @property
    @abstractmethod
    def write_trash_block(self) -> int:
        """The block padding tokens write to; nothing reads it."""

    @abstractmethod
    def kv_tensors(self) -> list[Tensor]:
        """Per layer, its key then its value cache, slot-major: [(num_blocks + 2) * block_size,
        kv_heads, head_dim]."""

    @abstractmethod
    def _before_step(self) -> None:
        """Runs before a batch is staged: where `kv_tensors` are not the cache itself, what the
        caller wrote into them goes into the cache."""

    @abstractmethod
    def _after_step(self) -> None:
        """Runs once a step's outputs are read: where `kv_tensors` are not the cache itself, the
        step's writes go into them."""

    def _keep_logits(self, _module: Any, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
        # From 5.13 the model keeps only the rows at `logits_indices` (its `logits_to_keep`); up to
        # 5.12 it returns every token's and the runner picks those rows after. Up to 5.10 the
        # indices run to the padded query size, the requests' rows first: the first
        # `max_requests` are kept. Either way: [rows, vocab], the requests' rows first, then
        # padding rows nobody reads; a replay repeats this copy. Up to 5.2 padding indices are -1,
        # which indexing takes from the end (`index_select` would refuse them); from 5.3 they are
        # 0, and both pick the same rows.
        logits = output.logits[0]
        if "logits_to_keep" not in kwargs:
            logits = logits[kwargs["logits_indices"][: self._logits.shape[0]]]
        self._logits[: logits.shape[0]].copy_(logits)

    def run(self, requests: Sequence[EngineRequest]) -> EngineStep:
        """Stage `requests` with transformers' own padding, run its model runner, read the results."""
        from transformers.generation.continuous_batching.requests import (
            RequestState,
            RequestStatus,
        )

        futures = []
        table = self._block_table()
        for request in requests:
            name = f"graphmode-{request.request_id}"
            state = RequestState(request_id=name, initial_tokens=list(request.tokens))
            # The status setter records lifecycle timestamps; the warm-up sets it this way too.
            state._status = (
                RequestStatus.DECODING if request.context_len else RequestStatus.PREFILLING
            )
            state.tokens_to_process = list(request.tokens)
            state.position_offset = request.context_len
            table[name] = list(request.block_ids)
            futures.append(self._future(state))
        try:
            return self._run(futures, requests)
        finally:
            for request in requests:
                table.pop(f"graphmode-{request.request_id}", None)

    def _future(self, state: Any) -> Any:
        """What transformers' scheduler hands out for `state`: a `FutureRequestState` that wants
        its next token and shares no complete block."""
        from transformers.generation.continuous_batching.requests import FutureRequestState

        # Up to 5.5 the query length is the state's `tokens_to_process`, not an argument.
        query = (len(state.tokens_to_process),) if has(self.version, "future_query_length") else ()
        return FutureRequestState(state, True, 0, *query)

    @torch.no_grad()
    def _run(self, futures: list[Any], requests: Sequence[EngineRequest]) -> EngineStep:
        self._before_step()
        num_requests = len(requests)
        graphs_before = len(self._graph_store())
        self._step(futures, requests)
        key = self._graph_key() if self.graphs else None
        step = EngineStep(
            logits=self._logits[:num_requests].float().clone(),
            tokens=self._tokens(num_requests),
            graph_key=key,
            captured=len(self._graph_store()) > graphs_before,
        )
        self._after_step()
        # transformers' compute stream does not wait for the caller's: the copies above must have
        # read the static outputs before the next step's forward rewrites them.
        if self._logits.is_cuda:
            torch.cuda.current_stream(self._logits.device).synchronize()
        return step

    def _step(self, futures: list[Any], requests: Sequence[EngineRequest]) -> None:
        """Pad the batch's sizes and stage it as transformers' loop does, then run its generation
        step: capture the graph of its padded sizes, replay it, or run eagerly."""
        num_q = sum(len(request.tokens) for request in requests)
        kv_read = sum(request.context_len for request in requests)
        padded_q, padded_kv = self._pad(num_q, kv_read)
        # From 5.13 the IO object pads the batch as it stages it; up to 5.12 it pads when
        # `_generation_step` hands the batch to the model, with the same flag.
        padding = {"use_padding": self._runner.pad_inputs} if split_trash(self.version) else {}
        if has(self.version, "staged_logits_processor"):
            self._io.prepare_batch_tensors(
                futures, self._processor.logit_processor, False, padded_q, padded_kv, **padding
            )
            self._processor._generation_step(self.model)
        else:
            self._io.prepare_batch_tensors(futures, False, padded_q, padded_kv)
            self._processor._generation_step(self.model, self._manager.logit_processor)

    def _order_streams(self) -> None:
        """With `order_streams`, transformers' compute stream (from 5.3) waits for the current
        one each time the IO object has handed out a batch's inputs, in its warm-up and in every
        step: what it staged is then ordered before the forward that reads it."""
        compute_stream = getattr(self._io, "compute_stream", None)
        if not self.config.order_streams or compute_stream is None:
            return
        model_kwargs = self._io.get_model_kwargs

        def ordered_model_kwargs(*args: Any, **kwargs: Any) -> Any:
            batch = model_kwargs(*args, **kwargs)
            compute_stream.wait_stream(torch.cuda.current_stream())
            return batch

        self._io.get_model_kwargs = ordered_model_kwargs

    def _tokens(self, num_requests: int) -> Tensor:
        """The requests' greedy tokens, from transformers' static output (its first row; a second
        holds log probabilities where they are asked for)."""
        return self._io.output_ids[0, :num_requests].to(torch.int64)

    def _graph_store(self) -> Mapping[Hashable, Any]:
        """transformers' captured graphs, by key."""
        store: Mapping[Hashable, Any] = self._io.graphs._storage
        return store

    def _graph_key(self) -> Hashable:
        """The key transformers stores the step's graph under."""
        if has(self.version, "graph_key"):
            return self._io._get_graph_key()
        # Up to 5.5 the graph store is keyed by the padded sizes alone.
        return (self._io.num_q_tokens, self._io.max_kv_read)

    def _pad(self, num_q: int, kv_read: int) -> tuple[int, int]:
        """The query and KV-read sizes transformers pads a varlen batch of these sizes to."""
        if has(self.version, "maybe_pad_inputs"):
            padded: tuple[int, int] = self._runner.maybe_pad_inputs(num_q, kv_read, False)
            return padded
        # Before 5.8 the scheduling step (`prepare_next_batch`, which the caller replaces) pads
        # inline, with these calls on these attributes of the batch processor.
        from transformers.generation.continuous_batching.utils import pad_to_interval

        processor = self._processor
        if not processor._pad_inputs:
            return num_q, kv_read
        return (
            pad_to_interval(num_q, processor.q_padding_interval_size, processor.max_batch_tokens),
            pad_to_interval(kv_read, processor.kv_padding_interval_size, self._cache.num_pages),
        )

    def load_weights(self, seed: int) -> None:
        """Replace every weight in place by those of `seed`, so captured graphs read the new ones."""
        fresh = llama(self.config, seed).state_dict()
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(fresh[name])

    def close(self) -> None:
        self._hook.remove()
        # Dropping the batch processor resets its graphs and frees their pool (its __del__).
        self._manager.batch_processor = None
        self._processor = self._cache = self._io = self._runner = None


def llama(config: EngineConfig, seed: int) -> Any:
    """The random-weight Llama of `seed` on the CPU, as an `Engine` of that seed holds it; the
    global generator is left as it was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # attn_implementation reaches the base config through **kwargs, which LlamaConfig's typed
    # signature does not show
    llama_config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position,
        attn_implementation="sdpa",
    )
    with _own_generators():
        torch.manual_seed(seed)
        return LlamaForCausalLM(llama_config)


def _own_generators() -> contextlib.AbstractContextManager[None]:
    """Restore every global generator on exit: `torch.manual_seed` seeds each GPU's too."""
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=gpus)
