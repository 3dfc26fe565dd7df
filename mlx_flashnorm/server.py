"""An OpenAI-compatible HTTP server: `python -m mlx_flashnorm.server`.

GET /v1/models, GET /health, POST /v1/chat/completions and POST /v1/completions, plain or
streamed as server-sent events; OPTIONS answers browsers' preflights. Built on the standard
library's ThreadingHTTPServer: each connection has a thread that reads and checks its request
(openai_api: every field range-checked, a JSON error for anything wrong), queues it on the
generation worker and writes the answer from the tokens that come back, which one thread reads
for every answer (streaming.Streamer), writing a streamed one's events itself. The worker decodes up to
--max-concurrent requests together (batch_worker.BatchWorker: continuous batching, with a prompt cache
of --prompt-cache-size MB); --max-concurrent 1 serves one request at a time on the compiled
one-request path (worker.SerialWorker: our fused kernels where they run, no prompt cache).

Under load: at most the worker's slots plus --max-queue requests are taken at once, the rest get
503 with Retry-After; a request (headers and body) must arrive within --timeout seconds and be at
most --max-body bytes; a client that hangs up, streaming or not, is noticed within
streaming.POLL seconds (a streamed one also at its next write) and its request dropped by the
worker at its next step.

Under `mlx.launch -n N` the model is split over the N processes (shard.py): rank 0 serves, one
request at a time (SerialWorker hands each to the other ranks, whose worker.follow() generates it
in lockstep), and the other ranks listen on no port."""
import argparse
import hmac
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .cli import HelpFormatter, add_model_args, add_sampling_args, wants_warmup
from .errors import UserError, run_cli
from .generate import context_length, load_from_args, make_sampler_for
from .openai_api import Answer, HTTPError, Transcript, bad, parse_call, parse_json
from .batch_worker import BatchWorker
from .engine_process import EngineProcess
from .lockstep import leads
from .shard import world
from .streaming import Stream, Streamer, event
from .worker import SerialWorker, follow

RETRY_AFTER = 1  # seconds, in a 503's Retry-After
MAX_BODY = 2**20  # bytes: a prompt filling a 128k-token context is about 0.5 MB of JSON
DRAIN_PAUSE = 0.2  # seconds: a body of unknown length has ended when none of it comes for this long
API_KEY_VARIABLE = "MLX_FLASHNORM_API_KEY"
MAX_CONCURRENT = 32  # requests decoded together (mlx_lm.server's default)
PROMPT_CACHE_MB = 512  # the prompt cache's bound
PREFILL_STEP = 2048  # prompt tokens prefilled per engine step, at most (mlx-lm's prefill step)


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
        self.seconds, self.lock, self.deadlines, self.stopped = seconds, threading.Lock(), {}, threading.Event()
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
    request_queue_size = 1024  # the listen backlog (socketserver's is 5): a burst of connections waits

    def __init__(self, model, tokenizer, model_id, host="127.0.0.1", port=8080, max_tokens=256,
                 temp=0.0, top_p=1.0, top_k=0, warm=False, *, api_key=None, cors_origins=(),
                 max_queue=64, max_body=MAX_BODY, timeout=30.0, max_concurrent=MAX_CONCURRENT,
                 prompt_cache_bytes=PROMPT_CACHE_MB * 2**20, prefill_step=PREFILL_STEP, worker=None):
        """max_tokens, temp, top_p, top_k: the defaults of requests that leave them out.
        warm: warm the model up on the worker thread before serving.
        api_key: requests must send it as a Bearer token; cors_origins: the web origins whose pages
        may call the server ("*": any); max_queue: requests waiting beyond the worker's slots;
        max_body: bytes; timeout: seconds for a request to arrive, and for any one socket operation.
        max_concurrent: requests generated together (1: one at a time, SerialWorker; else a
        BatchWorker with a prompt cache of prompt_cache_bytes). worker: what generates (default:
        the one max_concurrent says, running model); with model None, the worker's context_length
        and vocab_size (engine_process.EngineProcess) check the requests."""
        super().__init__((host, port), Handler)
        self.tokenizer, self.model_id = tokenizer, model_id
        self.defaults = dict(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k)
        self.api_key, self.cors_origins = api_key, set(cors_origins)
        self.max_queue, self.max_body, self.io_timeout = max_queue, max_body, timeout
        self.created = int(time.time())
        self.lock, self.active = threading.Lock(), 0
        try:
            self.worker = worker or (SerialWorker(model, tokenizer, warm) if max_concurrent == 1 else
                                     BatchWorker(model, tokenizer, warm, max_concurrent, prompt_cache_bytes,
                                                 prefill_step))
        except BaseException:
            self.server_close()
            raise
        self.reaper = Reaper(timeout)
        self.streamer = Streamer(timeout)
        self.limits = ((self.worker.context_length, self.worker.vocab_size) if model is None else
                       (context_length(model), model.args.vocab_size))

    def call(self, body, chat):
        return parse_call(body, chat, self.tokenizer, *self.limits, self.defaults)

    def admit(self, generation):
        """The worker's Ticket for generation, or a 503 when the worker's slots and the queue are full."""
        with self.lock:
            if self.active >= self.worker.slots + self.max_queue:
                raise HTTPError(503, f"the server is busy ({self.active} requests taken, --max-queue "
                                     f"{self.max_queue}): retry later", headers={"Retry-After": str(RETRY_AFTER)})
            self.active += 1
        return self.worker.submit(generation)

    def done(self):
        with self.lock:
            self.active -= 1

    def health(self):
        return {"status": "ok", "requests": self.active, "slots": self.worker.slots, "max_queue": self.max_queue}

    def server_close(self):
        super().server_close()
        if hasattr(self, "reaper"):
            self.reaper.stopped.set()
            self.streamer.stopped = True
        if hasattr(getattr(self, "worker", None), "close"):  # (none yet if its start failed)
            self.worker.close()


