"""Hugging Face transformers as the reference we did not write, and the near-tie rule.

``check_greedy_close`` follows the idea of vLLM's ``check_logprobs_close``: two fp32 implementations
may round differently, so where a greedy sequence departs from the reference, the departure is
accepted only if the reference itself rated the two candidate tokens within ``NEAR_TIE`` nats of
each other at that position; after that point the continuations legitimately differ and are not
compared. Anything else is a failure.
"""

from __future__ import annotations

from functools import lru_cache

import torch

NEAR_TIE = 0.05  # nats; fp32 reordering moves logits by ~1e-5, a real bug by much more


@lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # references run to max_new_tokens (ignore_eos)
    return model


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the per-step log-probabilities [steps, vocab] from transformers' generate."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return tokens, logprobs


def check_greedy_close(ours: list[int], ref: list[int], ref_logprobs: torch.Tensor, name: str = "") -> int:
    """Assert ``ours`` equals ``ref`` or departs only at a near-tie; return the matched length."""
    assert len(ours) == len(ref), f"{name}: {len(ours)} tokens, reference has {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = (ref_logprobs[i, b] - ref_logprobs[i, a]).item()
            assert gap < NEAR_TIE, (f"{name}: token {i} is {a}, reference {b}; the reference rates them "
                                    f"{gap:.4f} nats apart, not a near-tie (< {NEAR_TIE})")
            return i
    return len(ours)


def hf_greedy_batch(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """``hf_greedy`` for many prompts in one ``generate`` (left-padded, with the attention mask):
    one batched prefill and ``max_new_tokens`` batched steps instead of one generate per prompt.

    transformers derives each row's positions from its mask, and masked pads take no attention
    weight, so a row's logits are its unpadded ones up to fp32 reordering (measured on SmolLM2's
    batch of 16: the same tokens, log-probabilities within 7e-5), far inside ``NEAR_TIE``."""
    model = hf_model(path)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):   # left padding: every row's last prompt token is at the end
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    logprobs = torch.log_softmax(torch.stack(out.logits).float(), dim=-1)   # [steps, batch, vocab]
    return [(out.sequences[i, width:].tolist(), logprobs[:, i]) for i in range(len(prompts))]
