"""Admission by the KV cache's memory (--kv-budget): the default server answers a 256-client load in
full; requests wait for rows while the budget holds them, and only past it get 503 with
Retry-After; --max-concurrent and --max-queue still cap. Real HTTP on a free port of 127.0.0.1,
client threads, a tiny random Llama with a 60-token vocabulary (a step of 256 rows takes
milliseconds on the CPU) and a sentencepiece tokenizer trained here."""
import http.client
import json
import threading
import time

import pytest

from mlx_flashnorm import load
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.serve.batch_worker import MAX_ROWS, BatchWorker, kv_limits
from mlx_flashnorm.serve.slots import kv_layout, token_bytes
from mlx_flashnorm.server import Server, kv_budget, main

from conftest import TINY_LLAMA, in_process, make_checkpoint, serving

CONTEXT = 2048  # the model's: two cache steps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, spm_model):
    folder, _ = make_checkpoint(tmp_path_factory.mktemp("admit") / "llama",
                                dict(TINY_LLAMA, vocab_size=60, max_position_embeddings=CONTEXT))
    return load(str(folder), tokenizer=str(spm_model), norm="rms", progress=False)


def post(port, body, stream=False):
    """(status, headers, JSON answer; a stream's: the connection, its answer unread)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=stream)),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    if stream and r.status == 200:
        return r.status, dict(r.getheaders()), conn
    answer = json.loads(r.read())
    conn.close()
    return r.status, dict(r.getheaders()), answer


def load_of(port, clients, max_tokens):
    """clients threads posting a completion at once; their (status, completion tokens)."""
    results = [None] * clients

    def client(i):
        status, _, answer = post(port, {"prompt": f"the quick brown fox {i}", "max_tokens": max_tokens})
        results[i] = (status, answer.get("usage", {}).get("completion_tokens"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def idle(server):
    """Wait until the server's handlers have finished (they count a request done after writing
    its answer)."""
    deadline = time.monotonic() + 60
    while server.active:
        assert time.monotonic() < deadline, f"{server.active} requests still taken"
        time.sleep(0.05)
    return server.held == 0


class WatchedWorker(BatchWorker):
    """BatchWorker keeping the most rows it decoded together (on its thread)."""

    most_rows = 0

    def deliver(self, events):
        self.most_rows = max(self.most_rows, len(events))
        super().deliver(events)


def test_the_default_server_answers_a_256_client_load_in_full(tiny):
    """Server's defaults (as the command's: rows and queue from the default KV budget): 256 clients
    at once all get 200 and their tokens, with many rows decoding together."""
    model, tokenizer = tiny
    worker = WatchedWorker(model, tokenizer)
    assert worker.slots == MAX_ROWS  # (the default budget holds far more of this model's rows)
    with serving(Server(model, tokenizer, "tiny", port=0, worker=worker)) as server:
        assert server.max_queue is None
        results = load_of(server.server_address[1], 256, 4)
        assert [s for s, _ in results] == [200] * 256 and all(1 <= n <= 4 for _, n in results)
        assert worker.most_rows > 32 and idle(server)


def test_requests_wait_for_rows_while_the_budget_holds_them(tiny):
    """A KV budget of 4 rows at the model's context, 8 of one cache step (1024 positions): 40
    clients whose prompts and max_tokens fit it together are all taken and answered 200, at most 8
    rows decoding at once, the rest waiting."""
    model, tokenizer = tiny
    per_row = CONTEXT * token_bytes(kv_layout(model))
    worker = WatchedWorker(model, tokenizer, kv_budget=4 * per_row)
    assert (worker.slots, worker.kv_tokens) == (8, 4 * CONTEXT)
    with serving(Server(model, tokenizer, "tiny", port=0, worker=worker)) as server:
        results = load_of(server.server_address[1], 40, 4)
    assert [s for s, _ in results] == [200] * 40 and 1 < worker.most_rows <= 8


class HeldWorker(BatchWorker):
    """BatchWorker that stops after its first step's tokens until `let` is set (so that a request
    under way is still under way however slowly the test's thread runs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.let = threading.Event()

    def deliver(self, events):
        super().deliver(events)
        assert self.let.wait(120), "the test never let the worker go on"