class Handler(BaseHTTPRequestHandler):
    server: Server
    default_request_version = "HTTP/1.0"  # a malformed request line still gets a status line
    allowed_origin = None  # the request's Origin, once --cors-origin allowed it

    def setup(self):
        self.timeout = self.server.io_timeout  # on every socket operation
        super().setup()
        self.poller = select.poll()
        self.poller.register(self.connection, select.POLLIN)

    def handle_one_request(self):
        self.server.reaper.watch(self)
        try:
            super().handle_one_request()
        except ConnectionError:  # the client left before its request was read or answered
            self.close_connection = True
        finally:
            self.server.reaper.release(self)

    def parse_request(self):
        if not super().parse_request():
            return False
        if self.late:  # the headers did not all arrive in time
            self.fail(self.timed_out())
            return False
        return True

    def timed_out(self):
        return HTTPError(408, f"the request did not arrive within {self.server.io_timeout:g} s")

    def end_headers(self):
        if self.allowed_origin:
            self.send_header("Access-Control-Allow-Origin", self.allowed_origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def send_json(self, status, obj, headers=()):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in dict(headers).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def fail(self, error):
        try:
            self.send_json(error.status, error.body(), error.headers)
        except OSError:
            pass  # the client is gone

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a malformed request line or header, an unknown method) in JSON."""
        self.close_connection = True
        self.fail(HTTPError(code, message or HTTPStatus(code).phrase))

    def check_origin(self):
        """A page in a browser sends its Origin: refused unless --cors-origin allows it."""
        origin = self.headers.get("Origin")
        if origin is None:
            return
        if "*" not in self.server.cors_origins and origin not in self.server.cors_origins:
            raise HTTPError(403, f"requests from web pages of {origin} are refused: start the server with "
                                 f"--cors-origin {origin} to allow them")
        self.allowed_origin = origin

    def check_key(self):
        key = self.server.api_key
        if key is not None and not hmac.compare_digest(self.headers.get("Authorization", "").encode(),
                                                       f"Bearer {key}".encode()):
            raise HTTPError(401, "this server needs its API key (--api-key) in the header "
                                 "'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"})

    def do_OPTIONS(self):
        try:
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
            self.check_origin()
            if path == "/health":
                return self.send_json(200, self.server.health())
            if path != "/v1/models":
                raise HTTPError(404, f"no such endpoint: GET {self.path}")
            self.check_key()
        except HTTPError as e:
            return self.fail(e)
        model = {"id": self.server.model_id, "object": "model", "created": self.server.created,
                 "owned_by": "mlx-flashnorm"}
        self.send_json(200, {"object": "list", "data": [model]})

    def read_body(self):
        """The body's bytes: Content-Length of them, at most --max-body, arrived in time."""
        if "Transfer-Encoding" in self.headers:
            raise BodyRefused(411, "send the body with a Content-Length (chunked transfer encoding is not supported)")
        lengths = [v.strip() for v in self.headers.get_all("Content-Length", [])]
        if not lengths:
            raise BodyRefused(411, "a POST needs a Content-Length header")
        if len(set(lengths)) != 1 or not (lengths[0].isascii() and lengths[0].isdigit()):
            raise BodyRefused(400, f"Content-Length must be one whole number of bytes, not {', '.join(lengths)!r}")
        n = int(lengths[0])
        if n > self.server.max_body:
            raise BodyRefused(413, f"the body has {n} bytes, this server takes at most {self.server.max_body} "
                                   "(--max-body)", unread=n)
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
        try:
            body = self.read_body()  # first: an answer with bytes left unread could be lost (drain)
            if not chat and self.path.rstrip("/") != "/v1/completions":
                raise HTTPError(404, f"no such endpoint: POST {self.path}")
            self.check_origin()
            self.check_key()
            if self.headers.get("Content-Type", "").split(";")[0].strip().lower() != "application/json":
                raise HTTPError(415, "send the body as JSON, with the header 'Content-Type: application/json'")
            call = self.server.call(parse_json(body), chat)
            ticket = self.server.admit(call.generation)
        except HTTPError as e:
            self.fail(e)
            return self.drain(e.unread) if isinstance(e, BodyRefused) else None
        try:
            transcript = Transcript(self.server.tokenizer, call)
            answer = Answer(call, self.server.tokenizer, self.server.model_id)
            (self.stream if call.stream else self.whole)(Stream(self.connection, self.client_gone, ticket,
                                                                 transcript, answer, whole=not call.stream))
        except ClientGone:
            pass
        finally:
            ticket.cancel()
            self.server.done()

    def client_gone(self):
        """The client closed its connection: its socket reads as at the end of the stream."""
        try:
            return bool(self.poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def whole(self, stream):
        """The answer in one piece, once the server's Streamer has read all its tokens."""
        if not self.server.streamer.run(stream):
            raise ClientGone()
        if stream.failed is not None:  # nothing checked before should get here
            return self.fail(HTTPError(500, f"generation failed: {stream.failed}"))
        try:
            self.send_json(200, stream.answer.whole(stream.text, stream.finish, stream.entries,
                                                    stream.transcript.count))
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
            self.end_headers()
        except OSError as e:
            raise ClientGone() from e
        if stream.answer.call.chat:
            self.write(event(stream.answer.chunk("", None, [], role="assistant")))
        if not self.server.streamer.run(stream):
            raise ClientGone()


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/models, "
                    "/v1/chat/completions, /v1/completions, /health). The sampling flags set the "
                    "defaults of requests that leave them out.", formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    p.add_argument("--api-key", help=f"require the header 'Authorization: Bearer API_KEY' (default: the "
                                     f"{API_KEY_VARIABLE} environment variable, which ps does not show; "
                                     "unset: no key)")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let web pages of ORIGIN (e.g. http://localhost:3000; * for any) call the server; "
                        "repeatable (unset: requests from web pages are refused)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait while the worker is busy; beyond, 503 with Retry-After")
    p.add_argument("--max-body", type=int, default=MAX_BODY, help="request body bytes at most (beyond: 413)")
    p.add_argument("--max-concurrent", type=int, default=MAX_CONCURRENT,
                   help="requests decoded together, in one batch; 1: one at a time on the compiled "
                        "one-request path (no prompt cache)")
    p.add_argument("--prompt-cache-size", type=float, default=PROMPT_CACHE_MB, metavar="MB",
                   help="memory for the KV states of earlier prompts and replies, so that a shared "
                        "prefix (a system prompt, a conversation's earlier turns) is not computed "
                        "again; least recently used go first (0: off)")
    p.add_argument("--prefill-step-size", type=int, default=PREFILL_STEP,
                   help="prompt tokens prefilled per step of the batch, at most: a longer prompt goes in "
                        "chunks, between the running requests' tokens (smaller: shorter stalls for them, "
                        "later first tokens for newcomers)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a request (headers and body) may take to arrive, and a write to a client")
    add_model_args(p)
    add_sampling_args(p)
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    make_sampler_for(args.temp, args.top_p, args.top_k)  # checks the sampling flags
    if args.max_queue < 0 or args.max_body < 1 or not args.timeout > 0:
        raise UserError("--max-queue must be at least 0, --max-body at least 1 and --timeout above 0")
    if args.max_concurrent < 1 or not args.prompt_cache_size >= 0 or args.prefill_step_size < 1:
        raise UserError("--max-concurrent and --prefill-step-size must be at least 1 and --prompt-cache-size (MB) "
                        "at least 0")
    if world() is not None and args.max_concurrent != 1:  # the batched worker keeps no lockstep
        if leads():
            print("note: under mlx.launch the server generates one request at a time (--max-concurrent 1)",
                  file=sys.stderr)
        args.max_concurrent = 1
    if world() is None and args.max_concurrent > 1:  # the batch engine in a process of its own
        worker = EngineProcess(args, wants_warmup(args), args.max_concurrent, int(args.prompt_cache_size * 2**20),
                               args.prefill_step_size)
        model, tokenizer = None, worker.tokenizer
    else:
        worker = None
        model, tokenizer = load_from_args(args, warm=False)  # the worker thread warms up
    if not leads():  # under mlx.launch: rank 0 serves, this rank generates its requests with it
        # and ends when rank 0's worker closes (its last broadcast), not on Ctrl-C itself: an
        # interrupt taken between two collectives would leave rank 0 broadcasting to a rank gone
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return follow(model, tokenizer, warm=wants_warmup(args))
    model_id = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    try:
        server = Server(model, tokenizer, model_id, args.host, args.port, args.max_tokens, args.temp,
                        args.top_p, args.top_k, warm=wants_warmup(args),
                        api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
                        cors_origins=args.cors_origin or (), max_queue=args.max_queue, max_body=args.max_body,
                        timeout=args.timeout, max_concurrent=args.max_concurrent, worker=worker)
    except OSError as e:
        if worker is not None:
            worker.close()
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    host, port = server.server_address[:2]
    # Ctrl-C stops the server even where the process started with SIGINT ignored (as a shell's
    # background job does), when Python installs no handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"serving {model_id} on http://{host}:{port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the close short:
        server.server_close()  # under mlx.launch it ends the other ranks


if __name__ == "__main__":
    run_cli(main)
