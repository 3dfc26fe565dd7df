"""`python -m mlx_flashnorm.bench.front`: what our HTTP server alone can stream (issue 30).

Starts our server (server.Server, in a process of its own, the embedded tokenizer) fed by a
stand-in worker with no model: every --period seconds each request in it gets one token (the
tokens of a fixed English text), as a batch engine stepping at that period would give them. It
then drives --clients concurrent streaming clients as bench.serve does (--rounds requests each,
--max-tokens each) and reports aggregate tok/s, TPOT and TTFT at p50, and the server process's
CPU seconds per token: where TPOT rises above the period, the server, not the engine, sets the
pace. One row per period."""
import argparse
import subprocess
import sys
import threading
import time

from ..errors import HelpFormatter, UserError, run_cli
from .serve import cpu_seconds, free_port, load_round

TEXT = ("Once upon a time, in a small village by the sea, there lived an old lighthouse keeper who had "
        "watched the waves for forty years and knew every ship that passed. ") * 4


class Paced:
    """The stand-in worker (requests.py's interface): a token for every live ticket each period."""

    def __init__(self, tokens, period, vocab_size, slots=32):
        self.tokens, self.period, self.slots = tokens, period, slots
        self.context_length, self.vocab_size = 8192, vocab_size
        self.live, self.lock = [], threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, generation):
        from ..serve.requests import Ticket

        ticket = Ticket(generation)
        with self.lock:
            self.live.append([ticket, 0])
        return ticket

    def _run(self):
        from ..serve.requests import Token

        due = time.perf_counter()
        while True:
            due += self.period
            time.sleep(max(0.0, due - time.perf_counter()))
            with self.lock:
                for entry in list(self.live):
                    ticket, n = entry[0], entry[1] + 1
                    last = n >= ticket.generation.max_tokens
                    if ticket.cancelled or last:
                        self.live.remove(entry)
                    if not ticket.cancelled:
                        ticket.put(Token(self.tokens[n % len(self.tokens)], "length" if last else None))
                        if last:
                            ticket.put(None)
                    entry[1] = n


def serve(port, period):
    """Our server on port, fed by Paced (the server process of a row)."""
    from ..loader import load
    from ..server import Server

    model, tokenizer = load(None, progress=False)
    worker = Paced(tokenizer.encode(TEXT), period, model.args.vocab_size)
    server = Server(None, tokenizer, "paced", port=port, worker=worker)
    print("ready", flush=True)
    server.serve_forever()


def row(period, clients, rounds, max_tokens):
    port = free_port()
    command = [sys.executable, "-m", "mlx_flashnorm.bench.front", "--serve", str(port), "--period", str(period)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if process.stdout.readline().strip() != "ready":
            raise UserError("the paced server did not start")
        load_round(port, 2, 1, 8, "warm")  # untimed: first-request costs
        before = cpu_seconds(process.pid)
        r = load_round(port, clients, rounds, max_tokens, "front")
        cpu = cpu_seconds(process.pid) - before
    finally:
        process.terminate()
        process.wait(timeout=60)
    return (f"| {period * 1e3:.1f} | {clients} | {r['tokens']} | {r['tok_s']:.0f} | {r['tpot_p50'] * 1e3:.2f} "
            f"| {r['ttft_p50'] * 1e3:.0f} | {cpu / r['tokens'] * 1e6:.0f} | {r['errors']} |")


def arg_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.front", description=__doc__.split("\n\n")[1],
                                formatter_class=HelpFormatter)
    p.add_argument("--period", default="0.0014", help="comma-separated step periods, seconds")
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    p.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of every request")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # a row's server process
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    try:
        periods = [float(p) for p in args.period.split(",")]
    except ValueError:
        periods = []
    if not periods or min(periods) <= 0 or args.clients < 1 or args.rounds < 1 or args.max_tokens < 1:
        raise UserError("--period must be positive seconds (comma-separated); --clients, --rounds and "
                        "--max-tokens at least 1")
    if args.serve:
        return serve(args.serve, periods[0])
    print("| period (ms) | clients | tokens | aggregate tok/s | TPOT p50 (ms) | TTFT p50 (ms) | server CPU us/token "
          "| failed |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for period in periods:
        print(row(period, args.clients, args.rounds, args.max_tokens), flush=True)


if __name__ == "__main__":
    run_cli(main)
