"""The batch engine in a process of its own (engine_process.EngineProcess, the command-line
server's worker): a real child process on the embedded SmolLM2, its requests answered as one
process answers them, a cancelled request leaving its slot, the child's death answered as a JSON
error, the child restarted (then the command-line server exits), and a load error as one line."""
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_flashnorm.serve.sequence import Event
from mlx_flashnorm.serve.engine_process import EngineProcess, PipedWorker
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.decoding import stream_generate
from mlx_flashnorm.server import Server, arg_parser
from mlx_flashnorm.serve.requests import Generation, Ticket, Token

from conftest import children, cli, serving

WAIT = 300  # seconds: an upper bound (a model loaded in a new process), never a pace
PROMPTS = ["What is the capital of France?", "Name a color."]


def flags(*extra):
    return arg_parser().parse_args(["--norm", "rms", "--no-warmup", *extra])  # the smollm2 fixture's norm


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def tokens_of(ticket):
    out = []
    while (token := ticket.next(timeout=120)) is not None:
        out.append(token)
    return out


@pytest.fixture(scope="module")
def engine():
    worker = EngineProcess(flags(), max_batch=2)
    yield worker
    worker.close()
    assert worker.process.returncode == 0  # it stopped when asked


def test_requests_get_their_one_process_answers(engine, smollm2):
    """Two greedy requests decoded together in the child get the tokens a lone request gets in this
    process; log-probabilities come over too."""
    model, tokenizer = smollm2
    assert (engine.context_length, engine.vocab_size) == (8192, model.args.vocab_size)
    ids = [chat(engine.tokenizer, p) for p in PROMPTS]
    assert ids == [chat(tokenizer, p) for p in PROMPTS]  # the tokenizer the child sent over
    tickets = [engine.submit(Generation(i, 3, top_logprobs=2)) for i in ids]
    for i, ticket in zip(ids, tickets):
        got = tokens_of(ticket)
        alone = [r.token for r in stream_generate(model, tokenizer, i, max_tokens=3)]
        assert [t.id for t in got] == alone
        assert all(t.top_logprobs[0][0] == t.id and t.logprob == t.top_logprobs[0][1] for t in got)
        assert got[-1].finish_reason in ("length", "stop") and all(t.finish_reason is None for t in got[:-1])


def test_a_cancelled_request_leaves_its_slot(engine):
    """Two slots, both taken by long requests; one cancelled after its first token: a third request
    gets its slot and its answer while the other long one still runs."""
    ids = engine.tokenizer.encode("1, 2, 3, 4,")  # SmolLM2 counts on for as long as it may (11 tokens)
    long_ones = [engine.submit(Generation(ids, 4000)) for _ in range(2)]
    assert long_ones[0].next(timeout=120) is not None
    long_ones[0].cancel()
    assert len(tokens_of(engine.submit(Generation(ids, 2)))) == 2
    long_ones[1].cancel()


def test_choices_and_counts_cross_the_pipe(engine, smollm2):
    """A request of n = 2 (the engine's two rows) gets two choices, each the lone greedy answer; the
    engine's counters come back with its tokens: once they are all here, the engine's Load has
    counted each token made and the prompt's tokens once, and its batch is empty again."""
    model, tokenizer = smollm2
    ids = chat(tokenizer, PROMPTS[1])
    # (the requests of the tests before ended: their last counts come with the engine's idling)
    before = until(lambda: (load := engine.load).rows == load.processing == 0 and load)
    tokens = tokens_of(engine.submit(Generation(ids, 3, n=2)))
    after = engine.load
    alone = [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=3)]
    assert [[t.id for t in tokens if t.choice == c] for c in (0, 1)] == [alone, alone]
    assert after.generated - before.generated == sum(t.finish_reason != "stop" for t in tokens)
    assert after.prompt_tokens - before.prompt_tokens == len(ids) - sum(t.cached for t in tokens)
    assert after.steps - before.steps == 3 and after.rows_stepped - before.rows_stepped == 6
    assert (after.rows, after.processing, after.waiting, after.kv_tokens) == (0, 0, 0, 0)


def health(port):
    """(status, JSON body) of GET /health."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=WAIT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def until(condition):
    """Wait for condition() (at most WAIT seconds: an upper bound, never a pace)."""
    end = time.monotonic() + WAIT
    while not (got := condition()):
        assert time.monotonic() < end, "never happened"
        time.sleep(0.05)
    return got


def complete(port, prompt="1, 2, 3,", **fields):
    """(status, JSON body) of a plain completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    body = json.dumps({"prompt": prompt, "max_tokens": 2, **fields})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read()), r.headers


