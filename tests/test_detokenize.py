"""Incremental detokenization gives exactly the text of decoding the whole output at once."""

import random

import pytest

from minserve import SamplingParams
from minserve.engine.output_processor import OutputProcessor
from minserve.engine.request import Request

TEXTS = [
    "Héllo wörld — naïve café 日本語のテキスト 🙂🚀 code:\n    def f(x):\n\treturn x**2  # ok",
    "  leading spaces, trailing  \n\n\nand   runs   of   spaces.",
]


def _stream(tokenizer, ids, skip):
    op = OutputProcessor(tokenizer, 10**6, 0.0)
    params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip, ignore_eos=True)
    req = Request("x", None, [1], params, 0.0, len(ids), [2])
    statuses = [op.append_token(req, i, None, None) for i in ids]
    assert statuses[-1] is not None and not any(statuses[:-1])
    return req.output_text


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_equals_full_decode(tiny_llm, skip):
    tok = tiny_llm.get_tokenizer()
    rng = random.Random(0)
    cases = [tok(t, add_special_tokens=False).input_ids for t in TEXTS]
    cases[0] = cases[0][:20] + [2, 1] + cases[0][20:]                    # special tokens inside
    cases += [[rng.randrange(len(tok)) for _ in range(200)] for _ in range(3)]  # arbitrary byte pieces
    for ids in cases:
        full = tok.decode(ids, skip_special_tokens=skip)
        got = _stream(tok, ids, skip)
        assert got == full
