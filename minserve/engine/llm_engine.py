"""LLMEngine: the step-by-step heart of minserve, with vLLM's ``add_request / step / abort_request``.

One ``step()`` is one iteration of continuous batching: the scheduler picks the batch, the model
runner computes it and samples, the output processor appends tokens and checks stop conditions,
finished requests give their KV blocks back, and the step's outputs (incremental, so a notebook can
stream them) are returned together with a :class:`StepStats` record.

What a request asks for is checked and prepared before it is queued (:meth:`LLMEngine.prepare_params`:
bad words tokenized, grammars compiled, logits controls turned into tensors), so that a step never
pays for one request's preparation; a server calls it on its own threads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections import deque

from minserve.config import EngineConfig
from minserve.engine.kv_cache import KVCacheManager, plan_kv_cache
from minserve.engine.memory import device_memory_reader
from minserve.engine.model_runner import ModelRunner
from minserve.engine.output_processor import OutputProcessor
from minserve.engine.parallel_sampling import ParentRequest, fan_out
from minserve.engine.inputs import (check_cache_salt, check_params, check_priority, check_prompt_fits,
                                    prepare_logits_controls, prompt_ids)
from minserve.engine.isolation import execute_isolating_faults
from minserve.engine.logits_batch import LogitsProcessors
from minserve.engine.logits_processor import engine_logits_processor_classes
from minserve.engine.client import EngineClientView
from minserve.engine.extensions import EngineExtensions
from minserve.engine.observers import StepObservers
from minserve.engine.penalties import PreparedControls
from minserve.engine.request import Request, RequestRecord, RequestStatus
from minserve.engine.sampler import make_generator
from minserve.engine.scheduler import Scheduler
from minserve.engine.step_io import ModelRunnerOutput, StepUpdate
from minserve.engine.stats import StepStats
from minserve.metrics import EngineMetrics, requests_frame, steps_frame
from minserve.models.loader import LoadedModel, load_model
from minserve.outputs import RequestOutput
from minserve.sampling_params import SamplingParams
from minserve.spec import make_speculation
from minserve.structured import GrammarBackend

log = logging.getLogger("minserve")


class LLMEngine(EngineExtensions, EngineClientView):
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        loaded = load_model(config.model)
        self.model_config = loaded.config
        self.config_path = loaded.path  # the resolved local directory (a cache dir for aliases)
        self.tokenizer = loaded.tokenizer
        # Weights first, then the KV pool (vLLM's order). On CUDA the runner measures the device
        # around placing the weights and running the largest step once, and the pool gets what is
        # left of the budget (engine/memory.py); on CPU the pool is kv_cache_memory, as before.
        model_max = loaded.config.max_position_embeddings
        self.runner = ModelRunner(loaded, config, min(config.max_model_len or model_max, model_max),
                                  device_memory_reader(config.device))
        self.kv_spec = plan_kv_cache(loaded.config, config, self.runner.device_memory)
        self.max_model_len = self._resolve_max_model_len(model_max)
        self.runner.allocate_kv(self.kv_spec, self.max_model_len)
        # Custom logits processors (engine/logits_processor.py): each class's validate_params sees
        # every request in prepare_params; the instances run in the runner's sampling step.
        self.logits_processor_classes = engine_logits_processor_classes(config.logits_processors)
        if self.logits_processor_classes:
            self.runner.logits_processors = LogitsProcessors(self.logits_processor_classes, config,
                                                             self.runner.device)
        # The weight format is part of the key: int4 blocks must never be served to an fp32 engine.
        quant = config.quant_scheme.label() if config.quant_scheme is not None else "none"
        # K/V computed at "high" differ from exact float32 ones by its rounding: a key of their own.
        dtype = config.dtype if config.fp32_matmul_precision == "highest" else f"{config.dtype}:high"
        self.model_fingerprint = model_fingerprint(loaded, dtype, quant, kv_cache_dtype=config.kv_cache_dtype)
        self.kv = KVCacheManager(self.kv_spec, config.enable_prefix_caching, self.model_fingerprint)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        # Speculative decoding plugs in here: an object with ``propose_batch(requests) ->
        # [proposals]``, asked before each step for the next tokens of every decoding request, and
        # ``forget(request_id)`` when one leaves or is preempted (minserve/spec/).
        self.proposer, self.spec_control = make_speculation(config.speculative_config, self)
        if config.speculative_config is not None:
            # KV slots for the next step's proposals are reserved with each step's own.
            self.scheduler.num_lookahead_tokens = config.speculative_config.num_speculative_tokens
        self.last_step_failures: dict[str, str] = {}
        # Of those, the requests that failed for what they asked (constraints that left nothing to
        # sample), not for an engine fault: a server answers them 400 (unsatisfiable_constraints).
        self.last_step_client_errors: set[str] = set()
        # Marks the SamplingParams this engine prepared (PreparedControls.owner).
        self._prepared_key = object()
        self.start_s = time.perf_counter()
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len,
                                                time.time() - time.perf_counter())
        eos = set(loaded.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        # Structured outputs: grammars compiled for this tokenizer, cached (minserve/structured).
        self.grammar = self.runner.grammar = GrammarBackend(self.tokenizer, loaded.config.vocab_size,
                                                            self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._observers: StepObservers | None = None  # add_step_observer (engine/observers.py)
        # Requests with n > 1 while a sample of theirs is unfinished (engine/parallel_sampling.py);
        # each sample is also in ``requests``, sample 0 under the request's own id.
        self.parents: dict[str, ParentRequest] = {}
        # Bounded history for the frames: a long-running server's memory must stay flat.
        self._records: deque[RequestRecord] = deque(maxlen=config.max_request_records)
        self.step_stats: deque[StepStats] = deque(maxlen=config.max_step_records)
        self.num_steps = 0
        self.metrics = EngineMetrics(config.model, enabled=not config.disable_log_stats,
                                     max_model_len=self.max_model_len)
        self.metrics.set_cache_config(config.block_size, self.kv.pool.num_blocks, config.kv_cache_dtype,
                                      config.enable_prefix_caching, config.num_kv_blocks,
                                      config.gpu_memory_utilization)
        self.load_time_s = time.perf_counter() - t0
        w = self.runner.weight_footprint()
        log.info("engine ready in %.1f s: %s (%s, %.1f MiB of weights resident), max_model_len %d",
                 self.load_time_s, config.model, quant, w.resident_bytes / 2**20, self.max_model_len)

    @classmethod
    def from_engine_args(cls, model: str, **engine_args) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    def _resolve_max_model_len(self, model_max: int) -> int:
        want = self.config.max_model_len
        if want is not None and want > model_max:
            raise ValueError(f"max_model_len must be <= {model_max} for {self.config.model}, got {want}")
        if want is not None and want > self.kv_spec.max_tokens:
            raise ValueError(f"max_model_len={want} does not fit the KV cache ({self.kv_spec.max_tokens} "
                             "tokens); lower max_model_len or raise kv_cache_memory / num_kv_blocks")
        longest = min(model_max, self.kv_spec.max_tokens)
        if not self.config.enable_chunked_prefill:
            # Without chunking, a prompt (and a preempted request's recompute of prompt + output)
            # must fit in one step, so no sequence may outgrow the step's token budget.
            budget = self.config.max_num_batched_tokens
            if want is not None and want > budget:
                raise ValueError(f"max_model_len={want} is longer than max_num_batched_tokens={budget}; "
                                 "with enable_chunked_prefill=False a sequence must fit in one step: "
                                 "lower max_model_len, raise max_num_batched_tokens or enable chunking")
            longest = min(longest, budget)
        return want or longest

    # ---- requests -------------------------------------------------------------------------

    def prepare_params(self, params: SamplingParams) -> None:
        """Check ``params`` and do, now and on the calling thread, the per-request work a step
        must not do: tokenize ``bad_words``, compile ``structured_outputs`` (cached), build the
        ``allowed_token_ids`` mask and the ``logit_bias`` tensors; each custom logits processor's
        ``validate_params`` sees the request (its ``extra_args``). ValueError naming the field
        first when a value is refused (``check_params``'s checks included).

        Thread-safe (it reads the engine and writes only ``params``; the grammar cache locks) and
        idempotent. The result is kept on ``params``, marked as this engine's, so ``add_request``
        does not redo it; copies keep it (``clone``, ``dataclasses.replace``: add_request checks
        the copy's values first). Changing a list of ``params`` in place after preparing it is not
        seen: prepare after the last change. ``add_request`` prepares unprepared params itself."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        check_params(params, vocab, self.eos_token_ids)
        for cls in self.logits_processor_classes:
            cls.validate_params(params)
        prepare_logits_controls(params, vocab, self.tokenizer, self.grammar, self.eos_token_ids,
                                self.runner.device, owner=self._prepared_key)

    def _was_prepared(self, params: SamplingParams) -> bool:
        """``params`` (or the object it was copied from) went through prepare_params here, with
        the values it has now; then it is made ready to step (its copy's own fields bound)."""
        rec = params._prepared
        return (isinstance(rec, PreparedControls) and rec.owner is self._prepared_key
                and rec.vocab_size == self.model_config.vocab_size and rec.adopt(params))

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    priority: int = 0) -> None:
        """Queue a request. ``prompt`` is a string, a list of token ids, or a dict with
        ``prompt`` or ``prompt_token_ids`` (vLLM's TextPrompt / TokensPrompt). Every value that
        could fail a step is checked here (ValueError naming it; see engine/inputs.py)."""
        request_id = str(request_id)
        if request_id in self.requests or request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_cache_salt(cache_salt)
        check_priority(priority)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not self._was_prepared(params):
            self.prepare_params(params)
        text, ids = prompt_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        self._check_prompt_fits(len(ids))
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        # arrival_time is wall-clock (as in vLLM); the engine's clock is perf_counter.
        arrival = (time.perf_counter() if arrival_time is None
                   else arrival_time - self.output_processor.clock_offset_s)
        req = Request(request_id, text, ids, params, arrival, max_tokens, self.eos_token_ids,
                      generator=make_generator(params, self.runner.device), cache_salt=cache_salt,
                      priority=priority)
        if params.n > 1:  # req becomes sample 0, the one queued; the others are forked off it
            parent = fan_out(req, lambda p: make_generator(p, self.runner.device), self.requests)
            self.parents[request_id] = parent
            self.requests.update((s.request_id, s) for s in parent.samples[1:])  # ids taken now
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _check_prompt_fits(self, n: int) -> None:
        check_prompt_fits(n, self.config, self.max_model_len)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now; their KV blocks return to the pool immediately. Unknown ids are
        ignored. The id of a request with n > 1 stops all its samples."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            parent = self.parents.get(str(rid))
            for req in parent.samples if parent is not None else [self.requests.get(str(rid))]:
                if req is not None and not req.finished:
                    self._retire(req, RequestStatus.FINISHED_ABORTED)
                    self.metrics.record_abort(req)
        self.metrics.set_gauges(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.usage)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ---- one iteration ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. A failure tied to one request (its data, its sampling, its output)
        fails that request alone, with finish_reason "error" and ``RequestOutput.error`` set;
        the others in the step carry on as if it had never been there. The step's failures are
        also listed, id -> reason, in :attr:`last_step_failures`."""
        t0 = time.perf_counter()
        preempted_before = self.scheduler.num_preemptions
        self.last_step_failures = {}
        self.last_step_client_errors = set()
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        for req in sched.preempted:  # a draft model's KV for it goes too (recomputed later)
            self._forget_proposals(req)
        observers = self._observers
        if observers is not None and not sched.is_empty:
            observers.scheduled(self.num_steps, sched)
        outputs, finished = [], []
        for req, why in sched.failed:
            self._fail(req, why, outputs, finished)
        if sched.is_empty:
            if finished:
                self.metrics.record_step(self._record_step(t0, sched, 0), [], finished)
            return outputs
        ran = self._execute(sched)
        for s in sched.scheduled:  # computed prompt logprobs join their request's list
            s.request.prompt_logprobs += ran.prompt_logprobs.get(s.request.request_id, ())
        update = self.scheduler.update_from_output(sched, ran)
        self._append_accepted(update)
        self.scheduler.settle(update)
        for req, status in update.finished:
            self._retire(req, status)
            finished.append(req)
        failed = list(update.failed)
        for req, _ in update.appended:
            try:
                self._output(req, outputs)
            except Exception as e:  # building its output failed: it fails alone
                failed.append((req, f"{type(e).__name__}: {e}"))
        self._parent_outputs(update, outputs, failed)
        for req, why in failed:
            self._fail(req, why, outputs, finished, client=req.request_id in ran.client_errors)
        if observers is not None:
            observers.step_end(self.num_steps, [(r, n) for r, n in update.appended if r.error is None], finished)
        stats = self._record_step(t0, sched, self.scheduler.num_preemptions - preempted_before,
                                  update.num_accepted_spec_tokens)
        self.metrics.record_step(stats, [(r, n) for r, n in update.appended if r.error is None], finished)
        if self.spec_control is not None:
            self.spec_control.record(stats, len(sched.scheduled))
        if update.verified and self.metrics.enabled:
            self.metrics.spec.record(update.verified)
        return outputs

    def _propose(self) -> None:
        """Ask the proposer (speculative decoding) for the next tokens of decoding requests; the
        scheduler cuts them to what the step can hold (Scheduler._proposals). The adaptive rule
        (spec/adaptive.py) may skip a step's proposals where they have not been paying."""
        # A grammar-constrained request gets no proposals: the draft does not know the grammar and
        # the matcher advances on final tokens only (minserve/structured).
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1
                    and not r.params.uses_structured_outputs]
        propose = self.spec_control is None or self.spec_control.should_propose(len(self.scheduler.running))
        self.runner.draft_probs.clear()  # a draft model's q of the last step is spent
        batched = getattr(self.proposer, "propose_batch", None)  # a test's proposer may lack it
        proposals = ([] if not (propose and decoding) else batched(decoding) if batched is not None
                     else [self.proposer.propose(r) for r in decoding])
        for req, spec in itertools.zip_longest(decoding, proposals, fillvalue=[]):
            req.spec_token_ids = list(spec)

    def _execute(self, sched) -> ModelRunnerOutput:
        return execute_isolating_faults(self.runner, self.kv, sched)

    def _append_accepted(self, update: StepUpdate) -> None:
        """Hand each request's accepted tokens (and its forked samples') to the output processor;
        a request whose appending raises fails alone (with the samples forked off it)."""
        for a in update.accepted:
            try:
                for record in [a] + a.forks:
                    record.keep(*self._append_tokens(record.request, record.tokens))
            except Exception as e:  # its text or stop checks failed: it fails, the others go on
                a.error = f"{type(e).__name__}: {e}"
                update.failed.append((a.request, a.error))

    def _append_tokens(self, req: Request, tokens: list) -> tuple[int, RequestStatus | None]:
        """Append accepted tokens one by one (text, stop checks); a stop drops the tokens after
        it. Returns how many were kept and the finished status."""
        now = time.perf_counter()
        for i, tok in enumerate(tokens):
            status = self.output_processor.append_token(req, tok.token_id, tok.logprobs, tok.rank, now)
            if status is not None:
                return i + 1, status
        return len(tokens), None

    def _output(self, req: Request, outputs: list) -> None:
        if req.parent is not None:  # n > 1: one output per request, once all samples are booked
            req.parent.changed.append(req)
            return
        out = self.output_processor.make_output(req)
        if out is not None:
            outputs.append(out)

    def _parent_outputs(self, update, outputs: list, failed: list) -> None:
        """The step's output of each n > 1 request whose samples got tokens (see _output)."""
        parents = {r.parent.request_id: r.parent for r, _ in update.appended if r.parent is not None}
        for parent in parents.values():
            blamed = parent.changed[0] if parent.changed else parent.samples[0]
            try:
                out = self.output_processor.parent_output(parent)
            except Exception as e:  # building it failed: the request fails (its samples with it)
                failed.append((blamed, f"{type(e).__name__}: {e}"))
                continue
            if out is not None:
                outputs.append(out)

    def _fail(self, req: Request, why: str, outputs: list, finished: list, client: bool = False) -> None:
        """Fail ``req`` alone; ``client``: for its own contradictory constraints (see
        last_step_client_errors), logged at info level, since the engine is not at fault."""
        (log.info if client else log.warning)("request %s failed: %s", req.request_id, why)
        req.error = why
        rid = req.request_id if req.parent is None else req.parent.request_id
        self.last_step_failures[rid] = why
        if client:
            self.last_step_client_errors.add(rid)
        if req.finished:  # it failed while building its last output: already retired
            req.status = RequestStatus.FINISHED_ERROR
            if self._records and self._records[-1].request_id == req.request_id:
                self._records[-1] = RequestRecord.of(req)
        else:
            self._retire(req, RequestStatus.FINISHED_ERROR)
        if req not in finished:
            finished.append(req)
        if req.parent is not None:
            self._abort_siblings(req, why, finished)
        outputs[:] = [o for o in outputs if o.request_id != rid]
        outputs.append(self.output_processor.error_output(req))

    def _abort_siblings(self, req: Request, why: str, finished: list) -> None:
        """A sample failed: its request fails with it (the n samples are one answer); the other
        samples still running or waiting end aborted."""
        parent = req.parent
        parent.error = parent.error or why
        for sample in parent.samples:
            if not sample.finished:
                self._retire(sample, RequestStatus.FINISHED_ABORTED)
                finished.append(sample)

    def _retire(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self._forget_proposals(req)
        self.requests.pop(req.request_id, None)
        if req.parent is not None and req.parent.finished:
            self.parents.pop(req.parent.request_id, None)
        if self._records.maxlen:
            self._records.append(RequestRecord.of(req))

    def _forget_proposals(self, req: Request) -> None:
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(req.request_id)

    def _record_step(self, t0: float, sched, preemptions: int, accepted: int = 0) -> StepStats:
        now = time.perf_counter()
        self.num_steps += 1
        self.step_stats.append(StepStats(
            step=self.num_steps - 1, start_s=t0 - self.start_s, step_time_s=now - t0,
            num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage, num_preemptions=preemptions,
            prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits,
            num_spec_tokens=sched.num_spec_tokens, num_accepted_spec_tokens=accepted,
            prefill_chunks=tuple((s.request.request_id, s.context_len, s.num_new_tokens)
                                 for s in sched.scheduled if s.is_prefill)))
        return self.step_stats[-1]

    @property
    def finished_requests(self) -> deque[RequestRecord]:
        """Records of the latest ``max_request_records`` finished requests, oldest first."""
        return self._records

    @property
    def last_step_stats(self) -> StepStats | None:
        return self.step_stats[-1] if self.step_stats else None

    def get_tokenizer(self):
        return self.tokenizer

    # ---- observability (for notebooks; the Prometheus registry is ``self.metrics.registry``) ----

    def requests_frame(self):
        """One row per request (finished ones, then those still in flight): timeline in seconds
        from engine start, TTFT, TPOT, ITL, queue / prefill / decode times. See metrics.frames."""
        return requests_frame(list(self._records) + list(self.requests.values()), self.start_s)

    def steps_frame(self):
        """One row per engine step: tokens, batch composition, KV usage, prefix hits, preemptions."""
        return steps_frame(self.step_stats)

    def snapshot(self) -> dict[str, float]:
        """Current gauges and counter totals by vLLM metric name (a labelled counter: its total
        under the bare name, and one entry per label value, e.g. ``{position="0"}``)."""
        out = self.metrics.snapshot()
        if out:
            out.update(self.metrics.spec.by_position())
        return out


def model_fingerprint(loaded: LoadedModel, dtype: str, quantization: str = "none",
                      kv_cache_dtype: str = "auto") -> str:
    """What makes cached K/V reusable: the model's config, its weight files (names and sizes), the
    dtype, the quantization and the KV cache dtype (int8 blocks hold codes and scales, not the
    values an fp cache holds). Part of every prefix-cache key, so blocks computed by one model
    can never be served to another."""
    files = sorted((f.name, f.stat().st_size) for f in loaded.path.glob("*.safetensors"))
    text = json.dumps([loaded.hf_config, files, dtype, quantization, kv_cache_dtype], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
