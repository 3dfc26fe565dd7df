"""bench.serve's load client (issues 30, 62): streamed chat requests against a server's
OpenAI-compatible API, each content chunk's arrival time kept (Stream); N clients sending theirs
concurrently (load_round), each on one connection (kept alive where the server keeps it, as the
openai client's are), with --burst's newcomers sent at once while those stream; the rows'
percentiles."""
import http.client
import json
import threading
import time
from typing import NamedTuple, Optional

SUBJECTS = ["a lighthouse keeper", "a lost robot", "a dragon who bakes", "two rival chess players",
            "a city under the sea", "a clockmaker's apprentice", "the last tree on Mars",
            "a talking cat"]
# the answer a constrained client asks for: an object with required fields, an enum, an array
# (strings and the array bounded, so that an answer ends well within max_tokens)
SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "genre": {"enum": ["adventure", "mystery", "comedy", "fable"]},
                         "characters": {"type": "array", "items": {"type": "string",
                                                                    "maxLength": 20},
                                        "minItems": 1, "maxItems": 3}},
          "required": ["title", "genre", "characters"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
# a person as compact JSON of short bounded strings (llguidance's x-guidance option: the whitespace
# a schema allows otherwise takes half the tokens), so that even a random model's answers end
# within a few dozen tokens, at lengths of their own (tests/test_structured.py's schema, and
# bench/probes/constrained_steps.py's default)
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "color", "tags", "home"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
                         "home": {"type": "object", "additionalProperties": False,
                                  "required": ["city"],
                                  "properties": {"city": {"type": "string",
                                                          "pattern": "^[A-Z][a-z]{1,9}$"}}}},
          "x-guidance": {"whitespace_flexible": False}}
# --burst goes once every steady client's first request has this many content chunks (or has
# ended), so that all of them are decoding when the newcomers arrive...
BURST_AFTER = 4
# ...or this many seconds after the steady requests were sent, whichever comes first (a server
# that holds some stream back still gets its burst)
BURST_WAIT = 10.0


def percentile(xs, q):
    """The q-th percentile (0..100) of xs by linear interpolation; NaN for none."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    at = (len(xs) - 1) * q / 100
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


class Stream(NamedTuple):
    """One streamed answer: when its request was sent and when each content chunk arrived
    (time.perf_counter seconds), its completion tokens and its prompt tokens (None where the
    server does not say)."""
    sent: float
    times: list
    tokens: int
    prompt_tokens: Optional[int] = None

    @property
    def ttft(self):
        """Seconds to the first content; None without any."""
        return self.times[0] - self.sent if self.times else None

    @property
    def tpot(self):
        """Seconds per token after the first: the last content time less the first, over the
        tokens less one (a server may send several tokens in one chunk); None below two tokens."""
        if not self.times or self.tokens < 2:
            return None
        return (self.times[-1] - self.times[0]) / (self.tokens - 1)

    def gaps(self):
        """The gaps between consecutive content chunks as (start, end, seconds per token): each
        gap over the stream's mean tokens a gap (its tokens less one over its chunks less one), so
        that a stream's gaps average to its tpot."""
        if len(self.times) < 2 or self.tokens < 2:
            return []
        per_gap = (self.tokens - 1) / (len(self.times) - 1)
        return [(a, b, (b - a) / per_gap) for a, b in zip(self.times, self.times[1:])]


