"""Turn a scheduled step into tensors, run one forward pass, and sample.

The runner owns the model, the KV tensors and the sampler. It flattens the scheduler's decision
into what the model consumes: token ids and positions of every new token, the slots where their
K/V go, each sequence's cached context and block table (for attention), and which rows need
logits (the last new token of every sequence that reaches the end of its known tokens).

Two ways to run the forward pass, two step executors (engine/step_executor.py) picked per step: the
PyTorch model (models/llama.py) with an attention backend, for every step, or, on CPU when every
sequence adds a few tokens (a decode or a verify step), the fused C step (engine/fused_step.py,
kernels/decode.py), which computes the same thing without ~35 Python-dispatched operations per layer.

Prompt logprobs (``SamplingParams.prompt_logprobs``) need the LM head on prompt rows too, which the
fused step never computes: a step where a request asks for them runs through PyTorch, keeps the
hidden states of all rows, and runs the head over that request's prompt rows in chunks of at most
``PROMPT_LOGPROBS_CHUNK_ROWS`` (one chunk's logits live at a time, however long the prompt).

On CPU each step runs with the thread count a :class:`~minserve.engine.threads.ThreadController`
picks from measured decode steps: fewer threads when other processes take cores (engine/threads.py).
"""

from __future__ import annotations

import itertools
import logging
import types

import torch

from minserve.attention import StepSequences, TorchAttentionBackend
from minserve.config import EngineConfig
from minserve.engine.logits_batch import processor_rows
from minserve.engine.kv_cache import KVCacheManager, KVCacheSpec, LayerKV, allocate_kv_tensors, allocate_layer_kv
from minserve.engine.memory import DeviceMemory, DeviceMemoryReader, measure_device_memory, snapshot
from minserve.engine.sampler import Sampler, SamplingBatch, banned_tokens
from minserve.engine.batch_invariance import check_model, make_row_invariant
from minserve.engine.fused_step import FusedCpuExecutor, InvariantFusedExecutor, fused_decoder, invariant_fused_decoder
from minserve.engine.step_executor import ModelExecutor, StepExecutor
from minserve.engine.step_io import ModelRunnerOutput, SampledToken, SchedulerOutput
from minserve.engine.threads import CpuLoadHint, ThreadController, adaptive_threads_enabled
from minserve.kernels import bf16_gemm
from minserve.kernels.build import env_choice
from minserve.models.layers import Linear, RotaryEmbedding
from minserve.models.llama import LlamaForCausalLM
from minserve.models.loader import LoadedModel
from minserve.models.registry import ModelRegistry
from minserve.engine.kv_sizing import kv_budget_within
from minserve.quant.schemes import Int4Linear, Int8Linear, apply_quantization
from minserve.quant.sizes import WeightFootprint, model_footprint
from minserve.sampling_params import SamplingParams
from minserve.spec.verify import accept_one_hot, verify_with_draft

log = logging.getLogger("minserve")

# Tokens per sequence the fused C step takes: a decode (1) or a verify step of up to 7 proposals.
# Longer ones (prefill chunks) run through PyTorch, whose GEMMs use the cores better.
MAX_FUSED_QUERY_LEN = 8
# Prompt rows sent through the LM head at once for prompt logprobs: 256 rows of a 49k vocabulary
# are 50 MB of fp32 logits, which bounds the memory whatever the prompt length.
PROMPT_LOGPROBS_CHUNK_ROWS = 256


