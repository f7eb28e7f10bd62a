"""Lab 05 (quantization): the measurements. Engines per weight format at one memory budget, the
memory and KV-capacity table, a kernel race (PyTorch's own int8/int4 ops against minserve's C
kernels on one matrix), a side-by-side decode race, and a small live slice of the release gate.

The formats are named as ``minserve eval --quantization`` names them (``fp32``, ``int8``,
``int4``, ``int4:group_size=64``), and :func:`format_args` turns a name into engine arguments with
the gate's own parser, so the lab and the gate cannot disagree on what a name means.
"""

from __future__ import annotations

import time
from typing import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # annotations only
    import pandas as pd

import torch
import torch.nn.functional as F

from minserve.eval.gate import parse_format

MIB = 2**20
# The formats the lab builds engines for (label: the gate's name for it).
FORMATS = {"fp32": "fp32", "int8": "int8", "int4": "int4"}
# One more for the gate slice only: int4 with groups of 64, the row the shipped gate fails.
GATE_EXTRA = {"int4 g64": "int4:group_size=64"}


def format_args(name: str) -> dict:
    """Engine arguments of a gate format name: ``"int4:group_size=64"`` ->
    ``{"quantization": "int4", "quantization_config": {"group_size": 64}}``; ``"fp32"`` -> ``{}``."""
    spec = parse_format(name)
    return {**({"quantization": spec.quantization} if spec.quantization else {}), **spec.engine_args}


def fp32_resident_bytes(model: str) -> int:
    """Resident bytes of the model's fp32 weights (the planner's count, the engine's too)."""
    from minserve.plan import plan
    return plan(model, hardware="h100", precision="fp32").weight_bytes


def build_engines(preset, names: dict[str, str], title: str = "building engines",
                  warm_prompts: list[int] | None = None, warm_batches: list[int] | None = None,
                  **engine_args) -> dict:
    """``{label: LLM}``, one engine per format of ``names`` (label: gate name), each with the
    preset's arguments plus ``engine_args``, warmed up on the prompt lengths ``warm_prompts`` and
    decode batches ``warm_batches`` the lab will time (:func:`minserve.lab.hygiene.warm`; None: its
    defaults). A progress line while they load (quantizing at load takes seconds per engine)."""
    from minserve import LLM
    from minserve.lab.hygiene import warm
    from minserve.lab.live import Progress
    bar = Progress(len(names), title, "engines")
    engines = {}
    for k, (label, name) in enumerate(names.items()):
        bar.update(k, f"now: {label}")
        llm = LLM(preset.model, **preset.engine_kwargs(**format_args(name), **engine_args))
        warm(llm, warm_prompts, warm_batches)
        engines[label] = llm
    bar.update(len(names))
    return engines


# ---- memory and KV capacity --------------------------------------------------------------------

