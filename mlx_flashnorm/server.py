"""The OpenAI-compatible server command: `python -m mlx_flashnorm.server`.

The flags and the wiring: the model loaded, the worker chosen and the HTTP transport (serve/http.py)
started over it. The worker decodes requests together (serve/batch_worker: continuous batching,
with a prompt cache of --prompt-cache-size MB, in a process of its own: serve/engine_process), as
many as the KV cache's budget (--kv-budget) holds, at most --max-concurrent; --max-concurrent 1
serves one request at a time on the compiled one-request path (serve/serial.SerialWorker: our fused
kernels where they run, no prompt cache).

Under `mlx.launch -n N` the model is split over the N processes (shard.py): every rank runs the
batch engine (serve/lockstep_worker: rank 0 serves and plans each step, the other ranks, which
listen on no port, take the same steps); a rank that stops answering ends the server with an error
(--rank-timeout).

As a service: SIGTERM or SIGINT drains the server (Server.drain, within --drain-timeout) and it
exits 0; an engine process that dies is started again (--engine-restarts; past them the server
exits 1); --request-timeout bounds a request's time. The port is checked before the model
loads."""
import argparse
import ipaddress
import os
import signal
import socket
import sys
import time
from pathlib import Path

from .cli import HelpFormatter, add_model_args, add_sampling_args
from .decoding import load_from_args, make_sampler_for, wants_warmup
from .errors import UserError, run_cli
from .lockstep import abandon, leads
from .serve import http
from .serve.batch_worker import KV_BUDGET, MAX_ROWS, BatchWorker
from .serve.engine_process import RESTARTS, EngineProcess
from .serve.lockstep_worker import RANK_TIMEOUT, STEP_TIMEOUTS, LockstepWorker
from .serve.openai_api import HTTPError
from .serve.serial import SerialWorker
from .shard import world

API_KEY_VARIABLE = "MLX_FLASHNORM_API_KEY"
PROMPT_CACHE_MB = 512  # the prompt cache's bound
PREFILL_STEP = 2048  # prompt tokens prefilled per engine step, at most (mlx-lm's prefill step)
# seconds the requests in flight may take to finish once the server is told to stop: within the
# 10 s Docker gives a container between SIGTERM and SIGKILL
DRAIN_TIMEOUT = 8.0


class Stop(Exception):
    """Raised in Server.serve_forever's loop to end it; fatal: the worker is gone for good."""

    def __init__(self, reason, fatal=False):
        super().__init__(reason)
        self.fatal = fatal


class Server(http.Server):
    """The HTTP server over the worker that max_concurrent says, running model: 1, one request at a
    time (SerialWorker); else a BatchWorker of at most that many rows (None: as many as kv_budget
    holds, at most MAX_ROWS) with a prompt cache of prompt_cache_bytes and a KV cache within
    kv_budget (BatchWorker's). worker: a worker to serve instead (model is then unused). warm: warm
    the model up on the worker thread before serving. The rest as http.Server's."""

    def __init__(self, model, tokenizer, model_id, host="127.0.0.1", port=8080, max_tokens=256,
                 temp=0.0, top_p=1.0, top_k=0, warm=False, *, max_concurrent=None,
                 prompt_cache_bytes=PROMPT_CACHE_MB * 2**20, prefill_step=PREFILL_STEP, worker=None,
                 kv_budget=None, **limits):
        worker = worker or (SerialWorker(model, tokenizer, warm) if max_concurrent == 1 else
                            BatchWorker(model, tokenizer, warm, max_concurrent, prompt_cache_bytes,
                                        prefill_step, kv_budget=kv_budget))
        super().__init__(worker, tokenizer, model_id, host, port, max_tokens, temp, top_p, top_k,
                         **limits)
        self.stopped = None  # why serve_forever returned (a Stop)
        # set by the command's signal handler: the name of the signal that stops the server; a
        # second signal's cutting the drain short
        self.signalled, self.hurried = None, False

    def serve_forever(self, poll_interval=0.5):
        """As socketserver's, and returns once the worker is gone for good (its `fatal`: an
        EngineProcess whose restarts are spent) or self.signalled is set, self.stopped saying
        why."""
        try:
            super().serve_forever(poll_interval)
        except Stop as e:
            self.stopped = e

    def service_actions(self):
        """(in serve_forever's loop, at every poll_interval or request)"""
        if (fatal := getattr(self.worker, "fatal", None)) is not None:
            raise Stop(fatal, fatal=True)
        if self.signalled is not None:
            raise Stop(self.signalled)

    def drain(self, seconds):
        """After serve_forever: take no more connections (refused) or requests (503); answer the
        requests taken that have had no token yet 503 (a stream: its error event, then [DONE]);
        let the others finish for up to `seconds`, or until self.hurried is set, then end them
        alike. Returns once every request taken is answered (or a write to its client timed out).
        """
        self.draining = True
        self.socket.close()
        self.streamer.drain(HTTPError(503, "the server is shutting down: retry later",
                                      headers={"Retry-After": str(http.RETRY_AFTER)}))
        end = time.monotonic() + seconds
        while self.active and time.monotonic() < end and not self.hurried:
            time.sleep(0.05)
        self.streamer.stop(HTTPError(503, "the server is shutting down: the answer was cut "
                                          f"short after --drain-timeout {seconds:g} s"))
        end = time.monotonic() + self.io_timeout  # (the last writes)
        while self.active and time.monotonic() < end:
            time.sleep(0.05)


