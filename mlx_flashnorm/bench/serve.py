"""`python -m mlx_flashnorm.bench.serve`: the server under load (issues 30, 62, 63).

Starts our server (python -m mlx_flashnorm.server) and, for the peer rows, mlx_lm.server on the
same weights and (--llama-server) llama.cpp's llama-server on the GGUF file they were written from,
each in a process of its own on a free port of 127.0.0.1, and drives N concurrent streaming chat
clients against each at every N of --clients. Each client sends --rounds requests
one after another (distinct prompts, max_tokens each, greedy unless --temperature), so requests
join and leave a running batch. Reported per server and N: aggregate tokens/s (completion tokens
of all requests / wall time from the first request sent to the last answer's end), time to first
token (TTFT) and time per output token after the first (TPOT: a stream's last content time less
its first, over its tokens less one; a server may send several tokens in one chunk) at p50 and
p99 over the requests, as a markdown table; the rows in JSON also hold each \
server process's CPU seconds
(ours: the HTTP front alone, its engine in a child process; mlx_lm.server: everything).

Without --model the embedded SmolLM2 GGUF is written once as an MLX folder (its quantized weights
as loaded, mlx-lm's layout, convert.export) under --work, which our server and mlx_lm.server then
load; mlx-lm cannot read a GGUF's Q4_1 blocks itself. llama-server runs the GGUF itself
(loader.default_model_path), with -np slots (--llama-np: the largest N of --clients plus --burst's
M, at most LLAMA_NP_MAX), flash attention and every layer on the GPU, and a context of room for
each slot's prompt and max_tokens.

--constrained FRACTIONS plays each N once per fraction: that fraction of the clients (the first
ones) ask for a JSON schema's answer (response_format json_schema: an object with required fields,
an enum and an array, SCHEMA), the rest for free text; mlx_lm.server takes no response_format, so
its constrained rows are skipped and the table says so. With --out, a chart (.png beside it) of the
aggregate tok/s and TTFT p99 at each N, a line per server and fraction.

--burst M adds, at each N, a wave of arrivals to the served rows (not the engine alone's): once
every client's first request streams (has load.BURST_AFTER content chunks, or has ended; or after
load.BURST_WAIT s), M more clients send one free request each at once. The row's columns stay the
steady clients' requests' (wall time to the last of their answers); a second table, and keys
burst_* in the JSON rows, give the newcomers' TTFT p50 and p99 and how much the running streams
stalled while the newcomers were prefilled: the steady streams' TPOT (each gap between content
chunks, per token) at p50 and p99 within the window from the first newcomer's request sent to the
last newcomer's first content (a gap that overlaps it), beside the same outside it.

--engine adds a row for our engine alone: the same (free-text) requests, as our server would
tokenize them, fed to a engine.BatchEngine configured as the server's in this process, each
client's next request added when its last one ends (no HTTP, no threads; after an untimed
request, as each server gets one): what the server's front costs is the difference. Below the
table, each engine row's steps: the steady step (the median of those holding the most rows), the
seconds spent in such steps within 1.5x of it, and when the first of them ended: the rest of the
wall time went to arrivals, turns between rounds and the last rows.

--repeats R plays the --clients list R times over in each server process (1,32,1,32,... for
--clients 1,32): a timed round at many clients is short on the GPU, and whole stretches of a
process there ran slower than others (bench/RESULTS.md, "Serving"), so a ratio is read from rows
played side by side, several times over. Below the table, each server's and N's median aggregate
tok/s over the repeats and its ratio to the same repeat's first one-client row (the median of
those paired ratios, and their range).

--warm plays, before each N's timed requests, an untimed round of one request a client at that N
(prompts of their own, so the timed ones find only what the chat template shares in the prompt
cache), on every server (not the engine alone): a process's first batch of N rows is slower than
later ones (bench/RESULTS.md, "Serving"), a cost a server pays once, which without --warm the
first run at each N includes."""
import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from ..cli import add_model_args
from ..convert import export
from ..errors import HelpFormatter, UserError, run_cli
from ..loader import default_model_path, load
from .decode import device_name, write_atomic
from .load import (BURST_AFTER, BURST_WAIT, SCHEMA, Stream, load_round, percentile, prompt_of,
                   stream_chat, summary)