class ModelRunner:
    """Built in two phases, so that on CUDA the KV pool is sized after the weights are on the device
    and the largest step has run once (vLLM's order; engine/memory.py): ``ModelRunner(...)`` places
    the weights and, given a memory ``reader``, profiles (``device_memory``); the engine plans the
    pool from that, then :meth:`allocate_kv` allocates it. ``max_positions`` is an upper bound of
    max_model_len (the rotary tables are cut to the final length in allocate_kv)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_positions: int,
                 reader: DeviceMemoryReader | None = None):
        self.device = torch.device(config.device)
        self.config = config
        start = snapshot(reader) if reader is not None else None  # before any weight is placed
        # The architecture's class (models/registry.py): LlamaForCausalLM, Qwen3ForCausalLM or
        # one registered with ModelRegistry.register_model.
        model_cls = ModelRegistry.resolve_model_cls(loaded.config.architecture)
        self.model = model_cls(loaded.config, loaded.weights, max_positions)
        # Quantize before anything binds the weights (the fused decoder holds raw pointers) and
        # before .to(dtype): codes come from the checkpoint's own values, not a bf16 rounding.
        dense = _quantize(self.model, config, loaded.tokenizer)
        self.model.to(device=self.device, dtype=config.torch_dtype)
        self.model.rotary.build_tables(self.device)  # fp32 tables whatever the model dtype
        _split_for_tiles(self.model, config)
        _tile_for_a8(self.model)
        _log_weights(self.weight_footprint(), dense, config)
        _resolve_memory_budget(config, self.weight_footprint())
        # The attention backend whose metadata any step can use (torch), the Triton decode backend
        # on CUDA (its per-layer op serves torch metadata too, so the model attends through it),
        # and the step executors by preference (allocate_kv adds the fused C step).
        if config.batch_invariant:   # the PyTorch path's products, for where the fused step cannot run
            check_model(self.model.config)
            make_row_invariant(self.model)
        self.layer_backend = TorchAttentionBackend(config.block_size, self.device, config.batch_invariant)
        self.decode_backend = _triton_decode_backend(self.model.config, config, self.device)
        self.model.use_attention(self.decode_backend or self.layer_backend)
        self.model_executor = ModelExecutor(self, self.layer_backend)  # runs any step
        self.executors: list[StepExecutor] = [self.model_executor]
        # Profiling hook (CUDA): the weights are placed; run the largest step once and measure.
        self.device_memory: DeviceMemory | None = (
            measure_device_memory(reader, start, self._profile_largest_step) if reader is not None else None)
        self.kv_caches: list[LayerKV] = []  # allocate_kv(): (k, v) per layer, int8: + their scales
        self.block_size = config.block_size
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        # Custom logits processors (engine/logits_batch.py LogitsProcessors), set by the engine
        # when it has some; None: no rows are tracked and no logits copied for them.
        self.logits_processors = None
        # Structured outputs: the engine's GrammarBackend (minserve/structured), which fills the
        # allowed-token bitmask of constrained rows; None in a runner used without an engine.
        self.grammar = None
        # A draft-model proposer's distributions for this step's proposals, by request id
        # ([proposals, vocab]; spec/draft.py): sampled requests verify against them by rejection
        # sampling. Requests without an entry verify their proposals as one-hot (spec/verify.py).
        self.draft_probs: dict[str, torch.Tensor] = {}
        # Step observers' logits capture (engine/observers.py): called with the rows' requests and
        # the raw logits of every sampling step; None (no observer) costs nothing.
        self.logits_tap = None
        # CPU only: a GPU step's host threads are not where its time goes.
        adaptive = adaptive_threads_enabled(config) and self.device.type == "cpu"
        self.threads = ThreadController(torch.get_num_threads(), enabled=adaptive,
                                        load_hint=CpuLoadHint() if adaptive else None)

    def allocate_kv(self, spec: KVCacheSpec, max_model_len: int) -> None:
        """Second phase: allocate the planned KV pool (and bind the fused decode step to it)."""
        rotary = self.model.rotary
        if max_model_len != rotary.cos.shape[0]:
            cfg = self.model.config
            self.model.rotary = RotaryEmbedding(cfg.head_dim, max_model_len, cfg.rope_theta, cfg.rope_scaling)
            self.model.rotary.build_tables(self.device)
        self.kv_caches = allocate_kv_tensors(self.model.config, spec, self.config.torch_dtype, self.config.device)
        self.block_size = spec.block_size
        self.layer_backend.block_size = spec.block_size
        if self.config.batch_invariant:
            # One executor for every step: a step on another path would give its rows other bits.
            fused = invariant_fused_decoder(self.model, self.kv_caches, self.config, MAX_FUSED_QUERY_LEN)
            self.executors = [InvariantFusedExecutor(fused, fused.max_rows) if fused is not None
                              else self.model_executor]
            return
        fused = fused_decoder(self.model, self.kv_caches, self.config, MAX_FUSED_QUERY_LEN)
        decode = [ModelExecutor(self, self.decode_backend)] if self.decode_backend is not None else []
        for e in decode:
            e.backend.block_size = spec.block_size
        self.executors = ([FusedCpuExecutor(fused, MAX_FUSED_QUERY_LEN)] if fused is not None else []) + decode + [
            self.model_executor]

    def set_layer_attention(self, make_op) -> None:
        """Attend through ``make_op(num_heads, num_kv_heads, head_dim)`` in every layer (the
        per-layer op's contract: attention/backend.py ``layer_attention``), on the PyTorch path
        only: the fused C step and the Triton decode kernel compute their own attention, so they
        are set aside. ``None`` puts the engine's own attention and backends back."""
        if not hasattr(self, "_own_executors"):
            self._own_executors = list(self.executors)
        if make_op is None:
            self.model.use_attention(self.decode_backend or self.layer_backend)
            self.executors = list(self._own_executors)
            return
        self.model.use_attention(types.SimpleNamespace(layer_attention=make_op))
        self.executors = [self.model_executor]

    @property
    def backends(self) -> list:
        """The executors as they were listed before step executors existed: the attention backend
        of each PyTorch-model executor, the fused C executor itself. Assigning a list sets the
        executors (an attention backend becomes the PyTorch model attending through it)."""
        return [e.backend if isinstance(e, ModelExecutor) else e for e in self.executors]

    @backends.setter
    def backends(self, items: list) -> None:
        self.executors = [x if isinstance(x, StepExecutor) else ModelExecutor(self, x) for x in items]

    @property
    def fused(self):
        """The fused C decoder when that executor is in use (None otherwise)."""
        return next((e.decoder for e in self.executors if isinstance(e, FusedCpuExecutor)), None)

    @fused.setter
    def fused(self, decoder) -> None:
        """Replace the fused executor's decoder (tests wrap it to count or time its calls)."""
        next(e for e in self.executors if isinstance(e, FusedCpuExecutor)).decoder = decoder

    def _profile_largest_step(self) -> None:
        """The largest step the scheduler can build, run once for its memory peak: a full
        ``max_num_batched_tokens`` spread over ``max_num_seqs`` fresh sequences (the widest batch:
        most logits rows, the sampler's largest sort), then the same tokens as few sequences as
        positions allow (the largest attention). K/V go to a scratch cache of one sequence's
        blocks that every layer shares (what is written there is never read back), in the engine's
        kv_cache_dtype: an int8 cache's dequantized copies are part of the peak."""
        cfg, mc = self.config, self.model.config
        total, bs = cfg.max_num_batched_tokens, cfg.block_size
        longest = self.model.rotary.cos.shape[0]  # no sequence is longer than the position tables
        blocks = -(-min(total, longest) // bs)
        scratch = allocate_layer_kv(mc, blocks, bs, cfg.torch_dtype, self.device, cfg.kv_cache_dtype)
        sampler = Sampler(torch.Generator(device=self.device).manual_seed(0))  # not the engine's stream
        params = SamplingParams(temperature=1.0, top_p=0.99, max_tokens=1)
        fewest = -(-total // longest)
        for n in sorted({max(min(cfg.max_num_seqs, total), fewest), fewest}, reverse=True):
            lens = [total // n + (i < total % n) for i in range(n)]
            ids = torch.zeros(total, dtype=torch.long, device=self.device)
            pos = torch.cat([torch.arange(q, device=self.device) for q in lens])
            rows = torch.tensor(list(itertools.accumulate(lens)), device=self.device) - 1
            meta = self.layer_backend.build_metadata(StepSequences(lens, [0] * n, [list(range(blocks))] * n))
            logits = self.model(ids, pos, [scratch] * mc.num_layers, meta, rows)
            sampler(logits, SamplingBatch([params] * n, [None] * n, [[] for _ in range(n)]))
            del logits

    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> ModelRunnerOutput:
        """Run the step; return, per request that samples, its accepted tokens (see step_io), and
        the requests whose own constraints left a row with nothing to sample (``errors``, also in
        ``client_errors``): those fail alone, the others keep this step's tokens."""
        tokens: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        for s in sched.scheduled:
            start, end = s.context_len, s.context_len + s.num_new_tokens
            tokens += s.request.token_ids(start, end - len(s.spec_token_ids)) + s.spec_token_ids
            positions += range(start, end)
            logits_rows += range(len(tokens) - s.num_logits_rows, len(tokens))
        seqs = StepSequences([s.num_new_tokens for s in sched.scheduled],
                             [s.context_len for s in sched.scheduled],
                             [kv.block_table(s.request.request_id) for s in sched.scheduled])
        spans = _prompt_logprob_spans(sched)
        executor = self.executor_for(seqs)
        if spans and not executor.takes_prompt_rows:   # the decode fused step has no prompt rows
            executor = self.model_executor
        meta = executor.build_metadata(seqs)
        to = dict(dtype=torch.long, device=self.device)
        ids, pos, rows = (torch.tensor(v, **to) for v in (tokens, positions, logits_rows))
        # Decode and verify steps are timed per shape (backend, batch, rows per sequence), so the
        # thread count adapts for verify steps too; prefill chunks vary too much to compare.
        decode_only = not any(s.is_prefill for s in sched.scheduled)
        key = ((executor.name, _batch_bucket(len(seqs.query_lens)), max(seqs.query_lens))
               if decode_only else None)
        user_threads = torch.get_num_threads()
        threads = self.threads.choose(key) if self.threads.enabled else user_threads
        if threads != user_threads:  # the whole step (sampler too), then the caller's setting back
            torch.set_num_threads(threads)
        try:
            t0 = self.threads.clock()
            if spans and executor.takes_prompt_rows:   # every row's final hidden state from C
                logits, h = executor.run(ids, pos, meta, rows, threads, final_hidden=True)
                prompt_logprobs = self._prompt_logprobs(spans, h, executor.lm_head)
            elif spans:  # the hidden states of every row, for the prompt rows' LM head
                h = self.model.hidden_states(ids, pos, self.kv_caches, meta)
                logits = self.model.compute_logits(h[rows])
                prompt_logprobs = self._prompt_logprobs(spans, h, self.model.compute_logits)
            else:
                logits = executor.run(ids, pos, meta, rows, threads)
            copies = [c for s in sched.scheduled for c in s.block_copies]
            if copies:  # parallel sampling: forked samples' own copy of the last prompt block
                self.copy_blocks(copies)
            sampled = self._sample(sched, logits)
            if spans:
                sampled.prompt_logprobs = prompt_logprobs
            self.threads.record(key, threads, self.threads.clock() - t0)
        finally:
            if threads != user_threads:
                torch.set_num_threads(user_threads)
        return sampled

    def executor_for(self, seqs: StepSequences) -> StepExecutor:
        """The first step executor, in order of preference, that runs this step (the PyTorch
        model with the torch attention backend runs any; the batch-invariant mode's executor, its
        only one, any step the token budget allows)."""
        reasons = []
        for executor in self.executors:
            reason = executor.unsupported_reason(seqs)
            if reason is None:
                return executor
            reasons.append(f"{executor.name}: {reason}")
        raise AssertionError(f"no step executor runs this step ({'; '.join(reasons)})")

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> ModelRunnerOutput:
        """One draw per logits row (a verify step's k + 1 rows each use the request's own params
        and generator, in order), then the proposals each request keeps (spec/verify.py). A
        request fails when a row its tokens come from had nothing to sample (Sampler's
        ``failed_rows``); a verify row after the first rejection is never used, so it does not."""
        sampling = [s for s in sched.scheduled if s.needs_sampling]
        if not sampling:
            return ModelRunnerOutput()
        reqs = [s.request for s in sampling for _ in range(s.num_logits_rows)]
        # Per row, the proposals a verify step puts before it (they count as its output so far).
        before = [s.spec_token_ids[:i] for s in sampling for i in range(s.num_logits_rows)]
        # Parallel sampling: samples forked off a request in this step each draw their first
        # token from its last row (rows appended after the others, which keep their indices).
        forks = [child for s in sampling for child in s.forks]
        if forks:
            ends = itertools.accumulate(s.num_logits_rows for s in sampling)
            logits = torch.cat([logits, logits[[end - 1 for s, end in zip(sampling, ends) for _ in s.forks]]])
            reqs += forks
            before += [[]] * len(forks)
        if self.logits_tap is not None:
            self.logits_tap(reqs, logits)
        procs = self.logits_processors
        if procs is not None:
            procs.update(processor_rows(reqs, before))
        out = self.sampler(logits, SamplingBatch.for_requests(reqs, before, self.grammar, procs))
        # Rows that asked for no logprobs get None (the sampler gives them [] when others asked).
        drawn = [SampledToken(out.token_ids[i], out.logprobs[i] or None if out.logprobs is not None else None,
                              out.ranks[i] if out.ranks is not None else None) for i in range(len(reqs))]
        result, row = ModelRunnerOutput(), 0
        dead = out.failed_rows
        fork_row = row_end = sum(s.num_logits_rows for s in sampling)
        for s in sampling:
            mine = drawn[row:row + s.num_logits_rows]
            row += s.num_logits_rows
            req = s.request
            q = self.draft_probs.get(req.request_id) if s.spec_token_ids else None
            if q is not None and not req.params.is_greedy:
                # The target distribution includes the request's penalties and biases.
                target = out.controlled_logits if out.controlled_logits is not None else logits
                tokens = verify_with_draft(
                    target[row - s.num_logits_rows:row], req.params,
                    [banned_tokens(req, i) for i in range(s.num_logits_rows)], s.spec_token_ids, q,
                    req.generator if req.generator is not None else self.sampler.default_generator,
                    raw=logits[row - s.num_logits_rows:row])
            else:
                keep = accept_one_hot(s.spec_token_ids, [t.token_id for t in mine]) if s.spec_token_ids else 1
                tokens = mine[:keep]
            # Its samples forked in this step drew from its last row: one of them failing fails
            # the request (its samples are one answer; the engine aborts the others).
            own = [row - s.num_logits_rows + j for j in range(len(tokens))]
            own += range(fork_row, fork_row + len(s.forks))
            fork_row += len(s.forks)
            failed = next((r for r in own if r in dead), None)
            if failed is None:
                result.sampled[req.request_id] = tokens
                continue
            at = len(req.output_token_ids) + (failed - (row - s.num_logits_rows) if failed < row_end else 0)
            result.errors[req.request_id] = f"{dead[failed]} at output token {at}"
            result.client_errors.add(req.request_id)
        for child, token in zip(forks, drawn[row:]):
            if child.parent is None or child.parent.request_id not in result.errors:
                result.sampled[child.request_id] = [token]
        return result

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, (source, destination), in every layer and every tensor of its
        layout: K and V, and int8's scales too (every tensor is indexed by block first)."""
        src, dst = (torch.tensor(ids, dtype=torch.long, device=self.device) for ids in zip(*pairs))
        for layer in self.kv_caches:
            for t in layer:
                t.index_copy_(0, dst, t.index_select(0, src))

    def _prompt_logprobs(self, spans: list[tuple], h: torch.Tensor, lm_head) -> dict[str, list]:
        """The prompt logprobs of each span (see _prompt_logprob_spans), by request id, running
        ``lm_head`` (hidden rows -> logits) over at most PROMPT_LOGPROBS_CHUNK_ROWS rows at a time.
        Returned in the step's output (the engine appends them to the request), not written into
        the request."""
        out: dict[str, list] = {}
        for req, row, lo, hi in spans:
            targets, entries = req.prompt_token_ids[lo:hi], out.setdefault(req.request_id, [])
            for a in range(0, hi - lo, PROMPT_LOGPROBS_CHUNK_ROWS):
                b = min(a + PROMPT_LOGPROBS_CHUNK_ROWS, hi - lo)
                logits = lm_head(h[row + a:row + b])
                entries += _target_logprobs(logits, targets[a:b], req.params.prompt_logprobs)
        return out

    def weight_bytes(self) -> int:
        """Weight bytes one forward pass streams (every linear layer as stored, the norms): the
        roofline's numerator. What the weights occupy is :meth:`weight_footprint`'s resident_bytes."""
        return self.model.weight_bytes()

    def weight_footprint(self) -> WeightFootprint:
        """Resident and streamed weight bytes, per format (minserve/quant/sizes.py)."""
        return model_footprint(self.model)


def _quantize(model: LlamaForCausalLM, config: EngineConfig, tokenizer) -> WeightFootprint:
    """Apply ``config.quantization`` (nothing when None); returns the dense model's footprint."""
    dense = model_footprint(model)
    if config.quant_scheme is not None:
        apply_quantization(model, config.quant_scheme, tokenizer)
    return dense


def _split_for_tiles(model: torch.nn.Module, config: EngineConfig) -> None:
    """fp32_matmul_precision="high": every dense float32 layer also keeps its weight as two bf16
    halves for the tiles (layers.Linear.split_weight), once, after the weights are in place and
    before the fused decoder binds them. Nothing without AMX tiles (the exact products run)."""
    if config.fp32_matmul_precision != "high":
        return
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.weight.dtype is torch.float32]
    why_not = ("the engine is not on the CPU" if config.device != "cpu" else
               f"dtype={config.dtype!r} has no float32 products" if config.dtype != "float32" else
               "no float32 layers (all quantized)" if not layers else
               "no AMX tiles here (or MINSERVE_AMX=off)" if not bf16_gemm.available() else None)
    if why_not:
        log.info("fp32_matmul_precision=high changes nothing: %s; the products stay as they are", why_not)
        return
    for layer in layers:
        layer.split_weight()
    log.info("fp32_matmul_precision=high: %d float32 layers keep bf16 halves for the AMX tiles (+%.1f MiB)",
             len(layers), sum(2 * lay.bf16_halves[0].numel() for lay in layers) * 2 / 2**20)


def _tile_for_a8(model: torch.nn.Module) -> None:
    """int8 activations: every quantized layer that takes them also keeps its weight in the integer
    loops' tile order (tile_for_a8; the same outputs, faster at every row count), once, before the
    fused decoder binds them. ``MINSERVE_A8_TILES=off`` keeps the row-major loops (to compare the
    two). Nothing without AVX-512 VNNI."""
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear)) and m.activations == "int8"]
    if not layers or env_choice("MINSERVE_A8_TILES", ("auto", "off")) == "off":
        return
    tiled = [layer for layer in layers if layer.tile_for_a8()]
    if tiled:
        log.info("int8 activations: %d layers keep their weights in the integer loops' tile order (+%.1f MiB)",
                 len(tiled), sum(layer.a8_tiles.numel() for layer in tiled) / 2**20)


