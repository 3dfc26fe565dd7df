"""The load bench (mlx_flashnorm.bench.serve) against a real server on a free port: its counts
and timings come from the streams it read, and a failed request is counted with its reason."""
import math
import time

import pytest

from mlx_flashnorm import load
from mlx_flashnorm.bench.load import load_round, percentile
from mlx_flashnorm.bench.serve import engine_counters, engine_round, free_port, step_profile, table
from mlx_flashnorm.server import Server

from conftest import serving


@pytest.fixture
def rows_32(monkeypatch):
    """The engine alone at 32 rows at most, not the server's default MAX_ROWS: its warm-up traces every bucket up
    to them, and a step of 256 rows of the tiny Llama (SmolLM2's 49,152 ids in its head) takes most of a second
    on the CPU."""
    monkeypatch.setattr("mlx_flashnorm.serve.batch_worker.MAX_ROWS", 32)


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


def test_engine_round_feeds_the_requests_to_the_engine_alone(tiny_llama_dir, rows_32):
    """--engine's row: every client's requests, in turn, through a BatchEngine in this process."""
    model, tokenizer = load(str(tiny_llama_dir), progress=False)
    row = engine_round(model, tokenizer, clients=3, rounds=2, max_tokens=4, tag="t")
    assert (row["requests"], row["errors"]) == (6, 0)
    assert 6 <= row["tokens"] <= 24
    assert 0 < row["ttft_p50"] <= row["ttft_p99"] < row["wall_s"] and row["tok_s"] == row["tokens"] / row["wall_s"]
    assert math.isnan(row["tpot_p50"]) or 0 < row["tpot_p50"] <= row["tpot_p99"] < row["wall_s"]
    assert row["steps"] >= 8 and 0 < row["steady_step_s"] and row["steady_s"] < row["wall_s"]
    assert 0 < row["first_full_s"] < row["wall_s"]


def test_step_profile_finds_the_steady_step_and_the_time_in_it():
    """The steady step is the median of the steps holding the most rows; only those within 1.5x of
    it count as time in it; the end of the first of them, when every row decodes."""
    steps = [(0.0, 0.05, 2), (0.05, 0.01, 3), (0.06, 0.01, 3), (0.07, 0.02, 3), (0.09, 0.01, 1)]
    p = step_profile(steps)
    assert p["steps"] == 5 and math.isclose(p["first_full_s"], 0.06)
    assert math.isclose(p["steady_step_s"], 0.01) and math.isclose(p["steady_s"], 0.02)


def test_engine_round_samples_at_the_temperature_asked(tiny_llama_dir, monkeypatch, rows_32):
    """--temperature reaches every request: the engine alone's requests sample at it."""
    from mlx_flashnorm.serve.engine import BatchEngine

    model, tokenizer = load(str(tiny_llama_dir), progress=False)
    temps, add = [], BatchEngine.add
    monkeypatch.setattr(BatchEngine, "add", lambda self, r: temps.append(r.temp) or add(self, r))
    row = engine_round(model, tokenizer, clients=2, rounds=1, max_tokens=4, tag="t", temperature=0.7)
    assert row["requests"] == 2 and temps[-2:] == [0.7, 0.7]


def test_serve_bench_refuses_a_temperature_out_of_range(tmp_path):
    from mlx_flashnorm.bench.serve import main
    from mlx_flashnorm.errors import UserError

    with pytest.raises(UserError, match="--temperature must lie in 0..2"):
        main(["--temperature", "3", "--no-peer", "--work", str(tmp_path)])
    with pytest.raises(UserError, match="--repeats must be at least 1"):
        main(["--repeats", "0", "--no-peer", "--work", str(tmp_path)])


def test_cpu_seconds_counts_a_process_own_work():
    import os

    from mlx_flashnorm.bench.serve import cpu_seconds

    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert 0.2 <= cpu_seconds(os.getpid()) - before < 5
    assert math.isnan(cpu_seconds(2**22 + 12345))  # no such process


