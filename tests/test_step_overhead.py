"""The per-token shortcuts of a decode step give exactly what the general code gives.

Three shortcuts trim the Python work around the fused C step (issue 11): the sampler's argmax goes
through numpy on CPU (engine/sampler.py ``_argmax_rows``), the fused backend reuses the rows' block
tables while no sequence's table changed (engine/fused_step.py), and the output processor calls
the Rust tokenizer directly (engine/output_processor.py ``direct_decoder``). Each is checked against
the code it replaces, and whole engine runs with all three on are compared with runs where each is
replaced by the original: same tokens, text, logprobs, finish reasons and token counts, greedy and
seeded sampling, with and without logprobs, penalties, ``min_tokens`` bans, and speculative decoding.
"""

import random

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.attention import StepSequences
from minserve.engine.fused_step import FusedCpuExecutor, FusedStepMetadata
from minserve.engine import output_processor, sampler
from minserve.engine.output_processor import direct_decoder
from minserve.engine.sampler import Sampler, SamplingBatch
from minserve.kernels.decode import rows_block_tables

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}


def _torch_argmax(logits):
    return logits.argmax(dim=-1)


def test_numpy_argmax_picks_torchs_index_with_ties_infinities_and_nans():
    g = torch.Generator().manual_seed(0)
    for trial in range(500):
        rows, vocab = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 400, (1,), generator=g))
        x = torch.randint(-2, 3, (rows, vocab), generator=g).float()  # few values: many ties
        u = torch.rand(rows, vocab, generator=g)
        x[u < 0.04] = float("nan")
        x[(u >= 0.04) & (u < 0.08)] = float("inf")
        x[(u >= 0.08) & (u < 0.3)] = float("-inf")
        if trial % 5 == 0:
            x[:] = float("-inf")
        if trial % 7 == 0:
            x[u < 0.5] = -0.0  # equal to +0.0: the first one wins
        assert sampler._argmax_rows(x).tolist() == x.argmax(dim=-1).tolist(), trial
    wide = torch.randn(3, 49152, generator=g)
    wide[1, 7], wide[1, 40000] = float("nan"), float("nan")
    assert sampler._argmax_rows(wide).tolist() == wide.argmax(dim=-1).tolist()
    assert sampler._argmax_rows(wide[:, ::2]).tolist() == wide[:, ::2].argmax(dim=-1).tolist()  # strided view


def test_sampler_outputs_equal_torch_argmax(monkeypatch):
    """Greedy (with bans hitting the argmax), seeded sampling, logprobs: the same SamplerOutput."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g) * 3
    top = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.0, top_k=20, seed=6),
              SamplingParams(temperature=0.7, top_p=0.9, logprobs=2, seed=7),
              SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5)]
    banned = [[top[0]], [], [top[2]], [], [], [top[5], 3]]

    def run():
        gens = [sampler.make_generator(p) for p in params]
        batch = SamplingBatch(params, gens, banned, output_token_ids=[None] * 5 + [[top[5], 4, 4]],
                              prompt_token_ids=[None] * 5 + [[9, 10]])
        out = Sampler(torch.Generator().manual_seed(3))(logits, batch)
        return out.token_ids, out.logprobs, out.ranks, out.controlled_logits

    fast = run()
    monkeypatch.setattr(sampler, "_argmax_rows", _torch_argmax)
    slow = run()
    assert fast[:3] == slow[:3]
    assert torch.equal(fast[3], slow[3])
    assert fast[0][0] != top[0]  # the ban was applied


def test_block_tables_are_rebuilt_when_a_table_grows_in_place():
    backend = FusedCpuExecutor(decoder=None, max_query_len=8)
    tables = [[4, 7], [2]]  # the KV manager appends to these very lists

    def built(lens):
        return backend.build_metadata(StepSequences(lens, [0] * len(lens), tables)).block_tables

    first = built([1, 1])
    assert torch.equal(first, rows_block_tables([1, 1], [[4, 7], [2]]))
    assert built([1, 1]) is first  # unchanged: reused
    tables[1].append(9)
    assert torch.equal(built([1, 1]), rows_block_tables([1, 1], [[4, 7], [2, 9]]))
    assert torch.equal(built([3, 1]), rows_block_tables([3, 1], [[4, 7], [2, 9]]))  # a verify step
    tables[0][1] = 5  # a block replaced (e.g. after a rollback and a new allocation)
    assert torch.equal(built([3, 1]), rows_block_tables([3, 1], [[4, 5], [2, 9]]))


def test_direct_decoder_equals_tokenizer_decode(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    direct = direct_decoder(tok)
    assert direct.__name__ == "direct"  # the shortcut is taken for this tokenizer
    rng = random.Random(0)
    text = "Héllo wörld — naïve café 日本語 🙂\n\tdef f(x): return x**2  "
    cases = [tok(text, add_special_tokens=False).input_ids, [1, 2, 0], [], [5]]
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    for ids in cases:
        for skip in (True, False):
            assert direct(ids, skip) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)

    class Other:  # not a transformers tokenizer: decode is called as it is
        def decode(self, ids, skip_special_tokens=False):
            return f"{ids}{skip_special_tokens}"
    assert direct_decoder(Other())([1, 2], True) == "[1, 2]True"


def _slow_paths(monkeypatch):
    """Every shortcut replaced by the code it stands for."""
    monkeypatch.setattr(sampler, "_argmax_rows", _torch_argmax)
    monkeypatch.setattr(FusedCpuExecutor, "build_metadata", lambda self, seqs: FusedStepMetadata(
        rows_block_tables(seqs.query_lens, seqs.block_tables)))
    monkeypatch.setattr(output_processor, "direct_decoder", lambda tok: (
        lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)))


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, logprobs=3),
    SamplingParams(temperature=0, max_tokens=20, min_tokens=12, stop=["the"]),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, logprobs=2),
    SamplingParams(temperature=0.8, top_k=30, max_tokens=20, ignore_eos=True),  # the engine's stream
    SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=20, logprobs=1),
]


def _outputs(spec: bool):
    llm = LLM("tiny-llama", num_kv_blocks=256, seed=0, speculative_config=NGRAM if spec else None)
    prompts = [[5 + i, 17, 99, 5 + i, 17, 99, 300 + i] for i in range(len(PARAMS))]
    eng = llm.llm_engine
    for i, (p, params) in enumerate(zip(prompts, PARAMS)):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            c = o.outputs[0]
            final[o.request_id] = (c.token_ids, c.text, c.cumulative_logprob, c.logprobs, c.finish_reason,
                                   c.stop_reason, o.finished, o.metrics.num_generation_tokens)
    assert eng.runner.fused is not None  # the fused C step ran the decodes
    return final


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram-spec"])
def test_engine_outputs_equal_the_general_paths(monkeypatch, spec):
    fast = _outputs(spec)
    with monkeypatch.context() as m:
        _slow_paths(m)
        slow = _outputs(spec)
    assert fast == slow
    assert len(fast) == len(PARAMS) and all(v[6] for v in fast.values())
    assert fast["2"][4] in ("stop", "length") and len(fast["2"][0]) >= 12  # min_tokens held
    assert len(fast["1"][3]) == len(fast["1"][0])  # one logprobs dict per token
