"""The batch engine in a process of its own, so that the server's HTTP work leaves its interpreter.

The server answers each client on a thread of its own (its streamed events on streaming's). With
the engine on a thread of the same process, those threads and the engine's shared one interpreter
lock: with many streaming clients a token took far longer through the server than for the same
requests fed to the engine alone, and with this process close to that (bench/RESULTS.md,
"Serving"). Here a child process (a new interpreter, `python -m
mlx_flashnorm.serve.engine_process`: MLX's device state does not survive a fork) loads the
model from the server's own flags and runs a batch_worker.BatchWorker; the server
process keeps only the tokenizer, which the child sends over once it has loaded. Requests and
cancellations go to the child over a socket pair, and each engine step's tokens come back as one
message, with the engine's requests.Load where the child's worker took one (BatchWorker.look).

EngineProcess has the worker interface (requests.py: slots, choices, load, submit(generation) ->
Ticket, close()), plus the model's context_length and vocab_size, which the server checks requests
against, the child's kv_tokens (BatchWorker's: its KV budget, which the server counts requests
against), and `problem`: why it takes no requests now (None: it does). Its load's counters go on
across restarts (a dead child's last ones kept). The child is supervised: if it dies, every
request in flight fails with an error naming its exit (the server answers a 500: a stream's error
event, then [DONE]), `problem` says so at once (the server's /health answers 503 and new requests
503 with Retry-After), and a new child loads the model; once it is ready requests are taken again.
After `restarts` restarts, at the next death the engine is gone for good: `fatal` says why (the
server command then exits non-zero)."""
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from ..decoding import context_length, load_from_args
from ..errors import UserError
from .batch_worker import BatchWorker, event_token
from .requests import Load, Ticket, Token
from .serial import MAX_CHOICES

CLOSE_TIMEOUT = 30  # seconds the child may take to stop once asked
RESTARTS = 3  # times a dead child is replaced (the server's --engine-restarts)