def test_a_dead_engine_is_restarted(smollm2):
    """The child killed (SIGKILL) mid-stream: the stream ends with an error event naming its death,
    then [DONE]; at once /health answers 503 with the reason, and a request 503 with Retry-After,
    while a new child loads (held here until the test lets it); then /health answers 200 and the
    next request is answered. Killed again, past its one restart: the engine is gone for good
    (fatal, the reason /health would give) and the server's serve_forever returns with it."""
    worker = EngineProcess(flags(), max_batch=2, restarts=1)
    let, start = threading.Event(), worker._start
    worker._start = lambda: let.wait(WAIT) and start()
    server = Server(None, worker.tokenizer, "smol", port=0, worker=worker)
    with serving(server):
        port = server.server_address[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
        body = json.dumps({"prompt": "1, 2, 3, 4,", "max_tokens": 4000, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200 and json.loads(stream.readline()[6:])["choices"][0]["text"]
        os.kill(worker.process.pid, signal.SIGKILL)
        lines = [line.decode() for line in stream.read().split(b"\n\n") if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][6:])["error"]["message"]
        assert "engine process exited (killed by SIGKILL)" in error, error
        status, body = health(port)
        assert status == 503 and "(killed by SIGKILL); restarting" in body["reason"], body
        status, body, headers = complete(port)
        assert status == 503 and "restarting" in body["error"]["message"] and headers["Retry-After"]
        let.set()
        until(lambda: health(port)[0] == 200)
        status, body, _ = complete(port)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        assert worker.load.generated >= 3  # the dead child's counts kept: its first token's too
        os.kill(worker.process.pid, signal.SIGKILL)
        until(lambda: server.stopped)  # (a /health now could meet a server that no longer accepts)
        assert worker.problem == worker.fatal and "restarted 1 time already" in worker.fatal
        assert "killed by SIGKILL" in str(server.stopped) and server.stopped.fatal


def test_the_server_exits_once_its_engine_restarts_are_spent(tiny_llama_dir):
    """The command-line server with --engine-restarts 1: its engine process killed, a new one
    serves; killed again, the server exits with status 1 and a one-line error naming the bound."""
    server = subprocess.Popen([sys.executable, "-m", "mlx_flashnorm.server", "--model",
                               str(tiny_llama_dir), "--norm", "rms", "--no-warmup", "--port", "0",
                               "--engine-restarts", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline().rsplit(":", 1)[1].split("/")[0])
        assert complete(port)[0] == 200
        (first,) = children(server.pid)
        os.kill(first, signal.SIGKILL)
        (second,) = until(lambda: (c := children(server.pid)) and first not in c and c)
        until(lambda: health(port)[0] == 200)
        assert complete(port)[0] == 200
        os.kill(second, signal.SIGKILL)
        assert server.wait(WAIT) == 1
        err = server.stderr.read().strip().splitlines()
        assert err[-1].startswith("error: the engine process exited (killed by SIGKILL)"), err
        assert "--engine-restarts 1" in err[-1] and "Traceback" not in "".join(err), err
    finally:
        server.kill()
        server.wait()


def test_load_errors_are_one_line():
    with pytest.raises(UserError, match="nowhere"):
        EngineProcess(arg_parser().parse_args(["--model", "/nowhere/model.gguf", "--no-warmup"]))
    r = cli("mlx_flashnorm.server", "--model", "/nowhere/model.gguf", "--no-warmup")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "nowhere" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plain_tokens_cross_the_pipe_as_tuples():
    """The child's deliver sends a token without log-probabilities as (id, finish, choice) (a Token
    pickles ten times slower), one with them, or a request's first (which tells how much of its
    prompt was cached), as its Token, and None after a request's last, dropping its ticket; the
    requests above read both back as Tokens."""
    child = SimpleNamespace(outbox=[], tickets={7: "plain", 8: "rich", 9: "first"})

    def ticket(key, generation):
        t = Ticket(generation)
        t.key = key
        return t

    plain = SimpleNamespace(ticket=ticket(7, Generation([1], 4)), generated=[3, 5], choice=0)
    rich = SimpleNamespace(ticket=ticket(8, Generation([1], 4, top_logprobs=1)),
                           generated=[0, 0], cached=3, choice=0)
    first = SimpleNamespace(ticket=ticket(9, Generation([1, 2, 3], 4)), generated=[4], cached=2,
                            choice=0)
    logits = mx.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    step = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    PipedWorker.deliver(child, [Event(plain, 5, step, 0, None), Event(rich, 0, step, 1, "length")])
    assert child.tickets == {7: "plain", 9: "first"}
    PipedWorker.deliver(child, [Event(plain, 9, step, 0, "stop")])
    assert child.outbox[:1] == [(7, (5, None, 0))]
    assert child.outbox[2:] == [(8, None), (7, (9, "stop", 0)), (7, None)]
    key, token = child.outbox[1]
    assert key == 8 and isinstance(token, Token) and (token.id, token.finish_reason) == (0, "length")
    assert token.top_logprobs[0][0] == 0 and abs(token.logprob - step[1, 0].item()) < 1e-6
    assert child.tickets == {9: "first"}
    PipedWorker.deliver(child, [Event(first, 4, step, 0, None)])
    key, token = child.outbox[-1]
    assert key == 9 and isinstance(token, Token) and (token.id, token.cached) == (4, 2)
