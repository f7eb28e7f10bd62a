"""A custom logits processor: ban a set of tokens per request, given in SamplingParams.extra_args.

``BanTokens`` has vLLM v1's batch-level shape (engine/logits_processor.py): the engine tells it
which requests sit in which rows (``update_state``), it reads each one's
``extra_args["banned_token_ids"]`` once, and ``apply`` sets those logits to -inf in one indexed
write per step. Requests without the argument are untouched, in the same batch.

The script generates greedily twice for the same two prompts: once plain, once with the first
prompt banning the tokens it produced the first time. The banned request must route around them,
the other must not change. The same class serves HTTP clients::

    PYTHONPATH=examples minserve serve --logits-processors ban_tokens:BanTokens
    # request body: {"prompt": "...", "vllm_xargs": {"banned_token_ids": [42, 1337]}}

``--quick``: the tiny random model (its text is noise, the mechanism is the same).
"""

from __future__ import annotations

import argparse

import torch

from minserve import LLM, BatchUpdate, LogitsProcessor, MoveDirectionality, SamplingParams


class BanTokens(LogitsProcessor):
    """Rows whose request has ``extra_args["banned_token_ids"]`` never sample those ids."""

    def __init__(self, config, device: torch.device, is_pin_memory: bool):
        self.banned: dict[int, list[int]] = {}  # row index -> banned ids

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        ids = (sampling_params.extra_args or {}).get("banned_token_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise ValueError(f"extra_args['banned_token_ids'] must be a list of token ids, got {ids!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # banning the best token changes the argmax: greedy rows need it too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:  # same rows as the last step
            return
        for index in batch_update.removed:
            self.banned.pop(index, None)
        for index, params, _prompt_ids, _output_ids in batch_update.added:
            ids = (params.extra_args or {}).get("banned_token_ids")
            if ids:
                self.banned[index] = ids
            else:
                self.banned.pop(index, None)
        for src, dst, how in batch_update.moved:  # a move overwrites dst; a swap exchanges
            moving, there = self.banned.pop(src, None), self.banned.pop(dst, None)
            if moving is not None:
                self.banned[dst] = moving
            if how is MoveDirectionality.SWAP and there is not None:
                self.banned[src] = there

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.banned:
            rows = [i for i, ids in self.banned.items() for _ in ids]
            logits[rows, [t for ids in self.banned.values() for t in ids]] = float("-inf")
        return logits


def main(quick: bool = False) -> dict:
    model = "tiny-llama" if quick else "smollm2-135m"
    llm = LLM(model, logits_processors=[BanTokens], num_kv_blocks=64)
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    banned = sorted(set(plain[0][:4]))  # the first answer's own opening tokens
    ban = SamplingParams(temperature=0, max_tokens=12, extra_args={"banned_token_ids": banned})
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, [ban, greedy], use_tqdm=False)]
    print(f"banned for prompt 0: {[tok.decode([t]) for t in banned]}")
    for i, p in enumerate(prompts):
        print(f"{p!r}\n  plain : {tok.decode(plain[i])!r}\n  banned: {tok.decode(again[i])!r}")
    result = {"banned": banned, "plain": plain, "with_ban": again,
              "avoided": not set(again[0]) & set(banned), "other_unchanged": again[1] == plain[1]}
    print(f"prompt 0 avoided every banned token: {result['avoided']}; "
          f"prompt 1 unchanged: {result['other_unchanged']}")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny random model")
    main(ap.parse_args().quick)