def _log_weights(now: WeightFootprint, dense: WeightFootprint, config: EngineConfig) -> None:
    # e.g. "weights: int4 g32 lm_head=quantize, 101.3 MiB streamed per token, 209.3 MiB resident
    # (checkpoint: 513.3 MiB streamed) [int4 g32 101.2 MiB]"
    scheme = config.quant_scheme
    log.info("weights: %s, %.1f MiB streamed per token, %.1f MiB resident (checkpoint: %.1f MiB streamed) [%s]",
             scheme.label() if scheme is not None else f"dense {config.dtype}", now.streamed_bytes / 2**20,
             now.resident_bytes / 2**20, dense.streamed_bytes / 2**20,
             " + ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in now.by_format.items()))


def _resolve_memory_budget(config: EngineConfig, weights: WeightFootprint) -> None:
    """``memory_budget`` -> ``kv_cache_memory`` = budget - resident weight bytes (the planner's
    formula: engine/kv_sizing.kv_budget_within), before the engine plans its KV pool."""
    if config.memory_budget_bytes is None:
        return
    kv = kv_budget_within(config.memory_budget_bytes, weights.resident_bytes, config.quant_scheme.label()
                          if config.quant_scheme is not None else f"dense {config.dtype}")
    config.kv_cache_memory = config.kv_cache_memory_bytes = kv
    log.info("memory_budget %.1f MiB - weights %.1f MiB resident = KV cache %.1f MiB",
             config.memory_budget_bytes / 2**20, weights.resident_bytes / 2**20, kv / 2**20)


def _prompt_logprob_spans(sched: SchedulerOutput) -> list[tuple]:
    """Per scheduled request asking for prompt logprobs that has some left in this step:
    (request, flat row of its first one, first target position, end target position). The row of
    position j predicts prompt token j + 1; targets recorded before (the recompute of a preempted
    request) are not computed again, so ``req.prompt_logprobs`` grows chunk by chunk, in order
    (the engine appends each step's ``ModelRunnerOutput.prompt_logprobs``)."""
    spans, offset = [], 0
    for s in sched.scheduled:
        req = s.request
        hi = min(s.context_len + s.num_new_tokens + 1, req.num_prompt_tokens)
        if req.params.prompt_logprobs is not None and s.context_len + 1 < hi:
            done = len(req.prompt_logprobs)
            # No gap: such requests never take prefix-cache hits (Scheduler._admit_waiting).
            assert s.context_len <= done, "prompt logprobs need every prompt row computed"
            if done + 1 < hi:
                spans.append((req, offset + done - s.context_len, done + 1, hi))
        offset += s.num_new_tokens
    return spans


@torch.inference_mode()  # the logits are inference tensors: updated in place below
def _target_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[tuple]:
    """Per row, the layout of sampled-token logprobs (step_io.SampledToken): ([(target, logprob),
    then the top-N (id, logprob) best first], the target's rank, 1 = most likely)."""
    logits -= logits.logsumexp(dim=-1, keepdim=True)  # log_softmax in place: one [rows, vocab] buffer
    chosen = logits.gather(1, torch.tensor(targets, device=logits.device).unsqueeze(1))
    ranks = ((logits > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    top = [[]] * len(targets)
    if top_n:
        vals, ids = logits.topk(top_n, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return [([(t, lp)] + alts, rank) for t, lp, alts, rank in zip(targets, chosen, top, ranks)]


def _triton_decode_backend(model_config, config: EngineConfig, device: torch.device):
    """The Triton decode backend on CUDA when Triton is installed and the head size is one its
    kernel compiles for; None elsewhere (the torch backend then runs every step)."""
    from minserve.attention.triton_decode import TritonDecodeBackend, head_dim_supported
    from minserve.kernels import triton as tk
    if device.type != "cuda" or not tk.available():
        return None
    if not head_dim_supported(model_config.head_dim):
        log.info("decode attention runs in PyTorch: head_dim %d is not a power of two in 16..256",
                 model_config.head_dim)
        return None
    return TritonDecodeBackend(config.block_size, device)


def _batch_bucket(batch: int) -> int:
    """Batch sizes whose steps cost about the same: exact up to 4, then powers of two."""
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()