LLAMA = "llama-server"
LLAMA_NP_MAX = 256  # llama-server's slots (-np) by default at most
PROMPT_ROOM = 256  # llama-server's context per slot: room for a prompt, besides its max_tokens
SKIPPED = "mlx_lm.server takes no response_format"


def cpu_seconds(pid):
    """The CPU seconds process pid has used (Linux /proc; NaN elsewhere)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlx_folder(work):
    """The embedded model as an MLX folder under work (written once, atomically by export)."""
    out = Path(work) / "smollm2-135m-instruct-mlx"
    if not out.exists():
        Path(work).mkdir(parents=True, exist_ok=True)
        model, tokenizer = load(None, norm="rms", concat=False, progress=False)
        export(model, tokenizer, out)
    return out


def server_command(kind, model, port, extra):
    if kind == "ours":
        return [sys.executable, "-m", "mlx_flashnorm.server", "--model", str(model),
                "--port", str(port), *extra]
    return [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)]


def llama_server_command(binary, gguf, port, slots, max_tokens):
    """llama-server on gguf: `slots` parallel slots (-np), flash attention, every layer on the GPU,
    a context (-c) with room for each slot's prompt and max_tokens."""
    return [str(binary), "-m", str(gguf), "--port", str(port), "-np", str(slots), "-fa", "on",
            "-ngl", "99", "-c", str(slots * (max_tokens + PROMPT_ROOM))]


def check_llama_server(binary, model):
    """--llama-server's binary, found (a path or a name on PATH), checked before anything runs: it
    runs the embedded GGUF, so --model must be unset."""
    if model is not None:
        raise UserError("--llama-server runs llama.cpp on the embedded SmolLM2 GGUF, from which "
                        "the other servers' MLX folder is written: leave --model unset")
    found = shutil.which(binary)
    if found is None:
        raise UserError(f"{binary}: no such executable; --llama-server takes the path of "
                        "llama.cpp's llama-server")
    return found


def start(kind, command, log):
    """A server process of `kind` (its command line for a port: command(port)) on a free port, once
    it answers (llama-server /health, which is 503 while it loads; the others /v1/models)."""
    port = free_port()
    process = subprocess.Popen(command(port), stdout=subprocess.DEVNULL, stderr=log, text=True)
    probe = "/health" if kind == LLAMA else "/v1/models"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"the {kind} server exited with status {process.returncode}; "
                            f"see {log.name}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", probe)
            if conn.getresponse().status == 200:
                return process, port
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise UserError(f"the {kind} server did not answer within 600 s; see {log.name}")


def plan(kind, counts, fractions, repeats):
    """The rounds a server plays, in order: (repeat, N, constrained fraction, why it is skipped
    (None: it is played))."""
    return [(k, n, f, SKIPPED if kind == "mlx-lm" and f else None)
            for k in range(repeats) for n in counts for f in fractions]


