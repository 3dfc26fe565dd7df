"""The server's default worker (batch_worker.BatchWorker: continuous batching and a prompt cache) over
HTTP, on the embedded SmolLM2 with the official openai client and raw sockets: concurrent
requests get their one-at-a-time answers, a client that hangs up frees its row, a shared prefix is
not prefilled again. The server listens on a free port of 127.0.0.1."""
import json
import socket
import threading
import time

import pytest

from mlx_flashnorm import load
from mlx_flashnorm.serve.batch_worker import BatchWorker
from mlx_flashnorm.decoding import generate
from mlx_flashnorm.server import Server, main as server_main

from conftest import cli, in_process, serving

COUNTING = "1, 2, 3, 4,"  # SmolLM2 counts on for as long as it may
QUESTIONS = ["What is the capital of France?", "What is the capital of Germany?"]
SYSTEM = ("You are a helpful assistant for a travel agency. Answer in one short sentence, name the "
          "country where it helps, and never make up facts you are unsure of.")


class WatchedWorker(BatchWorker):
    """BatchWorker keeping the most rows it decoded together (on its thread)."""

    most_rows = 0

    def put(self, ticket, token):  # token: a Token, or None once the request is done
        if token is not None:
            self.most_rows = max(self.most_rows, len(self.engine.rows) + (token.finish_reason is not None))
        super().put(ticket, token)


@pytest.fixture(scope="module")
def server(smollm2):
    with serving(Server(*smollm2, "smol", port=0, worker=WatchedWorker(*smollm2, prompt_cache_bytes=2**26))) as server:
        yield server


def test_default_worker_batches(smollm2):
    """The default worker batches as many rows as the default KV budget holds, at most MAX_ROWS."""
    from mlx_flashnorm.serve.batch_worker import MAX_ROWS, kv_limits

    server = Server(*smollm2, "smol", port=0)
    try:
        assert isinstance(server.worker, BatchWorker) and server.max_queue is None
        assert server.worker.slots == kv_limits(smollm2[0])[0] <= MAX_ROWS  # (this machine's memory)
    finally:
        server.server_close()


def test_concurrent_requests_get_their_single_answers(server, client, smollm2):
    """Two chats at once, one streamed, decode in one batch; each answer is the one-request one."""
    model, tokenizer = smollm2
    answers = {}

    def ask(i):
        messages = [{"role": "user", "content": QUESTIONS[i]}]
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=8, stream=i % 2 == 1)
        answers[i] = "".join(c.choices[0].delta.content or "" for c in r) if i % 2 else r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert server.worker.most_rows > 1
    assert answers == {i: generate(model, tokenizer, q, max_tokens=8) for i, q in enumerate(QUESTIONS)}
    assert "Paris" in answers[0] and "Berlin" in answers[1]


def test_shared_prefix_is_not_prefilled_again(server, client, smollm2):
    """Two chats with one system prompt: the second computes only the tokens after the shared
    prefix; a conversation's next turn only its new message; the answers (4 tokens: what counts is
    the prompts) are the uncached ones."""
    model, tokenizer = smollm2
    engine = server.worker.engine

    def chat(messages):
        before = engine.prefilled
        text = client.chat.completions.create(model="smol", messages=messages,
                                              max_tokens=4).choices[0].message.content
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return text, tokens, engine.prefilled - before

    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    text, a, computed = chat(first)
    text2, b, computed2 = chat(second)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared > 30 and computed2 == len(b) - shared
    assert text2 == generate(model, tokenizer,
                             tokenizer.apply_chat_template(second, add_generation_prompt=True),
                             max_tokens=4)
    turn = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "And of Italy?"}]
    text3, c, computed3 = chat(turn)
    assert computed3 < 20 < len(c)
    assert text3 == generate(model, tokenizer, c, max_tokens=4)


def test_usage_counts_the_prompt_tokens_the_cache_gave(server, client):
    """usage.prompt_tokens_details.cached_tokens (mlx_lm.server's) is the prompt tokens the prompt
    cache gave (those the engine did not compute), in an answer in one piece and a stream's last
    chunk, on chats and completions."""
    engine = server.worker.engine
    for i, stream in enumerate((False, True, False)):
        before = engine.prefilled
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Say {i}."}]
        if stream:
            usage = list(client.chat.completions.create(
                model="smol", messages=messages, max_tokens=2, stream=True,
                stream_options={"include_usage": True}))[-1].usage
        else:
            usage = client.chat.completions.create(model="smol", messages=messages,
                                                   max_tokens=2).usage
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached == usage.prompt_tokens - (engine.prefilled - before), (i, usage)
        assert cached > 30 or i == 0  # the system prompt, after the first
    before = engine.prefilled
    usage = client.completions.create(model="smol", prompt=SYSTEM + " Go on.", max_tokens=2).usage
    computed = engine.prefilled - before
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - computed