def test_serve_bench_rows_hold_the_server_process_cpu(tiny_llama_dir, tmp_path, monkeypatch, rows_32):
    """bench.serve end to end (our server only, a process of its own, and --engine): the table and
    the JSON rows, each served row with the server process's CPU seconds for its requests; the engine
    alone, like the server, first takes an untimed request; --warm, an untimed round before each N's;
    --repeats, the served rows played again in the same process and summed up below the table."""
    import json

    from mlx_flashnorm.bench import serve

    rounds, served = [], []
    monkeypatch.setattr(serve, "engine_round",
                        lambda *a, f=serve.engine_round, **k: rounds.append(a[2:5]) or f(*a, **k))
    monkeypatch.setattr(serve, "load_round",
                        lambda *a, f=serve.load_round, **k: served.append(a[1:5]) or f(*a, **k))
    out = tmp_path / "serve.md"
    serve.main(["--model", str(tiny_llama_dir), "--clients", "2", "--rounds", "2", "--max-tokens", "4", "--no-peer",
                "--temperature", "0.5", "--engine", "--warm", "--repeats", "2", "--work", str(tmp_path / "work"),
                "--constrained", "0,1", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["server"], r["clients"], r["requests"], r["errors"], r.get("repeat"), r.get("constrained"))
            for r in rows] == [("ours", 2, 4, 0, 0, 0), ("ours", 2, 4, 0, 0, 1), ("ours", 2, 4, 0, 1, 0),
                               ("ours", 2, 4, 0, 1, 1), ("ours, engine alone", 2, 4, 0, None, None)]
    assert rounds == [(1, 1, 4), (2, 2, 4)]  # (clients, rounds, max_tokens): the untimed one first
    # --warm: an untimed round of its own prompts before each timed one; --repeats: the list played again;
    # --constrained: each N at each fraction
    assert served == [(2, 1, 4, "ours2-warm"), (2, 2, 4, "ours2"), (2, 1, 4, "ours2c1-warm"), (2, 2, 4, "ours2c1"),
                      (2, 1, 4, "ours2r1-warm"), (2, 2, 4, "ours2r1"), (2, 1, 4, "ours2c1r1-warm"),
                      (2, 2, 4, "ours2c1r1")]
    text = out.read_text()
    assert "ours, 2 clients (2 rows): median" in text and "ours, 2 clients, 1 constrained (2 rows): median" in text
    assert 0 <= rows[0]["server_cpu_s"] < rows[0]["wall_s"] * 64  # (a few ms here: 0 at 10 ms ticks)
    assert "| ours | 2 | 4 |" in text and "temperature 0.5" in text and "constrained |" in text
    assert "(the servers after an untimed round at each N)" in text and '"required": ["title"' in text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the chart
    # without --burst: no burst keys, no second table
    assert not [k for r in rows for k in r if k.startswith("burst")] and "window" not in text


def test_paired_ratios_divide_by_the_same_repeats_first_single():
    """--repeats: each N's rows over the repeats, each divided by its own repeat's first one-client row."""
    from mlx_flashnorm.bench.serve import paired

    rows = [dict(server="ours", clients=n, repeat=k, tok_s=t) for k, n, t in
            [(0, 1, 100), (0, 32, 2000), (0, 1, 50), (1, 1, 200), (1, 32, 3000), (2, 1, 100), (2, 32, 2500)]]
    rows.append(dict(server="mlx-lm", clients=32, repeat=0, tok_s=900))  # one row: no line
    lines = paired(rows)
    assert lines[0] == "ours, 1 clients (4 rows): median 100 tok/s"
    assert lines[1] == ("ours, 32 clients (3 rows): median 2,500 tok/s, 20.0x the same repeat's first single stream "
                        "(paired, median; 15.0-25.0x)")
    assert len(lines) == 2


