"""Structured output and tool calls on the embedded SmolLM2: a JSON schema's answer parses and
validates, greedy and seeded, alone (decoding's one-request path) and in a batch beside free rows,
whose tokens stay those of their unconstrained answers; the server's response_format and tools
(a forced call, a streamed one, the openai client's round trip, the 400s); generate --json-schema;
the tool-call text parser on every split of its text."""
import json
import threading

import jsonschema
import mlx.core as mx
import openai
import pytest

from mlx_flashnorm import constraints
from mlx_flashnorm.bench.load import PERSON as SCHEMA
from mlx_flashnorm.generate import main as generate_main
from mlx_flashnorm.constraints import JSON_OBJECT, Constraint, check, schema_grammar
from mlx_flashnorm.decoding import encode_prompt, stream_generate
from mlx_flashnorm.serve.batch_worker import BatchWorker
from mlx_flashnorm.serve.engine import BatchEngine
from mlx_flashnorm.serve.requests import Generation
from mlx_flashnorm.serve.sequence import Request
from mlx_flashnorm.serve.serial import stream_tokens
from mlx_flashnorm.serve.tools import Tools, ToolCalls
from mlx_flashnorm.server import Server

from conftest import in_process, serving

PERSON = "A person as JSON:"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}]


def alone(model, tokenizer, tokens, max_tokens, **kw):
    """The one-request tokens (kept: the tests of one model share them)."""
    key = (tuple(tokens), max_tokens, json.dumps(kw, sort_keys=True))
    if key not in ALONE:
        ALONE[key] = [r.token for r in stream_generate(model, tokenizer, tokens, max_tokens, **kw)]
    return ALONE[key]


ALONE = {}


def test_json_schema_alone_and_in_a_batch_beside_free_rows(smollm2):
    """Greedy and seeded rows under the schema, beside greedy and seeded free rows: each row's
    tokens are its one-request tokens, the schema rows' text valid JSON of the schema, their
    reported log-probabilities the model's (before the mask)."""
    model, tokenizer = smollm2
    # (plain text, no chat template: a few prompt tokens, prefilled four times over)
    person, free = (tokenizer.encode(t) for t in (PERSON, "The capital of France is"))
    stop = frozenset(tokenizer.eos_token_ids)
    rows = [(person, 80, dict(temp=0.0), True), (person, 80, dict(temp=0.8, seed=7), True),
            (free, 8, dict(temp=0.0), False), (free, 8, dict(temp=0.9, seed=3), False)]
    expected = [alone(model, tokenizer, p, n, json_schema=SCHEMA if c else None, **kw)
                for p, n, kw, c in rows]
    engine = BatchEngine(model)
    requests = [Request(p, n, stop_tokens=stop, **kw,
                        constraint=make(tokenizer, model) if c else None) for p, n, kw, c in rows]
    for r in requests:
        engine.add(r)
    most = 0
    while engine.busy:
        for e in engine.step():
            if e.request.constraint is not None:  # the model's log-probabilities, not masked
                assert mx.isfinite(e.logprobs).all().item()
        most = max(most, len(engine.rows))
    assert most == 4
    for r, want, (_, _, _, constrained) in zip(requests, expected, rows):
        assert r.generated == want
        if constrained:
            assert r.generated[-1] in stop  # the JSON text ended the row
            jsonschema.validate(json.loads(tokenizer.decode(r.generated[:-1])), SCHEMA)
    assert expected[0] != expected[1]


def test_free_rows_never_wait_for_a_grammars_mask(smollm2, monkeypatch):
    """Every grammar's mask held back (constraints.words blocked until the test lets it go): the
    free row beside a row under the schema decodes all its tokens, its one-request tokens, while
    that row sits every step out with no token; let go, it draws its own one-request tokens (its
    cache untouched by the steps it sat out)."""
    model, tokenizer = smollm2
    person, free = (tokenizer.encode(t) for t in (PERSON, "The capital of France is"))
    stop = frozenset(tokenizer.eos_token_ids)
    want_free = alone(model, tokenizer, free, 8, json_schema=None, temp=0.0)  # (the test above's)
    want_person = alone(model, tokenizer, person, 80, json_schema=SCHEMA, temp=0.0)[:24]
    let, words = threading.Event(), constraints.words
    monkeypatch.setattr(constraints, "words", lambda c: let.wait(120) and words(c))
    engine = BatchEngine(model)
    ruled = Request(person, 24, stop_tokens=stop, constraint=make(tokenizer, model))
    other = Request(free, 8, stop_tokens=stop)
    engine.add(ruled)
    engine.add(other)
    try:
        for _ in range(60):
            engine.step()
            if other.generated == want_free:
                break
        assert other.generated == want_free and other.slot is None
        assert ruled.generated == [] and engine.rows == [ruled]
    finally:
        let.set()
    while engine.busy:
        engine.step()
    assert ruled.generated == want_person


