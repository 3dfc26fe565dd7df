"""The OpenAI-compatible server, talked to with the official openai client, on the embedded
SmolLM2 (greedy, a few tokens a request). The server listens on a free port of 127.0.0.1."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import mlx.core as mx
import openai
import pytest

from mlx_flashnorm import load
from mlx_flashnorm.decoding import generate, generate_step
from mlx_flashnorm.serve.openai_api import Call, Transcript
from mlx_flashnorm.server import Server
from mlx_flashnorm.serve.requests import Generation, Token

from conftest import CountingWorker, count_traces, serving

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GERMANY = [{"role": "user", "content": "What is the capital of Germany?"}]
COUNTING = "1, 2, 3, 4,"  # SmolLM2 counts on for as long as it may


@pytest.fixture(scope="module")
def server(smollm2):
    with serving(Server(*smollm2, "smol", port=0, worker=CountingWorker(*smollm2))) as server:
        yield server


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_chat_completion_plain_and_streamed(client, smollm2):
    model, tokenizer = smollm2
    r = client.chat.completions.create(model="smol", messages=FRANCE, max_tokens=8)
    answer = r.choices[0].message.content
    assert "Paris" in answer and r.choices[0].finish_reason == "stop"
    assert answer == generate(model, tokenizer, FRANCE[0]["content"], max_tokens=8)
    prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(tokenizer.encode(answer))  # (the end-of-turn token not counted)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="smol", messages=FRANCE, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # piece by piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage == r.usage


def test_completion_stop_and_length(client):
    r = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, stop=[" 7", "x"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" 5, 6,", "stop")
    streamed = list(client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, stop=" 7",
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == " 5, 6,"
    r = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_two_clients_at_once(client):
    results = {}

    def ask(name, messages, stream):
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=8, stream=stream)
        results[name] = ("".join(c.choices[0].delta.content or "" for c in r) if stream
                         else r.choices[0].message.content)

    threads = [threading.Thread(target=ask, args=("france", FRANCE, True)),
               threading.Thread(target=ask, args=("germany", GERMANY, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert "Paris" in results["france"] and "Berlin" not in results["france"]
    assert "Berlin" in results["germany"] and "Paris" not in results["germany"]


def post(server, path, data):
    """POST raw bytes; (status, parsed JSON body)."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


BAD = [  # (body, the field the error names)
    (b"{not json", None),
    (b'{"model": "smol"}', "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": 7}]}', "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 9000}]}).encode(), "messages"),
]


def test_each_bad_request_gets_400_and_the_next_good_one_succeeds(server):
    for body, param in BAD:
        status, answer = post(server, "/v1/chat/completions", body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", body[:80]
        assert answer["error"]["message"] and answer["error"]["param"] == param, body[:80]
        status, answer = post(server, "/v1/completions", b'{"prompt": "Hello", "max_tokens": 1}')
        assert status == 200 and answer["usage"] == {"prompt_tokens": 1, "completion_tokens": 1,
                                                     "total_tokens": 2,
                                                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_bad_request_through_the_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="smol", messages=FRANCE, max_tokens=-5)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="smol", prompt="word " * 9000)


def test_completion_keeps_the_leading_space(client, smollm2):
    """The continuation of a prompt is the text its tokens add to the prompt's: its leading space
    included (a decoder drops the space at the start of a text)."""
    model, tokenizer = smollm2
    r = client.completions.create(model="smol", prompt=COUNTING, max_tokens=4)
    prompt = tokenizer.encode(COUNTING)
    tokens = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=4)]
    assert COUNTING + r.choices[0].text == tokenizer.decode(prompt + tokens)
    assert r.choices[0].text.startswith(" ")


def transcribe(tokenizer, prompt, tokens, stop=()):
    """Transcript.add's (piece, finish_reason, entries) for tokens up to the finish, the last one
    ending by length."""
    transcript, out = Transcript(tokenizer, Call(False, Generation(prompt, 100), stop=list(stop))), []
    for n, t in enumerate(tokens):
        out.append(transcript.add(Token(t, "length" if n == len(tokens) - 1 else None)))
        if out[-1][1]:
            return out


def test_transcript_pieces_add_up_to_the_decoded_text(smollm2):
    """Characters split over tokens are sent whole, once complete; each token's entry (for its
    log-probability) goes once; a stop string cuts the text and the entries after it."""
    tokenizer = smollm2[1]
    prompt, text = tokenizer.encode("Say:"), " héllo 😀 wörld, 東京 ok"
    tokens = tokenizer.encode(text)
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in tokens)  # a character split over tokens
    out = transcribe(tokenizer, prompt, tokens)
    assert "".join(p for p, _, _ in out) == text and all("\ufffd" not in p for p, _, _ in out)
    assert [e.token.id for _, _, got in out for e in got] == tokens
    assert [f for _, f, _ in out] == [None] * (len(tokens) - 1) + ["length"]

    out = transcribe(tokenizer, prompt, tokens, stop=["😀", "zzz"])
    pieces, finish = [p for p, _, _ in out], [f for _, f, _ in out]
    assert "".join(pieces) == " héllo " and finish[-1] == "stop" and finish.count("stop") == 1
    # " héllo " ends in the token " \xf0\x9f\x98" (" " and the emoji's first bytes), which the next
    # completes: both are sent, not " w" after them
    sent = [e.token.id for _, _, got in out for e in got]
    assert [tokenizer.decode([t]) for t in sent] == [" h", "é", "llo", " \ufffd", "\ufffd"] and sent == tokens[:5]


