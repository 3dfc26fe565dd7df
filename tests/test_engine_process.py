"""The batch engine in a process of its own (engine_process.EngineProcess, the command-line
server's worker): a real child process on the embedded SmolLM2, its requests answered as one
process answers them, a cancelled request leaving its slot, the child's death answered as a JSON
error by a server that goes on serving, and a load error as one line."""
import threading
import urllib.request
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_flashnorm.serve.sequence import Event
from mlx_flashnorm.serve.engine_process import EngineProcess, PipedWorker
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.decoding import stream_generate
from mlx_flashnorm.server import Server, arg_parser
from mlx_flashnorm.serve.requests import Generation, Token

from conftest import cli, openai_client, serving

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


def test_a_dead_engine_is_a_json_error_and_the_server_goes_on(smollm2):
    """The child killed mid-request: that request's stream and the next request get a 500 with a
    JSON error naming it, and /health still answers."""
    worker = EngineProcess(flags(), max_batch=2)
    with serving(Server(None, worker.tokenizer, "smol", port=0, worker=worker)) as server:
        client = openai_client(server)
        stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Tell a story."}],
                                                max_tokens=4000, stream=True)
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        threading.Timer(0.5, worker.process.kill).start()
        with pytest.raises(Exception, match="engine process exited"):
            for _ in stream:
                pass
        import openai

        with pytest.raises(openai.InternalServerError, match="engine process exited"):
            client.completions.create(model="smol", prompt="1, 2, 3,", max_tokens=3)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/health", timeout=30) as r:
            assert r.status == 200


def test_load_errors_are_one_line():
    with pytest.raises(UserError, match="nowhere"):
        EngineProcess(arg_parser().parse_args(["--model", "/nowhere/model.gguf", "--no-warmup"]))
    r = cli("mlx_flashnorm.server", "--model", "/nowhere/model.gguf", "--no-warmup")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "nowhere" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plain_tokens_cross_the_pipe_as_tuples():
    """The child's deliver sends a token without log-probabilities as (id, finish) (a Token pickles
    ten times slower), one with them, or a request's first (which tells how much of its prompt was
    cached), as its Token, and None after a request's last, dropping its ticket; the requests above
    read both back as Tokens."""
    child = SimpleNamespace(outbox=[], tickets={7: "plain", 8: "rich", 9: "first"})
    plain = SimpleNamespace(ticket=SimpleNamespace(key=7, generation=Generation([1], 4)),
                            generated=[3, 5])
    rich = SimpleNamespace(ticket=SimpleNamespace(key=8, generation=Generation([1], 4,
                                                                               top_logprobs=1)),
                           generated=[0, 0], cached=3)
    first = SimpleNamespace(ticket=SimpleNamespace(key=9, generation=Generation([1, 2, 3], 4)),
                            generated=[4], cached=2)
    logits = mx.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    step = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    PipedWorker.deliver(child, [Event(plain, 5, step, 0, None), Event(rich, 0, step, 1, "length")])
    assert child.tickets == {7: "plain", 9: "first"}
    PipedWorker.deliver(child, [Event(plain, 9, step, 0, "stop")])
    assert child.outbox[:1] == [(7, (5, None))] and child.outbox[2:] == [(8, None), (7, (9, "stop")), (7, None)]
    key, token = child.outbox[1]
    assert key == 8 and isinstance(token, Token) and (token.id, token.finish_reason) == (0, "length")
    assert token.top_logprobs[0][0] == 0 and abs(token.logprob - step[1, 0].item()) < 1e-6
    assert child.tickets == {9: "first"}
    PipedWorker.deliver(child, [Event(first, 4, step, 0, None)])
    key, token = child.outbox[-1]
    assert key == 9 and isinstance(token, Token) and (token.id, token.cached) == (4, 2)
