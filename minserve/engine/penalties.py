"""Logits controls that change which token is picked: allowed ids, bad words, logit bias, the
presence / frequency / repetition penalties, and the structured-output grammar mask.

The sampler calls :func:`apply_logits_controls` before temperature, top-k and top-p. Each control
works on the rows that use it, as a few tensor operations over those rows. What a request's
controls need is built once, off the step, by :func:`prepare_controls` (``LLMEngine.prepare_params``
runs it on the server's tokenizer threads): ``allowed_token_ids`` and the one-token bad words become
one [vocab] mask, ``logit_bias`` an index and a value tensor, the multi-token bad words an index by
the token before their last. A step then costs a few tensor ops per row whatever the size of those
lists. Rebuilding Python index lists over every entry at every step, as this file did before, made
a batch of 8 with one full-vocabulary ``allowed_token_ids`` and one full-vocabulary ``logit_bias``
step 1.56x slower on SmolLM2-135M (18.8x on tiny-llama); with the prepared tensors 1.01x
(benchmarks/bench_logits_controls.py, 2-core VM). Order as in vLLM V1:
allowed token ids, bad words, logit bias, then repetition, frequency and presence penalties; the
grammar mask and the ``min_tokens`` bans last (bans and masks set -inf, which every step keeps at
-inf, so their place in the order changes nothing; that is also why the one-token bad words can
share the allowed-ids mask).

A row left with no token that may be sampled is a request whose constraints contradict each other
(e.g. a grammar that only allows EOS before ``min_tokens``). It is reported, not raised, when the
caller asks (``dead_rows``): the sampler hands the row back as failed and the engine fails that
request alone, while its neighbours keep the tokens of the same step.

The formulas (vLLM's), with ``count`` a token's occurrences in the output so far:
    repetition (prompt and output tokens): logit / r if logit > 0 else logit * r
    frequency and presence (output tokens only): logit - f * count - p * (count > 0)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

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


@dataclass(eq=False)
class PreparedControls:
    """A request's logits controls in the form a step uses, built once by :func:`prepare_controls`
    and kept on its ``SamplingParams`` (``_prepared``).

    ``checked`` holds the fields it was built from and checked against (by reference): a step
    trusts the record while ``allowed_token_ids``, ``logit_bias`` and the bad words' token ids are
    still those very objects (an O(1) test), and ``LLMEngine.add_request`` compares the values
    when they are not (a ``dataclasses.replace`` copy builds new lists from equal ones). A deep
    copy (``SamplingParams.clone``, parallel samples) keeps that relation and shares the tensors,
    which nothing ever modifies.
    """

    owner: object                       # who prepared it (an engine's key; None: the sampler, lazily)
    vocab_size: int
    checked: tuple                      # see _checked_fields
    # [vocab] bool, True where the request may never sample: outside allowed_token_ids, and the
    # one-token bad words. None when neither applies.
    blocked: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None      # logit_bias keys (long) and values (float32)
    bias_values: torch.Tensor | None = None
    # Multi-token bad words by the token before their last: {that token: [(prefix, last)]}, so a
    # step looks only at the words the output's last token can continue.
    bad_words_after: dict[int, list[tuple[list[int], int]]] = field(default_factory=dict)
    grammar: tuple | None = None        # (GrammarBackend, its compiled grammar) for structured_outputs

    def __deepcopy__(self, memo):
        out = copy.copy(self)
        out.checked = copy.deepcopy(self.checked, memo)  # the copy's own fields, via the memo
        return out

    def fits(self, p: SamplingParams, vocab_size: int) -> bool:
        """Built for these very field objects and this vocabulary (the per-step test)."""
        return (self.vocab_size == vocab_size
                and all(a is b for a, b in zip(self.checked[:3], _step_fields(p))))

    def adopt(self, p: SamplingParams) -> bool:
        """True when this record was built from values equal to ``p``'s now (O(size of the
        lists) compares, mostly of identical objects); it is then bound to ``p``'s own field
        objects, and ``p`` gets the bad words' token ids back if a copy lost them
        (``dataclasses.replace`` resets that non-init field). ``add_request``'s test."""
        now = _checked_fields(p)
        same = all(a is b or a == b for j, (a, b) in enumerate(zip(self.checked, now))
                   if not (j == 2 and b is None))
        if not same:
            return False
        if p._bad_words_token_ids is None:
            p._bad_words_token_ids = self.checked[2]
        if not self.fits(p, self.vocab_size):
            bound = copy.copy(self)
            bound.checked = _checked_fields(p)
            p._prepared = bound
        return True


