"""Lab 06's workloads (copy-heavy, code, chat), their prompts, and the engines it compares."""

from __future__ import annotations

import inspect
import json
import statistics
import textwrap


WORKLOADS = ("copy", "code", "chat")
WORKLOAD_TEXT = {
    "copy": "fix the spelling of a paragraph given in the prompt and write it out again",
    "code": "add type hints to a Python function given in the prompt and return it whole",
    "chat": "free-form questions whose answers are nowhere in the prompt",
}

_CHAT = ["Tell me a short story about a lighthouse keeper.", "Why do cats purr? Explain briefly.",
         "Give three tips for learning to cook.", "What makes a good team leader?",
         "Describe a walk through a forest in autumn.", "How do airplanes stay in the air?",
         "Write a short poem about the sea.", "What should I pack for a weekend of hiking?"]


def _code_sources() -> list[str]:
    """Small standard-library functions, as written (the code workload edits them)."""
    import calendar
    import fnmatch
    import posixpath
    funcs = (textwrap.dedent, textwrap.indent, inspect.cleandoc, statistics.median, json.dumps,
             fnmatch.translate, posixpath.join, calendar.isleap, posixpath.splitext)
    out = []
    for f in funcs:
        try:
            out.append(textwrap.dedent(inspect.getsource(f)))
        except (OSError, TypeError):  # no source (a build without .py files): skip it
            continue
    return out


def _paragraph(text: str, sentences: int | None) -> str:
    if sentences is None:
        return text
    parts = text.split(". ")
    return ". ".join(parts[:sentences]).rstrip(".") + "."


def conversations(kind: str, n: int, sentences: int | None = None) -> list[list[dict]]:
    """``n`` one-turn chats of workload ``kind`` (copy, code or chat), cycling through the texts
    when ``n`` is larger than their number. ``sentences``: copy only, keep that many sentences
    of each paragraph (shorter prompts, for the large batches)."""
    if kind == "copy":
        from minserve.eval.data import load_texts
        texts = []
        for d in load_texts():
            d = _paragraph(d, sentences)
            texts.append("Correct the spelling mistakes in this text and write the whole text out "
                         f"again:\n\n{d.replace(' the ', ' teh ', 2).replace('which', 'whcih', 1)}")
    elif kind == "code":
        texts = ["Add a type hint to every parameter of this Python function and return it whole:"
                 f"\n\n{src}" for src in _code_sources()]
    elif kind == "chat":
        texts = list(_CHAT)
    else:
        raise ValueError(f"kind must be one of {', '.join(WORKLOADS)}, got {kind!r}")
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]


def prompt_ids(tokenizer, kind: str, n: int, sentences: int | None = None) -> list[list[int]]:
    """The token ids of :func:`conversations`, chat template applied (as ``LLM.chat`` does)."""
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
            for c in conversations(kind, n, sentences)]


def spec_config(k: int, adaptive: bool = False, prompt_lookup_min: int = 1, method: str = "ngram") -> dict:
    """This lab's ``speculative_config``: prompt lookup (n-gram), ``k`` proposals per step, from a
    match of 4 tokens down to ``prompt_lookup_min`` (1, the engine's default, which also proposes
    after a single matching token; ``benchmarks/bench_spec.py`` asks for 2). ``method=
    "draft_model"``: the target's own checkpoint in int4 proposes instead (the self-draft)."""
    if method == "draft_model":
        return {"method": "draft_model", "model": "self", "num_speculative_tokens": int(k),
                "adaptive": bool(adaptive)}
    return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": 4,
            "prompt_lookup_min": int(prompt_lookup_min), "adaptive": bool(adaptive)}


def make_engine(preset, k: int | None = None, adaptive: bool = False, prompt_lookup_min: int = 1,
                method: str = "ngram", warm_batches=None, **engine_args):
    """An ``LLM`` with the preset's engine arguments (plus ``engine_args``), speculating with
    ``k`` proposals when ``k`` is given (:func:`spec_config`), warmed up on the decode batch sizes
    the lab measures (``warm_batches``; default: 1 and ``max_num_seqs``). Several can live side by
    side (unlike ``lab.engine_for``): a comparison needs a plain and a speculative engine.

    A speculative engine that always proposes also runs one short copy request, so that its
    first verify steps (``k + 1`` rows) are behind it before anything is timed. An adaptive one
    does not: that request would seed the rule's estimates, and section 8 starts each adaptive
    engine fresh."""
    from minserve import LLM, SamplingParams
    from minserve.lab.session import warm
    args = preset.engine_kwargs(**engine_args)
    if k:
        args["speculative_config"] = spec_config(k, adaptive, prompt_lookup_min, method)
    llm = LLM(preset.model, **args)
    warm(llm, batch_sizes=warm_batches)
    if k and not adaptive:
        prompt = prompt_ids(llm.get_tokenizer(), "copy", 1, sentences=2)[0]
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8),
                     use_tqdm=False)
    return llm
