"""The server under bad input and load: every request gets a JSON answer with its status and the
next good request succeeds; the body limit, the queue limit, the timeouts and the listen backlog
hold; the API key and CORS rules apply; a connection serves requests until it idles (keep-alive).
Raw sockets, http.client and the openai client against the embedded
SmolLM2 behind a server with small limits, on a free port of 127.0.0.1."""
import json
import re
import socket
from http import client
import threading
import time

import openai
import pytest

from mlx_flashnorm.serve import http
from mlx_flashnorm.serve.batch_worker import BatchWorker
from mlx_flashnorm.serve.requests import Ticket, Token
from mlx_flashnorm.server import Server
from mlx_flashnorm.serve.serial import SerialWorker

from conftest import serving

KEY = "test-key-1234"
ORIGIN = "http://app.example"  # allowed by --cors-origin
TIMEOUT = 2.0  # seconds: the server's --timeout
MAX_BODY = 2**18  # bytes: room for JSON nested 100,000 deep


@pytest.fixture(scope="module")
def server(smollm2):
    """The server, one row, with a prompt cache (as by default: the tests' requests repeat a few
    prompts, each of them prefilled once)."""
    worker = BatchWorker(*smollm2, max_batch=1, prompt_cache_bytes=2**26)
    with serving(Server(*smollm2, "smol", port=0, api_key=KEY, cors_origins=[ORIGIN], max_queue=1,
                        max_body=MAX_BODY, timeout=TIMEOUT, worker=worker)) as server:
        yield server


def connect(server, timeout=60):
    return socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=timeout)


def read_answer(sock):
    """(status, headers with lower-case names, JSON body or None) of an answer read until the server
    closes the connection; status None if it closed without one."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    if not data:
        return None, {}, None
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def one_answer(sock):
    """(status, JSON body) of one answer with a Content-Length, the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    n = int(re.search(rb"\r\nContent-Length: (\d+)", head, re.I).group(1))
    while len(body) < n:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def exchange(server, data):
    with connect(server) as sock:
        sock.sendall(data)
        return read_answer(sock)