def _step_fields(p: SamplingParams) -> tuple:
    return p.allowed_token_ids, p.logit_bias, p._bad_words_token_ids


def _checked_fields(p: SamplingParams) -> tuple:
    """What a preparation (and ``check_params``) depends on: the step's three, then the rest."""
    return (*_step_fields(p), p.bad_words, p.structured_outputs, p.stop_token_ids, p.min_tokens,
            p.ignore_eos, p.extra_args)  # extra_args: what logits processors' validate_params read


def prepare_controls(p: SamplingParams, vocab_size: int, device="cpu", owner: object = None,
                     grammar: tuple | None = None) -> PreparedControls:
    """Build ``p``'s per-step tensors (bad words must be tokenized already) and attach them as
    ``p._prepared``. Cost O(vocab + entries), once per request instead of once per step."""
    rec = PreparedControls(owner, vocab_size, _checked_fields(p), grammar=grammar)
    one_token = [w[0] for w in p._bad_words_token_ids or () if len(w) == 1]
    if p.allowed_token_ids is not None or one_token:
        if p.allowed_token_ids is not None:
            blocked = torch.ones(vocab_size, dtype=torch.bool, device=device)
            blocked[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=device)] = False
        else:
            blocked = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if one_token:
            blocked[torch.tensor(one_token, dtype=torch.long, device=device)] = True
        rec.blocked = blocked
    if p.logit_bias:
        rec.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)
        rec.bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device)
    for word in p._bad_words_token_ids or ():
        if len(word) > 1:
            rec.bad_words_after.setdefault(word[-2], []).append((word[:-1], word[-1]))
    p._prepared = rec  # one assignment: a thread preparing the same params sees all or nothing
    return rec


def controls_of(p: SamplingParams, vocab_size: int, device) -> PreparedControls:
    """``p``'s prepared controls, built here when it has none that fit (a sampler used without
    an engine, or fields replaced since): then the first step pays what prepare_params would."""
    rec = p._prepared
    if not isinstance(rec, PreparedControls) or not rec.fits(p, vocab_size):
        grammar = rec.grammar if isinstance(rec, PreparedControls) else None
        rec = prepare_controls(p, vocab_size, device, grammar=grammar)
    return rec


