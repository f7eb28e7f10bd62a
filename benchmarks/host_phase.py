"""The host's phase around a side-by-side benchmark: wait for a quiet machine, say what the host
probe read, and flag a comparison whose two sides ran in different phases.

On this project's VM the arithmetic moves by 2-3x within minutes as other tenants come and go on
the same cores (bench_roofline.host_probe in the rounds of 2026-12-06's runs: the AMX tile loop
1,705 to 4,956 GFLOP/s, 1,728 and 4,956 within one run). ``bench_vs_vllm.py`` and
``bench_vs_vllm_serve.py`` alternate their engines and take medians, which evens out noise that
hits every engine alike; a slow phase that falls on one engine's rounds only does not even out. Run G of bench_vs_vllm (docs/performance/vllm-xeon-targets.md)
had both of minserve bf16's rounds in the tiles' fast phase and both of vLLM bf16's in the slow
one, and its bf16 mixed ratio read 1.61 against 1.35 in run F: :func:`phase_notes` says so under
the ratios instead of leaving it to a reader to compare the probe lines.
"""

from __future__ import annotations

import statistics
import time

# Two sides whose probes' medians differ by this factor or more ran in different phases (the
# fast and slow phases of the tile loop differ by 2-2.5x; FMA readings within one phase by up to
# ~1.25x, bench_vs_vllm's run F).
PHASE_GAP = 1.3


def busy_cores(window_s: float) -> float | None:
    """Cores the whole machine kept busy over the next ``window_s`` (bench_offline.cpu_seconds,
    /proc/stat; None where that is missing)."""
    from bench_offline import cpu_seconds
    w0, b0, _ = cpu_seconds()
    time.sleep(window_s)
    w1, b1, _ = cpu_seconds()
    busy = (b1 - b0) / (w1 - w0)
    return None if busy != busy else busy   # NaN: no /proc/stat


def wait_until_quiet(max_wait_s: float = 10.0, window_s: float = 0.5, below: float = 0.25) -> float:
    """Wait, up to ``max_wait_s``, until the machine keeps fewer than ``below`` cores busy; returns
    the seconds waited. vLLM's worker keeps about a core busy for ~1 s after its last request
    (2026-12-06, a scratch reading of /proc/stat: 0.51 of 2 cores over the 2 s after it, 0.01
    later), and the engine whose round started in that second ran its first steps beside it: its
    probe read fp32 FMA 101-134 GFLOP/s on two threads against 172-175 on one."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait_s:
        busy = busy_cores(window_s)
        if busy is None or busy < below:
            break
    return time.monotonic() - t0


def start_round() -> dict:
    """What both comparisons do before each engine's round: wait for a quiet machine (the previous
    engine's threads at rest), then probe the host (bench_roofline.host_probe) and return it."""
    from bench_roofline import host_probe
    wait_until_quiet()
    return host_probe()


def probe_line(p: dict) -> str:
    """A host probe (bench_roofline.host_probe) in a few words."""
    tiles = f", AMX tiles {p['tiles']:,.0f}" if p["tiles"] else ""
    return f"host: FMA {p['fma_1t']:.0f} one thread, {p['fma']:.0f} all{tiles} GFLOP/s"


def probe_key(name: str) -> str:
    """The probe reading that paces an engine: the AMX tile loop for a bf16 engine, fp32 FMA on
    every thread for the others (float32, and the weight-only formats, whose steps are float32)."""
    return "tiles" if name.endswith("bf16") else "fma"


def phase_notes(probes: dict[str, list[dict]], pairs) -> list[str]:
    """One line for each (mine, peer) pair in ``pairs`` whose rounds ran in different phases:
    the medians of their pacing probe (:func:`probe_key`; FMA where a side has no tile reading)
    at least :data:`PHASE_GAP` apart, naming the side the phase favoured. Pairs with a side
    missing from ``probes`` are skipped."""
    notes = []
    for mine, peer in pairs:
        if not probes.get(mine) or not probes.get(peer):
            continue
        key = probe_key(mine)
        if any(p.get(key) is None for p in probes[mine] + probes[peer]):
            key = "fma"
        a = statistics.median(p[key] for p in probes[mine])
        b = statistics.median(p[key] for p in probes[peer])
        if max(a, b) >= PHASE_GAP * min(a, b):
            what = "the AMX tile loop" if key == "tiles" else "fp32 FMA on every thread"
            notes.append(f"{mine} against {peer}: {what} probed a median {a:,.0f} GFLOP/s in {mine}'s "
                         f"rounds and {b:,.0f} in {peer}'s, so the two ran in different host phases "
                         f"and the pair's ratios lean toward {mine if a > b else peer}")
    return notes
