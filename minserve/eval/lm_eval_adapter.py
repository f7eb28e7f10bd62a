"""minserve as an in-process lm-eval model (``lm_eval.api.model.LM``), registered as "minserve".

lm-eval (EleutherAI's harness, ``pip install minserve[eval]``) asks a model for three things, and
each is answered through the engine, with every request of a call added before the engine steps,
so they are batched the way a server would batch them:

- ``loglikelihood(context, continuation)``: the prompt is context + continuation, asked with
  ``SamplingParams(prompt_logprobs=0, max_tokens=1)``; the answer is the sum of the
  continuation's prompt logprobs and whether each was the most likely token (rank 1). This is how
  lm-eval's own vLLM model does it (``prompt_logprobs`` is vLLM's field).
- ``loglikelihood_rolling(text)``: the text in windows of the model's context (lm-eval's
  ``get_rolling_token_windows``), each scored as above; the sum per text.
- ``generate_until(context, {"until": [...], ...})``: greedy unless the task asks to sample, cut
  at the stop strings.

Use it from Python (lm-eval's CLI cannot import it by name)::

    import lm_eval
    from minserve.eval.lm_eval_adapter import MinserveLM, shipped_tasks
    lm = MinserveLM("smollm2-135m", quantization="int8")       # or MinserveLM(llm=an_LLM)
    lm_eval.simple_evaluate(model=lm, tasks=shipped_tasks(), task_manager=task_manager())

or ``minserve eval --lm-eval``, which does this for every format of the table.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from minserve.eval.data import default_data_dir
from minserve.sampling_params import SamplingParams

SHIPPED_TASKS = ("minserve_prose", "minserve_questions")


@register_model("minserve")
class MinserveLM(TemplateLM):
    """``MinserveLM(pretrained, **engine_args)`` builds an :class:`~minserve.LLM`; ``llm=`` reuses one.
    ``batch_size`` and ``device`` (lm-eval's usual arguments) are accepted and ignored: the engine's
    scheduler batches, and the device is an engine argument."""

    def __init__(self, pretrained: str = "smollm2-135m", llm=None, max_gen_toks: int = 256,
                 batch_size=None, device=None, **engine_args):
        super().__init__()
        from minserve import LLM
        self.llm = llm if llm is not None else LLM(pretrained, **engine_args)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_length = self.llm.llm_engine.max_model_len
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens)).input_ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: (cache key, context tokens, continuation tokens). Prompts longer than the
        context (less one token to sample) lose their oldest context tokens, as in lm-eval's models."""
        keep = self.max_length - 1
        prompts, starts = [], []
        for _, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-keep:]
            prompts.append(whole)
            starts.append(len(whole) - len(cont))
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = []
        for (key, _, _), tokens, start, out in zip(requests, prompts, starts, outs):
            scored = [d[t] for t, d in zip(tokens[start:], out.prompt_logprobs[start:])]
            answer = (sum(lp.logprob for lp in scored), all(lp.rank == 1 for lp in scored))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            # max_seq_len: one position for the prefix token, one left for the sampled token.
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            kw = dict(gen_kwargs)
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_toks = min(int(kw.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
            sample = kw.pop("do_sample", False) and kw.get("temperature", 0) > 0
            # The oldest context tokens give way so the answer fits in the model's context.
            ids = self.tok_encode(context)[-(self.max_length - max_toks):] or [self.prefix_token_id]
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(temperature=float(kw.get("temperature", 1.0)) if sample else 0.0,
                                         max_tokens=max_toks, stop=until or None))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts


def shipped_tasks(data_dir: Path | None = None, names=SHIPPED_TASKS) -> list[dict]:
    """The task configs of ``datasets/eval/tasks/`` as dicts, their data files made absolute (the
    YAML names them relative to the repository root, where lm-eval's CLI would run)."""
    data_dir = Path(data_dir or default_data_dir())
    configs = []
    for name in names:
        cfg = yaml.safe_load((data_dir / "tasks" / f"{name}.yaml").read_text(encoding="utf-8"))
        files = cfg["dataset_kwargs"]["data_files"]
        cfg["dataset_kwargs"]["data_files"] = {split: str(data_dir / Path(f).name) for split, f in files.items()}
        configs.append(cfg)
    return configs


def task_manager():
    """A task manager that does not index lm-eval's thousands of built-in tasks (seconds)."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_defaults=False)


def run_lm_eval(llm, data_dir: Path | None = None, limit: int | None = None) -> dict[str, float]:
    """lm-eval on the shipped tasks for one engine: {"task/metric": value}."""
    import lm_eval
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the data is local; never ask the hub
    out = lm_eval.simple_evaluate(model=MinserveLM(llm=llm), tasks=shipped_tasks(data_dir), limit=limit,
                                  task_manager=task_manager(), bootstrap_iters=0, log_samples=False)
    return {f"{task}/{metric.split(',')[0]}": value for task, res in out["results"].items()
            for metric, value in res.items() if "," in metric and "_stderr" not in metric}
