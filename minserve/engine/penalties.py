"""Logits controls that change which token is picked: allowed ids, bad words, logit bias, the
presence / frequency / repetition penalties, and the structured-output grammar mask.

The sampler calls :func:`apply_logits_controls` before temperature, top-k and top-p. Each control
works on the rows that use it, as a few tensor operations over those rows (a loop over rows or
over a row's bad words builds index lists; nothing loops over the vocabulary). Order as in vLLM
V1: allowed token ids, bad words, logit bias, then repetition, frequency and presence penalties;
the grammar mask and the ``min_tokens`` bans last (bans and masks set -inf, which every step keeps
at -inf, so their place in the order changes nothing).

The formulas (vLLM's), with ``count`` a token's occurrences in the output so far:
    repetition (prompt and output tokens): logit / r if logit > 0 else logit * r
    frequency and presence (output tokens only): logit - f * count - p * (count > 0)
"""

from __future__ import annotations

import torch

from minserve.sampling_params import SamplingParams

# Bit b of word w of a packed grammar bitmask allows token 32 * w + b (xgrammar's layout).
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def needs_output_ids(p: SamplingParams) -> bool:
    """The row needs the tokens generated so far (penalties count them, bad words match them)."""
    return has_penalty(p) or bool(p.bad_words)


def adjusts_logits(p: SamplingParams) -> bool:
    """Whether a request uses any control here (the grammar mask is tracked separately)."""
    return needs_output_ids(p) or bool(p.logit_bias) or p.allowed_token_ids is not None