def check_listen(host, port):
    """A one-line UserError unless the server could listen on host:port (bound as http.Server
    binds, then let go): checked before the model loads."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be 0 to 65535, not {port}")
    try:
        with socket.socket(http.Server.address_family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, http.Server.allow_reuse_address)
            s.bind((host, port))
    except OSError as e:  # (socket.gaierror: a host that does not resolve)
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}")


def loopback(host):
    """Whether every address host names is this machine's loopback (0.0.0.0: every interface is
    not)."""
    try:
        addresses = {a[4][0] for a in socket.getaddrinfo(host, None, http.Server.address_family)}
        return all(ipaddress.ip_address(a).is_loopback for a in addresses)
    except (OSError, ValueError):
        return False


UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def kv_budget(text):
    """--kv-budget's value: bytes (an int; a suffix K, M, G or T multiplies by 2**10, 2**20...),
    or a fraction of the device's memory (a float above 0, at most 1); a UserError for anything
    else."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        size = (int(float(t[:-1]) * UNITS[t[-1]]) if t[-1:] in UNITS
                else float(t) if "." in t else int(t))
    except ValueError:
        size = 0
    if not (0 < size <= 1 if isinstance(size, float) else size > 1):
        raise UserError(f"--kv-budget must be bytes (8G, 512M, 1073741824) or a fraction of the "
                        f"device's memory (0.25), not '{text}'")
    return size


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/models, "
                    "/v1/chat/completions, /v1/completions, /health), llama-server's /tokenize, "
                    "/detokenize, /apply-template and /metrics, and a chat page at /. The sampling "
                    "flags set the defaults of requests that leave them out.",
        formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080,
                   help="port (0: any free one); checked before the model loads")
    p.add_argument("--api-key", help="require the header 'Authorization: Bearer API_KEY' "
                                     f"(default: the {API_KEY_VARIABLE} environment variable, "
                                     "which ps does not show; unset: no key)")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="serve GET /metrics: Prometheus's text format, llama-server's metric "
                        "names where it has the metric (llamacpp:prompt_tokens_total, ...), "
                        "mlx_flashnorm: ones where it has none; it needs the API key where one is "
                        "set, as llama-server's does. On by default (it shows counts and the "
                        "batch's state, no request's content); llama-server's is off unless "
                        "--metrics")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let web pages of ORIGIN (e.g. http://localhost:3000; * for any) call the "
                        "server; repeatable (unset: requests from web pages are refused)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a host name clients may reach the server by (their requests' Host "
                        "header); a name other than these, localhost and --host's gets 421 (an "
                        "address passes), against DNS rebinding by web pages; repeatable; * for "
                        "any")
    p.add_argument("--parse-special", action="store_true",
                   help="read special tokens' text in chat messages (<|im_end|> in a user's "
                        "message) as the tokens, as before, so that a client can write turns of "
                        "its own (default: as text; only the chat template writes them)")
    p.add_argument("--max-queue", type=int,
                   help="requests that may wait while the worker is busy, at most; beyond, 503 "
                        "with Retry-After (default: as many as --kv-budget holds, each its prompt "
                        f"and max_tokens; with --max-concurrent 1, {http.MAX_QUEUE})")
    p.add_argument("--max-body", type=int, default=http.MAX_BODY,
                   help="request body bytes at most (beyond: 413)")
    p.add_argument("--max-concurrent", type=int,
                   help="requests decoded together, in one batch, at most (default: as many as "
                        f"--kv-budget holds, at most {MAX_ROWS}); 1: one at a time on the compiled "
                        "one-request path (no prompt cache)")
    p.add_argument("--kv-budget", metavar="SIZE",
                   help="memory for the batch's KV cache, like llama-server's context size: bytes "
                        "(suffix K, M, G or T: 8G) or a fraction of the device's memory (0.5); "
                        "requests wait while the batch with them would not fit, and the server "
                        "takes requests while their prompts and max_tokens fit it, past that 503 "
                        f"(default: {KV_BUDGET:g} of the device's memory, at least one request at "
                        "the model's whole context)")
    p.add_argument("--prompt-cache-size", type=float, default=PROMPT_CACHE_MB, metavar="MB",
                   help="memory for the KV states of earlier prompts and replies, so that a shared "
                        "prefix (a system prompt, a conversation's earlier turns) is not computed "
                        "again; least recently used go first (0: off)")
    p.add_argument("--prefill-step-size", type=int, default=PREFILL_STEP,
                   help="prompt tokens prefilled per step of the batch, at most: a longer prompt "
                        "goes in chunks, between the running requests' tokens (smaller: shorter "
                        "stalls for them, later first tokens for newcomers)")
    p.add_argument("--engine-restarts", type=int, default=RESTARTS, metavar="N",
                   help="times the engine process is started again after it dies (the requests "
                        "in flight fail; /health answers 503 until it is back); at the next death "
                        "the server exits with status 1, for a service manager to restart it")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM or SIGINT (Ctrl-C) the server takes no more requests, answers "
                        "those not begun 503 and gives the others this long to finish, then ends "
                        "them with an error (a stream: an error event, then [DONE]) and exits 0; "
                        "a second signal ends them at once")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a request (headers and body) may take to arrive, a kept "
                        "connection may idle between requests, and a write to a client may take")
    p.add_argument("--request-timeout", type=float, metavar="SECONDS",
                   help="seconds a request may run once taken, waiting and generating; beyond, it "
                        "is stopped and answered 504 (streamed: an error event, then [DONE]) "
                        "(unset: no limit)")
    p.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT, metavar="SECONDS",
                   help="under mlx.launch: seconds a rank waits for the others between two steps "
                        f"(where they meet within milliseconds), or {STEP_TIMEOUTS} times as long "
                        "within a step (a long prompt's chunk, a first compile), before it takes "
                        "one for gone: the server then exits with an error")
    add_model_args(p)
    add_sampling_args(p)
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    make_sampler_for(args.temp, args.top_p, args.top_k)  # checks the sampling flags
    if (args.max_queue or 0) < 0 or args.max_body < 1 or not args.timeout > 0:
        raise UserError("--max-queue must be at least 0, --max-body at least 1 and --timeout "
                        "above 0")
    if args.request_timeout is not None and not 0 < args.request_timeout < float("inf"):
        raise UserError(f"--request-timeout must be a number of seconds above 0, not "
                        f"{args.request_timeout:g}")
    if not 0 < args.rank_timeout < float("inf"):
        raise UserError(f"--rank-timeout must be a number of seconds above 0, not "
                        f"{args.rank_timeout:g}")
    if args.engine_restarts < 0 or not 0 <= args.drain_timeout < float("inf"):
        raise UserError("--engine-restarts and --drain-timeout must be at least 0")
    if ((args.max_concurrent is not None and args.max_concurrent < 1)
            or not args.prompt_cache_size >= 0 or args.prefill_step_size < 1):
        raise UserError("--max-concurrent and --prefill-step-size must be at least 1 and "
                        "--prompt-cache-size (MB) at least 0")
    if args.kv_budget is not None:
        args.kv_budget = kv_budget(args.kv_budget)
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    if leads():
        check_listen(args.host, args.port)
        if api_key is None and not loopback(args.host):
            print(f"warning: listening on {args.host}, beyond this machine, with no API key: "
                  f"anyone who reaches it can use the server (set --api-key or "
                  f"{API_KEY_VARIABLE})", file=sys.stderr, flush=True)
    batch = (wants_warmup(args), args.max_concurrent, int(args.prompt_cache_size * 2**20),
             args.prefill_step_size)
    if world() is not None:  # every rank steps the batch engine, in lockstep (the ranks are the
        # processes: no engine process of its own), within rank 0's KV budget
        model, tokenizer = load_from_args(args, warm=False)  # the worker thread warms up
        lockstep = (*batch, args.rank_timeout, args.kv_budget)
        if not leads():  # rank 0 serves, this rank takes its steps, until rank 0's worker closes
            # (its last plan), not on Ctrl-C itself: an interrupt taken between two collectives
            # would leave rank 0 waiting on a rank gone
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if (fatal := LockstepWorker(model, tokenizer, *lockstep).wait()):
                abandon(f"error: rank {world().rank()}: {fatal}")
            return
        worker = LockstepWorker(model, tokenizer, *lockstep)
    elif args.max_concurrent != 1:  # the batch engine in a process of its own
        worker = EngineProcess(args, *batch, args.engine_restarts, args.kv_budget)
        model, tokenizer = None, worker.tokenizer
    else:
        worker = None
        model, tokenizer = load_from_args(args, warm=False)  # the worker thread warms up
    model_id = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    try:
        server = Server(model, tokenizer, model_id, args.host, args.port, args.max_tokens,
                        args.temp, args.top_p, args.top_k, warm=wants_warmup(args),
                        api_key=api_key,
                        cors_origins=args.cors_origin or (), max_queue=args.max_queue,
                        allowed_hosts=args.allowed_host or (), parse_special=args.parse_special,
                        max_body=args.max_body, timeout=args.timeout,
                        request_timeout=args.request_timeout, metrics=args.metrics,
                        max_concurrent=args.max_concurrent, worker=worker)
    except OSError as e:  # (the server closed the worker)
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    host, port = server.server_address[:2]

    def stop(signum, frame):  # the first signal drains, a second cuts the drain short
        if server.signalled is None:
            server.signalled = signal.Signals(signum).name
        else:
            server.hurried = True

    # SIGTERM (systemd's, Docker's) and Ctrl-C drain the server, even where the process started
    # with SIGINT ignored (as a shell's background job does)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"serving {model_id} on http://{host}:{port}/v1", flush=True)
    print(f"the chat page: http://{host}:{port}/", flush=True)
    try:
        server.serve_forever()
        if server.stopped is not None and not server.stopped.fatal:  # a signal
            print(f"{server.signalled}: stopping, {server.active} requests in flight (at most "
                  f"{args.drain_timeout:g} s, --drain-timeout)", file=sys.stderr, flush=True)
            server.drain(args.drain_timeout)
    finally:
        # a second Ctrl-C must not cut the close short: under mlx.launch it ends the other ranks
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.server_close()
    # (the worker may have failed while a signal drained the server)
    if (fatal := getattr(server.worker, "fatal", None)) is not None:
        if world() is not None:
            abandon(f"error: rank 0: {fatal}: the server stops")
        sys.exit(f"error: {fatal} (--engine-restarts {args.engine_restarts}): the server stops")


if __name__ == "__main__":
    run_cli(main)
    # the process ends here, its output flushed, without running C++'s exit handlers: MLX's
    # threads of the model's worker, still alive, abort a normal exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
