"""Fused C decode step on SmolLM2-135M: fp32 vs int8 vs int4 (g32/g128), LM head quantized or dense.

    .venv/bin/python /tmp/bench/bench_fused_quant.py [--rounds 5] [--context 300]

Every format's decoder is built first; then rounds interleave the formats, so each ratio compares
timings from the same moments of this shared, noisy host. Reported: median ms per step, tokens/s
(batch / step time) and GB/s of weight bytes streamed (every Linear's descriptor bytes: codes,
scales, mins; the weights are read once per step whatever the batch)."""
import argparse, statistics, time, torch
from minserve import LLM
from minserve.kernels.decode import FusedDecoder
from minserve.quant import quantize_
from minserve.quant.schemes import make_scheme

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=30)
p.add_argument("--context", type=int, default=300)
p.add_argument("--formats", default="fp32,int8,int4-g32,int4-g128,int8-densehead,int4-g32-densehead")
p.add_argument("--batches", default="1,16")
p.add_argument("--kv-cache-dtype", default="auto")
args = p.parse_args()

def build(fmt):
    llm = LLM("smollm2-135m", fused_decode=False, num_kv_blocks=16 * 21 + 8, max_model_len=1024, device="cpu",
              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    runner = llm.llm_engine.runner
    if fmt != "fp32":
        name, _, rest = fmt.partition("-")
        cfg = {"group_size": int(rest.split("-")[0][1:])} if name == "int4" else {}
        cfg["lm_head"] = "keep" if fmt.endswith("densehead") else "quantize"
        quantize_(runner.model, make_scheme(name, cfg))
    m = runner.model
    linears = [l for layer in m.layers for l in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    head = m.lm_head.descriptor().nbytes
    body = sum(l.descriptor().nbytes for l in linears)
    return runner, FusedDecoder(m, runner.kv_caches, max_rows=16), body, head

def step_fn(runner, dec, batch, context):
    bs = runner.block_size
    per = context // bs + 1
    tables = torch.tensor([list(range(i * per, (i + 1) * per)) for i in range(batch)])
    ids, pos, rows = torch.full((batch,), 5), torch.full((batch,), context), torch.arange(batch)
    return lambda: dec(ids, pos, tables, rows)

def timed_ms(fn, inner):
    t = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t) / inner * 1e3

formats = args.formats.split(",")
batches = [int(b) for b in args.batches.split(",")]
built = {f: build(f) for f in formats}
fns = {(f, b): step_fn(built[f][0], built[f][1], b, args.context) for f in formats for b in batches}
for fn in fns.values():
    fn(); fn()
times = {k: [] for k in fns}
for r in range(args.rounds):   # single-step samples, interleaved: min = the uncontended step
    for k, fn in fns.items():
        for _ in range(3):
            times[k].append(timed_ms(fn, 1))
print(f"kv_cache_dtype {args.kv_cache_dtype}, threads {torch.get_num_threads()}, context {args.context}, {args.rounds} rounds x 3 single steps per config, interleaved: median, then min")
print(f"{'format':22} {'MB/token':>9} {'head MB':>8} | " + " | ".join(
    f"b{b}: ms   tok/s   GB/s  x fp32" for b in batches))
for f in formats:
    _, _, body, head = built[f]
    mb = (body + head) / 1e6
    for stat in (statistics.median, min):
        cells = []
        for b in batches:
            ms = stat(times[(f, b)])
            base = stat(times[("fp32", b)]) if "fp32" in formats else ms
            cells.append(f"{ms:7.2f} {b * 1e3 / ms:7.1f} {mb / ms:6.1f} {base / ms:6.2f}")
        print(f"{f + (' (min)' if stat is min else ''):22} {mb:9.1f} {head / 1e6:8.1f} | " + " | ".join(cells))
