"""GET /metrics and /health's batch on a real server (the batch worker over a tiny random Llama, a
free port of 127.0.0.1), asked with the official openai client: the exposition read by
prometheus_client's parser, its counters against the usage of the answers, its gauges and
/health's batch while requests decode and wait, the API key and --no-metrics."""
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_flashnorm.server import Server, arg_parser

from conftest import serving

WAIT = 120  # seconds: an upper bound, never a pace
COUNTING = "1, 2, 3, 4,"


def get(tiny_server, path, key=None):
    """(status, Content-Type, body text) of GET path."""
    request = urllib.request.Request(f"http://127.0.0.1:{tiny_server.server_address[1]}{path}",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def scrape(tiny_server, key=None):
    """GET /metrics through prometheus_client's parser: {sample name (/label value): value}, and
    {family: type}."""
    status, kind, text = get(tiny_server, "/metrics", key)
    assert status == 200 and kind.startswith("text/plain; version=0.0.4"), (status, text)
    families = list(text_string_to_metric_families(text))
    return ({s.name + "".join(f"/{v}" for v in s.labels.values()): s.value
             for f in families for s in f.samples}, {f.name: f.type for f in families})


def health(tiny_server):
    status, _, body = get(tiny_server, "/health")
    assert status == 200, body
    return json.loads(body)


def until(condition):
    """condition()'s first true value (within WAIT seconds)."""
    end = time.monotonic() + WAIT
    while not (got := condition()):
        assert time.monotonic() < end, "never happened"
        time.sleep(0.02)
    return got


def test_the_counters_are_the_answers_usage(tiny_server, tiny_client):
    """After a chat, a streamed chat, a completion of two seeded choices and a bad request, the
    counters have grown by their usage: prompt tokens computed (those the prompt cache gave apart,
    the prompt once for two choices), tokens generated, requests by outcome; time was counted, and
    the throughput gauges are the counters' ratios. llama-server's names are there, of its types."""
    before, _ = scrape(tiny_server)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    usages = [tiny_client.chat.completions.create(model="tiny", messages=chat, max_tokens=5).usage,
              list(tiny_client.chat.completions.create(
                  model="tiny", messages=chat, max_tokens=3, stream=True,
                  stream_options={"include_usage": True}))[-1].usage,
              tiny_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4,
                                        n=2, seed=1, temperature=1.0).usage]
    with pytest.raises(openai.BadRequestError):
        tiny_client.completions.create(model="tiny", prompt="Once", max_tokens=0)
    # (a handler counts its request once its answer is written: requests_active 0 then)
    until(lambda: scrape(tiny_server)[0]["mlx_flashnorm:requests_active"] == 0)
    after, types = scrape(tiny_server)

    def grew(name):
        return after[name] - before[name]

    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert usages[1].prompt_tokens_details.cached_tokens > 0  # (the first chat's prompt)
    prompts = sum(u.prompt_tokens for u in usages)
    assert grew("llamacpp:prompt_tokens_total") == prompts - sum(cached)
    assert grew("mlx_flashnorm:prompt_tokens_cached_total") == sum(cached)
    assert grew("llamacpp:tokens_predicted_total") == sum(u.completion_tokens for u in usages)
    assert usages[2].prompt_tokens == 4 and usages[2].completion_tokens == 8
    assert grew("mlx_flashnorm:requests_total/ok") == 3
    assert grew("mlx_flashnorm:requests_total/invalid") == 1
    assert grew("llamacpp:prompt_seconds_total") > 0
    assert grew("llamacpp:tokens_predicted_seconds_total") > 0
    assert grew("llamacpp:n_decode_total") >= 5 + 3 + 4  # each answer's decode steps, at least
    # decode steps apart from prefill calls; no row under a grammar: no mask time
    assert 0 < grew("mlx_flashnorm:decode_steps_total") < grew("llamacpp:n_decode_total")
    assert grew("mlx_flashnorm:grammar_mask_seconds_total") == 0
    assert after["llamacpp:predicted_tokens_seconds"] == pytest.approx(
        after["llamacpp:tokens_predicted_total"] / after["llamacpp:tokens_predicted_seconds_total"])
    assert after["llamacpp:prompt_tokens_seconds"] == pytest.approx(
        after["llamacpp:prompt_tokens_total"] / after["llamacpp:prompt_seconds_total"])
    assert 1 <= after["llamacpp:n_busy_slots_per_decode"] <= 4
    assert {k: types[k] for k in ("llamacpp:prompt_tokens", "llamacpp:tokens_predicted",
                                  "llamacpp:requests_processing", "llamacpp:requests_deferred",
                                  "llamacpp:kv_cache_usage_ratio", "mlx_flashnorm:requests")} == {
        "llamacpp:prompt_tokens": "counter", "llamacpp:tokens_predicted": "counter",
        "llamacpp:requests_processing": "gauge", "llamacpp:requests_deferred": "gauge",
        "llamacpp:kv_cache_usage_ratio": "gauge", "mlx_flashnorm:requests": "counter"}
    assert after["mlx_flashnorm:batch_rows_max"] == 4
    assert after["mlx_flashnorm:kv_budget_tokens"] == tiny_server.worker.kv_tokens
    assert after["mlx_flashnorm:kv_budget_tokens_held"] == 0