def apply_logits_controls(logits: torch.Tensor, params: list[SamplingParams],
                          output_ids: list[list[int] | None] | None,
                          prompt_ids: list[list[int] | None] | None,
                          grammar_rows: list[int], grammar_bitmask: torch.Tensor | None,
                          banned: list[list[int]]) -> torch.Tensor:
    """``logits`` itself when no row uses a control (no copy), else a processed copy.

    ``output_ids`` / ``prompt_ids``: per row, the tokens the penalties and bad words look at
    (None for rows that need none). ``grammar_bitmask``: one packed row per entry of
    ``grammar_rows``. ``banned``: the sampler's ``min_tokens`` bans, applied here too for the
    processed rows so that a row left with no token to pick (e.g. a grammar that only allows EOS
    before ``min_tokens``) raises ValueError instead of sampling a forbidden token.
    """
    rows = [i for i, p in enumerate(params) if adjusts_logits(p)]
    if not rows and not grammar_rows:
        return logits
    _check_histories(rows, params, output_ids, prompt_ids)
    out = logits.clone(memory_format=torch.contiguous_format)  # flat views below need it
    if rows:
        _apply_allowed_token_ids(out, rows, params)
        _apply_bad_words(out, rows, params, output_ids)
        _apply_logit_bias(out, rows, params)
        _apply_penalties(out, rows, params, output_ids, prompt_ids)
    if grammar_rows:
        apply_token_bitmask(out, grammar_rows, grammar_bitmask)
    touched = sorted(set(rows) | set(grammar_rows))
    bans = [(i, t) for i in touched for t in banned[i]]
    if bans:
        out[[i for i, _ in bans], [t for _, t in bans]] = float("-inf")
    dead = (out[touched].amax(dim=-1) == float("-inf")).nonzero().squeeze(1).tolist()
    if dead:
        raise ValueError(f"rows {[touched[j] for j in dead]}: allowed_token_ids, bad_words, min_tokens "
                         "and the structured-output grammar together leave no token that may be sampled")
    return out


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """Each bad word's token ids, as vLLM derives them: the word as written (leading spaces
    stripped), and also with one leading space when that spelling starts with a different token
    but has as many tokens (a word in the middle of a sentence is usually the spaced token)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def _check_histories(rows: list[int], params: list[SamplingParams], output_ids, prompt_ids) -> None:
    """A penalty computed over a missing history would silently be no penalty at all."""
    for i in rows:
        if needs_output_ids(params[i]) and (output_ids is None or output_ids[i] is None):
            raise ValueError(f"output_token_ids[{i}] is needed by the row's penalties / bad_words")
        if params[i].repetition_penalty != 1.0 and (prompt_ids is None or prompt_ids[i] is None):
            raise ValueError(f"prompt_token_ids[{i}] is needed by the row's repetition_penalty")
        if params[i].bad_words and params[i]._bad_words_token_ids is None:
            raise ValueError(f"row {i}: bad_words were never tokenized (LLMEngine.add_request does it)")


def _apply_allowed_token_ids(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    rows = [i for i in rows if params[i].allowed_token_ids is not None]
    if not rows:
        return
    blocked = torch.ones((len(rows), logits.shape[1]), dtype=torch.bool, device=logits.device)
    r = [j for j, i in enumerate(rows) for _ in params[i].allowed_token_ids]
    blocked[r, [t for i in rows for t in params[i].allowed_token_ids]] = False
    logits[rows] = logits[rows].masked_fill_(blocked, float("-inf"))


def bad_word_bans(p: SamplingParams, output_ids: list[int]) -> list[int]:
    """Tokens a row may not pick now: the last token of every bad word whose other tokens the
    output ends with (a one-token word is always banned). vLLM's rule, on output tokens only."""
    banned = []
    for word in p._bad_words_token_ids or ():
        prefix = word[:-1]
        if len(prefix) <= len(output_ids) and output_ids[len(output_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def _apply_bad_words(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     output_ids: list[list[int] | None] | None) -> None:
    bans = [(i, t) for i in rows if params[i].bad_words
            for t in bad_word_bans(params[i], output_ids[i])]
    if bans:
        logits[[i for i, _ in bans], [t for _, t in bans]] = float("-inf")


def _apply_logit_bias(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    pairs = [(i * logits.shape[1] + t, b) for i in rows if params[i].logit_bias
             for t, b in params[i].logit_bias.items()]
    if pairs:  # flat indices are unique (one dict per row), so a plain index_add is exact
        keys = torch.tensor([k for k, _ in pairs], dtype=torch.long, device=logits.device)
        logits.view(-1).index_add_(0, keys, torch.tensor([b for _, b in pairs], dtype=logits.dtype,
                                                          device=logits.device))


def _flat_keys(id_lists: list[tuple[int, list[int]]], vocab: int, device) -> torch.Tensor:
    """row * vocab + token for every (row, token ids) pair: positions in the flattened logits."""
    parts = [torch.tensor(ids, dtype=torch.long, device=device) + row * vocab for row, ids in id_lists if ids]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     output_ids: list[list[int] | None] | None,
                     prompt_ids: list[list[int] | None] | None) -> None:
    """The three penalties, on the logits of the tokens a row has seen only: a step costs
    O(tokens seen), not O(vocabulary) (a [rows, vocab] count tensor is ~20x slower on CPU)."""
    rows = [i for i in rows if has_penalty(params[i])]
    if not rows:
        return
    vocab, device = logits.shape[1], logits.device
    out_keys, counts = torch.unique(_flat_keys([(i, output_ids[i]) for i in rows], vocab, device),
                                    return_counts=True)
    prompt_keys = _flat_keys([(i, prompt_ids[i]) for i in rows if params[i].repetition_penalty != 1.0],
                             vocab, device)
    keys = torch.unique(torch.cat([out_keys, prompt_keys]))  # sorted: every token seen, per row
    count = torch.zeros(keys.numel(), dtype=logits.dtype, device=device)
    count[torch.searchsorted(keys, out_keys)] = counts.to(logits.dtype)
    row_of = keys // vocab
    per_row = (lambda name: torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype,
                                         device=device)[row_of])
    flat = logits.view(-1)
    v = flat[keys]
    rep = per_row("repetition_penalty")  # 1 for rows without it: v / 1 and v * 1 are exact
    v = torch.where(v > 0, v / rep, v * rep)
    v -= per_row("frequency_penalty") * count + per_row("presence_penalty") * (count > 0)
    flat[keys] = v


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: in each of ``rows``, -inf for every token whose bit is 0 in its packed row of
    ``bitmask`` ([len(rows), ceil(vocab / 32)] int32). xgrammar's kernel when it is installed
    (it made the bitmask; ~3x faster than unpacking the bits with tensor ops on CPU)."""
    vocab = logits.shape[1]
    every_row = rows == list(range(logits.shape[0]))
    sub = logits if every_row else logits[rows]  # a copy unless every row is masked
    bitmask = bitmask.to(logits.device)
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1
        sub.masked_fill_(~bits.reshape(len(rows), -1)[:, :vocab].bool(), float("-inf"))
    else:
        apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab)
    if not every_row:
        logits[rows] = sub