def test_past_the_budget_a_request_gets_503_with_retry_after(tiny):
    """A budget of 1.5 requests at the model's context: a request holding 1900 positions (its
    prompt and max_tokens) under way, one asking for 1500 more is refused 503 with Retry-After, one
    asking for a few is taken; once the first is gone, the large one is taken."""
    model, tokenizer = tiny
    per_token = token_bytes(kv_layout(model))
    worker = HeldWorker(model, tokenizer, kv_budget=3 * CONTEXT // 2 * per_token)
    long = {"prompt": "the quick brown fox", "max_tokens": 1900, "logit_bias": {"2": -100}}  # no EOS
    with serving(Server(model, tokenizer, "tiny", port=0, worker=worker)) as server:
        port = server.server_address[1]
        status, _, running = post(port, long, stream=True)
        assert status == 200
        try:
            status, headers, answer = post(port, dict(long, max_tokens=1500))
            assert status == 503 and headers["Retry-After"] == "1", answer
            assert "--kv-budget" in answer["error"]["message"] and server.active == 1
            worker.let.set()
            assert post(port, {"prompt": "the lazy dog", "max_tokens": 4})[0] == 200
        finally:
            worker.let.set()
            running.close()
        assert idle(server)
        status, _, again = post(port, dict(long, max_tokens=1500), stream=True)
        again.close()
        assert status == 200


def test_max_concurrent_and_max_queue_still_cap(tiny):
    """--max-concurrent 2 --max-queue 0 over the default budget: two requests taken, a third 503."""
    model, tokenizer = tiny
    long = {"prompt": "the quick brown fox", "max_tokens": 1900, "logit_bias": {"2": -100}}
    worker = HeldWorker(model, tokenizer, max_batch=2)
    with serving(Server(model, tokenizer, "tiny", port=0, max_queue=0, worker=worker)) as server:
        assert server.worker.slots == 2
        port = server.server_address[1]
        running = [post(port, long, stream=True) for _ in range(2)]
        try:
            assert [s for s, _, _ in running] == [200, 200]
            status, headers, answer = post(port, long)
            assert status == 503 and headers["Retry-After"] == "1"
            assert "--max-queue 0" in answer["error"]["message"]
        finally:
            worker.let.set()
            for _, _, conn in running:
                conn.close()


def test_kv_budget_values_and_errors(tiny):
    """--kv-budget takes bytes (with a binary suffix) or a fraction of the device's memory; anything
    else, and a budget below one request at the model's context, is a one-line error."""
    assert (kv_budget("8G"), kv_budget("512MiB"), kv_budget("0.25"), kv_budget("4096")) == (
        8 * 2**30, 512 * 2**20, 0.25, 4096)
    for bad in ("lots", "1.5", "0", "-1", "1"):
        r = in_process(main, "--kv-budget", bad)
        assert r.returncode == 2 and r.stderr.startswith("error: --kv-budget must be bytes"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    model, _ = tiny
    per_token = token_bytes(kv_layout(model))
    with pytest.raises(UserError, match=f"fewer than one request at its context of {CONTEXT}: give "
                                        f"at least {CONTEXT * per_token}"):
        kv_limits(model, kv_budget=CONTEXT * per_token - 1)
    assert kv_limits(model, kv_budget=CONTEXT * per_token) == (2, CONTEXT * per_token, CONTEXT)
    assert kv_limits(model, max_batch=3, kv_budget=40 * CONTEXT * per_token)[0] == 3
    assert kv_limits(model, kv_budget=40 * CONTEXT * per_token)[0] == 64  # 80 rows: bucket 64
