"""`minserve bench serve` prints why requests failed, grouped and counted, not only how many."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from minserve.bench.results import MAX_FAILURE_REASONS, failure_lines, failure_reasons

NUM_PROMPTS = 9  # three of each failure below


class FailingHandler(BaseHTTPRequestHandler):
    """Answers the first completion (the bench's initial test run), then fails every one, in turn:
    a 429 whose message holds a per-request number, a stream cut mid-body (as llama-cpp-python's
    server did when a new request arrived), a plain 500."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "tiny-llama"}]}))
        else:
            self._send(404, '{"error": {"message": "not found"}}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            i = self.server.count - 1  # -1: the test run
            self.server.count += 1
        if i < 0:
            return self._send(200, 'data: {"choices": [{"index": 0, "text": "Hi"}]}\n\ndata: [DONE]\n\n',
                              "text/event-stream")
        if i % 3 == 0:
            return self._send(429, json.dumps({"error": {"message": f"queue holds {40 + i} requests",
                                                         "type": "rate_limit_exceeded"}}))
        if i % 3 == 2:
            return self._send(500, "internal trouble", "text/plain")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"choices": [{"index": 0, "text": "Hi"}]}\n\n'
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.flush()
        self.close_connection = True  # no terminating chunk: the body is cut


@pytest.fixture()
def failing_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FailingHandler)
    server.daemon_threads = True
    server.lock, server.count = threading.Lock(), 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_summary_groups_and_counts_failure_reasons(failing_server, tmp_path, capsys):
    from minserve.bench.cli import main
    rc = main(["--base-url", failing_server, "--dataset-name", "random", "--random-input-len", "8",
               "--random-output-len", "4", "--num-prompts", str(NUM_PROMPTS), "--disable-tqdm",
               "--save-result", "--result-dir", str(tmp_path), "--metrics-interval", "0.05"])
    assert rc == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Failed requests:"))
    assert lines[at].split()[-1] == str(NUM_PROMPTS)
    reasons = lines[at + 1:at + 4]
    assert sorted(r.split(" x ", 1)[0].strip() for r in reasons) == ["3", "3", "3"]
    texts = sorted(r.split(" x ", 1)[1] for r in reasons)
    # The 429s differ only in a number: one group, the number masked, the status kept.
    assert texts[0] == 'HTTP 429: {"error": {"message": "queue holds # requests", "type": "rate_limit_exceeded"}}'
    assert texts[1] == "HTTP 500: internal trouble"
    assert texts[2].startswith("RemoteProtocolError: ")
    assert not lines[at + 4].startswith("  ")  # three causes, three lines
    # The result file keeps every request's full error.
    res = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert res["failed"] == NUM_PROMPTS and sum("queue holds 4" in e for e in res["errors"]) == 3


def test_many_reasons_are_folded_and_long_ones_cut():
    names = "ABCDEFG"[:MAX_FAILURE_REASONS + 2]  # letters: numbers in a message are masked
    errors = [f"Error{name}: broke" for k, name in enumerate(names) for _ in range(k + 1)]
    errors += ["", "x" * 500]  # a success (no error) and one very long message
    lines = failure_lines(errors)
    assert len(lines) == MAX_FAILURE_REASONS + 1
    # Most frequent first: ErrorG happened 7 times.
    assert lines[0] == "      7 x ErrorG: broke"
    assert lines[-1].split(" x ")[0].strip() == str(2 + 1 + 1)  # ErrorB, ErrorA and the long one
    assert "3 other reasons" in lines[-1]
    (long_text, count), = [r for r in failure_reasons(errors) if r[0].startswith("xxx")]
    assert count == 1 and len(long_text) == 120 and long_text.endswith("...")
    assert failure_lines(["", ""]) == []
