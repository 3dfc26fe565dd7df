"""The server run as a service (issue 64): a request's time limit (--request-timeout), answered 504
and its request stopped; every answer ends (a stream's error event, then [DONE]). A real server on
a free port of 127.0.0.1 over a stand-in worker whose tokens the test hands out, a real HTTP
client; no wait depends on the machine's speed (timeouts are upper bounds)."""
import http.client
import json
import time

import pytest

from mlx_flashnorm.serve.requests import Ticket, Token
from mlx_flashnorm.server import Server

from conftest import serving

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
