"""The throughput bench runs every mode end to end on the tiny config and writes its outputs."""
import copy
import json
import os
import re
import shutil
import statistics
from pathlib import Path

import pytest

from mlx_flashnorm.bench import llama_bench
from mlx_flashnorm.bench.cli import main
from mlx_flashnorm.bench.decode import LLAMA_3_2_1B, SHAPES, TINY, plot, round_order, table
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.loader import default_model_path, model_args

from conftest import cli, in_process

MODES = ["rms", "flash", "none", "mlx-lm", "rms-eager", "rms-primitives"]


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
    rms, flash = r["results"]["rms"], r["results"]["flash"]
    for test in ("pp", "tg"):  # the median of the per-round ratios (two rounds: their mean)
        pairs = [a / b for a, b in zip(flash[test], rms[test])]
        assert flash[f"{test}_vs_rms"] == pytest.approx(sum(pairs) / 2)
    assert "ratios paired per round" in (report[0] / "bench.md").read_text()
    assert r["bits"] == 4 and r["dtype"] == "float32" and r["device"]
    assert "random weights" in r["model"]


def test_rounds_rotate_the_order():
    modes = ["rms", "flash", "mlx-lm"]
    orders = [round_order(modes, rep) for rep in range(-1, 4)]
    assert orders[0] == orders[1] == modes  # the warm-up, then round 1
    assert orders[2] == ["flash", "mlx-lm", "rms"] and orders[3] == ["mlx-lm", "rms", "flash"]
    assert all(sorted(o) == sorted(modes) for o in orders)


def test_table_has_a_row_per_mode_and_test(report):
    out, r = report
    md = (out / "bench.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| tiny OpenELM")]
    assert len(rows) == 2 * len(MODES)
    for mode in MODES:
        assert any(f"| {mode} | pp12 |" in row for row in rows)
        assert any(f"| {mode} | tg6 |" in row for row in rows)
    notes = [line for line in md.splitlines() if line.startswith("- ")]  # what each mode runs
    assert [line.split(":")[0][2:] for line in notes] == MODES
    assert "layer loop" in notes[MODES.index("rms-primitives")] and "after the matvec" in notes[1]
    assert r["device"] in md and r["mlx"] in md


def test_chart(report):
    out, _ = report
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, words", [(["--modes", "rms,fast"], "unknown mode 'fast'"),
                                         (["--tg", "1"], "--tg >= 2"),
                                         (["--pp", "1000", "--tg", "30"], "context is 1024")])
