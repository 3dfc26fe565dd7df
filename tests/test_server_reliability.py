"""The server run as a service (issue 64): a request's time limit (--request-timeout), answered 504
and its request stopped; the drain on SIGTERM and SIGINT; every answer ends (a stream's error
event, then [DONE]). A real server on
a free port of 127.0.0.1 over a stand-in worker whose tokens the test hands out, a real HTTP
client; no wait depends on the machine's speed (timeouts are upper bounds)."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from mlx_flashnorm.serve.requests import Ticket, Token
from mlx_flashnorm.server import Server

from conftest import TINY_LLAMA, in_process, make_checkpoint, serving

WAIT = 120  # seconds: an upper bound, never a pace


class Manual:
    """A worker (requests.py's interface) that takes requests and answers only what the test puts
    on their tickets."""
    slots, context_length = 2, 8192

    def __init__(self, vocab_size):
        self.vocab_size, self.tickets, self.closed = vocab_size, [], False

    def submit(self, generation):
        ticket = Ticket(generation)
        self.tickets.append(ticket)
        return ticket

    def close(self):
        self.closed = True


@pytest.fixture
def tokenizer(smollm2):
    return smollm2[1]


def until(condition):
    """Wait for condition() (at most WAIT seconds)."""
    end = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < end, "never happened"
        time.sleep(0.01)


def post(port, body, path="/v1/completions"):
    """An open http.client connection with body POSTed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


def answer(conn):
    """(status, JSON body) of a plain answer."""
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def sse(conn):
    """(status, [each event's JSON or "[DONE]"]) of a streamed answer, read to its end."""
    r = conn.getresponse()
    data = r.read().decode()
    return r.status, [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                      for line in data.split("\n\n") if line.startswith("data: ")]


def test_request_timeout_ends_a_request_with_504(tokenizer):
    """--request-timeout: a plain request the worker never finishes is answered 504 naming the
    limit, a streamed one ends with an error event naming it, then [DONE];
    both tickets are cancelled (the worker drops them)."""
    worker = Manual(len(tokenizer.vocab))
    server = Server(None, tokenizer, "m", port=0, worker=worker, request_timeout=0.5)
    with serving(server):
        port = server.server_address[1]
        status, body = answer(post(port, {"prompt": "Hi", "max_tokens": 5}))
        assert status == 504 and "--request-timeout" in body["error"]["message"], body
        assert "0.5 s" in body["error"]["message"] and worker.tickets[0].cancelled
        conn = post(port, {"prompt": "Hi", "max_tokens": 5, "stream": True})
        until(lambda: len(worker.tickets) == 2)
        worker.tickets[1].put(Token(tokenizer.encode(" there")[0]))
        status, events = sse(conn)
        assert status == 200 and events[-1] == "[DONE]"
        assert all("choices" in e for e in events[:-2])  # (the token, if before the limit)
        assert "--request-timeout" in events[-2]["error"]["message"]
        assert worker.tickets[1].cancelled


def first_event(conn):
    """The HTTPResponse of a streamed request and its first event."""
    r = conn.getresponse()
    assert r.status == 200
    return r, json.loads(r.readline()[6:])


def rest(r):
    """A stream's events after those read, to its end."""
    lines = [line.strip() for line in r.read().decode().split("\n\n")]
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in lines if line.startswith("data: ")]


def test_drain_refuses_the_new_ends_the_waiting_and_lets_the_begun_finish(tokenizer):
    """Server.drain (SIGTERM's and SIGINT's): new connections are refused; a plain request and a
    streamed one that had no token yet are answered 503 (the stream: an error event, then [DONE]),
    their requests cancelled; a stream that had begun goes on to its end, a plain [DONE], and the
    drain returns once it has."""
    worker = Manual(len(tokenizer.vocab))
    server = Server(None, tokenizer, "m", port=0, worker=worker)
    with serving(server):
        port = server.server_address[1]
        begun = post(port, {"prompt": "Hi", "max_tokens": 3, "stream": True})
        until(lambda: len(worker.tickets) == 1)
        ids = tokenizer.encode(" there was a")
        worker.tickets[0].put(Token(ids[0]))
        begun, event = first_event(begun)
        assert event["choices"][0]["text"]
        plain = post(port, {"prompt": "Hi", "max_tokens": 3})
        streamed = post(port, {"prompt": "Hi", "max_tokens": 3, "stream": True})
        until(lambda: len(worker.tickets) == 3)
        server.shutdown()  # (the command's serve_forever returns at the signal)
        drained = threading.Thread(target=server.drain, args=(WAIT,))
        drained.start()
        status, body = answer(plain)
        assert status == 503 and "shutting down" in body["error"]["message"], body
        status, events = sse(streamed)
        assert status == 200 and events[-1] == "[DONE]" and "shutting down" in str(events[-2])
        assert worker.tickets[1].cancelled and worker.tickets[2].cancelled
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        assert drained.is_alive() and not worker.tickets[0].cancelled
        worker.tickets[0].put(Token(ids[1]))
        worker.tickets[0].put(Token(ids[2], "length"))
        events = rest(begun)
        assert events[-1] == "[DONE]" and all("choices" in e for e in events[:-1]), events
        drained.join(WAIT)
        assert not drained.is_alive()