def hang_up_while_generating(server, body):
    """Send body to /v1/completions on a raw socket and close it once the worker has made 3 tokens
    of it; the number of tokens it had made then."""
    made, before = server.worker.made, len(server.worker.made)
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        deadline = time.perf_counter() + 120
        while len(made) == before or made[before] < 3:
            assert time.perf_counter() < deadline
            time.sleep(0.01)
        return made[before]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_disconnected_request_frees_its_slot(server, client, stream):
    """A client that hangs up, reading a stream or waiting for its whole answer, has its request
    dropped within a few steps (of 2000), so the next request does not wait for it."""
    made, before = server.worker.made, len(server.worker.made)
    at_hang_up = hang_up_while_generating(server, {"prompt": COUNTING, "max_tokens": 2000, "stream": stream})
    r = client.completions.create(model="smol", prompt=COUNTING, max_tokens=3)
    assert r.choices[0].text == " 5,"  # (" ", "5", ",")
    assert len(made) == before + 2 and made[before] < at_hang_up + 10, made[before:]


def test_a_waiting_request_whose_client_hangs_up_is_not_generated(server, client):
    made, before = server.worker.made, len(server.worker.made)
    stream = client.completions.create(model="smol", prompt=COUNTING, max_tokens=2000, stream=True)
    next(iter(stream))  # generating
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60) as sock:
        data = json.dumps({"prompt": "Hello", "max_tokens": 50}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        while server.active < 2:
            time.sleep(0.01)
    while server.active > 1:  # noticed while it waits
        time.sleep(0.01)
    stream.close()
    assert client.completions.create(model="smol", prompt=COUNTING, max_tokens=2).choices[0].text == " 5"
    assert len(made) == before + 2  # the stream's and the last request's


def test_client_resetting_its_connection_leaves_no_traceback(server, client, capfd):
    """Clients that reset their connection right after sending a request (nobody left to read
    the answer) cost the server no traceback, and the next request is answered."""
    for _ in range(10):
        sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.close()  # with a zero linger: a reset, not a FIN
    time.sleep(0.5)
    assert client.completions.create(model="smol", prompt=COUNTING, max_tokens=2).choices[0].text == " 5"
    assert "Traceback" not in capfd.readouterr().err


def test_warm_server_warms_its_worker_thread(tiny_llama_dir, monkeypatch):
    """Server(warm=True, max_concurrent=1) warms up on the worker thread (MLX keeps compiled
    functions per thread): its first request traces no decode step."""
    model, tokenizer = load(str(tiny_llama_dir), norm="rms", progress=False)
    traces = count_traces(model, monkeypatch)
    warm = Server(model, tokenizer, "tiny", port=0, warm=True, max_concurrent=1)  # SerialWorker
    try:
        assert len(traces) == 1
        ticket = warm.worker.submit(Generation(tokenizer.encode("hello"), 5))
        tokens = list(iter(lambda: ticket.next(timeout=60), None))
        assert [t.finish_reason for t in tokens] == [None] * 4 + ["length"] and len(traces) == 1
    finally:
        warm.server_close()


@pytest.mark.parametrize("flags", [[], ["--max-concurrent", "1"]], ids=["batch", "serial"])
def test_server_command(tiny_llama_dir, server, flags):
    """python -m mlx_flashnorm.server (the batch engine's process, or the one-request worker):
    says where it listens, serves, stops on Ctrl-C with status 0 (also when started with SIGINT
    ignored, as a shell's background job is; the model's worker thread, which ran compiled
    functions, does not abort the exit); a taken port or a bad limit is a one-line error; the API
    key may come from the environment."""
    cmd = [sys.executable, "-m", "mlx_flashnorm.server", "--model", str(tiny_llama_dir), *flags]
    taken = subprocess.run(cmd + ["--port", str(server.server_address[1])], capture_output=True,
                           text=True, timeout=120)
    assert taken.returncode == 2 and taken.stderr.startswith("error: cannot listen on 127.0.0.1:")
    assert "Traceback" not in taken.stderr
    bad = subprocess.run(cmd + ["--max-queue", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --max-queue must be at least 0")
    ignoring = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]  # starts the command with SIGINT ignored
    env = dict(os.environ, PYTHONFAULTHANDLER="1", MLX_FLASHNORM_API_KEY="k3y")  # SIGABRT: every thread's stack
    p = subprocess.Popen(ignoring + cmd + ["--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    deadline = threading.Timer(120, p.kill)  # so that no read below can wait forever
    deadline.start()
    try:
        line = p.stdout.readline()
        assert line.startswith("serving tiny-llama on http://127.0.0.1:"), line + p.stderr.read()
        url = line.split()[-1]
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"{url}/models", timeout=60)
        keyed = urllib.request.Request(f"{url}/models", headers={"Authorization": "Bearer k3y"})
        with urllib.request.urlopen(keyed, timeout=60) as r:
            assert json.load(r)["data"][0]["id"] == "tiny-llama"
        ask = urllib.request.Request(f"{url}/completions", headers={
            "Authorization": "Bearer k3y", "Content-Type": "application/json"},
            data=json.dumps({"prompt": "Hi", "max_tokens": 2}).encode())
        with urllib.request.urlopen(ask, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] >= 1
        p.send_signal(signal.SIGINT)
        try:
            code = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)
            code = f"none after 60 s; its threads: {p.communicate(timeout=30)[1][-4000:]}"
        assert code == 0, p.stderr.read()[-2000:]
    finally:
        deadline.cancel()
        p.kill()
        p.communicate()