def _row(label, source, resident, streamed, kv_per_token, blocks, block_size, context_tokens) -> dict:
    per_seq = -(-context_tokens // block_size)
    return {"format": label, "source": source, "resident MiB": resident / MIB,
            "streamed MiB per token": streamed / MIB, "KV bytes per token": int(kv_per_token),
            "KV blocks": int(blocks), "KV tokens": int(blocks * block_size),
            f"sequences of {context_tokens} tokens": int(blocks // per_seq)}


def memory_frame(engines: dict, context_tokens: int, planned: dict | None = None):
    """One row per engine (what it holds: resident and streamed weight bytes, its KV spec), then
    one per entry of ``planned`` (``{label: minserve.plan.Plan}``, for settings not built here).
    The ``source`` column says which is which."""
    import pandas as pd
    rows = []
    for label, llm in engines.items():
        eng = llm.llm_engine
        spec = eng.kv_spec
        rows.append(_row(label, "engine", eng.runner.weight_footprint().resident_bytes,
                         eng.runner.weight_bytes(), spec.bytes_per_token, spec.num_blocks,
                         spec.block_size, context_tokens))
    for label, p in (planned or {}).items():
        rows.append(_row(label, "planner", p.weight_bytes, p.weight_bytes_per_step, p.kv_bytes_per_token,
                         p.num_kv_blocks, p.block_size, context_tokens))
    return pd.DataFrame(rows).set_index("format")


def plan_format(model: str, name: str, memory_budget: int, context_tokens: int, kv_cache_dtype: str = "auto"):
    """minserve.plan's budget for a gate format name at ``memory_budget``, with the engine's CPU
    activations (float32) and its default LM-head policy."""
    from minserve.plan import plan
    args = format_args(name)
    precision = args.get("quantization", "fp32")
    group = args.get("quantization_config", {}).get("group_size", 32)
    return plan(model, hardware="h100", memory_budget=memory_budget, context_len=context_tokens,
                precision=precision, dtype="float32" if precision != "fp32" else None,
                group_size=group, kv_cache_dtype=kv_cache_dtype)


# ---- the kernel race ---------------------------------------------------------------------------

def _torch_int4_operands(packed, scales, mins):
    """Our int4 layout (``w = q * scale + min``) in PyTorch's CPU int4 op's (``w = (q - 8) *
    scale + zero``): the same matrix, so the two ops compute the same product."""
    from minserve.quant.formats import unpack_int4
    q = unpack_int4(packed).to(torch.int32)
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scales.t(), (mins + 8 * scales).t()], dim=2).contiguous()
    return weight, scales_zeros


def kernel_contenders(out_features: int, in_features: int, group_size: int = 32,
                      seed: int = 0) -> tuple[dict, Callable]:
    """``({name: (who, format, bytes stored, call(x))}, reference(x))`` for one random weight
    matrix: fp32 ``F.linear``; PyTorch's own W8A16 and W4A16 CPU ops; int8 dequantized then
    ``F.linear`` (the obvious way); minserve's int8 and int4 C kernels. The int8 entries share
    codes and the int4 ones share codes, so each quantized call can be checked against
    ``reference`` (the dequantized matrix through ``F.linear``)."""
    from minserve.kernels.quant import int4_linear, int8_linear
    from minserve.quant.formats import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
    if out_features % 16 or in_features % group_size:
        raise ValueError(f"PyTorch's int4 op packs 16 output rows at a time and int4 groups of {group_size} "
                         f"inputs: out_features must divide by 16 and in_features by {group_size}, got "
                         f"[{out_features} x {in_features}]")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.02
    codes, scales = quantize_int8(w)
    packed, s4, m4 = quantize_int4(w, group_size)
    t4, sz4 = _torch_int4_operands(packed, s4, m4)
    n8 = codes.numel() + 4 * scales.numel()
    n4 = packed.numel() + 4 * (s4.numel() + m4.numel())
    ref8, ref4 = dequantize_int8(codes, scales), dequantize_int4(packed, s4, m4, group_size)
    contenders = {
        "fp32 F.linear": ("PyTorch", "fp32", 4 * w.numel(), lambda x: F.linear(x, w)),
        "int8 torch._weight_int8pack_mm": ("PyTorch", "int8", n8,
                                           lambda x: torch._weight_int8pack_mm(x, codes, scales)),
        f"int4 g{group_size} torch int4pack_mm": (
            "PyTorch", "int4", n4,
            lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t4, group_size, sz4)),
        "int8 dequantize + F.linear": ("PyTorch", "int8", n8,
                                       lambda x: F.linear(x, dequantize_int8(codes, scales))),
        "int8 minserve C kernel": ("minserve", "int8", n8, lambda x: int8_linear(x, codes, scales)),
        f"int4 g{group_size} minserve C kernel": (
            "minserve", "int4", n4, lambda x: int4_linear(x, packed, s4, m4, group_size)),
    }

    def reference(name: str, x):
        fmt = contenders[name][1]
        return F.linear(x, {"fp32": w, "int8": ref8, "int4": ref4}[fmt])
    return contenders, reference


