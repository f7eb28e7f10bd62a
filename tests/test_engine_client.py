"""The narrow view a server reads of the engine (engine/client.py): which requests run, what each
has left, whether an id is still held (a request with n > 1 while any sample is unfinished), and
the prefix-cache reset that refuses while work is in flight."""

from minserve import LLM, SamplingParams

PROMPT_A, PROMPT_B = list(range(10, 30)), list(range(40, 47))   # 20 and 7 prompt tokens


def test_running_work_names_the_running_requests_and_what_each_has_left():
    eng = LLM("tiny-llama", num_kv_blocks=64, block_size=4, max_num_seqs=1,
              max_num_batched_tokens=8).llm_engine
    eng.add_request("a", {"prompt_token_ids": PROMPT_A}, SamplingParams(max_tokens=5, ignore_eos=True))
    eng.add_request("b", {"prompt_token_ids": PROMPT_B}, SamplingParams(max_tokens=3, ignore_eos=True))
    assert eng.running_work().running_ids == () and eng.running_work().num_waiting == 2
    eng.step()   # one seat: "a" runs its first chunk of 8 prompt tokens, "b" waits
    work = eng.running_work()
    assert work.running_ids == ("a",) and work.num_running == 1 and work.num_waiting == 1
    assert work.remaining == ((12, 5),)   # 20 - 8 prompt tokens left, 5 outputs to come
    assert eng.holds_request("a") and eng.holds_request("b") and not eng.holds_request("c")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.running_work().remaining == () and not eng.holds_request("a")


def test_a_request_with_samples_is_held_until_every_sample_ends():
    eng = LLM("tiny-llama", num_kv_blocks=64).llm_engine
    eng.add_request("n", {"prompt_token_ids": PROMPT_B}, SamplingParams(n=2, max_tokens=4, seed=1,
                                                                        ignore_eos=True))
    eng.step()
    assert eng.holds_request("n") and set(eng.running_work().running_ids) == {"n", "n#1"}
    eng.abort_request("n#1")
    assert eng.holds_request("n")           # sample 0 still runs
    while eng.has_unfinished_requests():
        eng.step()
    assert not eng.holds_request("n")


def test_reset_prefix_cache_refuses_while_a_request_is_unfinished():
    eng = LLM("tiny-llama", num_kv_blocks=64, block_size=4).llm_engine
    eng.add_request("a", {"prompt_token_ids": PROMPT_A}, SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    assert eng.reset_prefix_cache() is False and eng.kv.pool.cached     # in flight: unchanged
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.reset_prefix_cache() is True and not eng.kv.pool.cached
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks
