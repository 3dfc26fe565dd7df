"""The latency bench plays one seeded conversation per mode, each in a fresh process, and writes
its table; --serve times the first token through real servers."""
import json
import random

import pytest

from mlx_flashnorm.bench.latency import chat_prompt, main, series, ttft_summary, ttft_table
from mlx_flashnorm.decoding import encode_chat

from conftest import TINY_LLAMA, in_process

MODES = ["rms", "flash", "mlx-lm"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("latency")
    main(["--tiny", "--requests", "3", "--rounds", "2", "--modes", ",".join(MODES), "--warmup", "--out", str(out)])
    return out, json.loads((out / "latency.json").read_text())


def test_series_is_a_seeded_growing_conversation():
    requests = series(6, 0, 100, 10_000)
    assert requests == series(6, 0, 100, 10_000) and requests != series(6, 1, 100, 10_000)
    for (prompt, max_tokens), (following, _) in zip(requests, requests[1:]):
        # the next prompt resends this one, then the reply and a new user message
        assert following[:len(prompt)] == prompt and len(following) > len(prompt) + max_tokens
    assert len({n for _, n in requests}) > 1 and all(1 <= n <= 128 for _, n in requests)
    assert all(0 <= t < 100 for prompt, _ in requests for t in prompt)


def test_series_max_tokens():
    assert series(6, 0, 100, 10_000, 128) == series(6, 0, 100, 10_000)  # the default series
    assert {n for _, n in series(20, 0, 100, 10_000, 4)} <= {1, 2, 3, 4}


def test_series_fits_the_context():
    requests = series(20, 0, 100, 600)
    assert all(len(prompt) + n <= 600 for prompt, n in requests)
    assert max(len(prompt) + n for prompt, n in requests) == 600  # cut from the front, not dropped


def test_every_mode_in_its_own_process(report):
    _, r = report
    assert list(r["results"]) == MODES and r["rounds"] == 2
    pids = [run["pid"] for m in MODES for run in r["runs"][m]]
    assert len(set(pids)) == len(pids) == 2 * len(MODES)
    for m in MODES:
        for run in r["runs"][m]:  # every mode and round played the same series
            assert [[q["prompt"], q["max_tokens"]] for q in run["requests"]] == r["requests"]
            assert all(0 < q["ttft_s"] <= q["total_s"] for q in run["requests"])
        s = r["results"][m]
        assert len(s["first_ttft_s"]) == len(s["load_s"]) == len(s["warmup_s"]) == len(s["e2e_tps"]) == 2
        assert all((w is None) == (m == "mlx-lm") for w in s["warmup_s"])  # mlx-lm has no warm-up
        assert s["cold_start_s"] == [run["load_s"] + (run["warmup_s"] or 0) + run["requests"][0]["ttft_s"]
                                     for run in r["runs"][m]]
        assert 0 < s["ttft_median_s"] <= s["ttft_max_s"] and s["e2e_tps_median"] > 0
    assert r["model"] == "tiny OpenELM (random weights)" and r["dtype"] == "float32" and r["device"]


def test_table(report):
    out, r = report
    md = (out / "latency.md").read_text()
    assert md.startswith("Command: `python -m mlx_flashnorm.bench.latency --tiny") and r["device"] in md
    rows = {line.split(" | ")[0][2:]: line.strip(" |").split(" | ") for line in md.splitlines()
            if line.startswith(("| rms | ", "| flash | ", "| mlx-lm | "))}
    assert list(rows) == MODES and all(len(cells) == 10 for cells in rows.values())
    assert rows["rms"][-2] == "1.00" and rows["mlx-lm"][-1] == "1.00"  # end-to-end vs rms, vs mlx-lm
    assert rows["flash"][3] == " / ".join(f"{x:.2f}" for x in r["results"]["flash"]["first_ttft_s"])
    assert rows["mlx-lm"][2] == "- / -" and "with warm-up" in md
    requests = [line for line in md.splitlines() if line[:4] in ("| 1 ", "| 2 ", "| 3 ")]
    assert [line.split(" | ")[1:3] for line in requests] == [[str(p), str(n)] for p, n in r["requests"]]


def test_no_warmup(tmp_path):
    main(["--tiny", "--requests", "1", "--modes", "rms", "--no-warmup", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "latency.json").read_text())
    assert r["warmup"] is False and r["results"]["rms"]["warmup_s"] == [None]
    assert "no warm-up" in (tmp_path / "latency.md").read_text()


@pytest.mark.parametrize("args, words", [(["--tiny", "--requests", "0"], "--requests >= 1"),
                                         (["--tiny", "--max-tokens", "0"], "--max-tokens >= 1"),
                                         (["--tiny", "--modes", "rms,fast"], "unknown mode 'fast'"),
                                         (["--tiny", "--shape", "openelm-270m"], "both choose the model"),
                                         (["--shape", "gpt-5"], "unknown shape 'gpt-5'"),
                                         (["--bits", "4"], "already quantized"),
                                         (["--config", "{tiny_llama}"], "the series needs 300")])
def test_bad_arguments(args, words, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    r = in_process(main, "--out", str(tmp_path / "out"), *[str(config) if a == "{tiny_llama}" else a for a in args])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and words in r.stderr
    assert "Traceback" not in r.stderr


def test_chat_prompts_have_the_lengths_asked(smollm2):
    """--serve's prompts: the chat-templated prompt has the length's tokens, each prompt its own."""
    tokenizer, rng = smollm2[1], random.Random(0)
    for n in (16, 128, 512):
        prompts = [chat_prompt(tokenizer, n, rng) for _ in range(3)]
        assert all(count == n == len(encode_chat(tokenizer, m)) for m, count in prompts)
        assert len({m[1]["content"] for m, _ in prompts}) == 3
        assert all(m[0] == {"role": "system", "content": ""} for m, _ in prompts)


def test_ttft_table():
    rows = {"ours": [0.010, 0.030, 0.020, None], "mlx-lm": [0.040, 0.040, 0.050, 0.040],
            "llama-server": [0.010, 0.010, 0.010, 0.010]}
    results = {s: {"16": ttft_summary([{"ttft_s": t} for t in ts])} for s, ts in rows.items()}
    assert results["ours"]["16"] == {"requests": 4, "failed": 1, "ttft_median_s": 0.020,
                                     "ttft_p90_s": pytest.approx(0.028)}
    report = {"model": "m", "device": "d", "mlx": "0", "repeats": 4, "max_tokens": 4,
              "servers": list(rows), "lengths": [16], "prompt_tokens": [16], "results": results}
    md = ttft_table(report).splitlines()
    assert md[2] == ("| prompt tokens | ours | mlx_lm.server | llama-server | ours / mlx_lm.server "
                     "| ours / llama-server |")
    assert md[4] == "| 16 | 20.0 / 28.0 (1 failed) | 40.0 / 47.0 | 10.0 / 10.0 | 0.50 | 2.00 |"


def test_serve_times_our_server(tiny_llama_dir, tmp_path):
    """--serve with our server alone (a tiny model with SmolLM2's tokenizer, on this device): every
    request answered, the server counting the prompt tokens asked for."""
    main(["--serve", "--no-peer", "--model", str(tiny_llama_dir), "--prompts", "16,40",
          "--repeats", "2", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    r = json.loads((tmp_path / "out" / "ttft.json").read_text())
    assert r["servers"] == ["ours"] and r["lengths"] == r["prompt_tokens"] == [16, 40]
    for n in ("16", "40"):
        assert [q["prompt_tokens"] for q in r["requests"]["ours"][n]] == [int(n)] * 2
        s = r["results"]["ours"][n]
        assert s["requests"] == 2 and s["failed"] == 0 and 0 < s["ttft_median_s"] <= s["ttft_p90_s"]
    md = (tmp_path / "out" / "ttft.md").read_text()
    assert md.startswith("Command: `python -m mlx_flashnorm.bench.latency --serve")
    assert sum(line.startswith(("| 16 | ", "| 40 | ")) for line in md.splitlines()) == 2
    assert (tmp_path / "work" / "ours.log").is_file()


@pytest.mark.parametrize("args, words", [
    (["--serve", "--tiny"], "--tiny is for the conversation, not --serve"),
    (["--serve", "--modes", "rms"], "--modes is for the conversation"),
    (["--llama-server", "llama-server"], "--llama-server is for --serve"),
    (["--serve", "--llama-server", "x", "--model", "y"], "leave --model unset"),
    (["--serve", "--llama-server", "{missing}"], "no such executable"),
    (["--serve", "--prompts", "16,x"], "--prompts takes whole numbers of at least 1, not 'x'"),
    (["--serve", "--repeats", "0", "--model", "y"], "--repeats >= 1"),
    (["--serve", "--model", "{missing}"], "not an MLX model folder")])
def test_bad_serve_arguments(args, words, tmp_path):
    r = in_process(main, "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                   *[str(tmp_path / "missing") if a == "{missing}" else a for a in args])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and words in r.stderr
    assert "Traceback" not in r.stderr