def kernel_race(out_features: int = 49152, in_features: int = 576, rounds: int = 15,
                batch: int = 1, seed: int = 0):
    """Time every contender of :func:`kernel_contenders` on ``batch`` rows: ``rounds`` rounds,
    one call of each per round in turn (each call then finds the others' bytes in the cache, not
    its own: the weights come from memory, as in a decode step), and the fastest call per
    contender. Other work on a shared machine can only slow a call down, never speed it up, and it
    hurts short calls most (a two-thread call waits whenever one of its threads is descheduled), so
    the fastest call is the one that measures the kernel; a median would measure the neighbours.
    Each result is first checked against the dequantized matrix's product. Columns: who, format,
    MB stored, ms per call, GB/s (bytes stored / time), its share of the read bandwidth, speed-up
    over fp32 F.linear, the bytes' ratio to fp32's, and the speed-up over an fp32 multiply that
    ran at the read bandwidth. ``frame.attrs`` holds the read bandwidth: a ``torch.sum`` over as
    many bytes as the fp32 matrix, timed in the same rounds, or on one thread after them if that
    was faster (a busy machine) ("read GB/s", "read ms", "read MB", "read threads")."""
    import pandas as pd
    from minserve.lab.live import Progress
    contenders, reference = kernel_contenders(out_features, in_features, seed=seed)
    x = torch.randn(batch, in_features, generator=torch.Generator().manual_seed(seed + 1))
    # What merely reading the fp32 matrix's bytes costs on this machine, timed in the same rounds
    # (a sum over as many float32 values: every byte read once, one add each). It is the bound a
    # memory-bound fp32 multiply could reach, so the table can say how far F.linear is from it.
    plain = torch.ones(out_features * in_features)
    plain.sum()
    for name, (_, _, _, call) in contenders.items():
        want = reference(name, x)
        err = float((call(x) - want).abs().max())
        if err > 1e-3 * float(want.abs().max()) + 1e-5:
            raise AssertionError(f"{name} does not compute the product of its matrix (max error {err:.3g})")
    calls = {**{name: (lambda c=c: c(x)) for name, (_, _, _, c) in contenders.items()},
             READ: plain.sum}
    times: dict[str, list[float]] = {name: [] for name in calls}
    bar = Progress(rounds, f"kernel race, [{out_features} x {in_features}] x {batch} row(s)", "rounds")
    for r in range(rounds):
        bar.update(r)
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    bar.update(rounds)
    best = {name: min(t) for name, t in times.items()}
    fp32_bytes = contenders["fp32 F.linear"][2]
    # With a core taken by another process, a two-thread sum waits for its descheduled thread and
    # understates what memory gives; one thread on the free core does not. The faster one counts.
    one_thread = _one_thread_seconds(plain.sum)
    read_threads = torch.get_num_threads() if best[READ] <= one_thread else 1
    best[READ] = min(best[READ], one_thread)
    read_bw = fp32_bytes / best[READ]
    rows = [{"kernel": name, "who": who, "format": fmt, "MB stored": nbytes / 1e6,
             "ms per call": 1e3 * best[name], "GB/s": nbytes / best[name] / 1e9,
             "share of read bandwidth": nbytes / best[name] / read_bw,
             "speed-up over fp32": best["fp32 F.linear"] / best[name],
             "fewer bytes than fp32 (x)": fp32_bytes / nbytes,
             "speed-up over fp32 at read bandwidth": best[READ] / best[name]}
            for name, (who, fmt, nbytes, _) in contenders.items()]
    frame = pd.DataFrame(rows).set_index("kernel")
    frame.attrs.update({"read GB/s": read_bw / 1e9, "read ms": 1e3 * best[READ],
                        "read MB": fp32_bytes / 1e6, "read threads": read_threads})
    return frame


