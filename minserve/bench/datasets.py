"""Workloads for ``minserve bench serve``: what each request asks and how long its answer is.

Every workload returns a list of :class:`SampleRequest` (prompt text, its length in tokens as the
server will count it, the number of output tokens to ask for). Names and semantics follow
``vllm bench serve --dataset-name``:

``random``
    vLLM's synthetic workload. Input and output lengths are drawn uniformly from
    ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` for ``L = --random-input-len`` (default 1024) /
    ``--random-output-len`` (default 128) and ``r = --random-range-ratio`` (default 0, in [0, 1)).
    A fixed block of ``--random-prefix-len`` random tokens starts every prompt (shared, so it
    exercises prefix caching); the rest is a run of consecutive vocabulary ids from a random
    offset. Token ids are decoded to text and re-encoded until the text is exactly the drawn
    length (decoding then encoding does not always round-trip). Like vLLM, the CLI sends
    ``ignore_eos`` for this workload so outputs have the drawn length.
``sharegpt``
    A local ShareGPT-format JSON file (``--dataset-path``): a list of
    ``{"conversations": [{"from": "human" | "gpt", "value": ...}, ...]}``. The prompt is the first
    human turn, the output length is the token count of the gpt reply that follows (or
    ``--sharegpt-output-len``). As in vLLM, conversations are shuffled with the seed and pairs with
    a prompt or reply under 4 tokens, a prompt over 1024 tokens or a total over 2048 are skipped;
    if the file has fewer usable pairs than requested, they are reused in order.
``qa``, ``rag``, ``code``, ``agent``, ``mix``
    Our scenario shapes, built offline from the standard library's documentation (details,
    templates and rationale in :mod:`minserve.bench.scenarios` and ``datasets/README.md``).
    Lengths in tokens, lognormal ``round(median * exp(s * z))`` clipped to [lo, hi]:

    =====  ==========================================  ===========================
    name   prompt                                      output
    =====  ==========================================  ===========================
    qa     median 64, s 0.4, [40, 192]                 median 48, s 0.5, [8, 160]
    rag    median 1024, s 0.35, [512, 2048]            median 64, s 0.5, [16, 256]
    code   median 96, s 0.4, [48, 256]                 median 384, s 0.4, [128, 1024]
    agent  1024 shared + median 160, s 0.4, [64, 512]  median 32, s 0.4, [8, 96]
    mix    qa 40 %, rag 20 %, code 20 %, agent 20 %
    =====  ==========================================  ===========================

    ``--length-scale`` multiplies all of them. The CLI sends ``ignore_eos`` for these too: the
    shape, not the model, decides output lengths.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minserve.bench.corpus import Corpus
from minserve.bench.scenarios import SCENARIOS, _Builder, build_prompt, scenario_names

DATASET_NAMES = ("random", "sharegpt", "qa", "rag", "code", "agent", "mix")
SYNTHETIC = ("random", "qa", "rag", "code", "agent", "mix")  # where ignore_eos is the default


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int            # tokens, counted as the server counts the prompt
    expected_output_len: int   # sent as max_tokens
    request_id: str = ""
    scenario: str = ""
    priority_class: str = ""   # "interactive" / "batch" (minserve serve's x-priority-class); "": unset


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


# ---- random (vLLM's synthetic workload) ------------------------------------------------------

def _uniform_lens(rng: np.random.Generator, n: int, mean: int, ratio: float, low_min: int) -> np.ndarray:
    lo = max(math.floor(mean * (1 - ratio)), low_min)
    hi = max(math.ceil(mean * (1 + ratio)), lo)
    return rng.integers(lo, hi + 1, size=n)


def _decode_to_len(tokenizer, ids: list[int], target: int, rng: np.random.Generator,
                   allowed: np.ndarray) -> str:
    """Text whose encoding is ``target`` tokens: decode, re-encode, then trim or pad and retry."""
    text = tokenizer.decode(ids)
    for _ in range(10):
        got = tokenizer(text, add_special_tokens=False).input_ids
        if len(got) == target:
            break
        ids = got[:target] if len(got) > target else got + allowed[
            rng.integers(0, len(allowed), size=target - len(got))].tolist()
        text = tokenizer.decode(ids)
    return text


def sample_random(tokenizer, num_requests: int, seed: int = 0, input_len: int = 1024,
                  output_len: int = 128, range_ratio: float = 0.0,
                  prefix_len: int = 0) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError(f"random_input_len and random_output_len must be >= 1 and random_prefix_len"
                         f" >= 0, got {input_len}, {output_len}, {prefix_len}")
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size
    allowed = np.setdiff1d(np.arange(vocab), np.array(tokenizer.all_special_ids, dtype=np.int64))
    special = int(tokenizer.num_special_tokens_to_add())  # e.g. a BOS the server adds itself
    in_lens = _uniform_lens(rng, num_requests, max(input_len - special, 1), range_ratio, 1)
    out_lens = _uniform_lens(rng, num_requests, output_len, range_ratio, 1)
    offsets = rng.integers(0, vocab, size=num_requests)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
    out = []
    for i in range(num_requests):
        inner = allowed[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed)].tolist()
        text = _decode_to_len(tokenizer, prefix + inner, prefix_len + int(in_lens[i]), rng, allowed)
        out.append(SampleRequest(text, _count(tokenizer, text), int(out_lens[i]), str(i), "random"))
    return out


# ---- ShareGPT ----------------------------------------------------------------------------------

def _first_exchange(conversation: list[dict]) -> tuple[str, str] | None:
    """(first human turn, the gpt reply after it); falls back to turns 0 and 1 like vLLM."""
    for k, turn in enumerate(conversation[:-1]):
        if turn.get("from") == "human" and conversation[k + 1].get("from") == "gpt":
            return turn.get("value", ""), conversation[k + 1].get("value", "")
    if len(conversation) >= 2:
        return conversation[0].get("value", ""), conversation[1].get("value", "")
    return None


def sample_sharegpt(tokenizer, path: str | Path, num_requests: int, seed: int = 0,
                    output_len: int | None = None) -> list[SampleRequest]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"dataset_path {str(path)!r} is not a readable ShareGPT JSON file: {e}") from e
    entries = [e for e in data if isinstance(e, dict) and len(e.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(entries)
    picked: list[SampleRequest] = []
    for entry in entries:
        if len(picked) == num_requests:
            break
        pair = _first_exchange(entry["conversations"])
        if pair is None:
            continue
        prompt, reply = pair
        p_len = _count(tokenizer, prompt)
        o_len = output_len or len(tokenizer(reply, add_special_tokens=False).input_ids)
        # vLLM's default validity filter: drop degenerate and over-long pairs.
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:
            continue
        picked.append(SampleRequest(prompt, p_len, o_len, str(len(picked)), "sharegpt"))
    if not picked:
        raise ValueError(f"dataset_path {str(path)!r} has no usable human/gpt pairs")
    base = len(picked)
    while len(picked) < num_requests:  # reuse pairs in order, with fresh ids
        r = picked[len(picked) % base]
        picked.append(SampleRequest(r.prompt, r.prompt_len, r.expected_output_len, str(len(picked)),
                                    r.scenario))
    return picked


# ---- scenarios ---------------------------------------------------------------------------------

def sample_scenario(tokenizer, name: str, num_requests: int, seed: int = 0,
                    length_scale: float = 1.0, weights: dict[str, float] | None = None,
                    corpus: Corpus | None = None) -> list[SampleRequest]:
    """Requests of scenario ``name`` (qa, rag, code, agent) or of their ``mix``."""
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    rng = np.random.default_rng(seed)
    builder = _Builder(corpus or Corpus(tokenizer), rng, length_scale)
    out = []
    for i, kind in enumerate(scenario_names(name, num_requests, rng, weights)):
        prompt, output_len = build_prompt(builder, SCENARIOS[kind])
        out.append(SampleRequest(prompt, _count(tokenizer, prompt), output_len, str(i), kind))
    return out


def get_samples(dataset_name: str, tokenizer, num_requests: int, seed: int = 0, *,
                dataset_path: str | None = None, random_input_len: int = 1024,
                random_output_len: int = 128, random_range_ratio: float = 0.0,
                random_prefix_len: int = 0, sharegpt_output_len: int | None = None,
                length_scale: float = 1.0) -> list[SampleRequest]:
    """The ``num_requests`` requests of workload ``dataset_name`` (see the module docstring)."""
    if num_requests < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_requests}")
    if dataset_name == "random":
        return sample_random(tokenizer, num_requests, seed, random_input_len, random_output_len,
                             random_range_ratio, random_prefix_len)
    if dataset_name == "sharegpt":
        if not dataset_path:
            raise ValueError("dataset_name 'sharegpt' needs --dataset-path (a local ShareGPT JSON file)")
        return sample_sharegpt(tokenizer, dataset_path, num_requests, seed, sharegpt_output_len)
    if dataset_name in SCENARIOS or dataset_name == "mix":
        return sample_scenario(tokenizer, dataset_name, num_requests, seed, length_scale)
    raise ValueError(f"dataset_name must be one of {', '.join(DATASET_NAMES)}, got {dataset_name!r}")
