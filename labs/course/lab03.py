"""Lab 03 (the KV-cache detective): bytes per token, blocks a workload holds, planned and measured
capacity, and what limited the engine under pressure."""

from __future__ import annotations

import math
import numbers

from minserve.lab.checks import ChoiceCheck, Mistake, NumberCheck

LIMITS = ("kv cache", "max_num_seqs", "compute")


def _num(a) -> bool:
    return isinstance(a, numbers.Number) and not isinstance(a, bool)


def q1_bytes_per_token(alloc: dict, num_heads: int) -> NumberCheck:
    """K/V bytes per token from the model's shape; checked against the engine's own KVCacheSpec."""
    L, H, D, E = alloc["layers"], alloc["kv_heads"], alloc["head_dim"], alloc["dtype_bytes"]
    right = alloc["bytes_per_token"]
    return NumberCheck(
        "Exercise 1", right, unit="bytes", integer=True,
        tolerance_why="an exact product of the model's shape",
        hint=f"every layer ({L}) keeps a key *and* a value vector for each KV head ({H}), each of "
             f"head_dim ({D}) numbers of {E} bytes.",
        solution="answer = 2 * layers * kv_heads * head_dim * dtype_bytes",
        namespace=lambda: {k: alloc[k] for k in ("layers", "kv_heads", "head_dim", "dtype_bytes")},
        explanation="The 2 is for K and V; grouped-query attention keeps fewer KV heads than "
                    f"attention heads ({H} against {num_heads} here), which shrinks the cache by "
                    f"{num_heads // H if H else 1}x.",
        mistakes=[
            Mistake(f"half of it: either the K *and* V factor 2 is missing, or the element size "
                    f"is taken as 2 bytes; this engine keeps K/V in {8 * E}-bit floats ({E} bytes).",
                    value=right // 2),
            Mistake(f"that uses the {num_heads} attention heads; only the {H} KV heads are cached "
                    "(grouped-query attention: several query heads share one K/V head).",
                    value=2 * L * num_heads * D * E, rel_tol=0.0),
            Mistake("that counts bits, not bytes.", value=8 * right),
            Mistake(f"that is one layer's share; every one of the {L} layers keeps its own K and V.",
                    value=right // L),
            Mistake(f"that is a whole block of {alloc['block_size']} tokens; the question asks per token.",
                    value=right * alloc["block_size"]),
        ])


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-int(tokens) // int(block_size))


def q2_peak_blocks(concurrency: int, prompt_tokens: int, output_tokens: int, block_size: int,
                   measured_blocks: int, num_blocks: int) -> NumberCheck:
    """The most KV blocks the long-prompt run held at once (from its step records)."""
    C, Pt, O, BS = concurrency, prompt_tokens, output_tokens, block_size
    per_seq = blocks_needed(Pt + O, BS)
    return NumberCheck(
        "Exercise 2", int(measured_blocks), unit="blocks", integer=True,
        tolerance_why="a count of blocks, the same on every machine",
        hint=f"each of the {C} requests grows to {Pt} + {O} tokens, and its cache is allocated in "
             f"whole blocks of {BS} tokens, one request at a time.",
        solution=f"answer = {C} * math.ceil(({Pt} + {O}) / {BS})",
        explanation=f"Each request holds ceil({Pt + O} / {BS}) = {per_seq} blocks by its last "
                    f"step; its last block is only partly filled. (Strictly, the last sampled token is "
                    "never written to the cache, which changes nothing here.)",
        mistakes=[
            Mistake("that counts the prompts only: every generated token is added to the cache too, "
                    "so the cache keeps growing until the answers end.",
                    value=C * blocks_needed(Pt, BS)),
            Mistake("that rounds once for all requests together; blocks are not shared, so each "
                    "request rounds up its own last block.",
                    test=lambda a: _num(a) and a == blocks_needed(C * (Pt + O), BS) and a != C * per_seq),
            Mistake("that is a number of tokens; the question asks for blocks.",
                    test=lambda a: _num(a) and a in (C * (Pt + O), C * per_seq * BS)),
            Mistake("that is one request's blocks; all of them held theirs at the same time.",
                    value=per_seq),
            Mistake(f"that looks like a percentage; give the number of blocks (of {num_blocks}).",
                    test=lambda a: _num(a) and a != C * per_seq
                    and abs(a - 100 * C * per_seq / num_blocks) <= 1),
        ])


def q3_planned_capacity(plan, kv_budget_bytes: int) -> NumberCheck:
    """Sequences of ``plan.context_len`` tokens that fit in the KV budget (minserve.plan)."""
    per_token, BS, Lc = plan.kv_bytes_per_token, plan.block_size, plan.context_len
    blocks = kv_budget_bytes // (per_token * BS)
    return NumberCheck(
        "Exercise 3", plan.max_num_seqs, unit="sequences", integer=True,
        tolerance_why="a whole number of sequences, from whole blocks",
        hint="first the number of whole blocks the budget holds (KV bytes per token x block size "
             f"each), then the blocks one sequence of {Lc} tokens needs, rounded up.",
        solution=f"blocks = KV_BUDGET // (bytes_per_token * {BS})\n"
                 f"answer = blocks // math.ceil({Lc} / {BS})",
        namespace=lambda: {"KV_BUDGET": kv_budget_bytes, "bytes_per_token": per_token},
        explanation=f"{blocks} blocks, {math.ceil(Lc / BS)} per sequence: the engine hands out "
                    "whole blocks, so a sequence's partly filled last block counts in full.",
        mistakes=[
            Mistake(f"that divides the budget by the bytes of {Lc} tokens, as if sequences could "
                    f"share blocks; each sequence takes whole blocks of {BS} tokens, the last one "
                    "partly empty.", value=kv_budget_bytes // (per_token * Lc)),
            Mistake("that is twice too generous in bytes: was the K and V factor 2 left out of the "
                    "bytes per token?",
                    test=lambda a: _num(a) and a in ((2 * blocks) // math.ceil(Lc / BS),
                                                     2 * kv_budget_bytes // (per_token * Lc))
                    and a != plan.max_num_seqs),
            Mistake("that is the number of blocks, not of sequences.", value=blocks),
        ])


def measured_capacity(table) -> int:
    """The largest concurrency of the sweep (:func:`~minserve.lab.capacity.pressure_table`) at
    which every request ran from start to end without waiting or being preempted, and every lower
    concurrency did too."""
    best = 0
    for c in sorted(table.index):
        row = table.loc[c]
        if row["preemptions"] == 0 and row["max waiting"] == 0 and row["max running"] == c:
            best = int(c)
        else:
            break
    return best


def q4_measured_capacity(table) -> NumberCheck:
    loads = sorted(table.index)
    first_bad = next((int(c) for c in loads if int(c) > measured_capacity(table)), None)
    most = int(table["max running"].max())
    return NumberCheck(
        "Exercise 4", lambda: measured_capacity(table), unit="sequences", integer=True,
        tolerance_why="read from whole counts in the table, the same on every machine",
        hint="find the last concurrency at which the table shows no preemption and no waiting "
             "request, with every request running at once.",
        solution='clean = (table.preemptions == 0) & (table["max waiting"] == 0) \\\n'
                 '    & (table["max running"] == table.index)\n'
                 'answer = table.index[clean].max()  # the rows below it are clean too',
        namespace=lambda: {"table": table},
        mistakes=([Mistake("at that concurrency the engine already had to make a request wait or "
                           "preempt one: it did not fit any more.", value=first_bad)]
                  if first_bad is not None else []) + [
            Mistake("that many requests ran at once only for a while: the scheduler admits a "
                    "request when its *prompt* fits, and preempts the newest when the growing "
                    "answers no longer do.", test=lambda a: _num(a) and a == most
                    and a != measured_capacity(table)),
        ])


def what_limited(row, max_num_seqs: int) -> str:
    """What held requests back in a run: its KV cache (it preempted, or admitted fewer than the
    seats allowed), its seats, or neither (then only the compute per step)."""
    if row["preemptions"] > 0 or (row["max waiting"] > 0 and row["max running"] < max_num_seqs):
        return "kv cache"
    if row["max waiting"] > 0:
        return "max_num_seqs"
    return "compute"


def q5_what_limited(table, concurrency: int, max_num_seqs: int) -> ChoiceCheck:
    row = table.loc[concurrency]
    return ChoiceCheck(
        "Exercise 5", lambda: what_limited(row, max_num_seqs),
        options={
            "kv cache": "the engine had seats to spare, yet requests waited or were preempted: the "
                        "KV blocks ran out first. The prompts got in; the answers then grew past "
                        "what the pool holds.",
            "max_num_seqs": f"the engine has {max_num_seqs} seats (max_num_seqs); look at the most "
                            f"requests running in that row: were all seats ever taken?",
            "compute": "more compute would make each step faster, but it would not have stopped "
                       "the preemptions and the waiting in that row: those come from running out of "
                       "something else.",
        },
        hint="compare the row's 'max running' with max_num_seqs, and look at its preemptions and "
             "waiting requests.",
        solution=f'row = table.loc[{concurrency}]\n'
                 f'answer = ("kv cache" if row.preemptions > 0 or (row["max waiting"] > 0\n'
                 f'          and row["max running"] < {max_num_seqs}) else\n'
                 f'          "max_num_seqs" if row["max waiting"] > 0 else "compute")',
        namespace=lambda: {"table": table})


def deterioration_point(table, output_tokens: int, threshold: float = 0.10):
    """The lab's rule for "latency began to deteriorate materially": the lowest concurrency at
    which the slowest request was held up (:func:`~minserve.lab.capacity.extra_steps`) for more
    than ``threshold`` of the steps it needs alone (about its output length); None if none was."""
    for c in sorted(table.index):
        if table.loc[c, "most extra steps"] > threshold * output_tokens:
            return c
    return None


def pressure_evidence(table, planned: int) -> tuple[bool, str]:
    """The lesson of steps 4 and 5, on :func:`~minserve.lab.capacity.pressure_table`: no row at or
    below the planned capacity preempted or made a request wait, and every row above it did one
    or the other (counted by the engine, the same on any machine)."""
    below = [c for c in table.index if c <= planned]
    above = [c for c in table.index if c > planned]

    def troubled(c):
        return table.loc[c, "preemptions"] > 0 or table.loc[c, "max waiting"] > 0
    calm = [c for c in below if not troubled(c)]
    hit = [c for c in above if troubled(c)]
    shown = bool(below) and bool(above) and len(calm) == len(below) and len(hit) == len(above)
    pre = ", ".join(f"{int(table.loc[c, 'preemptions'])} at c = {c}" for c in above) or "no run above it"
    return shown, (f"planned capacity {planned}: {len(calm)} of {len(below)} runs at or below it ran "
                   f"without preemption or waiting; {len(hit)} of {len(above)} runs above it preempted "
                   f"or made requests wait (preemptions: {pre})")
