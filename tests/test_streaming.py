"""streaming.Streamer, the server's one writer of streamed answers, on real socket pairs and tickets:
a client that stops reading is dropped after the timeout without holding up the other streams,
one that leaves is noticed while its request waits, and a stream's events are the answer's."""
import json
import socket
import threading
import time

from mlx_flashnorm.serve.openai_api import Answer, Call, Transcript
from mlx_flashnorm.serve.streaming import POLL, Stream, Streamer
from mlx_flashnorm.serve.requests import Generation, Ticket, Token


def stream_on(pair_end, tokenizer, ticket_tokens=8):
    """A Stream of a completion over one end of a socket pair, its ticket and its call."""
    call = Call(False, Generation(tokenizer.encode("Once upon a time"), ticket_tokens), stream=True)
    ticket = Ticket(call.generation)
    left = lambda: False  # noqa: E731 (the peer closing shows as a failed write)
    answer = Answer(call, tokenizer, "m")
    return Stream(pair_end, left, ticket, [Transcript(tokenizer, call)], answer), ticket


def events(data):
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")]


def test_streamed_events_are_the_answer(smollm2):
    """Tokens put on the ticket come out of the socket as the answer's events, in order, then [DONE]."""
    _, tokenizer = smollm2
    ids = tokenizer.encode(" there was a small village by the sea")
    ours, theirs = socket.socketpair()
    streamer = Streamer(timeout=5)
    s, ticket = stream_on(ours, tokenizer, len(ids))
    done = []
    threading.Thread(target=lambda: done.append(streamer.run(s))).start()
    for i, t in enumerate(ids):
        ticket.put(Token(t, "length" if i == len(ids) - 1 else None))
        time.sleep(0.002)
    data = b""
    while not data.endswith(b"data: [DONE]\n\n"):
        data += theirs.recv(65536)
    text = "".join(e["choices"][0]["text"] for e in events(data))
    assert text == tokenizer.decode(tokenizer.encode("Once upon a time") + ids)[len("Once upon a time"):]
    deadline = time.monotonic() + 5
    while not done:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert done == [True] and not ticket.cancelled


def test_a_client_that_stops_reading_is_dropped_and_others_go_on(smollm2):
    """A stream whose peer never reads fills its socket; after the timeout its ticket is cancelled
    and run() returns False. Meanwhile another stream, whose peer reads, is written whole."""
    _, tokenizer = smollm2
    stuck_ours, stuck_theirs = socket.socketpair()
    for end in (stuck_ours, stuck_theirs):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    good_ours, good_theirs = socket.socketpair()
    streamer = Streamer(timeout=1.0)
    stuck, stuck_ticket = stream_on(stuck_ours, tokenizer, 100000)
    good, good_ticket = stream_on(good_ours, tokenizer, 200)
    results = {}
    for name, s in (("stuck", stuck), ("good", good)):
        threading.Thread(target=lambda n=name, s=s: results.__setitem__(n, streamer.run(s))).start()
    t0 = time.monotonic()
    word = tokenizer.encode(" word")[0]
    for i in range(2000):  # far more than the stuck socket takes (events of some 200 bytes)
        stuck_ticket.put(Token(word))
    for i in range(200):
        good_ticket.put(Token(word, "length" if i == 199 else None))
    data = b""
    while not data.endswith(b"data: [DONE]\n\n"):
        data += good_theirs.recv(65536)
    assert time.monotonic() - t0 < 1.0  # not held up by the stuck stream
    assert sum(e["choices"][0]["text"].count("word") for e in events(data)) == 200
    deadline = time.monotonic() + 10
    while "stuck" not in results:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert results == {"good": True, "stuck": False} and stuck_ticket.cancelled
    assert time.monotonic() - t0 >= 1.0 - POLL


def test_a_client_that_leaves_while_its_request_waits_is_noticed(smollm2):
    """A stream with no tokens yet whose client left (its `left` says so) is ended within a few POLL
    seconds: its ticket cancelled, run() False."""
    _, tokenizer = smollm2
    ours, theirs = socket.socketpair()
    s, ticket = stream_on(ours, tokenizer)
    gone = threading.Event()
    s.left = gone.is_set
    streamer = Streamer(timeout=30)
    result = []
    threading.Thread(target=lambda: result.append(streamer.run(s))).start()
    time.sleep(3 * POLL)
    assert not result and not ticket.cancelled
    gone.set()
    deadline = time.monotonic() + 3 * POLL + 1
    while not result:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert result == [False] and ticket.cancelled


def test_an_answer_that_fails_to_render_gets_a_500_and_the_streamer_goes_on(smollm2, monkeypatch):
    """An exception while reading an answer's tokens (its transcript here) ends that answer alone
    with a 500: a streamed one's last event, a whole one's `failed` for its handler; the next
    stream is still written."""
    _, tokenizer = smollm2
    streamer = Streamer(timeout=5)
    for whole in (False, True):
        ours, theirs = socket.socketpair()
        s, ticket = stream_on(ours, tokenizer)
        s.whole = whole
        monkeypatch.setattr(s.transcripts[0], "add", lambda token: 1 / 0)
        ticket.put(Token(tokenizer.encode(" word")[0]))
        assert streamer.run(s) and isinstance(s.failed, ZeroDivisionError)
        ours.close()
        data = theirs.recv(65536)
        assert (data == b"") if whole else events(data)[-1]["error"]["message"] == "generation failed: division by zero"
    ours, theirs = socket.socketpair()
    s, ticket = stream_on(ours, tokenizer, 1)
    ticket.put(Token(tokenizer.encode(" word")[0], "length"))
    assert streamer.run(s) and theirs.recv(65536).endswith(b"data: [DONE]\n\n")


def test_choices_stream_by_index_and_one_cut_at_a_stop_string_is_dropped(smollm2):
    """A completion of two choices: each choice's tokens go out as its own events (by index); the
    first cut at a stop string is dropped from the worker (Ticket.drop) while the second runs to its
    end; then [DONE]."""
    _, tokenizer = smollm2
    call = Call(False, Generation(tokenizer.encode("Once upon a time"), 8, n=2), stream=True,
                stop=[" stop"])
    ticket, (ours, theirs) = Ticket(call.generation), socket.socketpair()
    s = Stream(ours, lambda: False, ticket, [Transcript(tokenizer, call) for _ in range(2)],
               Answer(call, tokenizer, "m"))
    word, stop, end = (tokenizer.encode(w)[0] for w in (" word", " stop", " end"))
    for choice, ids in ((0, [word, stop, word]), (1, [word, word, end])):
        for i, t in enumerate(ids):
            ticket.put(Token(t, "length" if choice and i == 2 else None, choice=choice))
    assert Streamer(timeout=5).run(s)
    data = b""
    while not data.endswith(b"data: [DONE]\n\n"):
        data += theirs.recv(65536)
    text, finish = {}, {}
    for e in events(data):
        (c,) = e["choices"]
        text[c["index"]] = text.get(c["index"], "") + c["text"]
        finish[c["index"]] = finish.get(c["index"]) or c["finish_reason"]
    assert text == {0: " word", 1: " word word end"} and finish == {0: "stop", 1: "length"}
    assert ticket.dropped == {0} and not ticket.cancelled
