"""The OpenAI-compatible HTTP transport: GET /v1/models, GET /health, GET /metrics (metrics.py),
POST /v1/chat/completions and POST /v1/completions, plain or streamed as server-sent events;
OPTIONS answers browsers' preflights. Built on the standard library's ThreadingHTTPServer: each
connection has a thread that reads and checks its request (openai_api: every field range-checked,
a JSON error for anything wrong), submits it to the worker it was given (requests.py's interface)
and writes the answer from the tokens that come back, which one thread reads for every answer
(streaming.Streamer), writing a streamed one's events itself. Beside the API: the chat page
(page.py) at GET /, and llama-server's POST /tokenize, /detokenize and /apply-template
(tokenizer_api.py).

HTTP/1.1 with keep-alive, as llama-server's: an answer leaves the connection open for the
client's next request (a new connection and thread a request cost every client that reuses its
connections, the openai client among them), an answer in one piece with its Content-Length, a
stream in the chunked transfer coding; an answer after which the connection cannot be read on (a
body refused or cut short, a malformed head) closes it and says so; a connection idle for
`timeout` seconds between requests is closed (a request's own `timeout` counts from its first
byte), and an HTTP/1.0 request's after its answer (a stream's end is then the connection's).

Under load: requests wait for the worker while the KV cache they would all need together (each its
prompt and max_tokens) fits the worker's budget (kv_tokens), and, where max_queue is set, while at
most the worker's slots plus max_queue are taken; past that they get 503 with Retry-After; a
request (headers and body) must arrive within `timeout` seconds (else 408, a
request cut off in its head too) and be at most max_body bytes; a client that hangs up, streaming
or not, is noticed within streaming.POLL seconds (a streamed one also at its next write) and its
request dropped by the worker at its next step."""
import hmac
import ipaddress
import json
import select
import socket
import threading
import time
from collections import Counter
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import metrics, page, tokenizer_api
from .openai_api import Answer, HTTPError, Transcript, bad, parse_call, parse_json
from .requests import Load
from .streaming import SHUT, Stream, Streamer, event

RETRY_AFTER = 1  # seconds, in a 503's Retry-After
MAX_QUEUE = 64  # requests waiting beyond a worker's slots where it has no KV budget (kv_tokens)
MAX_BODY = 2**20  # bytes: a prompt filling a 128k-token context is about 0.5 MB of JSON
# seconds: a body of unknown length has ended when none of it comes for this long
DRAIN_PAUSE = 0.2


