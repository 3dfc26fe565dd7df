"""The server's answers, their tokens read by one thread (Streamer) rather than each by its own:
a streamed answer's events are written there, a whole answer's text kept for its handler.

With a thread per stream, every token woke its stream's thread, which then took the interpreter
lock again after each system call (the wait, a poll for the client, the write): with many
streams those handoffs cost more than the text and JSON (the server's threads queued on the lock:
bench/RESULTS.md, "Serving"). Here the worker's puts wake the one thread, which takes each
ticket's waiting tokens at once (a stream that fell behind sends them as one event), writes
without blocking (what a full socket does not take waits for the next round), and every POLL
seconds looks for clients that left. A client that left, or whose socket has taken nothing for
`timeout` seconds, has its request cancelled: the worker drops it at its next step."""
import json
import socket
import threading
import time

from .openai_api import HTTPError

POLL = 0.1  # seconds between looks for clients that left (and between tries of a full socket)


def event(obj):
    return f"data: {json.dumps(obj)}\n\n".encode()


class Stream:
    """One answer: its connection (a streamed one's headers sent), ticket, transcript and answer;
    whole: an answer in one piece, which its handler writes once the stream is finished."""

    def __init__(self, connection, left, ticket, transcript, answer, whole=False):
        # left(): whether the client closed its connection
        self.connection, self.left = connection, left
        self.ticket, self.transcript, self.answer = ticket, transcript, answer
        self.whole = whole  # no events: the text, finish and entries kept for one answer at the end
        self.text, self.finish, self.entries, self.failed = "", None, [], None
        self.out = bytearray()  # events not yet taken by the socket
        self.finished = False  # the last event is in out
        self.gone = False  # the client left (or stopped reading)
        self.stuck = None  # since when out has waited on a full socket
        self.done = threading.Event()

    def advance(self):
        """The events of the tokens waiting on the ticket, into out (one for all of them)."""
        text, finish, entries, failed, ended = "", None, [], None, False
        for token in self.ticket.take():
            if token is None:  # the worker is done with it
                ended = True
                break
            if isinstance(token, Exception):
                failed = token
                break
            piece, finish, got = self.transcript.add(token)
            text, entries = text + piece, entries + got
            if finish:
                break
        if failed is not None:  # nothing checked before should get here
            return self.fail(failed)
        answer = self.answer
        if self.whole:
            self.text, self.finish, self.entries = self.text + text, finish, self.entries + entries
            self.finished = bool(finish or ended)
            return
        # (None: text a chat's tool calls hold back)
        if (text or finish or entries) and (chunk := answer.chunk(text, finish, entries)):
            self.out += event(chunk)
        if finish or ended:
            if answer.call.include_usage:
                self.out += event(answer.usage_chunk(self.transcript.count))
            self.out += b"data: [DONE]\n\n"
            self.finished = True

    def fail(self, error):
        """End the answer with a 500 naming error (a streamed one's as its last event)."""
        self.failed, self.finished = error, True
        if not self.whole:
            self.out += event(HTTPError(500, f"generation failed: {error}").body())

    def flush(self, now, timeout):
        """Write what the socket takes without waiting; False once the client is gone."""
        if self.out:
            try:
                sent = self.connection.send(self.out, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return False
            del self.out[:sent]
            self.stuck = None if sent or not self.out else (self.stuck or now)
            if self.stuck is not None and now - self.stuck > timeout:
                return False
        return True


class Streamer:
    """The thread that writes every Stream. run(stream) returns once the stream is written or its
    client gone (then False); timeout: seconds a socket may take nothing before its client counts
    as gone."""

    def __init__(self, timeout):
        self.timeout, self.lock, self.wake = timeout, threading.Lock(), threading.Event()
        self.streams, self.ready = {}, set()  # ticket -> Stream; tickets with tokens waiting
        self.stopped = False
        threading.Thread(target=self._run, daemon=True).start()

    def run(self, stream):
        # writes that never wait (a socket with a timeout waits to write)
        stream.connection.settimeout(0)
        with self.lock:
            self.streams[stream.ticket] = stream
            self.ready.add(stream.ticket)  # (tokens may have come before the listener)
        stream.ticket.listener = self.notify
        self.wake.set()
        stream.done.wait()
        stream.connection.settimeout(self.timeout)
        return not stream.gone

    def notify(self, ticket):
        """A ticket has tokens (called by the worker, from its thread)."""
        with self.lock:
            self.ready.add(ticket)
        self.wake.set()

    def _run(self):
        looked = time.monotonic()
        while not self.stopped:
            self.wake.wait(POLL)
            self.wake.clear()
            with self.lock:
                ready, self.ready = self.ready, set()
                streams = list(self.streams.values())
            now = time.monotonic()
            look = now - looked >= POLL
            looked = now if look else looked
            for s in streams:
                try:
                    if s.ticket in ready and not s.finished:
                        s.advance()
                except Exception as e:  # one answer's failure (its text, JSON) ends it alone
                    s.fail(e)
                try:
                    ok = s.flush(now, self.timeout) and not (look and not s.out and s.left())
                except Exception:
                    ok = False
                if not ok or s.finished and not s.out:
                    self._end(s, gone=not ok)

    def _end(self, stream, gone):
        if gone:
            stream.gone = True
            stream.ticket.cancel()
        with self.lock:
            self.streams.pop(stream.ticket, None)
        stream.done.set()
