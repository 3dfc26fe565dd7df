"""Where a lone streamed chat request's time to first token (TTFT) goes through the server.

    PYTHONPATH=$PWD python bench/probes/ttft_path.py [--requests 60] [--warmup 5] [--prompt 128]
        [--max-tokens 2] [--ab REV] [--reuse]

It writes a tiny random Llama (tests/conftest.py's TINY_LLAMA: two small layers, its context
2048) with the embedded SmolLM2's tokenizer and chat template to a folder, starts our server on it
in a process of its own (this file in --serve mode: the server as `python -m mlx_flashnorm.server
--warmup` builds it, the engine in its own process, an EngineProcess; the front in that process
with hooks monkeypatched in), and sends it one streamed chat request at a time (a system message
and random words whose templated prompt has about --prompt tokens, distinct for each request, as
bench.latency's --serve; max_tokens --max-tokens, temperature 0) from a plain http.client, the
first --warmup of them untimed; with --reuse over one connection per server, as the openai client
keeps its connections (a server that closes them costs a new one a request).

Every hop is timestamped with time.monotonic_ns (CLOCK_MONOTONIC: one clock for every process of
the machine) by wrappers this file installs, none of them in the package: in the front process by
monkeypatching the server's classes; in the engine's process by launching this file as its entry
(--engine-child: the same patches on the engine's side, then engine_process.serve_engine), each
process writing its marks to a file as it exits. The hops: the client sends; the front accepts the
connection, reads the body, parses, templates and tokenizes it (Server.call), submits it, pickles
it onto the pipe; the engine process reads it off the pipe and unpickles it; the worker takes it
(BatchEngine.add), steps (the prefill, the slots, the decode step queued, its tokens read); the
tokens are pickled onto the pipe back; the front reads and unpickles them, its Streamer is woken
(notify), turns them into an event (Stream.advance) and writes it (Stream.flush); the client reads
its first content. Printed: per hop, the median and p90 of its time from the client's send, and
of its time since the hop before.

--ab REV: also a server of the package as at git revision REV (exported to a temporary folder),
the requests alternating between the two servers (each server's own warm-up first)."""
import argparse
import http.client
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
MARKS = []  # (hop, monotonic ns), in this process

# the hops in path order (those of the engine's process named engine:...)
HOPS = ["client send", "accept", "setup", "handler", "body read", "tokenized", "submit",
        "pipe send", "pipe sent", "engine:recv", "engine:unpickled", "engine:take", "engine:add",
        "engine:step", "engine:prefill", "engine:prefilled", "engine:placed", "engine:queued",
        "engine:read", "engine:deliver", "engine:send", "engine:sent", "front recv",
        "front unpickled", "notify", "advance", "advanced", "sse write", "client first content"]


def mark(hop):
    MARKS.append((hop, time.monotonic_ns()))


def dump(path):
    Path(path).write_text(json.dumps(MARKS))


class TracedConnection:
    """A multiprocessing Connection whose messages are marked: read (hop `got`), unpickled
    (`unpickled`, where the message is one of those `wanted` takes), sent (`send`, `sent`)."""

    def __init__(self, conn, got, unpickled, send, sent, wanted=lambda message: True):
        self.conn, self.hops, self.wanted = conn, (got, unpickled, send, sent), wanted

    def recv(self):
        got, unpickled = self.hops[:2]
        data = self.conn.recv_bytes()
        t = time.monotonic_ns()
        message = pickle.loads(data)
        if self.wanted(message):
            MARKS.append((got, t))
            mark(unpickled)
        return message

    def send(self, message):
        send, sent = self.hops[2:]
        if self.wanted(message):
            mark(send)
        self.conn.send(message)
        if self.wanted(message):
            mark(sent)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def wanted(message):
    """The messages marked: a request's ("add", ...), and the tokens that come back."""
    return message[0] == "add" if type(message[0]) is str else bool(message[0])


def wrap(cls, name, before=None, after=None, when=None):
    """Mark hop `before` as cls.name is called and `after` as it returns (when(args): only then)."""
    inner = getattr(cls, name)

    def traced(*args, **kwargs):
        on = when is None or when(*args)
        if before and on:
            mark(before)
        result = inner(*args, **kwargs)
        if after and on:
            mark(after)
        return result

    setattr(cls, name, traced)