def engine_round(model, tokenizer, clients, rounds, max_tokens, tag, temperature=0.0):
    """load_round's requests fed to a BatchEngine as the server's (its rows and KV budget by
    default, batch_worker.kv_limits, its prompt cache and prefill step), warmed up; timed from the
    first request added. A token's time is that of the engine step that read it."""
    from ..decoding import context_length
    from ..serve.batch_worker import kv_limits, warmup
    from ..serve.engine import FEED_WAIT, BatchEngine
    from ..serve.openai_api import parse_call
    from ..serve.prompt_cache import PromptCache
    from ..serve.sequence import Request
    from ..server import PREFILL_STEP, PROMPT_CACHE_MB

    rows, budget, _ = kv_limits(model)
    engine = BatchEngine(model, rows, PREFILL_STEP, PromptCache(PROMPT_CACHE_MB * 2**20),
                         feed_wait=FEED_WAIT, kv_budget=budget)
    warmup(engine)
    stops = frozenset(tokenizer.eos_token_ids)
    defaults = dict(max_tokens=max_tokens, temp=0.0, top_p=1.0, top_k=0)
    sent, times, done = {}, {}, [0] * clients

    def add(i):
        body = {"messages": [{"role": "user", "content": prompt_of(i, done[i], tag)}],
                "max_tokens": max_tokens, "temperature": temperature}
        call = parse_call(body, True, tokenizer, context_length(model), model.args.vocab_size,
                          defaults)
        g = call.generation
        r = Request(g.tokens, max_tokens, g.temp, g.top_p, g.top_k, g.min_p, g.seed, stops)
        sent[id(r)], times[id(r)], r.client = time.perf_counter(), [], i
        engine.add(r)

    t0 = time.perf_counter()
    for i in range(clients):
        add(i)
    streams, steps = [], []
    while engine.busy:
        began = time.perf_counter()
        events = engine.step()
        now = time.perf_counter()
        steps.append((began - t0, now - began, len(engine.rows)))
        for e in events:
            r = e.request
            times[id(r)].append(now)
            if e.finish_reason:
                streams.append(Stream(sent[id(r)], times[id(r)], len(times[id(r)])))
                done[r.client] += 1
                if done[r.client] < rounds:
                    add(r.client)
    return dict(summary(clients, streams, [], time.perf_counter() - t0), **step_profile(steps))


