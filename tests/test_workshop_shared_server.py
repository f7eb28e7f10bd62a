"""Issue 21, item 4: a workshop over one server. Four participants, four keys, one `minserve serve`.

The instructor writes the keys file with :mod:`minserve.workshop.keys` and starts one server with
a per-tenant quota; four participants then run lab-style workloads (the bench client, as
``lab.run_workload`` does over HTTP) at the same moment, each with its own key. What each one must
see: its own answers only (each request's own completion id, and the text its own prompt gives
alone), prefix-cache hits only from its own earlier prompts (none from the same prompt sent first
by another participant or the instructor), no ``/metrics`` (server-wide counters are an admin's),
and a quota that refuses the participant over it while the others are served.
"""

import asyncio
import csv
import json
import threading

import httpx
import pytest

from live_server import live_server
from minserve.bench.client import Target, run_http
from minserve.bench.datasets import SampleRequest
from minserve.bench.results import BenchOptions
from minserve.engine.llm_engine import LLMEngine
from minserve.server import AdmissionConfig, Auth, create_app
from minserve.server.admission import INTERACTIVE, Ticket
from minserve.workshop import keys as workshop_keys

PARTICIPANTS = workshop_keys.participant_names(4)
QUOTA = 2          # --tenant-max-inflight
OUTPUT_TOKENS = 4


def own_prefix(name: str) -> str:
    """A participant's long shared context (several KV blocks): its repeated prefix."""
    return " ".join(f"{name} keeps lab notebook page {i}." for i in range(8))


def prompts(name: str) -> list[str]:
    return [own_prefix(name) + " Question one: what is a token?",
            own_prefix(name) + " Question two: what is a block?"]


@pytest.fixture(scope="module")
def room(tmp_path_factory):
    d = tmp_path_factory.mktemp("workshop")
    assert workshop_keys.main(["--participants", str(len(PARTICIPANTS)), "--out", str(d / "keys.json"),
                               "--handout", str(d / "handout.csv")]) == 0
    with open(d / "handout.csv") as f:
        handout = {row["tenant"]: row["key"] for row in csv.DictReader(f)}
    server_file = (d / "keys.json").read_text()
    assert not any(key in server_file for key in handout.values())  # digests only on the server
    assert (d / "handout.csv").stat().st_mode & 0o077 == 0          # the handout is the owner's
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=8, max_num_batched_tokens=256,
                                        num_kv_blocks=256)
    app = create_app(engine, auth=Auth.from_options(keys_file=d / "keys.json"),
                     admission=AdmissionConfig(tenant_max_inflight=QUOTA))
    with live_server(app) as base:
        yield base, handout, app.state.minserve, engine.tokenizer


