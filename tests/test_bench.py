"""The throughput bench runs every mode end to end on the tiny config and writes its outputs."""
import json

import pytest

from mlx_flashnorm.bench.decode import main

from conftest import cli

MODES = ["rms", "flash", "none", "mlx-lm", "rms-eager"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    main(["--tiny", "--pp", "12", "--tg", "6", "--reps", "2", "--modes", ",".join(MODES), "--out", str(out)])
    return out, json.loads((out / "bench.json").read_text())


def test_every_mode_measured(report):
    _, r = report
    assert list(r["results"]) == MODES
    for mode, res in r["results"].items():
        assert len(res["pp"]) == len(res["tg"]) == 2
        assert all(x > 0 for x in res["pp"] + res["tg"])
        s = res["tg_summary"]
        assert s["min"] <= s["median"] <= s["max"]
        assert res["peak_memory_gb"] > 0
    assert r["results"]["rms"]["tg_vs_rms"] == 1.0
    assert r["bits"] == 4 and r["dtype"] == "float32" and r["device"]
    assert "random weights" in r["model"]


def test_table_has_a_row_per_mode_and_test(report):
    out, r = report
    md = (out / "bench.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| tiny OpenELM")]
    assert len(rows) == 2 * len(MODES)
    for mode in MODES:
        assert any(f"| {mode} | pp12 |" in row for row in rows)
        assert any(f"| {mode} | tg6 |" in row for row in rows)
    assert r["device"] in md and r["mlx"] in md


def test_chart(report):
    out, _ = report
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, words", [(["--modes", "rms,fast"], "unknown mode 'fast'"),
                                         (["--tg", "1"], "--tg >= 2"),
                                         (["--pp", "1000", "--tg", "30"], "context is 1024")])
def test_bad_arguments(args, words, tmp_path):
    r = cli("mlx_flashnorm.bench", "--tiny", "--out", str(tmp_path), *args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and words in r.stderr
    assert "Traceback" not in r.stderr