def test_the_serial_worker_follows_the_grammar(smollm2):
    """The one-request worker (--max-concurrent 1) hands a Generation's grammar to decoding."""
    model, tokenizer = smollm2
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    g = Generation(encode_prompt(tokenizer, "2+2 as JSON?"), 20, grammar=schema_grammar(schema))
    tokens = list(stream_tokens(model, tokenizer, g))
    assert tokens[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode([t.id for t in tokens[:-1]])), schema)


def test_a_lone_row_under_a_grammar_on_the_one_request_step(smollm2):
    """A batch of one row runs the one-request compiled step (Slots.solo): the same tokens."""
    model, tokenizer = smollm2
    tokens = tokenizer.encode("2+2 as JSON:")  # (no chat template: a few prompt tokens)
    grammar = schema_grammar({"type": "object", "properties": {"sum": {"type": "integer"}}})
    engine = BatchEngine(model)
    r = Request(tokens, 20, stop_tokens=frozenset(tokenizer.eos_token_ids),
                constraint=Constraint(grammar, tokenizer, model.args.vocab_size))
    engine.add(r)
    engine.step()
    assert engine.solo
    while engine.busy:
        engine.step()
    assert r.generated == alone(model, tokenizer, tokens, 20, grammar=grammar)


def make(tokenizer, model):
    return Constraint(schema_grammar(SCHEMA), tokenizer, model.args.vocab_size)


def test_generate_json_schema_file(smollm2, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    r = in_process(generate_main, "--prompt", PERSON, "--json-schema", str(path),
                   "--max-tokens", "80", "--norm", "rms")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout.split("=" * 10)[0]), SCHEMA)
    path.write_text('{"type": "objekt"}')
    r = in_process(generate_main, "--prompt", PERSON, "--json-schema", str(path))
    assert r.returncode != 0 and "not a JSON schema" in r.stderr


@pytest.fixture(scope="module")
def server(smollm2):
    """The server (a prompt cache, as by default: the tool tests' long system prompt is prefilled
    once)."""
    worker = BatchWorker(*smollm2, prompt_cache_bytes=2**26)
    with serving(Server(*smollm2, "smol", port=0, worker=worker)) as server:
        yield server


def test_response_formats_over_http(client):
    ask = [{"role": "user", "content": 'Return a JSON object with the key "answer" holding the '
                                       "sum 2+2."}]
    r = client.chat.completions.create(model="smol", messages=ask, max_tokens=40,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smol", messages=ask, max_tokens=20, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema,
                                                                "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_tool_round_trip_with_the_openai_client(client):
    """A forced call, its result sent back, the final answer: the embedded model's call is
    valid."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=WEATHER,
                                       tool_choice="required", max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER[0]["function"]["parameters"])
    messages += [choice.message,  # as the client returned it
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=WEATHER,
                                       tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_a_named_tool_call_streams_its_name_then_its_arguments(client):
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40,
        stream=True)
    deltas, finish = [], None
    for chunk in stream:
        deltas += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    head, pieces = deltas[0], deltas[1:]
    assert head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(pieces) > 1 and all(d.index == 0 and d.id is None for d in pieces)
    assert "city" in json.loads("".join(d.function.arguments for d in pieces))
    assert finish == "tool_calls"


@pytest.mark.parametrize("field, value, says", [
    ("response_format", {"type": "yaml"}, "'yaml' is not supported"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "objekt"}}},
     "not a JSON schema"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {}}}, ".name' must be"),
    ("tools", {"type": "function"}, "non-empty list"),
    ("tools", [{"type": "function", "function": {"description": "no name"}}], "name"),
    ("tools", [{"type": "retrieval"}], "'type': 'function'"),
    ("tool_choice", {"type": "function", "function": {"name": "nope"}}, "not one of 'tools'"),
    ("tool_choice", "always", "'tool_choice' must be"),
])
def test_bad_fields_get_400_naming_the_problem(client, field, value, says):
    body = {"tools": WEATHER} if field == "tool_choice" else {}
    body[field] = value
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", max_tokens=1, extra_body=body,
                                       messages=[{"role": "user", "content": "hi"}])
    assert says in e.value.body["message"] and e.value.body["param"] == field


TOOLS = Tools([{"name": "get_weather"}], "auto", "hermes", False)


def split(text, size, tools=TOOLS):
    calls, content, deltas = ToolCalls(tools), "", []
    for k in range(0, len(text), size):
        c, d = calls.feed(text[k:k + size], last=k + size >= len(text))
        content, deltas = content + c, deltas + d
    return content, deltas, calls.calls


@pytest.mark.parametrize("size", range(1, 9))
def test_tool_call_text_parsed_on_every_split(size):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", '
            '"days": [1, {"a": "]"}]}}\n</tool_call>')
    content, deltas, calls = split(text, size)
    assert content == "" and len(calls) == 1
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    arguments = "".join(d["function"]["arguments"] for d in deltas[1:])
    assert arguments == calls[0]["function"]["arguments"]
    assert json.loads(arguments) == {"city": "Pa}ris", "days": [1, {"a": "]"}]}
    assert split("Just text, <b>no</b> call.", size)[:2] == ("Just text, <b>no</b> call.", [])
    unknown = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert split(unknown, size)[0] == unknown
    llama = Tools([{"name": "get_weather"}], "auto", "llama", False)
    _, _, calls = split('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                        size, llama)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_a_forced_call_grammar_is_a_valid_grammar():
    tools = Tools([WEATHER[0]["function"], {"name": "now"}], "required", "hermes", False)
    assert check(tools.grammar()) == ""
    assert check(JSON_OBJECT) == ""


def test_a_batch_of_masks_is_each_rows_own(smollm2):
    """allowed_rows (a batch's rows' masks in one llguidance call) gives each row the mask it
    gets alone, for grammars at different states; the GPU's unpacking of the bitmasks (unpack, run
    here on the CPU) equals numpy's, the sign bit and a vocabulary of no whole word included."""
    import mlx.core as mx
    import numpy as np

    from mlx_flashnorm import constraints

    model, tokenizer = smollm2
    vocab = model.args.vocab_size
    rows = [Constraint(g, tokenizer, vocab) for g in (JSON_OBJECT, schema_grammar(SCHEMA), JSON_OBJECT)]
    for row, text in zip(rows, ['{"a": [1, ', "", '{"b": "x']):
        for t in tokenizer.encode(text, add_special_tokens=False):
            row.accept(t)
    together = constraints.allowed_rows(rows)
    alone = [row.allowed() for row in rows]
    assert all(mx.array_equal(together[j], a).item() for j, a in enumerate(alone))
    assert len({int(a.sum().item()) for a in alone}) == 3  # three different masks
    words = np.random.default_rng(0).integers(-2 ** 31, 2 ** 31, (3, 32), dtype=np.int64).astype(np.int32)
    want = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :1000].astype(bool)
    assert (np.array(constraints.unpack(mx.array(words), 1000)) == want).all()


