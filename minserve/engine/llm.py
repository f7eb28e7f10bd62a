"""LLM: the offline, synchronous front door (vLLM's ``LLM.generate`` and ``LLM.chat``)."""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from minserve.config import EngineConfig
from minserve.engine.llm_engine import LLMEngine
from minserve.outputs import RequestOutput
from minserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Load a model and generate for a list of prompts with continuous batching.

    >>> llm = LLM("tiny-llama")                                  # doctest: +SKIP
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str = "smollm2-135m", **engine_args):
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer. Every engine of the same model folder in this
        process shares it (``minserve.models.loader.load_tokenizer``): change a copy
        (``copy.deepcopy``), not it."""
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings, token-id lists, or prompt dicts); outputs
        come back in the order of the prompts. With ``SamplingParams(n=k)`` each output holds k
        completions, ``outputs[j].index == j`` (the prompt is computed once for all k)."""
        prompts = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                # The offline API returns whole outputs; streaming kinds are for the engine API.
                self.llm_engine.add_request(rid, prompt, _final_only(p))
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.llm_engine.abort_request(ids)  # e.g. a bad prompt or Ctrl-C: free what was queued
            raise

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of
        ``{"role", "content"}`` dicts) or a list of conversations, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations or any(not c for c in conversations):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        tok = self.get_tokenizer()
        prompts = [{"prompt_token_ids": list(tok.apply_chat_template(
            c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=True)["input_ids"])} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        generated = 0
        while wanted - done.keys():
            if not engine.has_unfinished_requests():
                raise RuntimeError("engine stopped with requests unfinished")
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
            if use_tqdm and bar.format_dict["elapsed"] > 0:
                bar.set_postfix_str(f"output {generated / bar.format_dict['elapsed']:.1f} tok/s", refresh=False)
        bar.close()
        return [done[i] for i in ids]


def _final_only(p: SamplingParams) -> SamplingParams:
    q = p.clone()
    q.output_kind = RequestOutputKind.FINAL_ONLY
    return q


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # a single prompt given as token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return list(prompts)


def _params_per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts; give one or one per prompt")
    return params
