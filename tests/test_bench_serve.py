"""The load bench (mlx_flashnorm.bench.serve) against a real server on a free port: its counts
and timings come from the streams it read, and a failed request is counted with its reason."""
import math

from mlx_flashnorm import load
from mlx_flashnorm.bench.serve import engine_round, free_port, load_round, percentile, table
from mlx_flashnorm.server import Server

from conftest import serving


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == 1.99
    assert math.isnan(percentile([], 50))


def test_load_round_counts_every_streamed_token(tiny_llama_dir):
    model, tokenizer = load(str(tiny_llama_dir), progress=False)
    with serving(Server(model, tokenizer, "tiny", port=0)) as server:
        row = load_round(server.server_address[1], clients=3, rounds=2, max_tokens=4, tag="t")
    assert (row["requests"], row["errors"], row["error_kinds"]) == (6, 0, [])
    assert 6 <= row["tokens"] <= 24  # usage's completion tokens: at most max_tokens each, an EOS may end one
    assert 0 < row["ttft_p50"] <= row["ttft_p99"] < row["wall_s"]
    assert math.isnan(row["tpot_p50"]) or 0 < row["tpot_p50"] <= row["tpot_p99"] < row["wall_s"]  # per request
    assert row["tok_s"] == row["tokens"] / row["wall_s"]
    assert "| 3 | 6 |" in table([dict(row, server="ours")])


def test_load_round_counts_a_refused_request():
    row = load_round(free_port(), clients=2, rounds=1, max_tokens=4, tag="t")  # nothing listens there
    assert (row["requests"], row["errors"], row["tokens"]) == (0, 2, 0)
    assert len(row["error_kinds"]) == 1 and "refused" in row["error_kinds"][0].lower()


def test_engine_round_feeds_the_requests_to_the_engine_alone(tiny_llama_dir):
    """--engine's row: every client's requests, in turn, through a BatchEngine in this process."""
    model, tokenizer = load(str(tiny_llama_dir), progress=False)
    row = engine_round(model, tokenizer, clients=3, rounds=2, max_tokens=4, tag="t")
    assert (row["requests"], row["errors"]) == (6, 0)
    assert 6 <= row["tokens"] <= 24
    assert 0 < row["ttft_p50"] <= row["ttft_p99"] < row["wall_s"] and row["tok_s"] == row["tokens"] / row["wall_s"]
    assert math.isnan(row["tpot_p50"]) or 0 < row["tpot_p50"] <= row["tpot_p99"] < row["wall_s"]