def patch_engine():
    """The engine process's hops (its connection's are TracedConnection's)."""
    from mlx_flashnorm.serve import engine, engine_process

    wrap(engine.BatchEngine, "add", "engine:add")
    wrap(engine.BatchEngine, "step", "engine:step")
    wrap(engine.BatchEngine, "_prefill", "engine:prefill", "engine:prefilled")
    wrap(engine.BatchEngine, "_place", None, "engine:placed")
    wrap(engine.BatchEngine, "_read", "engine:queued", "engine:read")
    wrap(engine_process.PipedWorker, "deliver", "engine:deliver")
    wrap(engine_process.PipedWorker, "request", "engine:take")


def engine_child(fd, out):
    from multiprocessing.connection import Connection

    from mlx_flashnorm.serve import engine_process

    patch_engine()
    conn = TracedConnection(Connection(fd), "engine:recv", "engine:unpickled", "engine:send",
                            "engine:sent", wanted)
    try:
        engine_process.serve_engine(conn)
    finally:
        dump(out)


def patch_front(engine_out):
    """The front's hops, and the engine process launched as this file's --engine-child."""
    from mlx_flashnorm.serve import engine_process, http as front, streaming

    wrap(front.Server, "process_request", "accept")
    wrap(front.Handler, "setup", "setup")
    wrap(front.Handler, "do_POST", "handler")
    wrap(front.Handler, "read_body", None, "body read")
    wrap(front.Server, "call", None, "tokenized")
    wrap(front.Server, "admit", "submit")
    wrap(streaming.Streamer, "notify", "notify")
    wrap(streaming.Stream, "advance", "advance", "advanced")
    wrap(streaming.Stream, "flush", "sse write", when=lambda s, *a: bool(s.out))
    popen = engine_process.subprocess.Popen

    def child(argv, **kwargs):
        env = dict(os.environ, TTFT_ENGINE_OUT=engine_out)
        return popen([argv[0], str(HERE), "--engine-child", argv[-1]], env=env, **kwargs)

    engine_process.subprocess = types.SimpleNamespace(
        **{k: getattr(subprocess, k) for k in ("DEVNULL", "TimeoutExpired")}, Popen=child)
    start = engine_process.EngineProcess._start

    def traced_start(self):
        reply = start(self)
        self.conn = TracedConnection(self.conn, "front recv", "front unpickled", "pipe send",
                                     "pipe sent", wanted)
        return reply

    engine_process.EngineProcess._start = traced_start


def serve(folder, out):
    """--serve: the server on a free port (printed), until stdin ends; then the marks to out."""
    patch_front(out + ".engine")
    from mlx_flashnorm import server as cli
    from mlx_flashnorm.serve.engine_process import EngineProcess

    args = cli.arg_parser().parse_args(["--model", folder, "--port", "0", "--warmup"])
    warm = True
    worker = EngineProcess(args, warm, args.max_concurrent, int(args.prompt_cache_size * 2**20),
                           args.prefill_step_size, args.engine_restarts, args.kv_budget)
    server = cli.Server(None, worker.tokenizer, "tiny", "127.0.0.1", 0, args.max_tokens,
                        args.temp, args.top_p, args.top_k, warm=warm, max_queue=args.max_queue,
                        timeout=args.timeout, worker=worker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.server_address[1], flush=True)
    sys.stdin.read()
    server.shutdown()
    server.server_close()
    dump(out)


def tiny_folder(work):
    """The tiny random Llama with SmolLM2's tokenizer, written to work (once)."""
    folder = Path(work) / "tiny-llama-2048"
    if (folder / "config.json").is_file():
        return folder
    from mlx_flashnorm import load
    from mlx_flashnorm.bench.decode import random_checkpoint

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import TINY_LLAMA

    _, tokenizer = load(norm="rms", progress=False)
    random_checkpoint(folder, dict(TINY_LLAMA, max_position_embeddings=2048))
    tokenizer._tokenizer.save_pretrained(str(folder))
    return folder