def host_name(value):
    """The name a Host header's value gives: without its port, an IPv6 address without its
    brackets, in lower case, without a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        name = value[1:].partition("]")[0]
    else:
        name = value.rpartition(":")[0] if ":" in value else value
    return name.rstrip(".")


def is_address(name):
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def positions(generation):
    """The KV cache positions a request may write: its prompt and max_tokens, a row a choice."""
    return (len(generation.tokens) + generation.max_tokens) * generation.n


class ClientGone(Exception):
    """The client closed its connection (or a write to it failed or timed out)."""


class BodyRefused(HTTPError):
    """An error answered before the body was read: `unread` bytes of it follow (None: unknown)."""

    def __init__(self, status, message, unread=None):
        super().__init__(status, message)
        self.unread = unread


class Reaper:
    """Shuts the reading side of a connection whose request (headers and body) has not arrived
    within `seconds`, so that a client sending slowly, or less than its Content-Length, cannot hold
    a thread: the handler's read then ends, and it answers 408 (handler.late is set)."""

    def __init__(self, seconds):
        self.seconds, self.lock, self.deadlines, self.stopped = (seconds, threading.Lock(), {},
                                                                 threading.Event())
        threading.Thread(target=self._run, daemon=True).start()

    def watch(self, handler):
        handler.late = False
        with self.lock:
            self.deadlines[handler] = time.monotonic() + self.seconds

    def release(self, handler):
        """Stop watching handler; False if its deadline had passed."""
        with self.lock:
            self.deadlines.pop(handler, None)
        return not handler.late

    def _run(self):
        while not self.stopped.wait(min(0.25, self.seconds / 4)):
            now = time.monotonic()
            with self.lock:
                for handler in [h for h, t in self.deadlines.items() if t < now]:
                    del self.deadlines[handler]
                    handler.late = True
                    try:
                        handler.connection.shutdown(socket.SHUT_RD)
                    except OSError:
                        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # the listen backlog (socketserver's is 5): a burst of connections waits
    request_queue_size = 1024

    def __init__(self, worker, tokenizer, model_id, host="127.0.0.1", port=8080, max_tokens=256,
                 temp=0.0, top_p=1.0, top_k=0, *, api_key=None, cors_origins=(), max_queue=None,
                 max_body=MAX_BODY, timeout=30.0, request_timeout=None, allowed_hosts=(),
                 parse_special=False, metrics=True):
        """worker: what generates (requests.py's interface, with the model's context_length and
        vocab_size, which the requests are checked against); it is closed with the server.
        max_tokens, temp, top_p, top_k: the defaults of requests that leave them out.
        api_key: requests must send it as a Bearer token; cors_origins: the web origins whose pages
        may call the server ("*": any); max_queue: requests waiting beyond the worker's slots at
        most (None: as many as its KV budget holds, or MAX_QUEUE for a worker without one);
        max_body: bytes; timeout: seconds for a request to arrive, and for any one socket
        operation; request_timeout: seconds a request may run once taken (None: no limit);
        allowed_hosts: the names (besides addresses, localhost and host's name) that requests may
        give in their Host header ("*": any: Handler.check_host); parse_special: special tokens'
        text in chat messages is parsed as the tokens (openai_api.chat_tokens); metrics: GET
        /metrics is served (else 404)."""
        self.worker = worker
        super().__init__((host, port), Handler)
        self.tokenizer, self.model_id = tokenizer, model_id
        self.defaults = dict(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k)
        self.api_key, self.cors_origins = api_key, set(cors_origins)
        self.parse_special = parse_special
        self.allowed_hosts = {host_name(h) for h in allowed_hosts} | (
            {host_name(host)} if host and not is_address(host) else set())
        self.max_queue, self.max_body, self.io_timeout = max_queue, max_body, timeout
        self.created = int(time.time())
        # requests taken, and the positions of KV cache they need (each its prompt and max_tokens)
        self.lock, self.active, self.held = threading.Lock(), 0, 0
        self.arriving = 0  # completion requests being read, parsed and tokenized, not yet taken
        self.metrics, self.outcomes = metrics, Counter()  # completion requests by outcome
        self.draining = False  # stopping: no request taken
        self.reaper = Reaper(timeout)
        self.streamer = Streamer(timeout, request_timeout)
        self.limits = (worker.context_length, worker.vocab_size)

    def call(self, body, chat):
        return parse_call(body, chat, self.tokenizer, *self.limits, self.defaults,
                          self.parse_special, getattr(self.worker, "choices", 1))

    def admit(self, generation):
        """The worker's Ticket for generation, or a 503 when the requests taken with it would need
        more KV cache than the worker's budget holds, or the worker's slots and the queue are
        full."""
        need = positions(generation)
        budget = getattr(self.worker, "kv_tokens", None)
        queue = MAX_QUEUE if self.max_queue is None and budget is None else self.max_queue
        with self.lock:
            if (problem := self.unavailable()) is not None:
                raise HTTPError(503, f"the server takes no requests now: {problem}",
                                headers={"Retry-After": str(RETRY_AFTER)})
            if queue is not None and self.active >= self.worker.slots + queue:
                raise HTTPError(503, f"the server is busy ({self.active} requests taken, "
                                     f"--max-queue {queue}): retry later",
                                headers={"Retry-After": str(RETRY_AFTER)})
            if budget is not None and self.held + need > budget:
                raise HTTPError(503, f"the server is busy ({self.active} requests taken, their "
                                     f"KV cache {self.held} of the {budget} positions "
                                     "--kv-budget holds): retry later",
                                headers={"Retry-After": str(RETRY_AFTER)})
            self.active += 1
            self.held += need
            generation.followed = self.arriving > 1  # (this one among them)
        return self.worker.submit(generation)

    def done(self, generation, outcome=None):
        """A request admitted with generation is answered (outcome: how, metrics.OUTCOMES, for a
        completion's)."""
        with self.lock:  # (with the count: requests_active 0 says every answer is counted)
            self.active -= 1
            self.held -= positions(generation)
            if outcome is not None:
                self.outcomes[outcome] += 1

    def count(self, outcome):
        """A completion request answered before it was taken (outcome: how; None: another)."""
        if outcome is not None:
            with self.lock:
                self.outcomes[outcome] += 1

    @property
    def load(self):
        """The worker's requests.Load (zeros for a worker that keeps none)."""
        return getattr(self.worker, "load", None) or Load()

    def exposition(self):
        """The text of GET /metrics (metrics.py)."""
        with self.lock:
            outcomes, active, held = dict(self.outcomes), self.active, self.held
        return metrics.exposition(self.load, outcomes, active, self.worker.slots, held,
                                  getattr(self.worker, "kv_tokens", None))

    def unavailable(self):
        """Why no request is taken now (the worker's `problem`, where it has one), or None."""
        if self.draining:
            return "the server is shutting down"
        return getattr(self.worker, "problem", None)

    def health(self):
        """(status, body) of GET /health: 503 with the reason while no request is taken."""
        problem = self.unavailable()
        load = self.load
        body = {"status": "ok", "requests": self.active, "slots": self.worker.slots,
                "max_queue": self.max_queue,
                # the batch: rows decoding, rows waiting for room, the KV cache they hold
                "batch": {"rows": load.rows, "queued": load.waiting,
                          "kv_cache_tokens": load.kv_tokens,
                          "kv_cache_usage_ratio": load.kv_tokens / max(load.kv_capacity, 1)}}
        if problem is None:
            return 200, body
        return 503, dict(body, status="unavailable", reason=problem)

    def server_close(self):
        super().server_close()
        if hasattr(self, "reaper"):
            self.reaper.stopped.set()
            self.streamer.stopped = True
        if hasattr(getattr(self, "worker", None), "close"):  # (none yet if its start failed)
            self.worker.close()


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"  # keep-alive (the module's note)
    # TCP_NODELAY: a kept connection's small writes (an event) go at once, not after the client's
    # delayed acknowledgement of the one before (Nagle's algorithm held a stream's first content)
    disable_nagle_algorithm = True
    default_request_version = "HTTP/1.0"  # a malformed request line still gets a status line
    allowed_origin = None  # the request's Origin, once --cors-origin allowed it
    late = False  # the request did not arrive in time (set by the Reaper)
    served = 0  # requests read on this connection
    written_ahead = b""  # the answer's first bytes, written by the Streamer as a probe

    def setup(self):
        self.timeout = self.server.io_timeout  # on every socket operation
        super().setup()
        self.poller = select.poll()
        self.poller.register(self.connection, select.POLLIN)

    def handle_one_request(self):
        if self.served:  # a kept connection: idle until its next request, for `timeout` at most
            if not self.poller.poll(1000 * self.server.io_timeout):
                self.close_connection = True
                return
        self.served += 1
        self.server.reaper.watch(self)  # (the request's time counts from its first byte on)
        # the reaper ends a late request head, which then gets its 408: a socket timeout of the
        # same length would close the connection without one (this one is a backstop)
        self.connection.settimeout(2 * self.server.io_timeout)
        try:
            super().handle_one_request()
        except ConnectionError:  # the client left before its request was read or answered
            self.close_connection = True
        finally:
            self.server.reaper.release(self)

    def parse_request(self):
        """http.server's, reading the headers; a head that did not all arrive in time gets 408."""
        try:
            if self.late and not self.raw_requestline.endswith(b"\n"):
                # cut off inside its request line: nothing of it to parse
                self.command, self.request_version = None, self.default_request_version
                self.requestline = self.raw_requestline.decode("latin-1")
                self.send_error(408)
                return False
            if not super().parse_request():
                return False
        finally:
            self.connection.settimeout(self.server.io_timeout)
        if self.late:  # the headers did not all arrive in time
            self.send_error(408)
            return False
        return True

    def timed_out(self):
        return HTTPError(408, f"the request did not arrive within {self.server.io_timeout:g} s")

    def end_headers(self):
        if self.allowed_origin:
            self.send_header("Access-Control-Allow-Origin", self.allowed_origin)
            self.send_header("Vary", "Origin")
        if self.close_connection:  # (said: its client would send its next request here)
            self.send_header("Connection", "close")
        super().end_headers()

    def flush_headers(self):
        """http.server's, less the bytes written ahead."""
        if self.written_ahead and getattr(self, "_headers_buffer", None):
            head = b"".join(self._headers_buffer)
            assert head.startswith(self.written_ahead)
            self._headers_buffer = [head[len(self.written_ahead):]]
            self.written_ahead = b""
        super().flush_headers()

    def send_json(self, status, obj, headers=()):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in dict(headers).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def send_file(self, body, content_type, headers=page.HEADERS):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def fail(self, error):
        try:
            self.send_json(error.status, error.body(), error.headers)
        except OSError:
            pass  # the client is gone

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a malformed request line or header, an unknown method) in
        JSON; a 408 for a head the reaper cut off (what it holds may be malformed for that)."""
        self.close_connection = True
        self.fail(self.timed_out() if self.late
                  else HTTPError(code, message or HTTPStatus(code).phrase))

    def check_host(self):
        """The Host header must name this server (421 otherwise): a page of a DNS-rebinding
        attacker, its name turned to this machine's address, reaches the server under the
        attacker's name, which the browser sends. An address (no page can turn one into another),
        localhost or a name under .localhost (browsers keep those to this machine), or a name of
        host or allowed_hosts passes, with any port (a tunnel or forwarded port changes it); so
        does a request without a Host (HTTP/1.0: not a browser's)."""
        hosts = self.headers.get_all("Host", [])
        if len(hosts) > 1:
            raise HTTPError(400, "a request has one Host header, not several")
        if not hosts:
            return
        name, allowed = host_name(hosts[0]), self.server.allowed_hosts
        if not ("*" in allowed or name in allowed or name == "localhost"
                or name.endswith(".localhost") or is_address(name)):
            raise HTTPError(421, f"this server does not answer for {name!r} (the Host header): "
                                 "only for its addresses, localhost and the names of --host and "
                                 f"--allowed-host (start it with --allowed-host {name} to answer "
                                 "for that name)")

    def check_origin(self):
        """A page in a browser sends its Origin: refused unless --cors-origin allows it."""
        origin = self.headers.get("Origin")
        if origin is None or page.same_origin(origin, self.headers.get("Host")):
            return
        if "*" not in self.server.cors_origins and origin not in self.server.cors_origins:
            raise HTTPError(403, f"requests from web pages of {origin} are refused: start the "
                                 f"server with --cors-origin {origin} to allow them")
        self.allowed_origin = origin

    def check_key(self):
        key = self.server.api_key
        if key is not None and not hmac.compare_digest(
                self.headers.get("Authorization", "").encode(), f"Bearer {key}".encode()):
            raise HTTPError(401, "this server needs its API key (--api-key) in the header "
                                 "'Authorization: Bearer <key>'",
                            headers={"WWW-Authenticate": "Bearer"})

    def do_OPTIONS(self):
        try:
            self.check_host()
            self.check_origin()
        except HTTPError as e:
            return self.fail(e)
        self.send_response(204)
        self.send_header("Allow", "GET, POST, OPTIONS")
        if self.allowed_origin:
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        path = self.path.rstrip("/")
        try:
            self.check_host()
            self.check_origin()
            if path == "/health":
                return self.send_json(*self.server.health())
            if (file := page.asset(self.path)) is not None:  # the chat page: no key
                return self.send_file(*file)
            if path == "/metrics" and not self.server.metrics:
                raise HTTPError(404, "no such endpoint: GET /metrics (the server was started "
                                     "with --no-metrics)")
            if path not in ("/v1/models", "/metrics"):
                raise HTTPError(404, f"no such endpoint: GET {self.path}")
            self.check_key()  # (/metrics too, as llama-server's)
        except HTTPError as e:
            return self.fail(e)
        if path == "/metrics":
            return self.send_file(self.server.exposition().encode(), metrics.FORMAT, {})
        model = {"id": self.server.model_id, "object": "model", "created": self.server.created,
                 "owned_by": "mlx-flashnorm"}
        self.send_json(200, {"object": "list", "data": [model]})

    def read_body(self):
        """The body's bytes: Content-Length of them, at most --max-body, arrived in time."""
        if "Transfer-Encoding" in self.headers:
            raise BodyRefused(411, "send the body with a Content-Length (chunked transfer encoding "
                                   "is not supported)")
        lengths = [v.strip() for v in self.headers.get_all("Content-Length", [])]
        if not lengths:
            raise BodyRefused(411, "a POST needs a Content-Length header")
        if len(set(lengths)) != 1 or not (lengths[0].isascii() and lengths[0].isdigit()):
            raise BodyRefused(400, "Content-Length must be one whole number of bytes, "
                                   f"not {', '.join(lengths)!r}")
        n = int(lengths[0])
        if n > self.server.max_body:
            raise BodyRefused(413, f"the body has {n} bytes, this server takes at most "
                                   f"{self.server.max_body} (--max-body)", unread=n)
        try:
            body = self.rfile.read(n)
        except TimeoutError:
            body = None
        if not self.server.reaper.release(self) or body is None:
            raise self.timed_out()
        if len(body) < n:
            raise bad(f"the body ended after {len(body)} of its Content-Length's {n} bytes")
        return body

    def drain(self, n=None):
        """Read and drop the n bytes of body the client sends (None: as long as it goes on sending,
        with pauses under DRAIN_PAUSE s), or until the request's time is up (the reaper): closing a
        connection with unread bytes resets it, and the client could lose our answer."""
        if n is None:
            self.connection.settimeout(DRAIN_PAUSE)
        try:
            while n is None or n > 0:
                got = self.rfile.read1(65536 if n is None else min(n, 65536))
                if not got:
                    break
                n = None if n is None else n - len(got)
        except OSError:
            pass

    def do_POST(self):
        chat = self.path.rstrip("/") == "/v1/chat/completions"
        completion = chat or self.path.rstrip("/") == "/v1/completions"
        utility = tokenizer_api.ROUTES.get(self.path.rstrip("/"))
        if completion:  # arriving until taken or refused (Generation.followed)
            with self.server.lock:
                self.server.arriving += 1
        body = None
        try:
            body = self.read_body()  # first: an answer with bytes left unread could be lost (drain)
            self.check_host()
            if not completion and utility is None:
                raise HTTPError(404, f"no such endpoint: POST {self.path}")
            self.check_origin()
            self.check_key()
            if (self.headers.get("Content-Type", "").split(";")[0].strip().lower()
                    != "application/json"):
                raise HTTPError(415, "send the body as JSON, with the header "
                                     "'Content-Type: application/json'")
            if utility is not None:  # /tokenize, /detokenize, /apply-template
                return self.send_json(200, utility(parse_json(body), self.server.tokenizer,
                                                   self.server.limits[1]))
            call = self.server.call(parse_json(body), chat)
            ticket = self.server.admit(call.generation)
        except HTTPError as e:
            self.server.count(metrics.outcome(e.status) if completion else None)
            if body is None:  # (what is left of the body would be read as the next request)
                self.close_connection = True
            self.fail(e)
            return self.drain(e.unread) if isinstance(e, BodyRefused) else None
        finally:
            if completion:
                with self.server.lock:
                    self.server.arriving -= 1
        outcome = "gone"
        try:
            transcripts = [Transcript(self.server.tokenizer, call)
                           for _ in range(call.generation.n)]
            answer = Answer(call, self.server.tokenizer, self.server.model_id)
            ahead = f"{self.protocol_version} ".encode()  # every status line's beginning
            chunked = (call.stream and self.request_version == "HTTP/1.1"
                       and not self.close_connection)
            stream = Stream(self.connection, self.client_gone, ticket, transcripts, answer,
                            whole=not call.stream, ahead=ahead, chunked=chunked)
            (self.stream if call.stream else self.whole)(stream)
            outcome = metrics.outcome(stream.error.status if stream.error else 200)
        except ClientGone:
            self.close_connection = True
        finally:
            ticket.cancel()
            self.server.done(call.generation, outcome)

    def client_gone(self):
        """True once the client is gone (its connection reset, or in error); streaming.SHUT once
        it has sent its end (its socket reads as ended): it closed its connection, or only its
        sending side, reading on (a write tells); else False. Read while the socket does not
        block (the Streamer's)."""
        try:
            events = self.poller.poll(0)
            if not events:
                return False
            if events[0][1] & (select.POLLERR | select.POLLNVAL):
                return True
            return SHUT if self.connection.recv(1, socket.MSG_PEEK) == b"" else False
        except BlockingIOError:
            return False
        except OSError:
            return True

    def whole(self, stream):
        """The answer in one piece, once the server's Streamer has read all its tokens."""
        if not self.server.streamer.run(stream):
            raise ClientGone()
        self.written_ahead = stream.written_ahead
        if stream.failed is not None:  # (a limit, or nothing checked before)
            return self.fail(stream.error)
        try:
            self.send_json(200, stream.answer.whole(stream.transcripts, stream.entries))
        except OSError as e:
            raise ClientGone() from e

    def write(self, data):
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError as e:
            raise ClientGone() from e

    def stream(self, stream):
        """The answer's events, written by the server's Streamer once the headers are out."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            if stream.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:  # (an HTTP/1.0 client's, or one asking to close: its end is the connection's)
                self.close_connection = True
            self.end_headers()
        except OSError as e:
            raise ClientGone() from e
        if stream.answer.call.chat:
            for i in range(len(stream.transcripts)):
                self.write(stream.frame(event(stream.answer.chunk("", None, [], role="assistant",
                                                                  index=i))))
        if not self.server.streamer.run(stream):
            raise ClientGone()