def test_bad_arguments(args, words, tmp_path):
    r = in_process(main, "--tiny", "--out", str(tmp_path), *args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and words in r.stderr
    assert "Traceback" not in r.stderr


# --matrix and --config: random weights of config.json files, shrunk from the bench's shapes
TINY_LLAMA3 = dict(LLAMA_3_2_1B, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                   max_position_embeddings=2000)  # llama3 RoPE scaling kept; 'long' is 1792 here
MATRIX_MODES = ["rms", "flash", "mlx-lm"]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    (folder / "tiny-openelm.json").write_text(json.dumps(TINY))
    (folder / "tiny-llama3").mkdir()
    (folder / "tiny-llama3" / "config.json").write_text(json.dumps(TINY_LLAMA3))
    return folder / "tiny-openelm.json", folder / "tiny-llama3" / "config.json"


@pytest.fixture(scope="module")
def matrix(configs, tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    r = cli("mlx_flashnorm.bench", "--matrix", "--config", str(configs[0]), "--config", str(configs[1]),
            "--pp", "12,long", "--tg", "4", "--reps", "1", "--modes", ",".join(MATRIX_MODES), "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out, json.loads((out / "matrix.json").read_text()), r.stderr


def test_llama_3_2_1b_shape():
    _, args = model_args(SHAPES["llama-3.2-1b"][1])
    assert (args.hidden_size, args.num_hidden_layers, args.intermediate_size, args.vocab_size) == (2048, 16, 8192, 128256)
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (32, 8, 64)
    assert args.rope_scaling["rope_type"] == "llama3" and args.rope_scaling["factor"] == 32
    assert args.context_length == 131072 and args.tie_word_embeddings


def test_matrix_points(matrix):
    _, reports, stderr = matrix
    # tiny OpenELM's context (1024) holds no long prompt: skipped with a note; tiny Llama's holds 1792
    assert [(r["model"], r["pp"]) for r in reports] == [
        ("tiny-openelm (random weights)", 12), ("tiny-llama3 (random weights)", 12),
        ("tiny-llama3 (random weights)", 1792)]
    assert "tiny-openelm: no long prompt" in stderr
    for r in reports:
        assert list(r["results"]) == MATRIX_MODES and r["tg"] == 4 and r["path"] == "CPU"
        assert r["results"]["mlx-lm"]["tg_vs_mlx_lm"] == r["results"]["rms"]["pp_vs_rms"] == 1.0


def test_matrix_table_and_chart(matrix):
    out, reports, _ = matrix
    md = (out / "matrix.md").read_text()
    assert md.startswith("Command: `python -m mlx_flashnorm.bench --matrix") and reports[0]["device"] in md
    rows = [line.strip(" |").split(" | ") for line in md.splitlines() if line.startswith("| tiny-")]
    assert [row[:3] for row in rows] == [[r["model"], str(r["pp"]), m] for r in reports for m in MATRIX_MODES]
    for (model, pp, mode, tg, tg_spread, tg_rms, tg_peer, pp_tps, *_), r in zip(rows, [r for r in reports for _ in MATRIX_MODES]):
        s = r["results"][mode]["tg_summary"]
        assert (tg, tg_spread) == (f"{s['median']:.1f}", f"{s['min']:.1f} - {s['max']:.1f}")
        assert tg_rms == f"{r['results'][mode]['tg_vs_rms']:.2f}" and tg_peer == f"{r['results'][mode]['tg_vs_mlx_lm']:.2f}"
        assert pp_tps == f"{r['results'][mode]['pp_summary']['median']:.1f}"
    assert (out / "matrix.png").read_bytes()[:4] == b"\x89PNG"


def test_merge_of_split_runs(matrix, tmp_path):
    """--merge makes the table and chart of one run from the matrix.json files of runs that each
    measured some of its points (a matrix split over calls of limited length); runs of other
    settings are refused."""
    out, reports, _ = matrix
    first, rest = tmp_path / "first.json", tmp_path / "rest.json"
    first.write_text(json.dumps(reports[:1]))
    rest.write_text(json.dumps(reports[1:]))
    main(["--merge", str(first), str(rest), "--out", str(tmp_path / "merged")])
    assert json.loads((tmp_path / "merged" / "matrix.json").read_text()) == reports

    def rows(folder):
        return [line for line in (folder / "matrix.md").read_text().splitlines() if line.startswith("|")]
    assert rows(tmp_path / "merged") == rows(out)
    assert (tmp_path / "merged" / "matrix.png").read_bytes()[:4] == b"\x89PNG"
    unpaired = [{k: v for k, v in r.items() if k != "ratios"} for r in reports[1:]]  # measured before pairing
    for other in ([dict(r, reps=r["reps"] + 1) for r in reports[1:]],
                  [dict(r, path="MLX primitives only (portable)") for r in reports[1:]], unpaired):
        rest.write_text(json.dumps(other))
        r = cli("mlx_flashnorm.bench", "--merge", str(first), str(rest), "--out", str(tmp_path / "other"))
        assert r.returncode == 2 and "the runs differ in their settings" in r.stderr, other[0]


def test_config_names_the_model(configs, tmp_path):
    main(["--config", str(configs[1]), "--pp", "8", "--tg", "3", "--reps", "1", "--modes", "flash,mlx-lm",
          "--out", str(tmp_path)])
    r = json.loads((tmp_path / "bench.json").read_text())
    assert r["model"] == "tiny-llama3 (random weights)" and list(r["results"]) == ["flash", "mlx-lm"]


@pytest.mark.parametrize("args, words", [
    (["--matrix", "--tiny"], "--matrix runs random weights of --shape and --config models: drop --tiny"),
    (["--matrix", "--shape", "openelm-270m,gpt-5"], "unknown shape 'gpt-5'"),
    (["--matrix", "--config", "{llama}", "--pp", "12,x"], "--pp takes whole numbers of at least 1, not 'x'"),
    (["--matrix", "--config", "{llama}", "--pp", "1990", "--tg", "30"], "tiny-llama3: --pp + --tg is 2020"),
    (["--shape", "openelm-270m,smollm2-135m"], "need --matrix"),
    (["--shape", "llama-3.2-1b", "--tiny"], "--tiny and --shape both choose the model"),
    (["--config", "{missing}"], "no such file"),
    (["--config", "{bad}"], "not a model's config.json (no model_type)"),
    (["--config", "{llama}", "--config", "{llama}"], "only --matrix takes several"),
    (["--merge", "{missing}"], "nope.json: cannot read it"),
    (["--merge", "{bad}"], "bad.json: not a matrix.json of a --matrix run"),
    (["--merge", "{bad}", "--matrix"], "--merge reads earlier runs' matrix.json files: it runs no model")])
def test_bad_matrix_and_config_arguments(args, words, configs, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 4}))
    files = {"{llama}": str(configs[1]), "{missing}": str(tmp_path / "nope.json"), "{bad}": str(bad)}
    r = in_process(main, "--out", str(tmp_path / "out"), *[files.get(a, a) for a in args])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and words in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_bad_arguments_in_a_real_process(configs, tmp_path):
    r = cli("mlx_flashnorm.bench", "--out", str(tmp_path / "out"), "--config", str(configs[1]), "--config",
            str(configs[1]))
    assert r.returncode == 2 and r.stderr.strip() == "error: --config is given twice; only --matrix takes several"
    assert not (tmp_path / "out").exists()


def test_anatomy_tables_and_cold_parts(capsys):
    from mlx_flashnorm.bench.anatomy import main as anatomy

    anatomy(["--tiny", "--pp", "16", "--reps", "1", "--modes", "flash,mlx-lm", "--dtype", "float32"])
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| flash", "| mlx-lm"))]
    # prefill (ours eager and compiled) and decode, each mode (no kernels to switch off on the CPU)
    assert [row[:2] for row in rows[:3]] == [[" flash ", " eager "], [" flash ", " compiled "],
                                             [" mlx-lm ", " eager "]] and len(rows) == 5
    assert all(float(cell) >= 0 for row in rows for cell in row[-3:])
    anatomy(["--tiny", "--pp", "16", "--cold", "flash", "--dtype", "float32"])
    parts = [line for line in capsys.readouterr().out.splitlines() if "request" in line]
    assert len(parts) == 12 and sum("step 1 trace" in line for line in parts) == 2  # two requests


@pytest.mark.parametrize("args, mode", [(["--modes", "rms,fast"], "fast"), (["--cold", "rms-eager"], "rms-eager")])
def test_anatomy_bad_mode(args, mode):
    from mlx_flashnorm.bench.anatomy import main as anatomy

    r = in_process(anatomy, "--tiny", *args)
    assert r.returncode == 2 and f"'{mode}'" in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_row(i, name, ns):
    return (f'"{i}","1","python3","127.0.0.1","{name}","1","14","(256, 1, 1)","(9, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","ns","{ns:,}"')


def test_step_kernels_runs_steps_and_sums_ncu_durations(tmp_path, capsys):
    from mlx_flashnorm.bench.step_kernels import main as step_kernels

    step_kernels(["run", "--tiny", "--pp", "8", "--steps", "2", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "step_kernels: steps 2 mode flash pp 8" in out
    # what ncu writes around it: its own lines, the header, one row per kernel launch
    rows = [ncu_row(0, "fn_decode_attention", 25_000), ncu_row(1, "void mlx::qmv_kernel<8, 16>(const T1 *)", 4_000),
            ncu_row(2, "fn_decode_attention", 23_000), ncu_row(3, "void mlx::qmv_kernel<8, 16>(const T1 *)", 4_400),
            ncu_row(4, "void mlx::qmv_kernel<8, 16>(const T1 *)", 3_600)]
    (tmp_path / "flash.csv").write_text("==PROF== Connected to process 1\n" + out + NCU_HEADER + "\n" + "\n".join(rows))
    step_kernels(["summary", str(tmp_path / "flash.csv")])
    lines = capsys.readouterr().out.splitlines()
    assert "2.5 kernels a step, 30.0 us of GPU time a step (over 2 steps)" in lines[0]
    assert lines[3] == "| `fn_decode_attention` | 1 | 24.0 | 24.0 |"
    assert lines[4] == "| `mlx::qmv_kernel<8, 16>` | 1.5 | 6.0 | 4.0 |"


def test_step_kernels_summary_of_a_file_without_kernels(tmp_path):
    (tmp_path / "empty.csv").write_text("==PROF== Connected to process 1\n")
    r = cli("mlx_flashnorm.bench.step_kernels", "summary", str(tmp_path / "empty.csv"))
    assert r.returncode == 2 and "no kernels" in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


def test_bench_takes_a_gguf_file_and_defaults_to_the_embedded_model(tmp_path, capsys):
    """--model FILE.gguf runs every mode (mlx-lm's on the same weights, written out as a checkpoint),
    with the file's quantization as it is; without a model argument the embedded SmolLM2 runs."""
    import gguf
    from conftest import QWEN2, make_checkpoint
    from gguf_files import smollm2_meta, write_qwen_gguf

    meta = smollm2_meta()  # its vocabulary: the embedding has one row per token, as the loader checks
    config = dict(QWEN2, vocab_size=len(meta["tokenizer.ggml.tokens"]))
    _, weights = make_checkpoint(tmp_path / "q", config)
    path = write_qwen_gguf(tmp_path / "tiny-qwen2.Q8_0.gguf", "qwen2", config, weights,
                           tokenizer_meta=meta, qtype=gguf.GGMLQuantizationType.Q8_0)
    main(["--model", str(path), "--pp", "8", "--tg", "3", "--reps", "1", "--modes", "flash,mlx-lm",
          "--out", str(tmp_path / "gguf")])
    r = json.loads((tmp_path / "gguf" / "bench.json").read_text())
    assert r["model"] == "tiny-qwen2.Q8_0.gguf" and (r["bits"], r["group_size"]) == (8, 32)
    assert all(x > 0 for m in ("flash", "mlx-lm") for x in r["results"][m]["tg"])
    main(["--pp", "4", "--tg", "2", "--reps", "1", "--modes", "flash", "--out", str(tmp_path / "default")])
    r = json.loads((tmp_path / "default" / "bench.json").read_text())
    assert r["model"] == "embedded SmolLM2-135M-Instruct" and (r["bits"], r["group_size"]) == (4, 32)
    assert "| embedded SmolLM2-135M-Instruct Q4 |" in (tmp_path / "default" / "bench.md").read_text()


def test_matrix_log_has_no_bar_off_a_terminal(matrix):
    """The matrix's progress bar is drawn on a terminal only: a captured log holds plain lines."""
    _, _, stderr = matrix
    assert "\r" not in stderr and "point/s" not in stderr and "tiny-llama3 (random weights): pp12" in stderr


# --llama-bench: llama.cpp's llama-bench on the same GGUF file. tests/data/llama_bench_smollm2.json is
# its real output on the embedded SmolLM2 GGUF (a CPU build; tests/data/README.md has the command),
# matched to the tiny bench report above (pp 12, tg 6, 2 repetitions, depths 0 and 12).
LLAMA_BENCH_JSON = Path(__file__).parent / "data" / "llama_bench_smollm2.json"
LLAMA_BENCH = shutil.which(os.environ.get("LLAMA_BENCH", "llama-bench"))


def test_llama_bench_command():
    cmd = llama_bench.command("/opt/llama-bench", "m.gguf", 128, 64, 5)
    assert cmd == ["/opt/llama-bench", "-m", "m.gguf", "-ngl", "99", "-fa", "1", "-p", "128", "-n", "64", "-r", "5",
                   "-o", "json"]
    assert llama_bench.command("lb", "m.gguf", 128, 64, 5, (0, 1792))[-2:] == ["-d", "0,1792"]


def test_llama_bench_output_parsed():
    """Its JSON, as llama-bench printed it: a prefill and a decode test at each depth, with the
    tokens/s of each repetition."""
    tests = llama_bench.parse(LLAMA_BENCH_JSON.read_text())
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"]) for t in tests] == [(12, 0, 0), (0, 6, 0), (12, 0, 12), (0, 6, 12)]
    for t in tests:
        assert len(t["samples_ts"]) == 2 and all(x > 0 for x in t["samples_ts"])
        assert t["avg_ts"] == pytest.approx(sum(t["samples_ts"]) / 2, rel=1e-4)
        assert t["model_size"] > 50e6 and "samples_ns" not in t
    assert llama_bench.find(tests, 0, 6, 12) is tests[3]
    with pytest.raises(UserError, match="no test of 0 prompt and 7 generated tokens at depth 12"):
        llama_bench.find(tests, 0, 7, 12)


def test_llama_bench_rows_and_ratios_in_the_report(report, tmp_path):
    """llama.cpp's prefill at depth 0 and decode after pp tokens become rows of the table and bars
    of the chart; each of our modes gets its median over llama.cpp's median."""
    out, r = report
    r = copy.deepcopy(r)
    tests = llama_bench.parse(LLAMA_BENCH_JSON.read_text())
    llama_bench.add_to_report(r, tests, "llama-bench -m m.gguf")
    peer = r["results"]["llama.cpp"]
    assert peer["pp"] == tests[0]["samples_ts"] and peer["tg"] == tests[3]["samples_ts"]
    for mode in MODES:
        for test in ("pp", "tg"):
            want = r["results"][mode][f"{test}_summary"]["median"] / statistics.median(peer[test])
            assert r["results"][mode][f"{test}_vs_llama_cpp"] == pytest.approx(want)
    md = table(r)
    assert "llama.cpp: `llama-bench -m m.gguf`" in md and "| vs rms | vs llama.cpp | peak mem |" in md
    rows = [line for line in md.splitlines() if line.startswith("| tiny OpenELM")]
    assert len(rows) == 2 * (len(MODES) + 1)
    ratio = r["results"]["flash"]["tg_vs_llama_cpp"]
    assert any("| flash | tg6 |" in row and row.endswith(f" | {ratio:.3f} | {r['results']['flash']['peak_memory_gb'] * 1e3:.0f} MB |")
               for row in rows)
    median = statistics.median(tests[3]["samples_ts"])
    assert any(row.startswith("| tiny OpenELM") and f"| llama.cpp | tg6 | {median:.2f} |" in row and row.endswith("| - | - | - |")
               for row in rows)
    plot([r], tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "vs llama.cpp" not in (out / "bench.md").read_text()  # without --llama-bench: no column


@pytest.mark.skipif(LLAMA_BENCH is None, reason="no llama-bench binary found: set LLAMA_BENCH to its path or put it "
                                                "on PATH (a CPU build: cmake -DGGML_CUDA=OFF of llama.cpp, target llama-bench)")
def test_llama_bench_runs_on_the_embedded_gguf(report):
    """The real llama-bench on the embedded SmolLM2 GGUF, matched to a bench report (here one of
    4 prompt and 3 generated tokens, 1 repetition: a CPU build takes seconds a test): it ran each
    test asked for, and the report has its rows."""
    r = dict(copy.deepcopy(report[1]), pp=4, tg=3, reps=1)
    llama_bench.compare(r, LLAMA_BENCH, default_model_path(), log=lambda _: None)
    tests = r["llama_bench"]["tests"]
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"]) for t in tests] == [(4, 0, 0), (0, 3, 0), (4, 0, 4), (0, 3, 4)]
    assert r["llama_bench"]["command"].endswith("-ngl 99 -fa 1 -p 4 -n 3 -r 1 -o json -d 0,4")
    assert all(len(t["samples_ts"]) == 1 and t["samples_ts"][0] > 0 for t in tests)
    assert r["results"]["llama.cpp"]["tg"] == tests[3]["samples_ts"] and r["size_bytes"]["llama.cpp"] > 50e6


def test_llama_bench_without_a_binary_is_a_one_line_error(tmp_path):
    r = cli("mlx_flashnorm.bench", "--llama-bench", "/no/such/llama-bench", "--tiny", "--out", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("error: /no/such/llama-bench: no such executable; --llama-bench "
                                                 "takes the path of llama.cpp's llama-bench")


@pytest.mark.parametrize("args, words", [
    (["--tiny"], "give --model FILE.gguf"),
    (["--model", "{folder}"], "give --model FILE.gguf"),
    (["--model", "{folder}/none.gguf"], "give --model FILE.gguf"),
    (["--matrix"], "drop --merge or --matrix"),
])
def test_llama_bench_bad_arguments(args, words, tmp_path):
    """Checked before anything is measured: llama-bench must run on the GGUF file our modes load."""
    args = [a.replace("{folder}", str(tmp_path)) for a in args]
    with pytest.raises(UserError, match=re.escape(words)):
        main(["--llama-bench", shutil.which("true"), "--out", str(tmp_path / "out"), *args])


@pytest.mark.parametrize("cmd, words", [(["false"], "llama-bench failed (exit code 1)"),
                                        (["echo", "| model | size |"], "printed no JSON list of tests"),
                                        (["echo", '[{"n_prompt": 12}]'], "no tests with n_prompt"),
                                        (["/no/such/llama-bench"], "cannot run it")])
def test_llama_bench_failures_are_user_errors(cmd, words):
    """A llama-bench that fails, or prints anything but its JSON tests, is a one-line error."""
    with pytest.raises(UserError, match=re.escape(words)):
        llama_bench.run(cmd, log=lambda _: None)


def test_parameter_count_unpacks_quantized_weights():
    """A quantized checkpoint's packed uint32 weights count their values (4 or 8 bits each, as its
    quantization block says per module), scales and biases none (the bench's params column: the
    embedded GGUF's export read 28.8 M for SmolLM2's 134.5 M)."""
    import mlx.core as mx

    from mlx_flashnorm.bench.decode import parameter_count

    weights = {"a.weight": mx.zeros((4, 2), mx.uint32), "a.scales": mx.zeros((4, 1)), "a.biases": mx.zeros((4, 1)),
               "e.weight": mx.zeros((4, 2), mx.uint32), "e.scales": mx.zeros((4, 1)), "e.biases": mx.zeros((4, 1)),
               "n.weight": mx.zeros((3,)), "n.biases": mx.zeros((3,))}
    config = {"quantization": {"bits": 4, "group_size": 16, "e": {"bits": 8, "group_size": 16}}}
    assert parameter_count(weights, config) == 4 * 16 + 4 * 8 + 3 + 3


def test_batch_step_times_the_kernel_alone_when_asked(monkeypatch, tiny_model):
    """bench.batch_step: a row per row count and form of the step (its host parts and the engine
    step in ms); where the kernels run, --no-loop (loop False) leaves the layer loop's rows out."""
    from mlx_flashnorm.bench import batch_step

    model = tiny_model[0]
    lines = []
    batch_step.measure(model, "tiny", [1, 2], 2, log=lines.append)
    assert [line.split(" | ")[1:3] for line in lines] == [["layer loop", "1"], ["layer loop", "2"]]
    assert all(float(line.split(" | ")[-1].rstrip(" |")) > 0 for line in lines)
    monkeypatch.setattr(batch_step, "kernels_run", lambda: True)  # (the reference runs here)
    lines.clear()
    batch_step.measure(model, "tiny", [2], 2, log=lines.append, loop=False)
    assert [line.split(" | ")[1:3] for line in lines] == [["kernel", "2"]]
