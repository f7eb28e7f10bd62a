"""Draft-model proposals: a smaller model with the target's tokenizer guesses the next k tokens.

The draft has its own ModelRunner (weights, fused C step or PyTorch path) and its own paged KV
pool, separate from the target's: the two models' K/V have nothing in common. Per request the
proposer remembers how far the draft's cache holds the request's real tokens (``valid``) and which
of its own guesses it wrote after them (``tail``). Before proposing it catches up:

- the guesses the target accepted are already in the draft's cache (they match the request's new
  tokens), so ``valid`` moves over them; the first guess that does not match, and everything after
  it, is rolled back (its blocks are trimmed, and its slots are overwritten below);
- the tokens it has not seen (the prompt, in chunks of at most ``max_num_batched_tokens``; the
  target's own corrected or bonus token) are run through the draft.

Then it proposes k tokens for every request at once: one draft forward per proposal position, each
row one request (the first forward also carries each request's last unseen tokens). Greedy requests
get the draft's argmax; sampled ones a draw from the draft's distribution q under the request's
own sampling parameters, and q goes to the target's runner (``draft_probs``) for rejection
sampling (spec/verify.py), so the output is distributed exactly as the target's.

The self-draft (``"model": "self"``) is the target's checkpoint made cheap: int4 weights (a CPU
decode step reads ~5x fewer bytes) and/or only the first ``draft_layers`` layers.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from minserve.attention import StepSequences
from minserve.engine.draws import draw_token
from minserve.engine.kv_cache import KVCacheManager, plan_kv_cache
from minserve.engine.model_runner import ModelRunner
from minserve.models.loader import LoadedModel, load_model
from minserve.spec.adaptive import _bucket
from minserve.spec.config import SELF_DRAFT, SpeculativeConfig
from minserve.spec.verify import sampling_probs

log = logging.getLogger("minserve")

# Unseen tokens a request may bring into the first proposal forward (the fused C step's row limit
# per sequence); more than that (a fresh prompt) is prefilled in chunks first.
MAX_CATCH_UP_ROWS = 8


@dataclass
class _DraftState:
    valid: int = 0                                  # the request's first tokens the draft holds
    tail: list[int] = field(default_factory=list)   # its own guesses written after them


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, engine):
        self.k = config.num_speculative_tokens
        self.target_runner = engine.runner
        loaded = load_draft(config, engine.config.model)
        check_same_vocabulary(loaded, engine.model_config, engine.tokenizer, config.model)
        self.config = dataclasses.replace(
            engine.config, model=loaded.name, quantization=config.quantization, quantization_config=None,
            memory_budget=None, kv_cache_memory=None, speculative_config=None, enable_prefix_caching=False,
            num_kv_blocks=config.draft_num_kv_blocks or engine.kv_spec.num_blocks, disable_log_stats=True)
        self.max_model_len = min(engine.max_model_len, loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded, self.config, self.max_model_len)
        spec = plan_kv_cache(loaded.config, self.config)
        self.runner.allocate_kv(spec, self.max_model_len)
        self.kv = KVCacheManager(spec, enable_prefix_caching=False)
        self.generator = torch.Generator(device=self.runner.device).manual_seed(engine.config.seed + 1)
        self._states: dict[str, _DraftState] = {}
        self.num_forwards = 0   # draft forward passes so far (to see what proposing costs)
        log.info("draft model: %s (%s%s), %d KV blocks", config.model, config.quantization or "dense",
                 f", first {config.draft_layers} layers" if config.draft_layers else "", self.kv.pool.num_blocks)

    # ---- the proposer interface (LLMEngine._propose, _retire) -----------------------------------

    def propose_batch(self, reqs: list) -> list[list[int]]:
        """Up to k proposals for each decoding request (in order; [] where it gets none)."""
        want = {r.request_id: self._sync(r) for r in reqs}
        live = [r for r in reqs if want[r.request_id] > 0]
        if not live:
            return [[] for _ in reqs]
        self._prefill_chunks(live)
        proposals = self._draft(live, want)
        return [proposals.get(r.request_id, []) for r in reqs]

    def forget(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: its draft blocks return to the pool."""
        self._states.pop(request_id, None)
        self.kv.free(request_id)

    # ---- catching up -----------------------------------------------------------------------------

    def _sync(self, req) -> int:
        """Roll the draft's cache back to what the request confirmed; reserve slots for this round.
        Returns how many tokens to propose (0: none, and the request holds no new draft slots)."""
        st = self._states.setdefault(req.request_id, _DraftState())
        n = req.num_tokens
        seen = req.token_ids(st.valid, min(n, st.valid + len(st.tail)))
        matched = next((i for i, (a, b) in enumerate(zip(seen, st.tail)) if a != b), len(seen))
        st.valid, st.tail = st.valid + matched, []
        self.kv.trim(req.request_id, st.valid)
        k = min(self.k, self.max_model_len - n, req.max_tokens - req.num_output_tokens - 1)
        # KV for the unseen tokens and for the guesses fed back (the last guess is never fed).
        if k < 1 or not self.kv.allocate_slots(req.request_id, n + k - 1):
            return 0
        return k

    def _prefill_chunks(self, live: list) -> None:
        """Run long unseen stretches (a new prompt) through the draft in budget-sized forwards,
        leaving at most MAX_CATCH_UP_ROWS tokens per request for the first proposal forward."""
        budget = self.config.max_num_batched_tokens
        while True:
            chunks, room = [], budget
            for req in live:
                st = self._states[req.request_id]
                todo = req.num_tokens - 1 - st.valid   # the last token goes with the proposal forward
                if todo >= MAX_CATCH_UP_ROWS and room > 0:
                    n = min(todo, room)
                    chunks.append((req.request_id, req.token_ids(st.valid, st.valid + n), st.valid))
                    st.valid += n
                    room -= n
            if not chunks:
                return
            self._forward(chunks)

    # ---- proposing -------------------------------------------------------------------------------

    def _draft(self, live: list, want: dict[str, int]) -> dict[str, list[int]]:
        """k forwards, one per proposal position, each row one request still proposing."""
        out: dict[str, list[int]] = {r.request_id: [] for r in live}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in live}
        chunks = []
        for req in live:
            st = self._states[req.request_id]
            chunks.append((req.request_id, req.token_ids(st.valid, req.num_tokens), st.valid))
            st.valid = req.num_tokens
        rows = live
        for step in range(self.k):
            logits = self._forward(chunks)
            tokens, q = self._choose(logits, rows)
            chunks = []
            for i, req in enumerate(rows):
                rid = req.request_id
                out[rid].append(tokens[i])
                if q is not None and q[i] is not None:
                    probs[rid].append(q[i])
                if step + 1 < want[rid]:  # feed the guess back to draft the next one
                    st = self._states[rid]
                    chunks.append((rid, [tokens[i]], st.valid + len(st.tail)))
                    st.tail.append(tokens[i])
            rows = [r for r in rows if len(out[r.request_id]) < want[r.request_id]]
            if not rows:
                break
        for rid, qs in probs.items():
            if qs:
                self.target_runner.draft_probs[rid] = torch.stack(qs)
        return out

    def _choose(self, logits: torch.Tensor, reqs: list) -> tuple[list[int], list | None]:
        """Each row's guess: the argmax for greedy requests; for sampled ones a draw from q (the
        draft's distribution under the request's sampling parameters), returned with q."""
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if not sampled:
            return tokens, None
        q_rows: list = [None] * len(reqs)
        q = sampling_probs(logits[sampled], [reqs[i].params for i in sampled], [[] for _ in sampled])
        for j, i in enumerate(sampled):
            gen = reqs[i].generator if reqs[i].generator is not None else self.generator
            tokens[i] = draw_token(q[j], gen)
            q_rows[i] = q[j]
        return tokens, q_rows

    @torch.inference_mode()
    def _forward(self, chunks: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """One draft forward over (request id, tokens, first position) chunks; logits [rows, V] at
        each chunk's last token."""
        lens = [len(t) for _, t, _ in chunks]
        seqs = StepSequences(lens, [start for _, _, start in chunks],
                             [self.kv.block_table(rid) for rid, _, _ in chunks])
        executor = self.runner.executor_for(seqs)
        meta = executor.build_metadata(seqs)
        dev = self.runner.device
        ids = torch.tensor([t for _, toks, _ in chunks for t in toks], dtype=torch.long, device=dev)
        pos = torch.tensor([p for _, toks, s in chunks for p in range(s, s + len(toks))], dtype=torch.long,
                           device=dev)
        rows = torch.tensor(lens, device=dev).cumsum(0) - 1
        self.num_forwards += 1
        # Thread count by step shape, as the target's runner picks it (engine/threads.py): on a
        # busy CPU all threads can be far slower than fewer.
        ctl, user = self.runner.threads, torch.get_num_threads()
        key = (executor.name, _bucket(len(lens)), max(lens)) if max(lens) <= MAX_CATCH_UP_ROWS else None
        threads = ctl.choose(key) if ctl.enabled else user
        if threads != user:
            torch.set_num_threads(threads)
        try:
            t0 = ctl.clock()
            logits = executor.run(ids, pos, meta, rows, threads)
            ctl.record(key, threads, ctl.clock() - t0)
        finally:
            if threads != user:
                torch.set_num_threads(user)
        return logits.float()


def load_draft(config: SpeculativeConfig, target_model: str) -> LoadedModel:
    """The draft's checkpoint: its own, or the target's (``"self"``), cut to ``draft_layers``."""
    loaded = load_model(target_model if config.model == SELF_DRAFT else config.model)
    n = config.draft_layers
    if n is None:
        return loaded
    if n > loaded.config.num_layers:
        raise ValueError(f"speculative_config['draft_layers'] must be at most the draft's "
                         f"{loaded.config.num_layers} layers, got {n}")
    # Early exit: the first n layers, then the model's own final norm and LM head.
    dropped = tuple(f"model.layers.{i}." for i in range(n, loaded.config.num_layers))
    weights = {name: w for name, w in loaded.weights.items() if not name.startswith(dropped)}
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, num_layers=n), weights=weights)


def check_same_vocabulary(draft: LoadedModel, target_config, target_tokenizer, name: str) -> None:
    """A draft must speak the target's tokens: same vocabulary size and the same tokenizer."""
    if draft.config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config['model']={name!r} has a vocabulary of {draft.config.vocab_size} "
                         f"tokens; the target's has {target_config.vocab_size}: a draft model must share "
                         "the target's tokenizer")
    if draft.tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"speculative_config['model']={name!r} has a different tokenizer from the target's "
                         "(the same ids mean different text): a draft model must share the target's tokenizer")