def stream_chat(port, prompt, max_tokens, temperature=0.0, response_format=None,
                on_content=None, conn=None):
    """One streamed chat request to 127.0.0.1:port (prompt: the user's text, or the messages; with
    response_format, where given), as a Stream. Tokens come from the final usage chunk, else count
    chunks. on_content, where given, is called with the count of content chunks read so far after
    each one. conn: an http.client connection to 127.0.0.1:port to send it on, read to its end
    and left open (a server that closes it: http.client opens another), as clients that keep
    their connections do; None: a connection of its own."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = {"messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if response_format is not None:
        body["response_format"] = response_format
    kept, conn = conn, conn or connection(port)
    sent = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    times, tokens, prompt_tokens = [], None, None
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
            prompt_tokens = chunk["usage"].get("prompt_tokens")
        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
            times.append(time.perf_counter())
            if on_content is not None:
                on_content(len(times))
    response.read()  # (the rest: a kept connection's next answer starts after it)
    if kept is None:
        conn.close()
    return Stream(sent, times, tokens or len(times), prompt_tokens)


def connection(port):
    return http.client.HTTPConnection("127.0.0.1", port, timeout=1800)


def prompt_of(i, r, tag):
    """Client i's r-th request's text (distinct for every request of a run)."""
    return f"Write a long story about {SUBJECTS[(i + r) % len(SUBJECTS)]} (story {tag}-{i}-{r})."


def summary(clients, streams, errors, wall):
    """A row's measurements from its requests' Streams and errors."""
    ttft = [s.ttft for s in streams if s.ttft is not None]
    tpot = [s.tpot for s in streams if s.tpot is not None]
    tokens = sum(s.tokens for s in streams)
    return {"clients": clients, "requests": len(streams), "errors": len(errors), "tokens": tokens,
            "error_kinds": sorted(set(e[:120] for e in errors)),
            "wall_s": wall, "tok_s": tokens / wall, "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99), "tpot_p50": percentile(tpot, 50),
            "tpot_p99": percentile(tpot, 99)}


def window_tpot(streams, start, end):
    """The streams' gaps' seconds per token (Stream.gaps) split in two lists: those of the gaps
    that overlap the window start..end (a stall that spans it counts), and the others."""
    inside, outside = [], []
    for s in streams:
        for a, b, tpot in s.gaps():
            (inside if a < end and b > start else outside).append(tpot)
    return inside, outside


def burst_summary(steady, burst, errors, asked, start_s):
    """--burst's keys of a row: the `asked` newcomers' answers (burst: their Streams, errors: the
    failed ones') and TTFT, the window from the first of them sent to the last first content, and
    the steady Streams' seconds per token within that window and outside it (window_tpot)."""
    firsts = [s.times[0] for s in burst if s.times]
    start = min((s.sent for s in burst), default=float("nan"))
    end = max(firsts, default=float("nan"))
    inside, outside = window_tpot(steady, start, end)
    ttft = [s.ttft for s in burst if s.ttft is not None]
    return {"burst": asked, "burst_requests": len(burst), "burst_errors": len(errors),
            "burst_error_kinds": sorted(set(e[:120] for e in errors)),
            "burst_tokens": sum(s.tokens for s in burst), "burst_start_s": start_s,
            "burst_window_s": end - start, "burst_ttft_p50": percentile(ttft, 50),
            "burst_ttft_p99": percentile(ttft, 99), "burst_in_gaps": len(inside),
            "burst_in_tpot_p50": percentile(inside, 50),
            "burst_in_tpot_p99": percentile(inside, 99), "burst_out_gaps": len(outside),
            "burst_out_tpot_p50": percentile(outside, 50),
            "burst_out_tpot_p99": percentile(outside, 99)}


def load_round(port, clients, rounds, max_tokens, tag, temperature=0.0, constrained=0.0,
               burst=0):
    """clients threads, each sending rounds requests in turn, the first `constrained` of them (a
    fraction, rounded) asking for SCHEMA's JSON; the row's measurements (wall time: to the last
    steady answer's end; where some clients ask for the schema and some not, the free ones' TPOT
    p50 and p99 apart too). With burst, that many newcomers send one free request each at once, when
    every client's first request has BURST_AFTER content chunks or has ended (or after
    BURST_WAIT s); their measurements (burst_summary) join the row, the rest of it the steady
    clients' alone."""
    streams, errors, free = [], [], []  # free: the streams of clients without a schema
    schema = round(constrained * clients)
    arrived, lock, go = set(), threading.Lock(), threading.Event()

    def ready(i):
        with lock:
            arrived.add(i)
            if len(arrived) == clients:
                go.set()

    def client(i):
        form = RESPONSE_FORMAT if i < schema else None
        conn = connection(port)  # (each client's requests on one connection, kept where it can)
        for r in range(rounds):
            first = bool(burst) and r == 0
            seen = (lambda n: n == BURST_AFTER and ready(i)) if first else None
            try:
                stream = stream_chat(port, prompt_of(i, r, tag), max_tokens, temperature, form,
                                     seen, conn)
                streams.append(stream)
                if form is None:
                    free.append(stream)
            except Exception as e:  # counted and reported, the others go on
                errors.append(str(e))
                conn.close()
                conn = connection(port)
            finally:
                if first:
                    ready(i)
        conn.close()

    newcomers, newcomer_errors, began = [], [], []

    def newcomer(j):
        try:
            newcomers.append(stream_chat(port, prompt_of(j, 0, f"{tag}-burst"), max_tokens,
                                         temperature))
        except Exception as e:
            newcomer_errors.append(str(e))

    def wave():
        go.wait(BURST_WAIT)
        began.append(time.perf_counter())
        threads = [threading.Thread(target=newcomer, args=(j,)) for j in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    waves = [threading.Thread(target=wave)] if burst else []
    t0 = time.perf_counter()
    for t in threads + waves:
        t.start()
    for t in threads:
        t.join()
    row = dict(summary(clients, streams, errors, time.perf_counter() - t0),
               constrained=constrained)
    if 0 < schema < clients:  # a mixed batch: what the free rows pay for the others' grammars
        tpot = [s.tpot for s in free if s.tpot is not None]
        row.update(free_tpot_p50=percentile(tpot, 50), free_tpot_p99=percentile(tpot, 99))
    for t in waves:
        t.join()
        row.update(burst_summary(streams, newcomers, newcomer_errors, burst, began[0] - t0))
    return row