def test_drain_ends_what_is_left_after_its_timeout(tokenizer):
    """A stream still running when the drain's time is up ends with an error event naming
    --drain-timeout, then [DONE]; a plain one is answered 503; the drain returns."""
    worker = Manual(len(tokenizer.vocab))
    server = Server(None, tokenizer, "m", port=0, worker=worker)
    with serving(server):
        port = server.server_address[1]
        streamed = post(port, {"prompt": "Hi", "max_tokens": 9, "stream": True})
        plain = post(port, {"prompt": "Hi", "max_tokens": 9})
        until(lambda: len(worker.tickets) == 2)
        for ticket in worker.tickets:
            ticket.put(Token(tokenizer.encode(" there")[0]))
        streamed, _ = first_event(streamed)
        server.shutdown()
        server.drain(0.5)
        events = rest(streamed)
        assert events[-1] == "[DONE]" and "--drain-timeout 0.5 s" in events[-2]["error"]["message"]
        status, body = answer(plain)
        assert status == 503 and "--drain-timeout" in body["error"]["message"]


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory, smollm2):
    """A tiny random Llama with SmolLM2's tokenizer and a context of 32768 tokens: room for
    requests that run far longer than a test."""
    folder, _ = make_checkpoint(tmp_path_factory.mktemp("long") / "llama",
                                dict(TINY_LLAMA, max_position_embeddings=32768),
                                tokenizer=smollm2[1])
    return folder


def health(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    conn.request("GET", "/health")
    return answer(conn)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_command_line_server(long_llama_dir, tokenizer, sig):
    """The command-line server (two slots, --drain-timeout 1) with two long streams running and a
    plain request waiting for a slot, sent SIGTERM or SIGINT to its whole process group (as systemd
    does, and Ctrl-C in a terminal: its engine process takes them too): the waiting request is
    answered 503, the streams end with an error event naming the drain's limit, then [DONE], and
    the server exits 0 without a traceback."""
    server = subprocess.Popen([sys.executable, "-m", "mlx_flashnorm.server", "--model",
                               str(long_llama_dir), "--norm", "rms", "--no-warmup", "--port", "0",
                               "--max-concurrent", "2", "--drain-timeout", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        port = int(server.stdout.readline().rsplit(":", 1)[1].split("/")[0])
        never = {str(t): -100 for t in tokenizer.eos_token_ids}  # (no stop token ends them)
        streams = [first_event(post(port, {"prompt": "1, 2, 3,", "max_tokens": 30000,
                                           "logit_bias": never, "stream": True}))[0]
                   for _ in range(2)]
        waiting = post(port, {"prompt": "Hi", "max_tokens": 3})
        until(lambda: health(port)[1]["requests"] == 3)
        os.killpg(server.pid, sig)
        status, body = answer(waiting)
        assert status == 503 and "shutting down" in body["error"]["message"], body
        for r in streams:
            events = rest(r)
            assert events[-1] == "[DONE]", events[-3:]
            assert "--drain-timeout 1 s" in events[-2]["error"]["message"], events[-3:]
        assert server.wait(WAIT) == 0
        assert "Traceback" not in server.stderr.read()
    finally:
        server.kill()
        server.wait()


def server_command(*args, env=None):
    """The server command run in this process (on a model that is nowhere, so that it stops at the
    load at the latest): a CompletedProcess."""
    from mlx_flashnorm.server import main

    with pytest.MonkeyPatch.context() as m:
        for name, value in (env or {}).items():
            m.setenv(name, value)
        return in_process(main, "--model", "/nowhere/model.gguf", "--max-concurrent", "1", *args)


def test_a_rank_timeout_out_of_range_is_a_one_line_error():
    """--rank-timeout (mlx.launch's bound on a rank's wait for the others) above 0 and finite."""
    for bad in ("0", "-1", "inf", "nan"):
        r = server_command("--rank-timeout", bad)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("error: --rank-timeout must be a number of seconds above 0"), \
            r.stderr
        assert len(r.stderr.splitlines()) == 1


def test_the_port_is_checked_before_the_model_loads():
    """A port out of range, or one another socket listens on, is a one-line error before the model
    loads (the model, nowhere, is not what it names)."""
    r = server_command("--port", "99999")
    assert r.returncode == 2 and r.stderr == "error: --port must be 0 to 65535, not 99999\n"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = server_command("--port", str(port))
    assert r.returncode == 2 and r.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert len(r.stderr.splitlines()) == 1 and "nowhere" not in r.stderr, r.stderr
    r = server_command("--port", "0")  # free: on to the model
    assert r.returncode == 2 and "nowhere" in r.stderr


@pytest.mark.parametrize("host,key,warned", [
    ("0.0.0.0", None, True), ("0.0.0.0", "flag", False), ("0.0.0.0", "environment", False),
    ("127.0.0.1", None, False), ("localhost", None, False)])
def test_listening_beyond_this_machine_without_a_key_is_warned(host, key, warned):
    """A non-loopback --host with no API key (neither --api-key nor the environment variable) gets
    a one-line warning on stderr, before the model loads; a key, or loopback, none."""
    from mlx_flashnorm.server import API_KEY_VARIABLE

    args = ["--host", host, "--port", "0"] + (["--api-key", "k3y"] if key == "flag" else [])
    env = {API_KEY_VARIABLE: "k3y" if key == "environment" else ""}
    lines = server_command(*args, env=env).stderr.splitlines()
    assert lines[-1].startswith("error: /nowhere/model.gguf")  # (after the warning)
    assert lines[:-1] == ([f"warning: listening on {host}, beyond this machine, with no API key: "
                           f"anyone who reaches it can use the server (set --api-key or "
                           f"{API_KEY_VARIABLE})"] if warned else []), lines
