"""Issue 21, item 3: `minserve bench serve` measures a warm server and writes files only when asked.

As `vllm bench serve` does: one initial test run of the first prompt before anything is timed
(a server that cannot answer it stops the command with a clear message), unmeasured; result
files only with --save-result, in --result-dir, named --result-filename.
"""

import json
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from minserve.bench.cli import main
from test_bench import StubHandler

NUM_PROMPTS = 3


class RecordingHandler(StubHandler):
    """test_bench's stub (GET /v1/models, /metrics) with a short stream, recording every POST
    with the times it began and ended; with ``server.fail`` set every completion gets a 500."""

    def do_POST(self):
        start = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.fail:
            self._send(500, '{"error": {"message": "the model is still loading"}}')
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for data in ({"id": "cmpl-1", "choices": [{"index": 0, "text": "Hi"}]},
                         {"id": "cmpl-1", "choices": [{"index": 0, "text": " there",
                                                       "finish_reason": "length"}]},
                         {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 8,
                                                                   "completion_tokens": 2}}):
                self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        with self.server.lock:
            self.server.posts.append((start, time.perf_counter(), body))


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), RecordingHandler)
    srv.daemon_threads = True
    srv.lock, srv.posts, srv.fail = threading.Lock(), [], False
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def bench(url, *extra):
    return main(["--base-url", url, "--dataset-name", "random", "--random-input-len", "8",
                 "--random-output-len", "2", "--num-prompts", str(NUM_PROMPTS), "--disable-tqdm",
                 "--metrics-interval", "0.05", *extra])


def test_nothing_is_written_without_save_result(server, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bench(server.url, "--request-rate", "50,inf") == 0
    assert list(tmp_path.iterdir()) == []
    assert bench(server.url, "--result-dir", str(tmp_path / "out")) == 0  # ignored, as in vLLM
    assert list(tmp_path.iterdir()) == []
    assert "only apply with --save-result" in capsys.readouterr().err


def test_save_result_writes_into_result_dir_with_vllm_names(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench(server.url, "--save-result") == 0
    default, = tmp_path.glob("openai-inf*qps-tiny-llama-*.json")  # the working directory
    assert json.loads(default.read_text())["completed"] == NUM_PROMPTS
    out = tmp_path / "results" / "deeper"
    assert bench(server.url, "--save-result", "--result-dir", str(out),
                 "--result-filename", "mine.json") == 0
    assert json.loads((out / "mine.json").read_text())["num_prompts"] == NUM_PROMPTS
    assert bench(server.url, "--save-result", "--result-dir", str(out), "--request-rate", "50,inf",
                 "--result-filename", "sweep.json") == 0
    assert sorted(p.name for p in out.glob("sweep-*")) == ["sweep-50.0qps.json", "sweep-infqps.json"]
    assert len(list(tmp_path.glob("*.json"))) == 1  # only the first run wrote to the cwd


def test_the_initial_test_run_comes_first_and_is_not_counted(server, tmp_path, capsys):
    assert bench(server.url, "--request-rate", "50,inf", "--save-result",
                 "--result-dir", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.index("Initial test run completed.") < out.index("Traffic request rate: 50.0")
    posts = sorted(server.posts, key=lambda p: p[0])
    assert len(posts) == 1 + 2 * NUM_PROMPTS  # one test run for the whole sweep, then each rate
    (_, test_end, test_body), timed = posts[0], posts[1:]
    assert all(start >= test_end for start, _, _ in timed)  # answered before any timed request
    # Fresh prompts for the test run and for each rate: none would find another's in the
    # server's prefix cache (replayed prompts made the first rate of a sweep look the slowest).
    first, second = ({body["prompt"] for _, _, body in timed[i:i + NUM_PROMPTS]} for i in (0, NUM_PROMPTS))
    assert len(first) == len(second) == NUM_PROMPTS and not first & second
    assert test_body["prompt"] not in first | second
    same_but_prompt = lambda body: {k: v for k, v in body.items() if k != "prompt"}  # noqa: E731
    assert same_but_prompt(test_body) == same_but_prompt(timed[0][2])  # a request like the others
    for f in tmp_path.glob("*.json"):
        res = json.loads(f.read_text())
        assert res["completed"] == NUM_PROMPTS and len(res["requests"]) == NUM_PROMPTS
        assert [r["response_id"] for r in res["requests"]] == ["cmpl-1"] * NUM_PROMPTS


def test_num_warmups_sends_more_unmeasured_requests(server, tmp_path):
    assert bench(server.url, "--num-warmups", "2", "--save-result", "--result-dir", str(tmp_path)) == 0
    assert len(server.posts) == 1 + 2 + NUM_PROMPTS
    res = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert res["completed"] == NUM_PROMPTS


def test_a_server_that_fails_the_test_run_stops_the_command(server, tmp_path, capsys):
    server.fail = True
    rc = bench(server.url, "--save-result", "--result-dir", str(tmp_path))
    err = capsys.readouterr().err
    assert rc != 0
    assert "Initial test run failed" in err and "HTTP 500" in err and "still loading" in err
    assert len(server.posts) == 1 and list(tmp_path.iterdir()) == []  # nothing timed, no file


def test_inprocess_backend_warms_up_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(["--backend", "inprocess", "--model", "tiny-llama", "--dataset-name", "random",
               "--random-input-len", "8", "--random-output-len", "2", "--num-prompts", "2",
               "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0 and "Initial test run completed." in out and "Successful requests:" in out
    assert list(tmp_path.iterdir()) == []
