"""Attention sinks and a sliding window: how much of its context does a model need?

StreamingLLM (Xiao et al., 2023, arXiv:2309.17453) keeps the K/V of the first few tokens, the
"attention sinks" that softmax parks weight on whatever they say, plus a window of recent ones,
and finds that a window alone collapses while sinks + window stays close to full attention.
Here every layer's attention is masked that way (a query at position p sees keys at positions
< ``sinks`` and in (p - ``window``, p]) through the engine's attention seam,
``LLMEngine.set_layer_attention``; positions keep their RoPE angles (a mask, not StreamingLLM's
re-indexed cache), and every step runs on the PyTorch path.

Measured on one text: its perplexity, teacher-forced (``prompt_logprobs``), and how many greedy
tokens after its first half match full attention's. ``--quick``: the tiny random model and a
short text (the numbers then only show that the mask bites); the default model shows the effect.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from minserve import LLM, SamplingParams
from minserve.attention.torch_paged import write_new_kv
from minserve.lab.workload import text_of_length


class SinkWindowAttention:
    """A per-layer attention op (the torch op's contract) with a sink + window mask."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sinks: int, window: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sinks, self.window = sinks, window

    def __call__(self, q, k, v, k_cache, v_cache, meta, k_scales=None, v_scales=None):
        if k_scales is not None:
            raise ValueError("this experiment reads a float KV cache (kv_cache_dtype='auto')")
        write_new_kv(k, v, (k_cache, v_cache, None, None), meta.slot_mapping)
        return torch.cat([self._group(q[g.token_start:g.token_end], k_cache, v_cache, g) for g in meta.groups])

    def _group(self, q, k_cache, v_cache, g):
        n, ql, L = g.num_seqs, g.query_len, g.kv_len
        keys, values = (c[g.kv_blocks].flatten(1, 2)[:, :L].transpose(1, 2) for c in (k_cache, v_cache))
        if g.mask is not None:   # each query's own last visible key: its position
            pos = g.mask.sum(dim=-1).squeeze(1) - 1
        elif g.is_causal:        # a fresh prompt: positions 0..ql-1
            pos = torch.arange(ql, device=q.device).unsqueeze(0)
        else:                    # a lone decode sees everything: it is the last position
            pos = torch.full((1, 1), L - 1, device=q.device)
        key = torch.arange(L, device=q.device)[None, None, :]
        pos = pos[:, :, None]
        mask = (key <= pos) & ((key < self.sinks) | (key > pos - self.window))
        queries = q.view(n, ql, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask.unsqueeze(1),
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(n * ql, self.num_heads * self.head_dim)


def measure(llm, ids: list[int], sinks: int | None, window: int | None, new_tokens: int) -> dict:
    """Perplexity of ``ids`` and greedy tokens after its first half, under sinks + window
    (``None``: the engine's own full attention)."""
    engine = llm.llm_engine
    if window is None:
        engine.set_layer_attention(None)
    else:
        engine.set_layer_attention(lambda h, kv, d: SinkWindowAttention(h, kv, d, sinks, window),
                                   name=f"sinks{sinks}-window{window}")
    scored = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    logprobs = [lp[t].logprob for lp, t in zip(scored.prompt_logprobs[1:], ids[1:])]
    greedy = llm.generate({"prompt_token_ids": ids[:len(ids) // 2]},
                          SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)[0]
    return {"ppl": math.exp(-sum(logprobs) / len(logprobs)), "tokens": greedy.outputs[0].token_ids}


def main(quick: bool = False) -> dict:
    model, length, window, new = ("tiny-llama", 192, 32, 24) if quick else ("smollm2-135m", 768, 128, 32)
    llm = LLM(model, num_kv_blocks=128, max_num_batched_tokens=1024)
    ids = llm.get_tokenizer()(text_of_length(llm.get_tokenizer(), length, seed=3)).input_ids
    configs = {"full attention": (None, None), f"window {window}": (0, window),
               f"4 sinks + window {window}": (4, window)}
    results = {name: measure(llm, ids, s, w, new) for name, (s, w) in configs.items()}
    full = results["full attention"]["tokens"]
    print(f"{model}, a text of {len(ids)} tokens; greedy continuation of its first half, {new} tokens")
    for name, r in results.items():
        r["matched"] = next((i for i, (a, b) in enumerate(zip(r["tokens"], full)) if a != b), len(full))
        print(f"{name:24s} perplexity {r['ppl']:10.4g}   greedy tokens equal to full attention's: "
              f"{r['matched']}/{len(full)}")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny random model, a short text")
    main(ap.parse_args().quick)
