"""Quality metrics that need no harness: perplexity, KL divergence, greedy agreement, exact match.

Each takes an :class:`~minserve.LLM` (any weight format) and the shipped data (eval/data.py):

- :func:`perplexity`: exp of the mean negative log-likelihood of every token of every text, each
  text scored alone after one prefix token (lm-eval's convention: the tokenizer's EOS), from
  ``SamplingParams.prompt_logprobs`` through the engine, all texts batched;
- :func:`mean_kl`: the mean over positions of KL(P_ref || P) between two models' next-token
  distributions on the same tokens, llama.cpp's measure for comparing quantizations. It needs
  the whole distribution at every position, which no engine output carries, so it runs each
  model's forward pass directly, once per text, and the LM head in chunks of rows;
- :func:`greedy_agreement`: per prompt, the position of the first token where two models' greedy
  outputs differ (the full length when they never do);
- :func:`exact_match`: accuracy on the question set, greedy answers cut at a newline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from minserve.attention import StepSequences
from minserve.engine.kv_sizing import allocate_layer_kv
from minserve.eval.data import ANSWER_MAX_TOKENS, ANSWER_STOP, Question, is_correct
from minserve.sampling_params import SamplingParams

KL_CHUNK_ROWS = 256  # positions whose full distributions are held at once (as the engine's chunk)


def prefix_token_id(tokenizer) -> int:
    """The token each scored text follows, so that its first token is scored too (lm-eval's
    ``prefix_token_id``: the end-of-text token)."""
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id


def scored_sequences(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    prefix = prefix_token_id(tokenizer)
    return [[prefix] + tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@dataclass
class Perplexity:
    nll_sum: float     # nats, over all scored tokens
    num_tokens: int

    @property
    def value(self) -> float:
        return math.exp(self.nll_sum / self.num_tokens)


def token_logprobs(llm, sequences: Sequence[list[int]]) -> list[list[float]]:
    """Log-probability of every token after the first of each sequence, from prompt logprobs
    (all sequences added to the engine at once, then stepped: batched prefill)."""
    longest = llm.llm_engine.max_model_len - 1
    if any(len(s) > longest for s in sequences):
        raise ValueError(f"a scored text is longer than max_model_len - 1 = {longest} tokens")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [[d[t].logprob for t, d in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(sequences, outs)]


def perplexity(llm, texts: Sequence[str]) -> Perplexity:
    lps = token_logprobs(llm, scored_sequences(llm.get_tokenizer(), texts))
    return Perplexity(-sum(map(sum, lps)), sum(map(len, lps)))


@torch.inference_mode()
def next_token_logprobs(llm, tokens: list[int], chunk_rows: int = KL_CHUNK_ROWS) -> Iterator[torch.Tensor]:
    """Full next-token log-distributions [rows, vocab] (fp32) after each position but the last,
    chunk by chunk. One forward pass of the engine's own model over a scratch KV cache: a single
    fresh sequence writes each layer's K/V and reads it back before the next layer writes, so
    all layers can share one scratch (as ModelRunner._profile_largest_step does). The scratch is
    in the engine's kv_cache_dtype: an int8 cache's rounding is part of what a row measures (a
    scratch in the model's dtype gave `fp32:kv_cache_dtype=int8` a KL of exactly 0 until
    2026-12-06)."""
    runner = llm.llm_engine.runner
    model, device, bs, cfg = runner.model, runner.device, runner.block_size, runner.config
    mc, n = model.config, len(tokens)
    blocks = -(-n // bs)
    scratch = allocate_layer_kv(mc, blocks, bs, cfg.torch_dtype, device, cfg.kv_cache_dtype)
    meta = runner.layer_backend.build_metadata(StepSequences([n], [0], [list(range(blocks))]))
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    h = model.hidden_states(ids, torch.arange(n, device=device), [scratch] * mc.num_layers, meta)
    for a in range(0, n - 1, chunk_rows):
        yield torch.log_softmax(model.compute_logits(h[a:min(a + chunk_rows, n - 1)]), dim=-1)


def mean_kl(ref_llm, llm, texts: Sequence[str], chunk_rows: int = KL_CHUNK_ROWS) -> float:
    """Mean KL(P_ref || P) in nats per predicted token over the texts (as :func:`perplexity`
    scores them). Both models must share the tokenizer."""
    total, count = 0.0, 0
    for seq in scored_sequences(ref_llm.get_tokenizer(), texts):
        for p, q in zip(next_token_logprobs(ref_llm, seq, chunk_rows), next_token_logprobs(llm, seq, chunk_rows)):
            total += (p.exp() * (p - q)).sum().item()
            count += p.shape[0]
    return total / count


def agreement_prompts(tokenizer, texts: Sequence[str], lengths: Sequence[int] = (16, 48)) -> list[list[int]]:
    """Greedy-agreement prompts: the first ``lengths`` tokens of each text (20 texts -> 40)."""
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    return [t[:n] for n in lengths for t in ids if len(t) >= n]


def greedy_tokens(llm, prompts: Sequence[list[int]], max_tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@dataclass
class Agreement:
    first_difference: list[int]   # per prompt: index of the first differing token (= length if none)
    num_tokens: int               # tokens generated per prompt

    @property
    def mean_fraction(self) -> float:
        """Mean position of the first difference as a fraction of the length (1.0: identical)."""
        return sum(self.first_difference) / (len(self.first_difference) * self.num_tokens)

    @property
    def num_identical(self) -> int:
        return sum(d == self.num_tokens for d in self.first_difference)


def greedy_agreement(reference: Sequence[list[int]], outputs: Sequence[list[int]]) -> Agreement:
    if len(reference) != len(outputs) or not reference:
        raise ValueError(f"need the same non-zero number of outputs, got {len(reference)} and {len(outputs)}")
    length = len(reference[0])
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
              for r, o in zip(reference, outputs)]
    return Agreement(firsts, length)


@dataclass
class ExactMatch:
    predictions: list[str]
    correct: list[bool]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


def exact_match(llm, questions: Sequence[Question]) -> ExactMatch:
    params = SamplingParams(temperature=0, max_tokens=ANSWER_MAX_TOKENS, stop=[ANSWER_STOP])
    outs = llm.generate([q.prompt for q in questions], params, use_tqdm=False)
    preds = [o.outputs[0].text for o in outs]
    return ExactMatch(preds, [is_correct(p, q.answers) for p, q in zip(preds, questions)])