def request(port, messages, max_tokens, kept=None):
    """One streamed chat request: (sent, first content) in monotonic ns. kept: {port: connection}
    to reuse one connection per server (http.client opens another where the server closed it),
    as the openai client does; None: a new connection each."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True})
    conn = (http.client.HTTPConnection("127.0.0.1", port, timeout=120) if kept is None
            else kept.setdefault(port, http.client.HTTPConnection("127.0.0.1", port, timeout=120)))
    sent = time.monotonic_ns()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    first = None
    for line in response:
        if line.startswith(b"data: ") and first is None and line[6:].strip() != b"[DONE]":
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content") or choice.get("finish_reason"):
                first = time.monotonic_ns()
    if kept is None:
        conn.close()
    return sent, first


# hops that also come before the request's tokens do (a Stream's first advance finds none):
# taken after the front receives them
LATE = {"advance", "advanced", "sse write"}


def per_request(marks, windows):
    """Each window's (sent, first content) hops: {hop: ns after sent}, each hop's first in it."""
    rows = []
    for sent, first in windows:
        row = {"client send": 0, "client first content": first - sent}
        for hop, t in marks:
            if (sent <= t <= first and hop not in row
                    and (hop not in LATE or t >= sent + row.get("front unpickled", first))):
                row[hop] = t - sent
        rows.append(row)
    return rows


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def table(results):
    """The hops' medians and p90s (ms), per variant."""
    names = list(results)
    head = "| hop | " + " | ".join(f"{n}: at (med / p90) | {n}: since last (med)" for n in names)
    lines = [head + " |", "| --- |" + " ---: | ---: |" * len(names)]
    for hop in HOPS:
        cells = []
        for n in names:
            rows = [r for r in results[n] if hop in r]
            if not rows:
                cells += ["-", "-"]
                continue
            at = [r[hop] / 1e6 for r in rows]
            gaps = []
            for r in rows:
                before = [r[h] for h in HOPS[:HOPS.index(hop)] if h in r]
                gaps.append((r[hop] - max(before)) / 1e6 if before else 0.0)
            cells += [f"{statistics.median(at):.2f} / {pct(at, 90):.2f}",
                      f"{statistics.median(gaps):.2f}"]
        lines.append(f"| {hop} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=60, help="timed requests per server")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests per server first")
    p.add_argument("--prompt", type=int, default=128, help="templated prompt tokens")
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--ab", metavar="REV", help="also the package as at git revision REV")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "ttft_path"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true",
                   help="one connection per server, kept where it keeps it (keep-alive)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from mlx_flashnorm.bench.latency import chat_prompt
    from mlx_flashnorm.loader import load_tokenizer

    work = Path(args.work)
    folder = tiny_folder(work)
    tokenizer, rng = load_tokenizer(folder), random.Random(args.seed)
    trees = {"now": ROOT}
    if args.ab:
        old = Path(tempfile.mkdtemp(prefix="ttft_ab_"))
        archive = subprocess.run(["git", "archive", args.ab, "mlx_flashnorm"], cwd=ROOT,
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        trees = {args.ab: old, "now": ROOT}
    servers = {}
    for name, tree in trees.items():
        out = str(work / f"marks-{name}.json")
        process = subprocess.Popen([sys.executable, str(HERE), "--serve", str(folder), out],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env=dict(os.environ, PYTHONPATH=str(tree)))
        servers[name] = (process, int(process.stdout.readline()), out)
    windows = {name: [] for name in servers}
    kept = {} if args.reuse else None
    try:
        for name, (_, port, _) in servers.items():
            for _ in range(args.warmup):
                request(port, chat_prompt(tokenizer, args.prompt, rng)[0], args.max_tokens, kept)
        count = []
        for i in range(args.requests):
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for name in order:
                messages, n = chat_prompt(tokenizer, args.prompt, rng)
                count.append(n)
                windows[name].append(request(servers[name][1], messages, args.max_tokens, kept))
    finally:
        for process, _, _ in servers.values():
            process.stdin.close()
            process.wait(timeout=60)
    results = {}
    for name, (_, _, out) in servers.items():
        marks = json.loads(Path(out).read_text()) + json.loads(Path(out + ".engine").read_text())
        marks.sort(key=lambda m: m[1])
        results[name] = per_request(marks, windows[name])
    print(f"{args.requests} requests per server, one at a time after {args.warmup} untimed; "
          f"prompt {statistics.median(count)} tokens (median), max_tokens {args.max_tokens}; "
          "ms from the client's send")
    print(table(results))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine-child"]:
        engine_child(int(sys.argv[2]), os.environ["TTFT_ENGINE_OUT"])
    elif sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3])
    else:
        main()