def test_constrained_clients_ask_our_server_for_the_schema(tiny_llama_dir):
    """--constrained's rows for real: of 4 clients at 0.5, the first 2 send response_format json_schema,
    which our server turns into a grammar for its engine; the others send free requests; all answered."""
    from mlx_flashnorm.serve.batch_worker import BatchWorker

    class Recording(BatchWorker):
        grammars = []

        def submit(self, generation):
            self.grammars.append(generation.grammar)
            return super().submit(generation)

    model, tokenizer = load(str(tiny_llama_dir), progress=False)
    worker = Recording(model, tokenizer)
    with serving(Server(model, tokenizer, "tiny", port=0, worker=worker)) as server:
        port = server.server_address[1]
        before = engine_counters(port)
        row = load_round(port, clients=4, rounds=1, max_tokens=6, tag="t", constrained=0.5)
        # the engine's counters as /metrics gives them (its load is taken once the engine idles)
        end = time.monotonic() + 60
        while (grown := [b - a for a, b in zip(before, engine_counters(port))])[1] == 0:
            assert time.monotonic() < end, "no mask time counted"
            time.sleep(0.05)
    assert grown[0] >= 5 and grown[1] > 0  # decode steps; the constrained rows' masks' seconds
    assert (row["requests"], row["errors"], row["constrained"]) == (4, 0, 0.5)
    # the free half's TPOT apart (2 streams of 6 tokens: measured), and its column in the table
    assert 0 < row["free_tpot_p50"] <= row["free_tpot_p99"] < 10
    assert f"| 0.5 | {1e3 * row['free_tpot_p50']:.1f} / {1e3 * row['free_tpot_p99']:.1f} | |" in table([dict(row, server="ours")])
    assert sorted(g is None for g in worker.grammars) == [False, False, True, True]
    assert all('"genre"' in g and "adventure" in g for g in worker.grammars if g is not None)


def test_mlx_lm_constrained_rows_are_skipped_and_the_table_says_so():
    from mlx_flashnorm.bench.serve import SKIPPED, plan

    assert plan("mlx-lm", [1, 32], [0, 0.5], 1) == [(0, 1, 0, None), (0, 1, 0.5, SKIPPED), (0, 32, 0, None),
                                                    (0, 32, 0.5, SKIPPED)]
    assert plan("ours", [8], [0, 1], 2) == [(0, 8, 0, None), (0, 8, 1, None), (1, 8, 0, None), (1, 8, 1, None)]
    text = table([dict(server="mlx-lm", clients=32, constrained=0.5, repeat=0, skipped=SKIPPED)])
    assert text.splitlines()[0].endswith("| constrained | free rows' TPOT p50 / p99 (ms) | masks a step (ms) |")
    assert text.splitlines()[-1] == f"| mlx-lm | 32 | skipped: {SKIPPED} | | | | | | | 0.5 | | |"


def test_llama_server_command_and_argument_errors(tmp_path):
    """llama-server's command line: -np slots, flash attention, every layer on the GPU, a context of
    max_tokens and a prompt's room for each slot; bad arguments are one-line errors before anything
    runs (the llama-server rows themselves need the binary: the GPU session runs them)."""
    from mlx_flashnorm.bench.serve import PROMPT_ROOM, llama_server_command, main
    from mlx_flashnorm.errors import UserError

    assert llama_server_command("/opt/llama-server", "m.gguf", 8081, 64, 256) == [
        "/opt/llama-server", "-m", "m.gguf", "--port", "8081", "-np", "64", "-fa", "on", "-ngl", "99",
        "-c", str(64 * (256 + PROMPT_ROOM))]
    work = ["--no-peer", "--work", str(tmp_path)]
    for args, message in [(["--llama-server", str(tmp_path / "llama-server")], "no such executable"),
                          (["--llama-server", "llama-server", "--model", str(tmp_path)], "leave --model unset"),
                          (["--llama-np", "0"], "--llama-np must be at least 1"),
                          (["--constrained", "0,2"], "--constrained must be fractions from 0 to 1"),
                          (["--constrained", "half"], "--constrained must be fractions"),
                          (["--burst", "-1"], "--burst must be a count of requests")]:
        with pytest.raises(UserError, match=message):
            main(args + work)
    assert not any(tmp_path.iterdir())  # (nothing converted or started)