def test_health_and_the_gauges_show_the_batch(tiny_server, tiny_client):
    """While a request of 3 choices decodes (3 rows of the batch's 4) and one of 2 waits for room,
    /health's batch and the gauges say so, with the KV positions the rows hold; the client of the
    first leaving, its rows go, the other is answered, and the batch is empty again."""
    stream = tiny_client.completions.create(model="tiny", prompt=COUNTING, max_tokens=1000, n=3,
                                       stream=True)
    next(iter(stream))  # (decoding)
    waiting = threading.Thread(target=tiny_client.completions.create,
                               kwargs=dict(model="tiny", prompt=COUNTING, max_tokens=2, n=2))
    waiting.start()
    batch = until(lambda: (b := health(tiny_server)["batch"])["queued"] == 2 and b)
    assert batch["rows"] == 3 and batch["kv_cache_tokens"] > 3 * len(COUNTING.split())
    assert 0 < batch["kv_cache_usage_ratio"] <= 1
    gauges, _ = scrape(tiny_server)
    assert (gauges["mlx_flashnorm:batch_rows"], gauges["llamacpp:requests_processing"],
            gauges["llamacpp:requests_deferred"]) == (3, 3, 2)
    assert gauges["llamacpp:kv_cache_tokens"] >= batch["kv_cache_tokens"]
    assert gauges["mlx_flashnorm:requests_active"] == 2
    # (the KV positions they may write, a row a choice)
    prompt = len(tiny_server.tokenizer.encode(COUNTING))
    assert gauges["mlx_flashnorm:kv_budget_tokens_held"] == 3 * (prompt + 1000) + 2 * (prompt + 2)
    stream.close()  # (the client leaves)
    waiting.join(WAIT)
    assert not waiting.is_alive()
    until(lambda: health(tiny_server)["batch"] == {"rows": 0, "queued": 0, "kv_cache_tokens": 0,
                                              "kv_cache_usage_ratio": 0.0})
    assert scrape(tiny_server)[0]["mlx_flashnorm:requests_total/gone"] >= 1


class Idle:
    """A stand-in worker (requests.py's interface) that keeps no Load and is never asked."""
    slots, context_length, vocab_size = 2, 2048, 49152

    def submit(self, generation):
        raise AssertionError("no request was sent")


def test_metrics_need_the_api_key_and_can_be_turned_off(smollm2):
    """With --api-key, /metrics needs the key as llama-server's does (/health does not); a worker
    that keeps no Load shows zeros; --no-metrics (on by default) answers 404 naming the flag."""
    tokenizer = smollm2[1]
    with serving(Server(None, tokenizer, "m", port=0, worker=Idle(), api_key="sesame")) as s:
        status, kind, body = get(s, "/metrics")
        assert status == 401 and kind == "application/json" and "API key" in body
        assert get(s, "/health")[0] == 200
        samples, _ = scrape(s, key="sesame")
        assert samples["llamacpp:tokens_predicted_total"] == 0
        assert samples["llamacpp:kv_cache_usage_ratio"] == 0
    with serving(Server(None, tokenizer, "m", port=0, worker=Idle(), metrics=False)) as s:
        status, _, body = get(s, "/metrics")
        assert status == 404 and "--no-metrics" in json.loads(body)["error"]["message"]
    assert arg_parser().parse_args([]).metrics
    assert not arg_parser().parse_args(["--no-metrics"]).metrics
    assert arg_parser().parse_args(["--metrics"]).metrics  # (llama-server's flag, taken)