def engine_counters(port):
    """(decode steps, seconds of the constrained rows' masks) so far, from our server's /metrics
    (mlx_flashnorm:decode_steps_total, mlx_flashnorm:grammar_mask_seconds_total); None where it
    has none (--no-metrics in --server-args)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                  if line and not line.startswith("#"))
    names = ("mlx_flashnorm:decode_steps_total", "mlx_flashnorm:grammar_mask_seconds_total")
    if response.status != 200 or not all(n in values for n in names):
        return None
    return tuple(float(values[n]) for n in names)


def step_profile(steps):
    """An engine's steps [(start s, seconds, rows after it)]: their count, the steady step (the
    median of those holding the most rows), the seconds spent in such steps within 1.5x of it, and
    when the first of them ended (every client's row decoding from there)."""
    most = max(rows for _, _, rows in steps)
    full = [(t, dt) for t, dt, rows in steps if rows == most]
    steady = percentile([dt for _, dt in full], 50)
    return {"steps": len(steps), "steady_step_s": steady,
            "steady_s": sum(dt for _, dt in full if dt <= 1.5 * steady),
            "first_full_s": sum(full[0])}


def paired(rows):
    """Lines saying, for each server, N and constrained fraction with more than one row (the rows
    of --repeats), the median aggregate tok/s and the median (and range) of its ratio to the same
    repeat's first one-client row (unconstrained)."""
    # (server, N, fraction) -> its rows; (server, repeat) -> its first single's tok/s
    lines, groups, singles = [], {}, {}
    for r in rows:
        if "repeat" in r and "skipped" not in r:
            f = r.get("constrained", 0)
            groups.setdefault((r["server"], r["clients"], f), []).append(r)
            if r["clients"] == 1 and not f:
                singles.setdefault((r["server"], r["repeat"]), r["tok_s"])
    for (server, n, f), group in groups.items():
        if len(group) < 2:
            continue
        median = percentile([r["tok_s"] for r in group], 50)
        line = (f"{server}, {n} clients" + (f", {f:g} constrained" if f else "")
                + f" ({len(group)} rows): median {median:,.0f} tok/s")
        ratios = [r["tok_s"] / singles[server, r["repeat"]] for r in group
                  if (server, r["repeat"]) in singles]
        if n > 1 and ratios:
            line += (f", {percentile(ratios, 50):.1f}x the same repeat's first single stream "
                     f"(paired, median; {min(ratios):.1f}-{max(ratios):.1f}x)")
        lines.append(line)
    return lines


def table(rows):
    """The rows as a markdown table; columns for the constrained fraction where a row has one,
    for the free rows' TPOT p50 / p99 in a mixed batch, and for the host time of the constrained
    rows' masks a decode step (ours: engine_counters)."""
    fractions = any(r.get("constrained") for r in rows)
    lines = ["| server | clients | requests | tokens | aggregate tok/s | TTFT p50 (s) "
             "| TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) |"
             + (" constrained | free rows' TPOT p50 / p99 (ms) | masks a step (ms) |"
                * fractions),
             "| --- |" + " ---: |" * (8 + 3 * fractions)]
    for r in rows:
        free = (f" {1e3 * r['free_tpot_p50']:.1f} / {1e3 * r['free_tpot_p99']:.1f} |"
                if "free_tpot_p50" in r else " |")
        masks = f" {r['mask_ms_per_step']:.2f} |" if "mask_ms_per_step" in r else " |"
        end = (f" {r.get('constrained', 0):g} |" + free + masks) * fractions
        if "skipped" in r:
            lines.append(f"| {r['server']} | {r['clients']} | skipped: {r['skipped']} "
                         "| | | | | | |" + end)
            continue
        errors = f" ({r['errors']} failed)" if r["errors"] else ""
        lines.append(f"| {r['server']} | {r['clients']} | {r['requests']}{errors} | {r['tokens']} "
                     f"| {r['tok_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
                     f"{1e3 * r['tpot_p50']:.1f} | {1e3 * r['tpot_p99']:.1f} |" + end)
    return "\n".join(lines)


def burst_table(rows):
    """--burst's measurements of the rows that have them, as a second markdown table: the
    newcomers answered, their TTFT, the window (their first request sent to their last first
    content) and the steady streams' seconds per token (their gaps between content chunks) within
    it and outside it, and how many times the one's p99 is the other's."""
    rows = [r for r in rows if "burst" in r]
    fractions = any(r.get("constrained") for r in rows)
    lines = ["| server | clients | burst | answered | burst TTFT p50 (s) | burst TTFT p99 (s) "
             "| window (s) | TPOT p50 in window (ms) | TPOT p99 in window (ms) "
             "| TPOT p50 outside (ms) | TPOT p99 outside (ms) | p99 in / outside |"
             + " constrained |" * fractions,
             "| --- |" + " ---: |" * (11 + fractions)]
    for r in rows:
        errors = f" ({r['burst_errors']} failed)" if r["burst_errors"] else ""
        inside, outside = r["burst_in_tpot_p99"], r["burst_out_tpot_p99"]
        stall = inside / outside if outside > 0 else float("nan")
        lines.append(f"| {r['server']} | {r['clients']} | {r['burst']} | {r['burst_requests']}"
                     f"{errors} | {r['burst_ttft_p50']:.2f} | {r['burst_ttft_p99']:.2f} "
                     f"| {r['burst_window_s']:.2f} | {1e3 * r['burst_in_tpot_p50']:.1f} "
                     f"| {1e3 * inside:.1f} | {1e3 * r['burst_out_tpot_p50']:.1f} "
                     f"| {1e3 * outside:.1f} | {stall:.1f}x |"
                     + f" {r.get('constrained', 0):g} |" * fractions)
    return "\n".join(lines)


def chart(rows, path, title):
    """The rows' aggregate tok/s and TTFT p99 at each N (medians over repeats), a line per server
    and constrained fraction, log scales, as a PNG at path (written under another name, then
    renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    series = {}  # label -> N -> rows
    for r in rows:
        if "skipped" not in r:
            label = r["server"] + (f", {r['constrained']:g} constrained"
                                   if r.get("constrained") else "")
            series.setdefault(label, {}).setdefault(r["clients"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, field, name in zip(axes, ("tok_s", "ttft_p99"), ("aggregate tokens/s, higher is better",
                                                             "TTFT p99 (s), lower is better")):
        for label, by_n in series.items():
            ns = sorted(by_n)
            ax.plot(ns, [percentile([r[field] for r in by_n[n]], 50) for n in ns], marker="o",
                    label=label)
        counts = sorted({n for by_n in series.values() for n in by_n})
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.xaxis.set_minor_locator(NullLocator())
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:,.3g}"))
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(name, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def arg_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.serve",
                                description=__doc__.split("\n\n")[1], formatter_class=HelpFormatter)
    add_model_args(p, "--model", model=dict(help="MLX model folder our server and mlx_lm.server "
                                                 "load (default: the embedded SmolLM2, written as "
                                                 "an MLX folder under --work)"))
    p.add_argument("--clients", default="1,8,32,64",
                   help="comma-separated concurrent client counts")
    p.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="temperature of every request (0: greedy)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure mlx_lm.server on the same weights")
    p.add_argument("--llama-server", metavar="PATH",
                   help="also measure llama.cpp's llama-server (this binary) on the embedded "
                        "SmolLM2 GGUF")
    p.add_argument("--llama-np", type=int, metavar="N",
                   help=f"llama-server's slots (-np; default: the largest of --clients plus "
                        f"--burst, at most {LLAMA_NP_MAX})")
    p.add_argument("--constrained", default="0", metavar="FRACTIONS",
                   help="comma-separated fractions of the clients asking for a JSON schema's "
                        "answer (response_format json_schema), each N played at each (e.g. "
                        "0,0.5,1); mlx_lm.server's constrained rows are skipped")
    p.add_argument("--repeats", type=int, default=1,
                   help="play the --clients list this many times over in each server process, and "
                        "report each N's median and its ratio to the same repeat's one-client row")
    p.add_argument("--warm", action="store_true",
                   help="before each N's timed requests, an untimed round of one request a client "
                        "at that N")
    p.add_argument("--burst", type=int, default=0, metavar="M",
                   help="at each N, once every client's first request streams (its first "
                        f"{BURST_AFTER} content chunks, or after {BURST_WAIT:g} s), M more clients "
                        "send one request each at once; a second table: their TTFT and the "
                        "steady streams' TPOT while they are prefilled, beside it the rest of the "
                        "time")
    p.add_argument("--engine", action="store_true",
                   help="also feed the same requests to our batch engine in this process (no HTTP)")
    p.add_argument("--server-args", default="", help="extra flags for our server, space-separated")
    p.add_argument("--work", default="out/serve", help="folder for the converted model and logs")
    p.add_argument("--out", help="also write the table (markdown) here, the rows (.json) and a "
                                 "chart (.png) beside it")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def parse_clients(text):
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UserError("--clients must be positive whole numbers separated by commas, "
                        f"not '{text}'")
    return counts


def parse_fractions(text):
    try:
        fractions = [float(f) for f in text.split(",")]
    except ValueError:
        fractions = []
    if not fractions or not all(0 <= f <= 1 for f in fractions):
        raise UserError("--constrained must be fractions from 0 to 1 separated by commas (e.g. "
                        f"0,0.5,1), not '{text}'")
    return fractions


def main(argv=None):
    args = arg_parser().parse_args(argv)
    counts, fractions = parse_clients(args.clients), parse_fractions(args.constrained)
    if args.rounds < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise UserError("--rounds, --max-tokens and --repeats must be at least 1")
    if args.burst < 0:
        raise UserError(f"--burst must be a count of requests (0: none), not {args.burst}")
    if not 0 <= args.temperature <= 2:
        raise UserError("--temperature must lie in 0..2 (the server's range), "
                        f"not {args.temperature:g}")
    if args.llama_np is not None and args.llama_np < 1:
        raise UserError(f"--llama-np must be at least 1, not {args.llama_np}")
    if args.llama_server:  # (checked before the model is converted)
        binary, gguf = check_llama_server(args.llama_server, args.model), default_model_path()
        slots = args.llama_np or min(max(counts) + args.burst, LLAMA_NP_MAX)
    model = Path(args.model) if args.model else mlx_folder(args.work)
    if not (model / "config.json").is_file():
        raise UserError(f"{model}: not an MLX model folder (config.json missing)")
    # each server's command line for a port
    commands = {"ours": lambda port: server_command("ours", model, port, args.server_args.split())}
    if args.peer:
        commands["mlx-lm"] = lambda port: server_command("mlx-lm", model, port, [])
    if args.llama_server:
        commands[LLAMA] = lambda port: llama_server_command(binary, gguf, port, slots,
                                                            args.max_tokens)
    rows = []
    for kind, command in commands.items():
        Path(args.work).mkdir(parents=True, exist_ok=True)
        with open(Path(args.work) / f"{kind}.log", "w") as log:
            process, port = start(kind, command, log)
            try:
                stream_chat(port, "Say hello.", 4)  # untimed: first-request costs
                for repeat, n, f, skipped in plan(kind, counts, fractions, args.repeats):
                    if skipped:
                        rows.append(dict(server=kind, clients=n, constrained=f, repeat=repeat,
                                         skipped=skipped))
                        continue
                    tag = f"{kind}{n}" + (f"c{f:g}" if f else "") + (f"r{repeat}" if repeat else "")
                    if args.warm:
                        load_round(port, n, 1, args.max_tokens, f"{tag}-warm", args.temperature,
                                   f)
                    # the server process's own (ours: its HTTP front)
                    before = cpu_seconds(process.pid)
                    counted = engine_counters(port) if kind == "ours" else None
                    row = dict(load_round(port, n, args.rounds, args.max_tokens, tag,
                                          args.temperature, f, burst=args.burst),
                               server=kind, repeat=repeat)
                    row["server_cpu_s"] = cpu_seconds(process.pid) - before
                    # the engine's decode steps and its masks' host time a step
                    if counted and (after := engine_counters(port)):
                        steps, mask = (b - a for a, b in zip(counted, after))
                        row.update(decode_steps=steps, mask_ms_per_step=1e3 * mask / max(steps, 1))
                    print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
                    if args.burst:
                        print(burst_table([row]).splitlines()[-1], file=sys.stderr, flush=True)
                    rows.append(row)
            finally:
                process.terminate()
                process.wait(timeout=60)
    if args.engine:
        ours, tokenizer = load(str(model), progress=False)
        # untimed: first-request costs, as the servers'
        engine_round(ours, tokenizer, 1, 1, 4, "engine")
        for n in counts:
            rows.append(dict(engine_round(ours, tokenizer, n, args.rounds, args.max_tokens,
                                          f"engine{n}", args.temperature),
                             server="ours, engine alone"))
            print(table([rows[-1]]).splitlines()[-1], file=sys.stderr, flush=True)
    sampling = "temperature %g" % args.temperature if args.temperature else "greedy"
    warm = " (the servers after an untimed round at each N)" if args.warm else ""
    title = (f"{device_name()}, MLX {mx.__version__}, model {model.name}, {args.rounds} requests "
             f"per client{warm}, max_tokens {args.max_tokens}, {sampling}, streamed")
    text = f"{title}\n\n{table(rows)}\n"
    if any("burst" in r for r in rows):
        text += (f"\n--burst {args.burst}: at each N, once every client's first request had "
                 f"{BURST_AFTER} content chunks (or after {BURST_WAIT:g} s), {args.burst} more "
                 "clients sent one request each at once (the table above: the steady clients' "
                 "requests alone). The window: from the first of them sent to the last first "
                 "content; TPOT in and outside it: the steady streams' gaps between content "
                 "chunks, per token, that overlap the window and that do not\n\n"
                 f"{burst_table(rows)}\n")
    if any(fractions):
        text += ("\nconstrained: the fraction of the clients asking for a JSON schema's answer "
                 f"(response_format json_schema: {json.dumps(SCHEMA)})\n")
    if LLAMA in commands:
        text += f"\n{LLAMA}: {' '.join(commands[LLAMA]('PORT'))}\n"
    for r in rows:
        if "steps" in r:
            text += (f"\n{r['server']}, {r['clients']} clients: {r['steps']} steps, the steady "
                     f"step {1e3 * r['steady_step_s']:.2f} ms; {r['steady_s']:.2f} s of "
                     f"{r['wall_s']:.2f} in such steps, the first ended at "
                     f"{r['first_full_s']:.2f} s")
    text += "".join(f"\n{line}" for line in paired(rows)) if args.repeats > 1 else ""
    print(text)
    if args.out:
        write_atomic(Path(args.out), text)
        write_atomic(Path(args.out).with_suffix(".json"), json.dumps(rows, indent=1) + "\n")
        chart(rows, Path(args.out).with_suffix(".png"), title)


if __name__ == "__main__":
    run_cli(main)