def test_a_grammar_is_compiled_once_and_each_constraint_is_its_own(smollm2, monkeypatch):
    """Constraints of one grammar share its compilation (constraints.matcher: a copy of the one
    kept on the tokenizer), yet each follows its own tokens: the second's masks are those of a
    matcher compiled for it, at the start and after its own tokens, whatever the first took; at
    most KEPT_GRAMMARS grammars are kept, the least recently used dropped; a grammar in error is
    not kept and raises each time."""
    import llguidance
    import mlx.core as mx

    from mlx_flashnorm import constraints

    model, tokenizer = smollm2
    vocab = model.args.vocab_size
    grammar = schema_grammar(SCHEMA)
    ll = constraints.ll_tokenizer(tokenizer, vocab)
    tokenizer._llguidance_matchers.clear()
    compiled = []
    real = llguidance.LLMatcher

    def counted(*a, **k):
        compiled.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(llguidance, "LLMatcher", counted)
    first, second = (Constraint(grammar, tokenizer, vocab) for _ in range(2))
    assert compiled == [grammar]
    alone = Constraint(grammar, tokenizer, vocab)
    alone.matcher = real(ll, grammar, log_level=0)  # compiled for it alone
    for t in tokenizer.encode('{"name":"Ada","color":"red"', add_special_tokens=False):
        first.accept(t)
    assert not mx.array_equal(first.allowed(), second.allowed()).item()
    for t in tokenizer.encode('{"name":"Bo', add_special_tokens=False):
        assert mx.array_equal(second.allowed(), alone.allowed()).item()
        second.accept(t)
        alone.accept(t)
    assert mx.array_equal(second.allowed(), alone.allowed()).item()
    monkeypatch.setattr(constraints, "KEPT_GRAMMARS", 1)
    Constraint(JSON_OBJECT, tokenizer, vocab)
    assert list(tokenizer._llguidance_matchers) == [JSON_OBJECT]
    Constraint(grammar, tokenizer, vocab)
    assert compiled == [grammar, JSON_OBJECT, grammar]
    bad = "%llguidance {}\nstart: foo"
    for _ in range(2):
        with pytest.raises(ValueError, match="not valid"):
            Constraint(bad, tokenizer, vocab)
    assert list(tokenizer._llguidance_matchers) == [grammar]
    assert compiled[-2:] == [bad, bad]
