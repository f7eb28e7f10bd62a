"""The xgrammar backend: compile a ``StructuredOutputsParams`` once, match each request's output.

Why xgrammar and not llguidance (both install from PyPI without touching torch): it is vLLM's
default, and it was faster here. With SmolLM2's 49k-token vocabulary on the 2-core reference VM:
tokenizer analysis 0.2 s (xgrammar) vs 0.47 s (llguidance); a 4-property nested schema compiled in
5.6 ms (xgrammar; llguidance builds its matcher lazily, 1.2 ms); filling the bitmasks of 8 rows at
the schema's start took 0.016 ms (xgrammar, whose masks are precomputed per grammar state) vs
0.35 ms (llguidance), and xgrammar's fill + accept mid-schema ~8 us per token.
benchmarks/bench_structured.py reports compile times and the per-step cost in the engine.

Differences from vLLM: compilation happens before the request is queued, in
``LLMEngine.prepare_params`` (the server calls it on its tokenizer threads, so a slow compile
never holds up the engine's step) or in ``add_request`` for callers that did not; vLLM compiles in
a thread pool while the request waits. So an invalid spec is a ValueError there. xgrammar has no
``whitespace_pattern``, so a request that sets it is refused rather than served without it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict

import torch

from minserve.sampling_params import StructuredOutputsParams

# Distinct compiled grammars kept per engine. A JSON schema compiles in milliseconds but its
# compiled form holds per-token tables (~100 KB to a few MB); 64 bounds a server's memory.
GRAMMAR_CACHE_SIZE = 64


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured_outputs needs the xgrammar package, which is not installed: "
                         "pip install 'minserve[structured]' (or pip install xgrammar)") from e
    return xgrammar


def cache_key(spec: StructuredOutputsParams) -> tuple:
    """(kind, spec text, whitespace option): equal specs share one compiled grammar (a JSON
    schema given as a dict or as text is the same spec)."""
    kind = spec.kind
    value = getattr(spec, kind)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        # Not sort_keys: the order of "properties" is the order the output writes them in.
        text = json.dumps(value)
    elif kind == "choice":
        text = json.dumps(list(value))
    else:
        text = str(value)
    return kind, text, spec.disable_any_whitespace


class GrammarState:
    """One request's position in its grammar. Advances only on final output tokens."""

    def __init__(self, matcher, request_id: str):
        self.matcher = matcher
        self.request_id = request_id  # whose state it is (a copied request must not share it)
        self.num_accepted = 0  # output tokens the matcher has consumed

    def advance(self, output_token_ids: list[int]) -> bool:
        """Consume the output tokens not yet consumed; True once the grammar has terminated (it
        accepted an end-of-sequence token at an accepting state)."""
        for tok in output_token_ids[self.num_accepted:]:
            if not self.matcher.accept_token(tok):
                raise ValueError(f"structured_outputs: token {tok} does not fit the grammar "
                                 f"(output token {self.num_accepted})")
            self.num_accepted += 1
        return self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarBackend:
    """Compiles grammars for one tokenizer (cached) and fills bitmasks for constrained rows.

    Nothing is built until the first structured request: an engine that never sees one neither
    imports xgrammar nor pays the ~0.2 s tokenizer analysis.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (its logits' width), >= the tokenizer's
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._compiler = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self.cache_hits = 0
        self.cache_misses = 0
        # compile() runs on several threads at once (the server's tokenizer pool, the engine's):
        # the lock guards the cache and counters only; a compile runs outside it, and a second
        # thread asking for a spec being compiled waits for that compile instead of repeating it.
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._in_flight: dict[tuple, _Compile] = {}

    @property
    def compiler(self):
        with self._compiler_lock:  # built once (~0.2 s), however many threads ask first
            return self._build_compiler()

    def _build_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            # Our own LRU decides what stays compiled; xgrammar's cache would hold a second copy.
            self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                 cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar for ``spec``; ValueError naming the field when it is invalid."""
        if spec.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar "
                             "backend; use disable_any_whitespace=True for compact JSON")
        key = cache_key(spec)
        with self._lock:
            if key in self._cache:
                self.cache_hits += 1
                self._cache.move_to_end(key)
                return self._cache[key]
            job = self._in_flight.get(key)
            mine = job is None
            if mine:
                job = self._in_flight[key] = _Compile()
                self.cache_misses += 1
            else:
                self.cache_hits += 1
        if not mine:
            return job.wait()
        try:
            job.result = self._compile_uncached(*key)
        except BaseException as e:
            job.error = e
            raise
        else:
            with self._lock:
                self._cache[key] = job.result
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return job.result
        finally:
            with self._lock:
                del self._in_flight[key]
            job.done.set()

    def _compile_uncached(self, kind: str, text: str, compact: bool):
        compiler = self.compiler
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=not compact)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(text)))
            return compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            raise ValueError(f"structured_outputs.{kind} is invalid: {_first_line(e)}") from None

    def state_of(self, req) -> GrammarState:
        """``req``'s matcher, made (and caught up on the request's output) when it has none, or
        holds one copied from another request (a parallel sample forked from a sibling)."""
        state = req.structured
        if state is None or state.request_id != req.request_id:
            matcher = _xgrammar().GrammarMatcher(self.compiled_for(req.params))
            state = req.structured = GrammarState(matcher, req.request_id)
        state.advance(req.output_token_ids)
        return state

    def compiled_for(self, params):
        """The grammar prepare_params compiled for ``params`` when it was this backend's (no
        compile on the engine thread even if the cache has evicted it since), else compile()."""
        prepared = getattr(getattr(params, "_prepared", None), "grammar", None)
        if prepared is not None and prepared[0] is self:
            return prepared[1]
        return self.compile(params.structured_outputs)

    def fill_bitmask(self, requests: list) -> torch.Tensor:
        """Packed allowed-token bitmask [len(requests), ceil(vocab / 32)] int32, one row per
        request at its current output. A request's matcher is made on its first step (so each
        request, a parallel sample too, has its own) and caught up on its final tokens."""
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        for row, req in enumerate(requests):
            state = self.state_of(req)
            if state.terminated:
                raise ValueError("structured_outputs: the grammar has already terminated")
            state.matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask


class _Compile:
    """One compile in progress, for the threads that ask for the same spec meanwhile."""

    def __init__(self):
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def wait(self):
        self.done.wait()
        if isinstance(self.error, ValueError):  # the spec's own fault: this caller's message too
            raise ValueError(str(self.error)) from None
        if self.error is not None:
            raise RuntimeError(f"structured_outputs: compiling failed in another thread: {self.error!r}")
        return self.result


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``. JSON string literals are valid
    xgrammar EBNF literals (same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _first_line(e: Exception) -> str:
    """The parser's message without xgrammar's "[time] /source/file.cc:line: " prefix."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(e).__name__