def _one_thread_seconds(call, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of ``call`` on one thread (the thread count restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        call()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return best


READ = "read the fp32 bytes (torch.sum)"


def speedup_parts(race, name: str) -> dict:
    """Why a kernel's speed-up over fp32 F.linear is what it is: speed-up = (fp32 bytes / its
    bytes) x (its GB/s / fp32's GB/s), exactly, since time = bytes / GB/s for both. A speed-up
    past the byte ratio means the fp32 call moved its bytes more slowly than the kernel did."""
    fp, row = race.loc["fp32 F.linear"], race.loc[name]
    return {"speed-up": float(row["speed-up over fp32"]), "bytes": float(row["fewer bytes than fp32 (x)"]),
            "GB/s ratio": float(row["GB/s"] / fp["GB/s"]),
            "over fp32 at read bandwidth": float(row["speed-up over fp32 at read bandwidth"])}


# ---- the decode race ---------------------------------------------------------------------------

def prose_prompts(tokenizer, n: int, tokens: int = 16) -> list[list[int]]:
    """``n`` prompts: the first ``tokens`` tokens of the shipped prose paragraphs, cycling."""
    from minserve.eval.data import load_texts
    texts = load_texts()
    ids = [tokenizer(t, add_special_tokens=False).input_ids[:tokens] for t in texts]
    return [ids[i % len(ids)] for i in range(n)]


def decode_race(engines: dict, prompts: list[list[int]], max_tokens: int):
    """All engines get the same prompts at once (greedy, exactly ``max_tokens`` each) and are
    stepped in turn, one step each (lab 06's :func:`run_side_by_side`), so the load of a shared
    machine falls on all alike. Decode tokens/s from the decode-only steps, hiccups capped. One row
    per format: batch, streamed MiB per token, decode tok/s, speed-up over the first engine (fp32)
    and the speed-up the bytes alone predict (streamed bytes of fp32 / of the format)."""
    import pandas as pd
    from minserve import SamplingParams
    from course.lab06 import run_side_by_side
    from minserve.lab.live import Progress
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    total = len(prompts) * max_tokens
    bar = Progress(total, f"decode race, batch {len(prompts)}", "tokens (slowest engine)")
    runs = run_side_by_side(list(engines.values()), prompts, params,
                            on_step=lambda traces: bar.update(min(t[-1][1] for t in traces)))
    bar.update(total)
    for label, run in zip(engines, runs):
        if run.steps.num_preemptions.sum():
            raise RuntimeError(f"the {label} engine preempted during the race, so its time includes "
                               "recomputing: give it a larger memory budget or race fewer/shorter requests")
    streamed = {label: llm.llm_engine.runner.weight_bytes() for label, llm in engines.items()}
    first = next(iter(engines))
    rates = {label: run.decode_rate for label, run in zip(engines, runs)}
    rows = [{"format": label, "batch": len(prompts), "streamed MiB per token": streamed[label] / MIB,
             "decode tok/s": rates[label], "speed-up over fp32": rates[label] / rates[first],
             "bytes predict": streamed[first] / streamed[label]} for label in engines]
    return pd.DataFrame(rows).set_index("format")


def decode_races(engines: dict, tokenizer, batch: int, max_tokens: int, repeats: int = 3,
                 max_runs: int = 5, tolerance: float = 0.2, echo: bool = True):
    """:func:`decode_race` at batch 1 and at ``batch``, repeated as a calibration
    (:func:`minserve.lab.hygiene.calibrate`: the first repetition is dropped, and repetitions are
    added until the last ``repeats`` agree within ``tolerance`` on the last format's batch-1
    speed-up, or ``max_runs`` were made). One race is a few seconds of a shared machine, and a
    memory-hungry neighbour slows the memory-bound fp32 engine most, so one race can say
    anything; the median of a few says what the engines do.

    Returns (batch-1 frame, batch frame, calibration): :func:`decode_race`'s columns, each the
    median over the kept repetitions (the speed-ups are medians of per-repetition ratios, so both
    sides of a ratio come from the same seconds), and ``attrs["speed-ups"]``: every kept
    repetition's speed-ups per format."""
    import pandas as pd

    from minserve.lab.hygiene import calibrate
    last = list(engines)[-1]
    reps: list[tuple] = []

    def one() -> float:
        r1 = decode_race(engines, prose_prompts(tokenizer, 1), max_tokens)
        rb = decode_race(engines, prose_prompts(tokenizer, batch), max_tokens)
        reps.append((r1, rb))
        return 100 * float(r1.loc[last, "speed-up over fp32"])

    cal = calibrate(one, name=f"{last}'s batch-1 decode speed", unit=f"% of {list(engines)[0]}'s",
                    repeats=repeats, max_runs=max_runs, tolerance=tolerance, echo=echo)
    kept = reps[-len(cal.kept):]
    out = []
    for i in range(2):
        frames = [r[i] for r in kept]
        med = pd.concat(frames).groupby(level=0, sort=False).median()
        med = med.loc[frames[0].index]
        med["batch"] = frames[0]["batch"]
        med.attrs["speed-ups"] = {k: [float(f.loc[k, "speed-up over fp32"]) for f in frames]
                                  for k in frames[0].index}
        out.append(med)
    return out[0], out[1], cal


def speedup_share(race) -> "pd.Series":
    """How much of the bytes' predicted speed-up each format got: measured / predicted."""
    return race["speed-up over fp32"] / race["bytes predict"]


# SmolLM2-135M's matrices as the engine holds them ([out x in]; q/k/v and gate/up merged).
SHAPES = {"LM head [49152 x 576]": (49152, 576), "gate+up [3072 x 576]": (3072, 576),
          "down [576 x 1536]": (576, 1536), "q/k/v [960 x 576]": (960, 576)}


def race_panel(shape: str = next(iter(SHAPES)), batch: int = 1, rounds: int = 7):
    """:func:`kernel_race` behind an ipywidgets ``interactive`` panel (a matrix, rows and rounds, and a
    Run button); returns the widget, or None with a note without ipywidgets."""
    try:
        import ipywidgets as w
    except ImportError:
        print("ipywidgets is not installed: call kernel_race(...) directly "
              "(pip install ipywidgets for the panel).")
        return None

    def run(matrix, rows, rounds):
        return kernel_race(*SHAPES[matrix], rounds=rounds, batch=rows).round(2)
    style = {"description_width": "120px"}
    return w.interactive(run, {"manual": True, "manual_name": "Run"},
                         matrix=w.Dropdown(options=list(SHAPES), value=shape, style=style),
                         rows=w.IntSlider(value=batch, min=1, max=64, style=style),
                         rounds=w.IntSlider(value=rounds, min=3, max=25, style=style))