def test_a_stream_behind_the_worker_catches_up_in_one_event(server, client, monkeypatch):
    """A stream that fell behind the batch (the streamer held at its first look at the ticket until
    the worker has put all its tokens, however long they take) sends the tokens waiting as one
    event: fewer events than tokens, the same text and log-probabilities as the answer in one
    piece."""
    from mlx_flashnorm.serve import requests, streaming

    ask = dict(model="smol", messages=[{"role": "user", "content": COUNTING}], max_tokens=12,
               logprobs=True)
    whole = client.chat.completions.create(**ask)
    ended, held = threading.Event(), []
    put, advance = requests.Ticket.put, streaming.Stream.advance

    def noting_the_end(self, item):
        put(self, item)
        if item is None:  # the worker is done with the request: all its tokens are on the ticket
            ended.set()

    def held_first(self):
        if not held:
            held.append(ended.wait(300))
        return advance(self)

    monkeypatch.setattr(requests.Ticket, "put", noting_the_end)
    monkeypatch.setattr(streaming.Stream, "advance", held_first)
    chunks = list(client.chat.completions.create(**ask, stream=True,
                                                 stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert held == [True] and len(content) == 1  # all 12 were waiting once the hold ended
    assert content[0].choices[0].delta.content == whole.choices[0].message.content
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert ([(e.token, e.logprob) for e in entries]
            == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_disconnected_request_frees_its_row(server, client, stream):
    """A client that hangs up, streaming or waiting for its whole answer, leaves the batch within a
    few steps (of 2000), and the next request is answered at once."""
    engine = server.worker.engine
    data = json.dumps({"prompt": COUNTING, "max_tokens": 2000, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        deadline = time.monotonic() + 120
        while not engine.rows or len(engine.rows[0].generated) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        request = engine.rows[0]
    deadline = time.monotonic() + 60
    while request in engine.rows:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(request.generated) < 100
    assert client.completions.create(model="smol", prompt=COUNTING, max_tokens=3).choices[0].text == " 5,"


def test_warm_batch_server_warms_its_worker_thread(tiny_llama_dir, monkeypatch):
    """Server(warm=True) with the batch worker plays its warm-up on the worker thread, before
    serving, and counts nothing of it (at 32 rows: the warm-up traces every bucket up to them, and a
    step of 256 rows of this model's 49,152-id head takes most of a second on the CPU)."""
    model, tokenizer = load(str(tiny_llama_dir), progress=False)
    threads = []
    call = type(model).__call__

    def recording(self, tokens, cache=None):
        threads.append(threading.current_thread())
        return call(self, tokens, cache)

    monkeypatch.setattr(type(model), "__call__", recording)
    warm = Server(model, tokenizer, "tiny", port=0, warm=True, max_concurrent=32)
    try:
        assert threads and threading.main_thread() not in threads and len(set(threads)) == 1
        assert isinstance(warm.worker, BatchWorker) and warm.worker.engine.prefilled == 0
    finally:
        warm.server_close()


def test_bad_batch_flags_are_one_line_errors():
    """The first in a real process, as users run it; the others in this one (conftest.in_process:
    a process each cost seconds of imports)."""
    for i, flags in enumerate((["--max-concurrent", "0"], ["--prompt-cache-size", "-1"],
                               ["--prefill-step-size", "0"])):
        r = cli("mlx_flashnorm.server", *flags) if i == 0 else in_process(server_main, *flags)
        assert r.returncode == 2 and r.stderr.startswith(
            "error: --max-concurrent and --prefill-step-size must be at least 1 and "
            "--prompt-cache-size (MB) at least 0"), r.stderr
        assert "Traceback" not in r.stderr


def test_a_request_taken_while_another_arrives_is_a_bursts(tiny_llama_dir):
    """Generation.followed, which lets an idle batch worker gather a burst: True for a request
    taken while another is still being read (its body half sent), False for that one once taken
    alone and for a request that came alone (a lone request waits for no gather)."""
    model, tokenizer = load(str(tiny_llama_dir), progress=False)
    followed = []

    class Recording(BatchWorker):
        def submit(self, generation):
            followed.append(generation.followed)
            return super().submit(generation)

    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2}).encode()
    with serving(Server(model, tokenizer, "tiny", port=0, worker=Recording(model, tokenizer))) as server:
        port = server.server_address[1]

        def status(s):  # the answer's status line, read whole
            line = b""
            while b"\r\n" not in line:
                got = s.recv(1)
                assert got, line
                line += got
            return line

        def post():
            with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nConnection: close\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                assert b" 200 " in status(s)

        slow = socket.create_connection(("127.0.0.1", port), timeout=120)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode()
                     + body[:5])
        end = time.monotonic() + 60
        while server.arriving < 1:  # its handler is reading the body
            assert time.monotonic() < end
            time.sleep(0.01)
        post()  # taken while the slow one arrives
        slow.sendall(body[5:])
        assert b" 200 " in status(slow)
        slow.close()
        post()  # alone
    assert followed == [True, False, False]
