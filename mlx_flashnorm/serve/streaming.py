"""The server's answers, their tokens read by one thread (Streamer) rather than each by its own:
a streamed answer's events are written there, a whole answer's text kept for its handler.

With a thread per stream, every token woke its stream's thread, which then took the interpreter
lock again after each system call (the wait, a poll for the client, the write): with many
streams those handoffs cost more than the text and JSON (the server's threads queued on the lock:
bench/RESULTS.md, "Serving"). Here the worker's puts wake the one thread, which takes each
ticket's waiting tokens at once (a stream that fell behind sends them as one event), writes
without blocking (what a full socket does not take waits for the next round), and every POLL
seconds looks for clients that left. A client that left, or whose socket has taken nothing for
`timeout` seconds, has its request cancelled: the worker drops it at its next step; so has one
running past `request_timeout` seconds, answered 504, and, as the server stops, one that had no
token yet (drain()) or any one (stop()), answered 503: a streamed one with an error event, then
[DONE].

A client that sent its end (its socket reads as ended) has closed its connection, or only its
sending side (shutdown(SHUT_WR) once its request is sent), and reads on: only a write tells, which
a closed one's system answers with a reset. So it is written a probe (PROBE, a comment that event
readers skip; for an answer in one piece the first bytes of its status line, which its handler
then leaves out) and looked at every round for POLL seconds more: gone once its socket reports
the reset (or an error), or a write fails."""
import json
import socket
import threading
import time

from .openai_api import HTTPError

POLL = 0.1  # seconds between looks for clients that left (and between tries of a full socket)
# a Stream's left() for a client that sent its end: it closed, or half-closed and reads on
SHUT = "shut"
PROBE = b":\n\n"  # a server-sent-event comment


def event(obj):
    return f"data: {json.dumps(obj)}\n\n".encode()


class Stream:
    """One answer: its connection (a streamed one's headers sent), ticket, transcripts (one a
    choice: openai_api.Transcript) and answer; whole: an answer in one piece, which its handler
    writes once the stream is finished. A choice cut at a stop string is dropped from the worker
    (Ticket.drop) while the others go on."""

    def __init__(self, connection, left, ticket, transcripts, answer, whole=False, ahead=b"",
                 chunked=False):
        # left(): whether the client is gone (True), there (False), or has sent its end (SHUT)
        self.connection, self.left = connection, left
        self.ticket, self.transcripts, self.answer = ticket, transcripts, answer
        self.whole = whole  # no events: each choice's entries kept for one answer at the end
        self.entries = [[] for _ in transcripts]  # (a whole answer's) each choice's
        # a whole answer's first bytes (whatever its status), which a probe writes ahead (none: a
        # whole answer's client is not probed)
        self.ahead, self.written_ahead = ahead, b""
        self.probed = None  # when a client that sent its end was written a probe
        self.failed = None
        self.error = None  # the HTTPError answering failed
        self.began = False  # a token came
        self.since = time.monotonic()  # (for the request's time limit)
        self.out = bytearray()  # events not yet taken by the socket
        # a stream's events in HTTP/1.1's chunked transfer coding (its connection kept alive)
        self.chunked = chunked
        self.finished = False  # the last event is in out
        self.gone = False  # the client left (or stopped reading)
        self.stuck = None  # since when out has waited on a full socket
        self.done = threading.Event()

    def advance(self):
        """The events of the tokens waiting on the ticket, into out (one a choice for all of
        them)."""
        got, failed, ended = {}, None, False  # got: choice -> (text, finish, entries)
        for token in self.ticket.take():
            if token is None:  # the worker is done with it
                ended = True
                break
            if isinstance(token, Exception):
                failed = token
                break
            t = self.transcripts[token.choice]
            if t.finish:  # (a choice cut at a stop string: its tokens the worker made since)
                continue
            self.began = True
            piece, finish, entries = t.add(token)
            text, _, before = got.get(token.choice, ("", None, []))
            got[token.choice] = text + piece, finish, before + entries
            if finish and not token.finish_reason and len(self.transcripts) > 1:
                self.ticket.drop(token.choice)  # (one choice alone: the handler cancels it)
        if failed is not None:  # nothing checked before should get here
            return self.fail(failed)
        done = ended or all(t.finish for t in self.transcripts)
        answer = self.answer
        for choice, (text, finish, entries) in sorted(got.items()):
            if self.whole:
                self.entries[choice] += entries
            # (None: text a chat's tool calls hold back)
            elif (text or finish or entries) and (chunk := answer.chunk(text, finish, entries,
                                                                         index=choice)):
                self.out += self.frame(event(chunk))
        if done and not self.whole:
            if answer.call.include_usage:
                self.out += self.frame(event(answer.usage_chunk(self.transcripts)))
            self.out += self.frame(b"data: [DONE]\n\n", last=True)
        self.finished = done

    def frame(self, data, last=False):
        """data as the stream writes it: a chunk of its own where chunked (last: the chunk that
        ends the answer too)."""
        if not self.chunked:
            return data
        return b"%x\r\n%s\r\n" % (len(data), data) + b"0\r\n\r\n" * last

    def fail(self, error):
        """End the answer with error: an HTTPError as it is, another exception a 500 naming it (a
        streamed one's as its last event, then [DONE])."""
        self.failed, self.finished = error, True
        self.error = (error if isinstance(error, HTTPError)
                      else HTTPError(500, f"generation failed: {error}"))
        if not self.whole:
            self.out += self.frame(event(self.error.body()) + b"data: [DONE]\n\n", last=True)

    def look(self, now):
        """Whether the client is still there (left()); one that sent its end is probed once."""
        state = self.left()
        if state is SHUT and self.probed is None:
            self.probed = now
            self.written_ahead = self.ahead if self.whole else b""
            self.out += self.ahead if self.whole else self.frame(PROBE)
        return not state or state is SHUT

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
    as gone; request_timeout: seconds a request may run, from its Stream's making (None: no
    limit)."""

    def __init__(self, timeout, request_timeout=None):
        self.timeout, self.lock, self.wake = timeout, threading.Lock(), threading.Event()
        self.streams, self.ready = {}, set()  # ticket -> Stream; tickets with tokens waiting
        self.stopped = False
        self.request_timeout = request_timeout
        # HTTPErrors ending streams early: those with no token yet (drain), every one (stop)
        self.unbegun = self.every = None
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

    def drain(self, error):
        """End with error (its request cancelled) every stream that has had no token, now and from
        now on."""
        self.unbegun = error
        self.wake.set()

    def stop(self, error):
        """End with error every stream not finished, now and from now on."""
        self.every = error
        self.wake.set()

    def cut(self, s, now):
        """The HTTPError that ends s early, or None."""
        if self.every is not None:
            return self.every
        if self.unbegun is not None and not s.began:
            return self.unbegun
        if self.request_timeout is not None and now - s.since > self.request_timeout:
            return HTTPError(504, "the request ran past the server's limit of "
                                  f"{self.request_timeout:g} s (--request-timeout)")
        return None

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
                if not s.finished and (error := self.cut(s, now)) is not None:
                    s.ticket.cancel()
                    s.fail(error)
                try:
                    ok = s.flush(now, self.timeout)
                    # (a probed client's answer to the probe comes within a round or a few)
                    probing = s.probed is not None and now - s.probed < POLL
                    if ok and not s.out and not s.finished and (look or probing):
                        ok = s.look(now) and s.flush(now, self.timeout)
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
