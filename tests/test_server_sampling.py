"""The server's sampling fields against mlx-lm's generate_step (eager, over its growing KVCache) on
the embedded SmolLM2, greedy: logprobs/top_logprobs are the log-softmax of the model's logits, and
the penalties and logit bias act as mlx-lm's logits processors do."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_flashnorm.server import Server

from conftest import f32_tol, openai_client, serving

COUNTING = "1, 2, 3, 4,"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
TOL = f32_tol(1e-5)  # float32 log-probabilities, the server's compiled decode step against mlx-lm's
STEPS = 6


@pytest.fixture(scope="module")
def client(smollm2):
    with serving(Server(*smollm2, "smol", port=0)) as server:
        yield openai_client(server)


def reference(model, tokenizer, prompt, steps, processors=None):
    """mlx-lm's greedy decoding: [(the chosen token, the log-softmax of the step's logits, after
    processors)] up to the first end-of-sequence token."""
    out = []
    for token, logprobs in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=steps,
                                                logits_processors=processors):
        if token in tokenizer.eos_token_ids:
            break
        out.append((token, np.array(logprobs.astype(mx.float32))))
    return out


def top(logprobs, k):
    return np.argsort(-logprobs, kind="stable")[:k]


def test_completion_logprobs_are_the_models(client, smollm2):
    model, tokenizer = smollm2
    r = client.completions.create(model="smol", prompt=COUNTING, max_tokens=STEPS, logprobs=3)
    got = r.choices[0].logprobs
    expected = reference(model, tokenizer, tokenizer.encode(COUNTING), STEPS)
    assert got.tokens == [tokenizer.decode([t]) for t, _ in expected]
    assert "".join(got.tokens) == r.choices[0].text
    assert got.text_offset == [len(COUNTING) + len("".join(got.tokens[:i])) for i in range(STEPS)]
    for (token, logprobs), logprob, tops in zip(expected, got.token_logprobs, got.top_logprobs):
        assert abs(logprob - logprobs[token]) < TOL
        assert list(tops) == [tokenizer.decode([i]) for i in top(logprobs, 3)]
        assert all(abs(tops[tokenizer.decode([i])] - logprobs[i]) < TOL for i in top(logprobs, 3))

    chunks = list(client.completions.create(model="smol", prompt=COUNTING, max_tokens=STEPS, logprobs=3,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((c.tokens for c in streamed), []) == got.tokens
    assert sum((c.token_logprobs for c in streamed), []) == got.token_logprobs
    assert sum((c.text_offset for c in streamed), []) == got.text_offset


def test_chat_logprobs_are_the_models(client, smollm2):
    model, tokenizer = smollm2
    r = client.chat.completions.create(model="smol", messages=FRANCE, max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    expected = reference(model, tokenizer, tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True), 4)
    assert [c.token for c in content] == [tokenizer.decode([t]) for t, _ in expected]
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for (token, logprobs), c in zip(expected, content):
        assert abs(c.logprob - logprobs[token]) < TOL and c.bytes == list(c.token.encode())
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode([i]) for i in top(logprobs, 2)]
        assert all(abs(t.logprob - logprobs[i]) < TOL for t, i in zip(c.top_logprobs, top(logprobs, 2)))


REPEATING = "cat, cat, cat,"  # SmolLM2 goes on " cat, cat, cat," unless something stops it
PENALTIES = [{"repetition_penalty": 1.5}, {"presence_penalty": 2.0}, {"frequency_penalty": 1.0},
             {"logit_bias": " cat"}]


@pytest.fixture(scope="module")
def plain(client):
    """The greedy completion of REPEATING without penalties."""
    return client.completions.create(model="smol", prompt=REPEATING, max_tokens=STEPS).choices[0]


def test_repeating_repeats(plain):
    assert plain.text == " cat, cat, cat," and plain.logprobs is None


@pytest.mark.parametrize("fields", PENALTIES, ids=lambda f: next(iter(f)))
def test_penalties_act_as_mlx_lms_processors(client, smollm2, plain, fields):
    """Each penalty gives the tokens (and their log-probabilities) that mlx-lm's generate_step gives with
    its logits processor for it, and changes the greedy output."""
    model, tokenizer = smollm2
    if "logit_bias" in fields:  # ban the token " cat"
        (cat,) = tokenizer.encode(fields["logit_bias"])
        fields = {"logit_bias": {cat: -100}}
    prompt = tokenizer.encode(REPEATING)
    expected = reference(model, tokenizer, prompt, STEPS, make_logits_processors(**fields))
    sent = {k: {str(t): v for t, v in v.items()} if k == "logit_bias" else v for k, v in fields.items()}
    r = client.completions.create(model="smol", prompt=REPEATING, max_tokens=STEPS, logprobs=0, extra_body=sent)
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t, _ in expected]
    assert np.allclose(r.choices[0].logprobs.token_logprobs, [lp[t] for t, lp in expected], atol=TOL, rtol=0)
    assert r.choices[0].text == tokenizer.decode(prompt + [t for t, _ in expected])[len(REPEATING):]
    assert r.choices[0].text != plain.text
