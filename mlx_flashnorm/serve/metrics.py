"""GET /metrics: the server's counters and state in Prometheus's text exposition format (0.0.4),
under llama-server's names (`llamacpp:`) where it has the metric, under ours (`mlx_flashnorm:`)
where it has none.

The engine's numbers (requests.Load) are counted where the engine runs and come back with its
tokens (batch_worker.BatchWorker.look; over the pipe from engine_process's child): the HTTP side
counts only what it sees itself, how each completion request ended and how many it holds.

Where ours differ from llama-server's: its throughput gauges (prompt_tokens_seconds,
predicted_tokens_seconds) average over the time since the last scrape, which each scrape resets
(two scrapers disturb each other); ours average over the server's life, and the counters beside
them give any window's rate. An end-of-sequence token is not counted in tokens_predicted_total (as
usage leaves it out). n_busy_slots_per_decode is a gauge here (an average, not a count).
kv_cache_usage_ratio and kv_cache_tokens are the names of llama-server's earlier releases: the
positions the batch's rows hold, and their share of those the KV budget (--kv-budget) holds."""

FORMAT = "text/plain; version=0.0.4; charset=utf-8"
# how a completion request ended (mlx_flashnorm:requests_total's outcome), by its answer's status
OUTCOMES = ("ok", "invalid", "unavailable", "timeout", "failed", "gone")


def outcome(status):
    """The outcome of a request answered with HTTP status (a streamed one: its error event's)."""
    if status < 400:
        return "ok"
    return "invalid" if status < 500 else {503: "unavailable", 504: "timeout"}.get(status, "failed")


def value(v):
    return str(v) if isinstance(v, int) else repr(float(v))


def family(name, kind, text, samples):
    """One metric's lines: samples [(labels "" or '{k="v"}', value)]."""
    return ([f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            + [f"{name}{labels} {value(v)}" for labels, v in samples])


def exposition(load, outcomes, active, slots, held, budget):
    """The text of GET /metrics: load (requests.Load), outcomes {outcome: requests}, active
    (requests taken and not answered), slots (rows the batch may hold), held (the KV positions the
    requests taken may write), budget (those the worker's KV budget holds; None: no budget)."""
    def rate(tokens, seconds):
        return tokens / seconds if seconds > 0 else 0.0

    lines = []
    for name, kind, text, v in (
            ("llamacpp:prompt_tokens_total", "counter",
             "Prompt tokens processed (not those the prompt cache gave).", load.prompt_tokens),
            ("llamacpp:prompt_seconds_total", "counter",
             "Prompt processing time, summed over requests.", load.prompt_seconds),
            ("llamacpp:tokens_predicted_total", "counter", "Tokens generated.", load.generated),
            ("llamacpp:tokens_predicted_seconds_total", "counter",
             "Generation time, summed over choices.", load.generation_seconds),
            ("llamacpp:n_decode_total", "counter", "Model calls: prefill calls and decode steps.",
             load.calls),
            ("llamacpp:n_busy_slots_per_decode", "gauge", "Rows per decode step, on average.",
             rate(load.rows_stepped, load.steps)),
            ("llamacpp:prompt_tokens_seconds", "gauge",
             "Prompt throughput per request in tokens/s, over the server's life.",
             rate(load.prompt_tokens, load.prompt_seconds)),
            ("llamacpp:predicted_tokens_seconds", "gauge",
             "Generation throughput per choice in tokens/s, over the server's life.",
             rate(load.generated, load.generation_seconds)),
            ("llamacpp:requests_processing", "gauge", "Rows in the batch or under prefill.",
             load.processing),
            ("llamacpp:requests_deferred", "gauge",
             "Rows waiting for room in the batch (the queue).", load.waiting),
            ("llamacpp:kv_cache_usage_ratio", "gauge",
             "Share of the KV budget's positions the batch's rows hold.",
             rate(load.kv_tokens, load.kv_capacity)),
            ("llamacpp:kv_cache_tokens", "gauge", "KV cache positions the batch's rows hold.",
             load.kv_tokens),
            ("mlx_flashnorm:prompt_tokens_cached_total", "counter",
             "Prompt tokens the prompt cache gave.", load.cached_tokens),
            ("mlx_flashnorm:decode_steps_total", "counter", "Decode steps of the batch.",
             load.steps),
            ("mlx_flashnorm:grammar_mask_seconds_total", "counter",
             "Host time of the constrained rows' token masks (response_format, tools), summed "
             "over steps.", load.mask_seconds),
            ("mlx_flashnorm:batch_rows", "gauge", "Rows decoding in the batch.", load.rows),
            ("mlx_flashnorm:batch_rows_max", "gauge",
             "Rows the batch may hold (--max-concurrent).", slots),
            ("mlx_flashnorm:requests_active", "gauge",
             "Requests taken and not answered yet: waiting or generating.", active),
            ("mlx_flashnorm:kv_budget_tokens_held", "gauge",
             "KV positions the requests taken may write (prompt and max_tokens, a row a choice).",
             held),
            ("mlx_flashnorm:kv_budget_tokens", "gauge",
             "KV positions the budget holds (--kv-budget); a request past them gets 503.", budget)):
        if v is not None:  # (no budget: no such line)
            lines += family(name, kind, text, [("", v)])
    lines += family("mlx_flashnorm:requests_total", "counter",
                    "Completion requests by how they ended: ok, invalid (4xx), unavailable (503), "
                    "timeout (504), failed (500), gone (the client left).",
                    [(f'{{outcome="{o}"}}', outcomes.get(o, 0)) for o in OUTCOMES])
    return "\n".join(lines) + "\n"
