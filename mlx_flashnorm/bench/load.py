"""bench.serve's load client (issues 30, 62): streamed chat requests against a server's
OpenAI-compatible API, each content chunk's arrival time kept (Stream); N clients sending theirs
concurrently (load_round); the rows' percentiles."""
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


def stream_chat(port, prompt, max_tokens, temperature=0.0, response_format=None):
    """One streamed chat request to 127.0.0.1:port (prompt: the user's text, or the messages; with
    response_format, where given), as a Stream. Tokens come from the final usage chunk, else count
    chunks."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = {"messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if response_format is not None:
        body["response_format"] = response_format
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
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
    conn.close()
    return Stream(sent, times, tokens or len(times), prompt_tokens)


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


def load_round(port, clients, rounds, max_tokens, tag, temperature=0.0, constrained=0.0):
    """clients threads, each sending rounds requests in turn, the first `constrained` of them (a
    fraction, rounded) asking for SCHEMA's JSON; the row's measurements."""
    streams, errors = [], []
    schema = round(constrained * clients)

    def client(i):
        form = RESPONSE_FORMAT if i < schema else None
        for r in range(rounds):
            try:
                streams.append(stream_chat(port, prompt_of(i, r, tag), max_tokens, temperature,
                                           form))
            except Exception as e:  # counted and reported, the others go on
                errors.append(str(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(summary(clients, streams, errors, time.perf_counter() - t0),
                constrained=constrained)