def test_window_tpot_splits_the_steady_gaps_at_the_burst_window():
    """A stream's gaps between content chunks, per token (several tokens a chunk: the stream's
    mean), averaging to its TPOT; those overlapping the window (a stall spanning it too) apart from
    the others; the window from the first newcomer sent to the last first content."""
    from mlx_flashnorm.bench.load import Stream, burst_summary, window_tpot

    steady = Stream(0.0, [1.0, 2.0, 3.0, 6.0, 7.0], 5)
    assert [g[2] for g in steady.gaps()] == [1.0, 1.0, 3.0, 1.0] and steady.tpot == 1.5
    doubled = Stream(0.0, [1.0, 2.0, 4.0], 5)  # 4 tokens after the first in 2 gaps: 2 a gap
    assert [g[2] for g in doubled.gaps()] == [0.5, 1.0] and doubled.tpot == 0.75
    assert window_tpot([steady], 4.0, 5.0) == ([3.0], [1.0, 1.0, 1.0])
    assert window_tpot([steady, doubled], 1.5, 2.5) == ([1.0, 1.0, 0.5, 1.0], [3.0, 1.0])
    burst = [Stream(4.0, [4.5, 4.6], 2), Stream(4.2, [5.0], 1)]
    row = burst_summary([steady], burst, ["refused"], 3, 3.9)
    assert (row["burst"], row["burst_requests"], row["burst_errors"], row["burst_tokens"]) == (
        3, 2, 1, 3)
    assert row["burst_window_s"] == 1.0 and math.isclose(row["burst_ttft_p50"], 0.65)
    assert (row["burst_in_gaps"], row["burst_in_tpot_p99"]) == (1, 3.0)
    assert (row["burst_out_gaps"], row["burst_out_tpot_p50"]) == (3, 1.0)


def test_serve_bench_burst_rows(tiny_llama_dir, tmp_path, rows_32):
    """--burst for real (our server in a process of its own, at 1 and 2 streaming clients): once
    each client's stream has its first chunks, 2 newcomers send theirs at once; every row holds
    their answers and TTFT, and the steady streams' TPOT within the window and outside it."""
    import json

    from mlx_flashnorm.bench import serve
    from mlx_flashnorm.bench.load import BURST_AFTER

    out = tmp_path / "serve.md"
    # (the tiny Llama's context of 64 tokens: a prompt's 48 and 12 new)
    serve.main(["--model", str(tiny_llama_dir), "--clients", "1,2", "--rounds", "1",
                "--max-tokens", "12", "--no-peer", "--burst", "2", "--work", str(tmp_path / "w"),
                "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["clients"], r["requests"], r["errors"]) for r in rows] == [(1, 1, 0), (2, 2, 0)]
    for r in rows:
        assert (r["burst"], r["burst_requests"], r["burst_errors"]) == (2, 2, 0)
        assert 0 < r["burst_ttft_p50"] <= r["burst_ttft_p99"] <= r["burst_window_s"]
        assert r["burst_start_s"] > r["ttft_p99"]  # it waited for the steady streams' first chunks
        # the gaps before every client's BURST_AFTER-th chunk are outside the window; it overlaps
        # some of the rest
        assert r["burst_out_gaps"] >= (BURST_AFTER - 1) * r["clients"] and r["burst_in_gaps"] >= 1
        for key in ("in_tpot_p50", "in_tpot_p99", "out_tpot_p50", "out_tpot_p99"):
            assert 0 < r[f"burst_{key}"] and math.isfinite(r[f"burst_{key}"]), key
    text = out.read_text()
    assert "| server | clients | requests | tokens | aggregate tok/s |" in text
    assert "| TPOT p99 in window (ms) |" in text and "| ours | 2 | 2 | 2 |" in text
