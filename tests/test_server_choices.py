"""`n` > 1 (OpenAI's choices) on a real server over a tiny random Llama, asked with the official
openai client: with the batch worker the choices are rows sharing one prefill, with the serial one
(--max-concurrent 1) the request run n times; greedy choices are copies of the n = 1 answer,
seeded ones the same on a second run, streamed or not, chat or completion; n out of range is a 400;
a choice cut at a stop string leaves the batch while the others go on."""
import openai
import pytest

from mlx_flashnorm.server import Server
from mlx_flashnorm.serve.requests import Generation

from conftest import CountingWorker, openai_client, serving

CHAT = [{"role": "user", "content": "Tell me a story about a dragon."}]
PROMPT = "Once upon a time"


def ask(tiny_client, chat, stream=False, **fields):
    """(each choice's text by index, usage) of one request."""
    create = tiny_client.chat.completions.create if chat else tiny_client.completions.create
    body = dict(messages=CHAT) if chat else dict(prompt=PROMPT)
    if not stream:
        r = create(model="tiny", **body, **fields)
        assert [c.index for c in r.choices] == list(range(len(r.choices)))
        return [c.message.content if chat else c.text for c in r.choices], r.usage
    texts = {}
    chunks = list(create(model="tiny", **body, **fields, stream=True,
                         stream_options={"include_usage": True}))
    for c in chunks:
        for choice in c.choices:
            piece = choice.delta.content if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
    return [texts[i] for i in sorted(texts)], chunks[-1].usage


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_greedy_choices_are_the_one_answer(tiny_client, chat):
    """Under greedy decoding three choices are three copies of the n = 1 answer, streamed or not;
    usage counts the prompt once and the choices' tokens together."""
    (one,), usage = ask(tiny_client, chat, max_tokens=8)
    for stream in (False, True):
        texts, usage3 = ask(tiny_client, chat, stream, max_tokens=8, n=3)
        assert texts == [one] * 3, stream
        assert usage3.prompt_tokens == usage.prompt_tokens
        assert usage3.completion_tokens == 3 * usage.completion_tokens


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_seeded_choices_are_the_same_on_a_second_run(tiny_client, chat):
    """Three sampled choices with a seed differ from each other (each its own seed) and come back
    the same on a second run, which streams them."""
    fields = dict(max_tokens=8, n=3, seed=11, temperature=1.0)
    first, _ = ask(tiny_client, chat, **fields)
    assert len(set(first)) == 3, first
    assert ask(tiny_client, chat, stream=True, **fields)[0] == first


def test_each_choice_has_its_own_seed():
    g = Generation([1], 4, seed=5, n=3)
    assert g.seeds() == Generation([2], 9, seed=5, n=3).seeds()
    assert g.seeds()[0] == 5 and len(set(g.seeds())) == 3
    assert Generation([1], 4, n=2).seeds() == [None, None]


@pytest.mark.parametrize("n", [0, 5, "2", 1.5, True, -1])
def test_n_out_of_range_is_a_400(tiny_client, n):
    """n must be a whole number from 1 to the batch's rows (4 here): a 400 naming it, and the
    server answers the next request."""
    with pytest.raises(openai.BadRequestError) as e:
        tiny_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, n=n)
    assert e.value.body["param"] == "n"
    assert "'n' must be an integer from 1 to 4" in e.value.body["message"]
    assert tiny_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).choices


def test_a_dropped_choice_leaves_the_batch(tiny_server):
    """A choice dropped (the stream cut it at a stop string) gets no more tokens while the other
    runs to its end."""
    worker = tiny_server.worker
    ids = worker.tokenizer.encode("1, 2, 3, 4,")
    ticket = worker.submit(Generation(ids, 12, n=2))
    tokens = [ticket.next(timeout=120)]
    ticket.drop(1)
    while (token := ticket.next(timeout=120)) is not None:
        tokens.append(token)
        if token.finish_reason:
            break
    made = [sum(t.choice == c for t in tokens) for c in (0, 1)]
    assert made[0] == 12 and made[1] < 12, made
    ticket.cancel()


def test_the_serial_worker_runs_a_request_n_times(tiny_model):
    """With --max-concurrent 1 the choices are generated one after another (three generations),
    greedy ones copies of the one answer, seeded ones the same on a second run; up to 16."""
    worker = CountingWorker(*tiny_model)
    with serving(Server(*tiny_model, "tiny", port=0, worker=worker)) as tiny_server:
        tiny_client = openai_client(tiny_server)
        (one,), _ = ask(tiny_client, False, max_tokens=3)
        texts, usage = ask(tiny_client, False, max_tokens=3, n=3)
        assert texts == [one] * 3 and worker.made == [3, 3, 3, 3]
        fields = dict(max_tokens=3, n=2, seed=3, temperature=1.0)
        assert ask(tiny_client, False, **fields) == ask(tiny_client, False, stream=True, **fields)
        with pytest.raises(openai.BadRequestError, match="from 1 to 16"):
            tiny_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, n=17)