def alone(base: str, key: str, prompt: str) -> str:
    """The greedy answer to ``prompt`` asked on its own, non-streaming."""
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def all_at_once(room, workloads: dict[str, list[str]]) -> dict:
    """Each participant's prompts through the bench client with its own key, one thread each,
    started together; a participant's own requests go one after another (max_concurrency 1), so
    its second prompt finds its first one's blocks. Returns name -> BenchResult."""
    base, handout, _, tok = room
    results: dict = {}
    start = threading.Barrier(len(workloads))

    def participant(name, texts):
        reqs = [SampleRequest(t, len(tok(t).input_ids), OUTPUT_TOKENS, f"{name}-{i}")
                for i, t in enumerate(texts)]
        target = Target(f"{base}/v1/completions", base, "tiny-llama", api_key=handout[name])
        start.wait()
        try:
            results[name] = asyncio.run(run_http(target, reqs, BenchOptions(max_concurrency=1,
                                                                            ignore_eos=True), tok, 0.05))
        except BaseException as e:  # noqa: BLE001 - reported below, in the test's thread
            results[name] = e

    threads = [threading.Thread(target=participant, args=item) for item in workloads.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    for name, res in results.items():
        assert not isinstance(res, BaseException), f"{name}: {res!r}"
    return results


def test_four_participants_see_only_their_own_answers_and_cache_hits(room):
    base, handout, _, _ = room
    # The instructor asks every prompt first (its own tenant): the reference answers, and a cache
    # that holds every participant's prompts, in the instructor's tenant only.
    reference = {p: alone(base, handout["instructor"], p) for n in PARTICIPANTS for p in prompts(n)}

    first = all_at_once(room, {n: prompts(n) for n in PARTICIPANTS})
    neighbour = {n: PARTICIPANTS[(i + 1) % len(PARTICIPANTS)] for i, n in enumerate(PARTICIPANTS)}
    # Second round: the prompt a neighbour sent in the first round, then one's own first prompt.
    again = all_at_once(room, {n: [prompts(neighbour[n])[0], prompts(n)[0]] for n in PARTICIPANTS})

    ids = []
    for n in PARTICIPANTS:
        df = first[n].requests
        assert df.success.all() and list(df.request_id) == [f"{n}-0", f"{n}-1"]
        assert first[n].summary["generated_texts"] == [reference[p] for p in prompts(n)]
        # Its first prompt hits nothing, though the instructor sent the very same text before;
        # its second one reuses the prefix its first one filled.
        assert list(df.cached_tokens[:1]) == [0] and df.cached_tokens[1] > 0
        df2 = again[n].requests
        assert df2.success.all()
        assert again[n].summary["generated_texts"] == [reference[prompts(neighbour[n])[0]],
                                                       reference[prompts(n)[0]]]
        assert df2.cached_tokens[0] == 0    # the neighbour's prompt: sent first, by someone else
        assert df2.cached_tokens[1] > 0     # its own prompt again: its own cache
        # What a participant does not see: the server-wide metrics (its polls got 403).
        assert first[n].server_metrics.empty and again[n].server_metrics.empty
        ids += list(df.response_id) + list(df2.response_id)
    # Every stream a participant read was its own request's: one completion id per request.
    assert all(ids) and len(set(ids)) == len(ids) == 4 * len(PARTICIPANTS)


def test_metrics_are_the_instructors_only(room):
    base, handout, _, _ = room

    def get(path, key):
        return httpx.get(base + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    for n in PARTICIPANTS:
        assert get("/metrics", handout[n]).status_code == 403
        assert get("/v1/models", handout[n]).json()["data"][0]["id"] == "tiny-llama"
    r = get("/metrics", handout["instructor"])
    assert r.status_code == 200 and "vllm:prefix_cache_hits" in r.text
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 401  # no key, no service


def test_the_participant_over_its_quota_is_refused_while_the_others_are_served(room):
    _, handout, st, _ = room
    over = PARTICIPANTS[-1]
    # Its QUOTA slots taken, as by QUOTA long requests still streaming (no timing involved).
    held = [Ticket(over, INTERACTIVE, 1, 1) for _ in range(QUOTA)]
    assert all(st.admission.try_admit(t).admitted for t in held)
    try:
        res = all_at_once(room, {n: prompts(n) for n in PARTICIPANTS})
    finally:
        for t in held:
            st.admission.release(t)
    for n in PARTICIPANTS[:-1]:
        assert res[n].summary["completed"] == 2
    errors = res[over].summary["errors"]
    assert res[over].summary["completed"] == 0
    assert all(e.startswith("HTTP 429") and "tenant_quota" in e for e in errors), errors
    assert json.loads(errors[0].split(": ", 1)[1])["error"]["message"].endswith(f"the quota is {QUOTA}")
    # Its slots back, it is served again.
    assert alone(room[0], handout[over], prompts(over)[0])


def test_keys_helper_refuses_names_the_server_would_confuse(tmp_path, capsys):
    out = ["--out", str(tmp_path / "k.json"), "--handout", str(tmp_path / "h.csv")]
    assert workshop_keys.main(["--names", "ann,ann", *out]) == 2
    assert workshop_keys.main(["--names", "ann,instructor", *out]) == 2
    assert workshop_keys.main(["--participants", "0", *out]) == 2
    assert "distinct" in capsys.readouterr().err and not (tmp_path / "k.json").exists()
    assert workshop_keys.participant_names(12)[-1] == "participant-12"