def request(method, path, body=b"", key=KEY, content_type="application/json", length=None, **headers):
    """The bytes of an HTTP/1.1 request; length: the Content-Length header's text (default: the body's);
    Connection: close unless given (read_answer reads until the server closes)."""
    headers = {"Host": "127.0.0.1", "Content-Type": content_type, "Authorization": key and f"Bearer {key}",
               "Content-Length": str(len(body)) if length is None else length, "Connection": "close",
               **headers}
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items() if v]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def completion(**fields):
    return request("POST", "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 1, **fields}).encode())


def chat(**fields):
    messages = [{"role": "user", "content": "Hi"}]
    return request("POST", "/v1/chat/completions",
                   json.dumps({"messages": messages, "max_tokens": 1, **fields}).encode())


GOOD = completion()


def assert_good(server):
    status, _, body = exchange(server, GOOD)
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body


BAD = [  # (what, request bytes, status, the field the error names)
    ("unpaired surrogate", request("POST", "/v1/completions", b'{"prompt": "hi \\ud800"}'), 400, None),
    ("JSON nested 100,000 deep", request("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400, None),
    ("invalid UTF-8", request("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}'), 400, None),
    ("not JSON", request("POST", "/v1/completions", b"{prompt"), 400, None),
    ("not an object", request("POST", "/v1/completions", b"[1]"), 400, None),
    ("non-numeric Content-Length", request("POST", "/v1/completions", b"{}", length="abc"), 400, None),
    ("negative Content-Length", request("POST", "/v1/completions", b"{}", length="-5"), 400, None),
    ("chunked body", request("POST", "/v1/completions", b"2\r\n{}\r\n0\r\n\r\n", length="",
                             Transfer_Encoding="chunked"), 411, None),
    ("body over --max-body", request("POST", "/v1/completions", b" " * (MAX_BODY + 1)), 413, None),
    ("seed below 0", completion(seed=-1), 400, "seed"),
    ("seed above 2**64 - 1", completion(seed=2**64), 400, "seed"),
    ("seed not an integer", completion(seed=1.5), 400, "seed"),
    ("temperature NaN", completion(temperature=float("nan")), 400, "temperature"),
    ("temperature infinite", completion(temperature=float("inf")), 400, "temperature"),
    ("temperature above 2", completion(temperature=2.5), 400, "temperature"),
    ("temperature of 401 digits", completion(temperature=10**400), 400, "temperature"),
    ("temperature below 0", completion(temperature=-0.1), 400, "temperature"),
    ("top_p 0", completion(top_p=0), 400, "top_p"),
    ("top_p above 1", completion(top_p=1.5), 400, "top_p"),
    ("top_k below 0", completion(top_k=-1), 400, "top_k"),
    ("min_p above 1", completion(min_p=1.5), 400, "min_p"),
    ("empty stop string", completion(stop=""), 400, "stop"),
    ("empty stop string in a list", completion(stop=["a", ""]), 400, "stop"),
    ("max_tokens above the context", completion(max_tokens=9000), 400, "max_tokens"),
    ("max_tokens 0", completion(max_tokens=0), 400, "max_tokens"),
    ("n above the batch's one row", completion(n=2), 400, "n"),
    ("an unsupported field", completion(suffix="!"), 400, "suffix"),
    ("echo", completion(echo=True), 400, "echo"),
    ("logprobs above 20", completion(logprobs=21), 400, "logprobs"),
    ("presence_penalty above 2", completion(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency_penalty NaN", completion(frequency_penalty=float("nan")), 400, "frequency_penalty"),
    ("repetition_penalty 0", completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("repetition_penalty 2**63", completion(repetition_penalty=2**63), 400, "repetition_penalty"),
    ("repetition_penalty 1e-320", completion(repetition_penalty=1e-320), 400, "repetition_penalty"),
    ("top_k 2**63", completion(top_k=2**63, temperature=1), 400, "top_k"),
    ("top_k the vocabulary's size", completion(top_k=49152, temperature=1), 400, "top_k"),
    ("temperature 1e999 (infinite)",
     request("POST", "/v1/completions", b'{"prompt": "Hi", "temperature": 1e999}'), 400,
     "temperature"),
    ("logit_bias Infinity",
     request("POST", "/v1/completions", b'{"prompt": "Hi", "logit_bias": {"5": Infinity}}'), 400,
     "logit_bias"),
    ("logit_bias key not a token id", completion(logit_bias={"a": 1}), 400, "logit_bias"),
    ("logit_bias above 100", completion(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias key of 5000 digits", completion(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
    ("a token id outside the vocabulary", completion(prompt=[10**9]), 400, "prompt"),
    ("an empty prompt", completion(prompt=""), 400, "prompt"),
    ("chat: top_logprobs without logprobs", chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat: logprobs not a boolean", chat(logprobs=3), 400, "logprobs"),
    ("chat: tools not functions", chat(tools=[{"type": "function"}]), 400, "tools"),
    ("chat: a message's tool_calls", request("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}).encode()), 400, "messages"),
    ("text/plain body", request("POST", "/v1/completions", b'{"prompt": "Hello"}', content_type="text/plain"), 415, None),
    ("unknown endpoint", request("POST", "/v1/embeddings", b"{}"), 404, None),
    ("unknown GET endpoint", request("GET", "/v2/models"), 404, None),
    ("unsupported method", request("DELETE", "/v1/models"), 501, None),
    ("malformed request line", b"HELLO\r\n\r\n", 400, None),
    ("malformed header", b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n", 431, None),
]


@pytest.mark.parametrize("what, data, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status_and_the_next_good_one_succeeds(server, what, data, status, param):
    got, headers, body = exchange(server, data)
    assert got == status and headers["content-type"] == "application/json", (what, body)
    assert body["error"]["message"] and body["error"]["param"] == param, body
    assert_good(server)


def test_numbers_the_engine_cannot_take_are_400s_naming_their_range(server):
    """A number the engine cannot take (a top_k beyond the vocabulary, a penalty beyond what a float
    holds) is a 400 naming the accepted range, never reaching the engine, whose sampling goes on; a
    temperature too small for half precision decodes greedily."""
    for fields, accepted in ((dict(top_k=49152, temperature=1), "from 0 to 49151"),
                             (dict(repetition_penalty=2**63), "from 0.01 to 100")):
        status, _, body = exchange(server, completion(**fields))
        assert status == 400 and accepted in body["error"]["message"], body
    status, _, body = exchange(server, completion(temperature=1, seed=1, max_tokens=4))
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    greedy = exchange(server, completion(max_tokens=4))[2]["choices"][0]["text"]
    tiny = exchange(server, completion(temperature=1e-320, max_tokens=4))[2]
    assert tiny["choices"][0]["text"] == greedy


IGNORED = dict(store=False, metadata={"app": "test"}, service_tier="auto", user="u-1",
               parallel_tool_calls=True, prompt_cache_key="k", safety_identifier="s-1")


def test_fields_that_change_nothing_are_accepted(server):
    """The fields OpenAI clients send that change nothing here (as mlx_lm.server ignores them) are
    accepted, through the official client too, each type-checked; a completion takes `user`."""
    for name, value in IGNORED.items():
        assert exchange(server, chat(**{name: value}))[0] == 200, name
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="smol", max_tokens=1, **IGNORED,
                                            messages=[{"role": "user", "content": "Hi"}])
    assert answer.usage.completion_tokens == 1
    assert client.completions.create(model="smol", prompt="Hi", max_tokens=1, user="u").usage
    for name, value in (("store", "yes"), ("metadata", "app"), ("service_tier", 1),
                        ("parallel_tool_calls", "no"), ("prompt_cache_key", 2)):
        status, _, body = exchange(server, chat(**{name: value}))
        assert status == 400 and body["error"]["param"] == name, body


def test_a_body_shorter_than_its_content_length_gets_408(server):
    with connect(server) as sock:
        tic = time.perf_counter()
        sock.sendall(request("POST", "/v1/completions", b'{"prompt": "Hello"}', length="100"))
        status, _, body = read_answer(sock)
    assert status == 408 and "did not arrive" in body["error"]["message"]
    assert TIMEOUT - 0.5 < time.perf_counter() - tic < TIMEOUT + 5
    assert_good(server)


PARTIAL_HEADS = [(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */", "inside a header"),
                 (b"POST /v1/completions HTTP/1.1\r\n", "after the request line"),
                 (b"POST /v1/comp", "inside the request line")]


@pytest.mark.parametrize("partial", [p for p, _ in PARTIAL_HEADS], ids=[w for _, w in PARTIAL_HEADS])
def test_unfinished_headers_get_408(server, partial):
    """A client that sends part of its request's head and waits gets a 408 with a JSON error once
    --timeout has passed, then the close."""
    with connect(server) as sock:
        tic = time.perf_counter()
        sock.sendall(partial)
        status, headers, body = read_answer(sock)
    assert status == 408 and headers["content-type"] == "application/json", body
    assert "did not arrive" in body["error"]["message"] and time.perf_counter() - tic > TIMEOUT - 0.5
    assert_good(server)


def test_slow_headers_are_cut_off(server):
    """A client sending its headers a byte at a time gets 408 after --timeout, however long it goes on."""
    sock = connect(server)
    stop = threading.Event()

    def trickle():
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            while not stop.wait(0.1):
                sock.sendall(b"x")
        except OSError:
            pass

    tic = time.perf_counter()
    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        status, _, body = read_answer(sock)
    finally:
        stop.set()
        sender.join()
        sock.close()
    assert status == 408 and TIMEOUT - 0.5 < time.perf_counter() - tic < TIMEOUT + 5
    with connect(server) as idle:  # a connection that sends nothing is closed as well
        tic = time.perf_counter()
        assert idle.recv(1) == b"" and time.perf_counter() - tic < TIMEOUT + 5
    assert_good(server)


def wait_for(server, requests, seconds=60):
    deadline = time.perf_counter() + seconds
    while server.active != requests:
        assert time.perf_counter() < deadline, f"{server.active} requests taken, not {requests}"
        time.sleep(0.05)


def test_full_queue_answers_503_with_retry_after(server):
    """One request generating (the worker's one slot) and one waiting (--max-queue 1) fill the server:
    the next gets 503 at once; once their clients hang up, requests succeed again."""
    generating, waiting = connect(server), connect(server)
    try:
        generating.sendall(completion(max_tokens=2000, stream=True))
        assert generating.recv(4096).startswith(b"HTTP/1.1 200")  # under way
        waiting.sendall(completion(max_tokens=2000))
        wait_for(server, 2)
        status, headers, body = exchange(server, GOOD)
        assert status == 503 and headers["retry-after"] == "1" and "busy" in body["error"]["message"]
        assert exchange(server, request("GET", "/health"))[2]["requests"] == 2
    finally:
        generating.close()
        waiting.close()
    wait_for(server, 0)
    assert_good(server)


def test_a_burst_of_connections_is_answered(server):
    """320 clients connecting at once all get their answer (a listen backlog of 5 dropped 95 of 320)."""
    n, answers, barrier = 320, [], threading.Barrier(320)

    def ask():
        barrier.wait()
        try:  # the kernel completes a connection in the backlog before the server accepts it
            with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=1.0) as sock:
                sock.settimeout(60)
                sock.sendall(request("GET", "/health"))
                answers.append(read_answer(sock)[0])
        except OSError as e:
            answers.append(e)

    threads = [threading.Thread(target=ask) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert answers == [200] * n


def test_api_key(server):
    for key in (None, "wrong"):
        for data in (request("GET", "/v1/models", key=key), request("POST", "/v1/completions", b'{"prompt": "Hi"}', key=key)):
            status, headers, body = exchange(server, data)
            assert status == 401 and headers["www-authenticate"] == "Bearer", body
            assert "Authorization: Bearer" in body["error"]["message"]
    assert exchange(server, request("GET", "/health", key=None))[0] == 200  # a health check needs no key
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    assert client.completions.create(model="smol", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_cross_origin_requests_need_cors_origin(server):
    """A web page's request (it carries an Origin) is refused unless the origin is allowed; a form's
    text/plain POST, which a browser sends without asking first, is refused either way."""
    other = "http://evil.example"
    for data in (completion(), request("POST", "/v1/completions", b'{"prompt": "Hi"}',
                                             content_type="text/plain", key=None)):
        status, headers, body = exchange(server, data.replace(b"Host:", f"Origin: {other}\r\nHost:".encode()))
        assert status == 403 and other in body["error"]["message"] and "access-control-allow-origin" not in headers
    status, _, _ = exchange(server, request("POST", "/v1/completions", b'{"prompt": "Hi"}', content_type="text/plain"))
    assert status == 415

    status, headers, body = exchange(server, completion().replace(b"Host:", f"Origin: {ORIGIN}\r\nHost:".encode()))
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN and headers["vary"] == "Origin"

    preflight = request("OPTIONS", "/v1/chat/completions", key=None, content_type=None, length="",
                        Access_Control_Request_Method="POST", Access_Control_Request_Headers="authorization")
    status, headers, _ = exchange(server, preflight.replace(b"Host:", f"Origin: {ORIGIN}\r\nHost:".encode()))
    assert status == 204 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "Authorization" in headers["access-control-allow-headers"]
    status, headers, _ = exchange(server, preflight.replace(b"Host:", f"Origin: {other}\r\nHost:".encode()))
    assert status == 403 and "access-control-allow-origin" not in headers
    assert exchange(server, preflight)[0] == 204  # OPTIONS without an Origin: the allowed methods


def test_requests_must_name_the_server_in_host(server):
    """A page of a DNS-rebinding attacker reaches the server under the attacker's name: a Host that
    names neither an address, nor localhost, nor a name of --allowed-host gets 421 and a JSON error,
    on every endpoint; an address or localhost, with any port or none, and a request without a Host
    (HTTP/1.0) are answered; two Host headers are a 400."""
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil"):
        for data in (request("GET", "/health", Host=host), request("GET", "/v1/models", Host=host),
                     completion().replace(b"Host: 127.0.0.1", f"Host: {host}".encode()),
                     request("OPTIONS", "/v1/models", Host=host)):
            status, headers, body = exchange(server, data)
            assert status == 421 and headers["content-type"] == "application/json", (host, body)
            message = body["error"]["message"]
            assert host.partition(":")[0] in message and "--allowed-host" in message
    for host in ("127.0.0.1", "127.0.0.1:9000", "localhost", "LOCALHOST.:1", "[::1]:80",
                 "app.localhost", "10.1.2.3"):
        assert exchange(server, request("GET", "/health", Host=host))[0] == 200, host
    assert exchange(server, b"GET /health HTTP/1.0\r\n\r\n")[0] == 200
    status, _, body = exchange(server, b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
                                       b"Host: evil.example\r\n\r\n")
    assert status == 400 and "Host" in body["error"]["message"]
    assert_good(server)


def test_allowed_host_names_a_host_to_answer_for(smollm2):
    """--allowed-host NAME (repeatable; any case, a trailing dot or not) answers requests naming it;
    --allowed-host * answers any."""
    for allowed, good, refused in ((["MyHost.lan.", "other.lan"], ["myhost.lan:8080", "other.lan"],
                                    ["evil.lan"]), (["*"], ["evil.lan"], [])):
        with serving(Server(None, smollm2[1], "gated", port=0, worker=GatedWorker(smollm2[1]),
                            allowed_hosts=allowed)) as gated:
            for host in good + refused:
                status = exchange(gated, request("GET", "/health", Host=host))[0]
                assert status == (421 if host in refused else 200), host


class GatedWorker:
    """A stand-in worker (requests.py's interface): each request's tokens (the ids of " a b c d")
    come once `release` is set, none for a cancelled one."""
    slots, context_length, vocab_size = 4, 2048, 49152

    def __init__(self, tokenizer):
        self.ids, self.release, self.tickets = tokenizer.encode(" a b c d"), threading.Event(), []

    def submit(self, generation):
        ticket = Ticket(generation)
        self.tickets.append(ticket)
        threading.Thread(target=self.answer, args=(ticket,), daemon=True).start()
        return ticket

    def answer(self, ticket):
        self.release.wait()
        for i, t in enumerate(self.ids):
            if ticket.cancelled:
                return
            ticket.put(Token(t, "length" if i == len(self.ids) - 1 else None))
        ticket.put(None)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_client_that_half_closes_after_its_request_is_answered(smollm2, monkeypatch, stream):
    """A client that shuts its sending side once its request is sent (shutdown(SHUT_WR)) is still
    reading: seen by the server's looks for clients gone while its request waits, it gets its whole
    answer."""
    looks, gone = [], http.Handler.client_gone
    monkeypatch.setattr(http.Handler, "client_gone",
                        lambda self: looks.append(gone(self)) or looks[-1])
    worker = GatedWorker(smollm2[1])
    with (serving(Server(None, smollm2[1], "gated", port=0, worker=worker)) as gated,
          connect(gated) as sock):
        sock.sendall(request("POST", "/v1/completions", json.dumps(
            {"prompt": "Hello", "max_tokens": 4, "stream": stream}).encode(), key=None))
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 60
        # the server has looked at the half-closed client, probed it and looked again
        while len(looks) < 3 and not (worker.tickets and worker.tickets[0].cancelled):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        worker.release.set()
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK\r\n"), data
    body = data.partition(b"\r\n\r\n")[2]
    text = ("".join(json.loads(e[6:])["choices"][0]["text"] for e in body.decode().split("\n\n")
                    if e.startswith("data: {")) if stream else json.loads(body)["choices"][0]["text"])
    assert text == " a b c d" and (body.endswith(b"data: [DONE]\n\n") or not stream)


class FailingWorker(SerialWorker):
    def stream(self, generation):
        raise RuntimeError("the device fell over")
        yield


def test_a_failing_worker_gets_a_500_and_the_server_goes_on(smollm2):
    with serving(Server(*smollm2, "smol", port=0, worker=FailingWorker(*smollm2))) as failing:
        status, _, body = exchange(failing, completion())
        assert status == 500 and body["error"]["message"] == "generation failed: the device fell over"
        with connect(failing) as sock:
            sock.sendall(completion(stream=True))
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 200") and b'data: {"error": {"message": "generation failed' in data
        assert exchange(failing, request("GET", "/health"))[2]["requests"] == 0


def test_keep_alive_serves_a_connection_until_it_idles(server):
    """HTTP/1.1 keep-alive (http.client): completions, a stream (chunked), /health and an error
    answered on one connection, never reopened; a refused body's answer says Connection: close
    and closes it, as does one asked to (Connection: close, or an HTTP/1.0 stream's); a connection
    left idle after an answer is closed after --timeout, and a request's own time counts from its
    first byte."""
    # (Nagle's algorithm off: on a kept connection it held a stream's event for the client's
    # delayed acknowledgement of the one before: bench/RESULTS.md, "Time to first token")
    assert http.Handler.disable_nagle_algorithm
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    body = json.dumps({"prompt": "Hello", "max_tokens": 1})
    streamed = json.dumps({"prompt": "Hello", "max_tokens": 2, "stream": True})
    conn = client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)

    def ask(method, path, data=None, expect=200, **more):
        conn.request(method, path, data, dict(headers, **more))
        r = conn.getresponse()
        answer = r.read()
        assert r.status == expect and r.version == 11, (r.status, answer)
        return r, answer

    r, _ = ask("POST", "/v1/completions", body)
    sock = conn.sock
    assert not r.will_close and r.getheader("Content-Length")
    r, events = ask("POST", "/v1/completions", streamed)
    assert r.getheader("Transfer-Encoding") == "chunked" and not r.will_close
    assert events.startswith(b"data: {") and events.endswith(b"data: [DONE]\n\n")
    ask("GET", "/health")
    ask("POST", "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 0}), expect=400)
    ask("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 1, "stream": True}))
    assert conn.sock is sock  # (http.client reopens a connection the server closed)
    r, _ = ask("POST", "/v1/completions", b" " * (MAX_BODY + 1), expect=413)
    assert r.will_close and r.getheader("Connection") == "close" and conn.sock is None
    r, _ = ask("POST", "/v1/completions", streamed, Connection="close")
    assert r.getheader("Connection") == "close" and r.will_close and conn.sock is None
    ask("GET", "/health")
    tic = time.perf_counter()
    assert conn.sock.recv(1) == b"" and TIMEOUT - 0.5 < time.perf_counter() - tic < TIMEOUT + 5
    conn.close()
    with connect(server) as kept:  # a request's time counts from its first byte, not the idling
        kept.sendall(request("GET", "/health", Connection=None))
        assert one_answer(kept)[0] == 200
        time.sleep(0.75 * TIMEOUT)
        late = request("POST", "/v1/completions", body.encode(), Connection=None)
        kept.sendall(late[:20])
        time.sleep(0.5 * TIMEOUT)
        kept.sendall(late[20:])
        status, answer = one_answer(kept)
        assert status == 200 and answer["usage"]["completion_tokens"] == 1, answer
    with connect(server) as old:  # an HTTP/1.0 client's stream ends with its connection
        old.sendall(request("POST", "/v1/completions", streamed.encode(), Connection=None)
                    .replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1))
        data = b""
        while chunk := old.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and b"\r\nConnection: close\r\n" in data
    assert data.endswith(b"data: [DONE]\n\n")
    assert_good(server)
