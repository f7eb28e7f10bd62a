"""Lab 05 (quantization): memory, speed and quality of each weight format, the KV capacity the
saved bytes buy, and the exercises' checks. The notebook imports this module as ``ex``; the
measurements live in lab05_measure.py (engines, memory table, kernel race, decode race) and
lab05_gate.py (the release gate, live slice and shipped run).
"""

from __future__ import annotations

import numbers

from minserve.lab.checks import ChoiceCheck, Mistake, NumberCheck
from course.lab05_gate import (  # noqa: F401
    SHIPPED_COMMAND, SHIPPED_GATE, gate_frame, gate_slice, judge, kl_order, second_look,
    shipped_frame, shipped_results, smallest_passing, verdicts)
from course.lab05_measure import (  # noqa: F401
    FORMATS, GATE_EXTRA, MIB, build_engines, decode_race, decode_races, format_args, fp32_resident_bytes,
    READ, SHAPES, kernel_contenders, kernel_race, memory_frame, plan_format, prose_prompts, race_panel,
    speedup_parts, speedup_share)


def _num(a) -> bool:
    return isinstance(a, numbers.Number) and not isinstance(a, bool)


def q1_tokens_gained(frame, budget_bytes: int, fmt: str = "int4") -> NumberCheck:
    """How many more KV tokens ``fmt``'s engine holds than fp32's at the same memory budget
    (``frame``: :func:`memory_frame` of the engines built with that ``memory_budget``)."""
    fp, q = frame.loc["fp32"], frame.loc[fmt]
    right = int(q["KV tokens"] - fp["KV tokens"])
    per_token = int(fp["KV bytes per token"])
    saved_resident = (fp["resident MiB"] - q["resident MiB"]) * MIB
    saved_streamed = (fp["streamed MiB per token"] - q["streamed MiB per token"]) * MIB
    block = int(fp["KV tokens"] // fp["KV blocks"])
    return NumberCheck(
        "Exercise 1", right, unit="tokens", abs_tol=block,
        tolerance_why=f"each engine rounds its pool down to whole blocks of {block} tokens, so "
                      "dividing the saved bytes directly can differ by up to one block",
        hint="the KV pool is the memory budget less the *resident* weights; the bytes a smaller "
             "format saves become KV cache, at the KV bytes per token of these engines (fp32 K/V).",
        solution=f'blocks = {{f: (BUDGET - resident_mib[f] * 2**20) // ({per_token} * {block})\n'
                 f'          for f in ("fp32", "{fmt}")}}\n'
                 f'answer = int((blocks["{fmt}"] - blocks["fp32"]) * {block})',
        namespace=lambda: {"BUDGET": budget_bytes, "resident_mib": frame["resident MiB"].to_dict()},
        explanation=f"{right:,} tokens more: {right / max(int(fp['KV tokens']), 1):.1f} times what "
                    "the fp32 engine holds, at no extra memory.",
        mistakes=[
            Mistake("that counts the *streamed* bytes saved; the memory budget holds what is "
                    "resident, and the dense embedding table stays resident.",
                    value=saved_streamed / per_token, rel_tol=0.02),
            Mistake(f"that is every token the {fmt} engine holds; the question asks how many more "
                    "than the fp32 engine's.", value=int(q["KV tokens"]), rel_tol=0.0),
            Mistake("that uses the int8 KV cache's bytes per token; these engines keep K and V in "
                    f"fp32 ({per_token:,} bytes per token).",
                    value=saved_resident / 12240, rel_tol=0.02),
            Mistake("that is in blocks; the question asks for tokens.",
                    value=right / block, rel_tol=0.02),
        ])


def q2_bytes_speedup(streamed: dict[str, int], resident: dict[str, int], fmt: str = "int4") -> NumberCheck:
    """The batch-1 decode speed-up of ``fmt`` over fp32 that the bytes streamed per token predict
    (a memory-bound step's time is its bytes / bandwidth). ``streamed`` / ``resident``: bytes per
    format, from the engines."""
    right = streamed["fp32"] / streamed[fmt]
    others = {k: streamed["fp32"] / v for k, v in streamed.items() if k not in ("fp32", fmt)}
    bits = {"int8": 8, "int4": 4}.get(fmt.split()[0], 8)
    return NumberCheck(
        "Exercise 2", right, unit="x", rel_tol=0.02,
        tolerance_why="the MiB in the table are rounded to 0.1",
        hint=f"at batch 1 a decode step reads every streamed weight byte once, and little else; "
             f"if its time is bytes / bandwidth, how much faster is a step that reads "
             f"{streamed[fmt] / MIB:.1f} MiB instead of {streamed['fp32'] / MIB:.1f} MiB?",
        solution=f'answer = streamed_mib["fp32"] / streamed_mib["{fmt}"]',
        namespace=lambda: {"streamed_mib": {k: v / MIB for k, v in streamed.items()}},
        explanation="That is the ceiling: it assumes the step does nothing but read weights, at "
                    "the same bandwidth for every format. The race below measures how close each "
                    "format gets.",
        mistakes=[
            Mistake(f"that is 32 / {bits}, the ratio of bits per weight. The format also stores "
                    "scales (and for int4 a min per group), and its LM head is int8, so a step "
                    f"streams more than 1/{32 // bits} of fp32's bytes.", value=32 / bits),
            Mistake("that uses the resident bytes. A quantized LM head unties it from the embedding "
                    "table; the dense table stays in memory for the token lookup, which reads a few "
                    "rows per step, so it is resident but not streamed. Use the streamed column.",
                    value=resident["fp32"] / resident[fmt]),
            Mistake("upside down: fewer bytes per step means a *faster* step, so the speed-up is "
                    "above 1.", value=1 / right),
            *[Mistake(f"that is {k}'s ratio; the question is about {fmt}.", value=v, rel_tol=0.01)
              for k, v in others.items()],
        ])


def q3_int8_kv_tokens(kv_budget_bytes: int, layers: int, kv_heads: int, head_dim: int,
                      block_size: int, right: int) -> NumberCheck:
    """KV tokens an int8 cache holds in ``kv_budget_bytes`` (``right``: the engine's, or the
    planner's which uses the engine's function)."""
    def tokens(per_token):
        return kv_budget_bytes // (per_token * block_size) * block_size
    fp32_per_token = 2 * layers * kv_heads * head_dim * 4
    no_scales = 2 * layers * kv_heads * head_dim
    int8_per_token = 2 * layers * kv_heads * (head_dim + 4)
    return NumberCheck(
        "Exercise 3", right, unit="tokens", integer=True,
        tolerance_why="whole blocks of a fixed number of bytes: the same on every machine",
        hint=f"an int8 cache stores each K and V number in 1 byte, plus one float32 scale (4 bytes) "
             f"per token, layer, K or V, and KV head; then whole blocks of {block_size} tokens.",
        solution=f"per_token = 2 * {layers} * {kv_heads} * ({head_dim} * 1 + 4)\n"
                 f"answer = KV_BYTES // (per_token * {block_size}) * {block_size}",
        namespace=lambda: {"KV_BYTES": kv_budget_bytes},
        explanation=f"{right / max(tokens(fp32_per_token), 1):.2f} times the fp32 cache's "
                    f"{tokens(fp32_per_token):,} tokens: 4 x head_dim / (head_dim + 4), a little less "
                    "than 4 because of the scales.",
        mistakes=[
            # Checked first: a count one block short of the bytes' quotient is a right formula
            # with the allocation unit forgotten, not "0 % too high".
            Mistake(f"you forgot that KV is allocated in whole blocks of {block_size} tokens: "
                    f"{kv_budget_bytes:,} / {int8_per_token:,} bytes per token is "
                    f"{kv_budget_bytes / int8_per_token:,.1f} tokens, but the pool holds whole blocks "
                    "only; round down to whole blocks first.",
                    test=_unrounded(kv_budget_bytes, int8_per_token, right)),
            Mistake(f"that forgets the scales: {no_scales:,} bytes per token is the int8 codes "
                    f"alone; each head's K and V also carry a 4-byte scale, {2 * layers * kv_heads * 4:,} "
                    "bytes more per token.", value=tokens(no_scales), rel_tol=0.0),
            Mistake(f"that forgets the scales, and that KV is allocated in whole blocks of {block_size} "
                    f"tokens: {no_scales:,} bytes per token is the int8 codes alone, and the pool "
                    "holds whole blocks only.", test=_unrounded(kv_budget_bytes, no_scales, tokens(no_scales))),
            Mistake("that is 4 x the fp32 cache's tokens: 1 byte instead of 4 would be exactly that, "
                    "but the scales take room too.", value=4 * tokens(fp32_per_token), rel_tol=0.0),
            Mistake("that is the fp32 cache's count; kv_cache_dtype changes the bytes per token.",
                    value=tokens(fp32_per_token), rel_tol=0.0),
            Mistake("that is a number of blocks, not of tokens.", value=right // block_size, rel_tol=0.0),
        ])


def _unrounded(budget_bytes: int, per_token: int, rounded: int):
    """A test for "divided the bytes by the bytes per token, without rounding down to whole
    blocks": within one token of the quotient (as a float, or floored or rounded) and not the
    block-rounded count itself."""
    raw = budget_bytes / per_token

    def test(answer) -> bool:
        return (_num(answer) and abs(float(answer) - raw) <= 1.0
                and round(float(answer)) != rounded)
    return test


RELEASE_OPTIONS = ("int8", "int4", "int4:lm_head=quantize", "int4:group_size=64", "int4-awq:group_size=64")


def q4_release(results) -> ChoiceCheck:
    """From the full gate run (``results``: FormatResults judged by the gate), the format with the
    fewest weight bytes streamed that passes every threshold, among :data:`RELEASE_OPTIONS`."""
    by = {r.spec.label: r for r in results}

    def why(label: str) -> str:
        r = by[label]
        if not r.passed:
            return f"{label} fails the gate: {'; '.join(r.failures)}."
        return f"{label} passes, with {r.weight_bytes / 1e6:.1f} MB streamed per token."
    return ChoiceCheck(
        "Exercise 4", lambda: smallest_passing(results, list(RELEASE_OPTIONS)),
        options={label: why(label) for label in RELEASE_OPTIONS},
        hint="keep the rows whose gate column says pass, then take the one with the smallest "
             "'weights MB streamed'.",
        solution=f"ok = shipped[(shipped.gate == 'pass') & shipped.index.isin({list(RELEASE_OPTIONS)})]\n"
                 "answer = ok['weights MB streamed'].idxmin()",
        namespace=lambda: {"shipped": gate_frame(results)},
        explanation="Smaller rows exist, but each misses a threshold: fewer bytes are only a win "
                    "where the answers stay the same.")