def exit_status(code):
    """A child's exit code in words."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"


class EngineProcess:
    def __init__(self, args, warm=False, max_batch=None, prompt_cache_bytes=0, prefill_step=2048,
                 restarts=RESTARTS, kv_budget=None):
        """args: the server's parsed flags (the model flags of cli.add_model_args: the child loads
        with decoding.load_from_args); restarts: how many times a dead child is replaced; the rest
        as BatchWorker's. Returns once the child has loaded (and warmed up); a load error
        (UserError) is raised here."""
        # the child's last Load, and the counters of the children before it
        self.latest, self.earlier = Load(), Load()
        self.setup = (args, warm, max_batch, prompt_cache_bytes, prefill_step, kv_budget)
        self.restarts, self.restarted = restarts, 0
        self.tickets, self.keys, self.lock = {}, itertools.count(), threading.Lock()
        self.problem = None  # why no request is taken now (None: they are)
        self.closing = False
        self.fatal = None  # why the engine is gone for good
        (_, self.tokenizer, self.context_length, self.vocab_size, self.slots,
         self.kv_tokens) = self._start()
        self.choices = min(MAX_CHOICES, self.slots)
        threading.Thread(target=self._supervise, daemon=True).start()

    def _start(self):
        """Start a child and hand it the setup; its reply ("ready", tokenizer, context length, vocab
        size, slots, kv_tokens) once it has loaded. A load error is raised (a UserError where the
        child died)."""
        here, there = socket.socketpair()
        with there:
            self.process = process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(there.fileno())], pass_fds=(there.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        conn = Connection(here.detach())
        try:
            conn.send(self.setup)
            reply = conn.recv()
        except (EOFError, OSError):
            conn.close()
            raise UserError("the engine process exited while loading the model "
                            f"({exit_status(process.wait())})")
        if reply[0] == "failed":
            conn.close()
            process.wait()
            raise reply[1]
        self.conn = conn
        return reply

    @property
    def load(self):
        return self.latest.after(self.earlier)

    def submit(self, generation):
        key = next(self.keys)
        ticket = RemoteTicket(generation, lambda choice=None: self._cancel(key, choice))
        with self.lock:
            if self.problem is None:
                self.tickets[key] = ticket
                self._send(("add", key, generation))
            else:
                ticket.put(RuntimeError(self.problem))
        return ticket

    def close(self):
        with self.lock:
            self.closing = True
            self._send(("close",))
            if self.problem is not None:  # a child loading, or none: nothing in flight
                self.process.kill()
        try:
            self.process.wait(CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()

    def _cancel(self, key, choice=None):
        """Tell the child to drop request `key` (or only its choice `choice`), once."""
        with self.lock:
            if choice is not None:
                if key in self.tickets:
                    self._send(("drop", key, choice))
            elif self.tickets.pop(key, None) is not None:
                self._send(("cancel", key))

    def _send(self, message):
        """(under self.lock)"""
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # the child is gone: _supervise fails the requests in flight
            pass

    def _supervise(self):
        """Hand the child's tokens to their tickets; once it is gone, fail every request in flight
        and start another, up to `restarts` times; then set fatal."""
        while True:
            self._receive()
            with self.lock:
                if self.closing:
                    return
                self.problem = "the engine process is gone"  # (its exit status next)
            try:
                status = exit_status(self.process.wait(CLOSE_TIMEOUT))
            except subprocess.TimeoutExpired:  # (its connection closed, the process alive)
                self.process.kill()
                status = exit_status(self.process.wait())
            dead = f"the engine process exited ({status})"
            with self.lock:
                if self.closing:
                    return
                self.problem = self._restarting(dead)  # (before its requests hear of it)
                self.latest, self.earlier = Load(), self.latest.counted().after(self.earlier)
                for ticket in self.tickets.values():
                    ticket.put(RuntimeError(dead))
                self.tickets.clear()
                self.conn.close()
            while self.restarted < self.restarts:
                with self.lock:
                    self.problem = self._restarting(dead)
                self.restarted += 1
                try:
                    self._start()
                    break
                except BaseException as e:  # (the next restart, or fatal, says it)
                    if self.closing:
                        return
                    dead = f"the engine process failed to load the model again: {e}"
            else:
                n = self.restarted
                reason = f"{dead}; it was restarted {n} time{'s' * (n != 1)} already"
                with self.lock:
                    self.problem = self.fatal = reason
                return
            with self.lock:
                if self.closing:  # (close() waits for this child)
                    self._send(("close",))
                    return
                self.problem = None

    def _restarting(self, dead):
        """The problem while the next restart runs, dead saying why."""
        if self.restarted >= self.restarts:
            return dead
        return f"{dead}; restarting it ({self.restarted + 1} of {self.restarts})"

    def _receive(self):
        """Hand each step's tokens to their tickets, until the child's connection ends."""
        while True:
            try:
                tokens, load = self.conn.recv()
            except (EOFError, OSError):
                return
            if load is not None:  # (before the tokens: a client answered finds its counts)
                self.latest = load
            for key, item in tokens:
                if type(item) is tuple:  # a plain token (PipedWorker.deliver)
                    item = Token(item[0], item[1], choice=item[2])
                ticket = self.tickets.get(key)
                if ticket is not None:
                    ticket.put(item)
                    if item is None or isinstance(item, BaseException):
                        self.tickets.pop(key, None)


class RemoteTicket(Ticket):
    """A Ticket whose cancel() (once) and drop() also tell the child."""

    def __init__(self, generation, tell):
        super().__init__(generation)
        self.tell = tell

    def cancel(self):
        super().cancel()
        self.tell()

    def drop(self, choice):
        super().drop(choice)
        self.tell(choice)


class PipedWorker(BatchWorker):
    """The child's BatchWorker: its tickets carry the server's keys, and their tokens go back over
    the pipe, one message per engine step (flush)."""

    def __init__(self, conn, *args, **kwargs):
        self.conn, self.outbox, self.tickets = conn, [], {}  # tickets: by key, until finished
        super().__init__(*args, **kwargs)

    def submit(self, generation, key):
        ticket = self.tickets[key] = Ticket(generation)
        ticket.key = key
        return self.enqueue(ticket)

    def put(self, ticket, item):
        """(None or an exception: the tokens go by deliver)"""
        self.outbox.append((ticket.key, item))
        self.tickets.pop(ticket.key, None)

    def deliver(self, events):
        """As BatchWorker's, a token without log-probabilities as the tuple (id, finish_reason,
        choice):
        pickled in a fraction of a Token's time, both ways, and made without one (a Token a row
        and step cost the step's host work: bench/RESULTS.md, "Host work of the batched step");
        a request's first as its Token, which carries how much of the prompt was cached."""
        out = self.outbox
        for e in events:
            ticket = e.request.ticket
            plain = ticket.generation.top_logprobs is None and len(e.request.generated) > 1
            out.append((ticket.key, (e.token, e.finish_reason, e.request.choice) if plain
                        else event_token(e)))
            if e.finish_reason and ticket.finished():
                out.append((ticket.key, None))
                self.tickets.pop(ticket.key, None)

    def flush(self, looked):
        if self.outbox or looked:
            tokens, self.outbox = self.outbox, []
            self.conn.send((tokens, self.load if looked else None))

    def _serve(self):
        """BatchWorker's, and should its thread end (it handles a failed step itself), the process
        with it: the server then fails the requests in flight and starts another."""
        try:
            super()._serve()
        except OSError:  # the server is gone
            pass
        except BaseException:
            traceback.print_exc()
        os._exit(70)


def serve_engine(conn):
    """The child: take (flags, warm, max_batch, prompt_cache_bytes, prefill_step, kv_budget), load,
    reply ("ready", tokenizer, context length, vocab size, slots, kv_tokens) or ("failed",
    exception), then take ("add", key, generation), ("cancel", key), ("drop", key, choice) and
    ("close",) until the server closes or goes. Ctrl-C and SIGTERM (sent to every process of a
    terminal's job, or of a systemd service) are the server's to take: it drains, then closes the
    child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        args, warm, max_batch, prompt_cache_bytes, prefill_step, kv_budget = conn.recv()
        model, tokenizer = load_from_args(args, warm=False)
        worker = PipedWorker(conn, model, tokenizer, warm, max_batch, prompt_cache_bytes,
                             prefill_step, kv_budget=kv_budget)
    except BaseException as e:
        return conn.send(("failed", e))
    try:
        conn.send(("ready", tokenizer, context_length(model), model.args.vocab_size,
                   worker.slots, worker.kv_tokens))
    except OSError:  # the server went while the model loaded
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if message[0] == "add":
            worker.submit(message[2], message[1])
        elif message[0] == "cancel":
            if (ticket := worker.tickets.pop(message[1], None)) is not None:
                ticket.cancel()
        elif message[0] == "drop":
            if (ticket := worker.tickets.get(message[1])) is not None:
                ticket.drop(message[2])
        else:
            return


if __name__ == "__main__":
    serve_engine(Connection(int(sys.argv[1])))