def apply_logits_controls(logits: torch.Tensor, params: list[SamplingParams],
                          output_ids: list[list[int] | None] | None,
                          prompt_ids: list[list[int] | None] | None,
                          grammar_rows: list[int], grammar_bitmask: torch.Tensor | None,
                          banned: list[list[int]], dead_rows: dict[int, str] | None = None) -> torch.Tensor:
    """``logits`` itself when no row uses a control (no copy), else a processed copy.

    ``output_ids`` / ``prompt_ids``: per row, the tokens the penalties and bad words look at
    (None for rows that need none). ``grammar_bitmask``: one packed row per entry of
    ``grammar_rows``. ``banned``: the sampler's ``min_tokens`` bans, applied here too for the
    processed rows, to find the rows left with no token to pick. Such a row raises ValueError,
    or, given a ``dead_rows`` dict, is recorded there (row -> which controls left it empty) and
    filled with zeros, so that sampling the batch goes on and the caller drops that row's token.
    """
    rows = [i for i, p in enumerate(params) if adjusts_logits(p)]
    if not rows and not grammar_rows:
        return logits
    _check_histories(rows, params, output_ids, prompt_ids)
    out = logits.clone(memory_format=torch.contiguous_format)  # flat views below need it
    if rows:
        vocab, device = logits.shape[1], logits.device
        controls = {i: controls_of(params[i], vocab, device) for i in rows}
        _apply_blocked(out, controls)
        _apply_bad_words(out, rows, params, output_ids, controls)
        _apply_logit_bias(out, controls)
        _apply_penalties(out, rows, params, output_ids, prompt_ids)
    if grammar_rows:
        apply_token_bitmask(out, grammar_rows, grammar_bitmask)
    touched = sorted(set(rows) | set(grammar_rows))
    bans = [(i, t) for i in touched for t in banned[i]]
    if bans:
        out[[i for i, _ in bans], [t for _, t in bans]] = float("-inf")
    dead = [touched[j] for j in (out[touched].amax(dim=-1) == float("-inf")).nonzero().squeeze(1).tolist()]
    if dead:
        why = {i: _why_dead(params[i], bool(banned[i]), i in grammar_rows) for i in dead}
        if dead_rows is None:
            raise ValueError(f"rows {dead}: {why[dead[0]]}")
        dead_rows.update(why)
        out[dead] = 0.0  # any finite row: what is drawn from it is thrown away
    return out


def _why_dead(p: SamplingParams, min_tokens_bans: bool, grammar: bool) -> str:
    """Which of the row's controls, together, left it nothing (the engine adds where)."""
    names = [n for n, on in (("allowed_token_ids", p.allowed_token_ids is not None),
                             ("bad_words", bool(p.bad_words)), ("min_tokens", min_tokens_bans),
                             ("the structured-output grammar", grammar)) if on]
    if not names:
        return "the logits controls leave no token that may be sampled"
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{listed} {'together leave' if len(names) > 1 else 'leaves'} no token that may be sampled"


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


def _apply_blocked(logits: torch.Tensor, controls: dict[int, PreparedControls]) -> None:
    """allowed_token_ids and one-token bad words: one masked_fill per row, from its mask."""
    for i, c in controls.items():
        if c.blocked is not None:
            logits[i].masked_fill_(c.blocked.to(logits.device), float("-inf"))


def bad_word_bans(p: SamplingParams, output_ids: list[int]) -> list[int]:
    """Tokens a row may not pick now: the last token of every bad word whose other tokens the
    output ends with (a one-token word is always banned). vLLM's rule, on output tokens only.
    The reference a step follows (a step gets the same bans from the prepared controls: the
    one-token words in the mask, the others looked up by the output's last token)."""
    banned = []
    for word in p._bad_words_token_ids or ():
        prefix = word[:-1]
        if len(prefix) <= len(output_ids) and output_ids[len(output_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def _apply_bad_words(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     output_ids: list[list[int] | None] | None,
                     controls: dict[int, PreparedControls]) -> None:
    """Multi-token bad words (the one-token ones are in the mask): only the words whose
    next-to-last token is the output's last are compared, so a step costs what can match."""
    bans = []
    for i in rows:
        out = output_ids[i] if params[i].bad_words else None
        if not out:
            continue
        for prefix, last in controls[i].bad_words_after.get(out[-1], ()):
            if len(prefix) <= len(out) and out[len(out) - len(prefix):] == prefix:
                bans.append((i, last))
    if bans:
        logits[[i for i, _ in bans], [t for _, t in bans]] = float("-inf")


def _apply_logit_bias(logits: torch.Tensor, controls: dict[int, PreparedControls]) -> None:
    """One index_add per row from its prepared tensors: its keys are unique (one dict), so
    ``logit + bias`` is exact, the same float32 sum as any other order."""
    for i, c in controls.items():
        if c.bias_ids is not None:
            logits[i].index_add_(0, c.bias_ids.to(logits.device), c.bias_values.to(logits.device, logits.dtype))


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
