"""Tensor parallelism (shard.py, lockstep.py): real ring processes on this machine, started with
`mlx.launch --backend ring`, against one process. The split arithmetic itself is checked in this
process first, module by module (the ranks' partial outputs summed by hand)."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest

from mlx_flashnorm import flashnorm, load
from mlx_flashnorm.chat import Chat
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.server import Server
from mlx_flashnorm.loader import build_model, prepare, read_config, read_safetensors
from mlx_flashnorm.shard import split

from conftest import GEMMA3, QWEN2, QWEN3, TINY_LLAMA, TINY_OPENELM, children, make_checkpoint, openai_client, rel, serving

ROOT = Path(__file__).resolve().parent.parent
TOL = 2e-5  # float32: the ranks' partial sums add in another order than one matmul's
# a head count and an FFN width that divide over 2 processes, for each architecture
CONFIGS = {"llama": dict(TINY_LLAMA, vocab_size=80), "openelm": dict(TINY_OPENELM, num_kv_heads=[2, 2], vocab_size=80),
           "qwen2": dict(QWEN2, vocab_size=80), "qwen3": dict(QWEN3, vocab_size=80),
           "gemma3": dict(GEMMA3, num_key_value_heads=2, vocab_size=80)}
NORMS = ("rms", "flash")
PROMPT, NEW = 12, 8  # prompt tokens and greedy tokens the launched check compares


def tiny_tokenizer(folder):
    """A word-level tokenizer of 64 entries ("w0".."w60"), quick to load, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    folders = {}
    for name, config in CONFIGS.items():
        folders[name], _ = make_checkpoint(root / name, config)
        tiny_tokenizer(folders[name])
    return folders


def launch(n, *args, env=None):
    """`mlx.launch -n n --backend ring python args...` from the worktree (its mlx_flashnorm), with
    the variables of env added to this process's."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    cmd = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
           "-n", str(n), "--backend", "ring", sys.executable, *args]  # what the mlx.launch script runs
    return cmd, env


# mlx.launch's thread for each rank loops on select() over the rank's stdin pipe for writing, which
# returns at once while the pipe has room, and its main loop on its own stdin, which returns at once
# at end of file: both spin for the whole run (the three-process test took 34 s of CPU time in
# 17 s). Blank lines that no rank reads fill the ranks' pipes (64 KiB each), and mlx.launch's
# stdin is held open until it exits: its loops wait (that test: 16 s of CPU time in 9 s).
IDLE_INPUT = b"\n" * (256 << 10)


def popen_launch(n, *args, stdin="", env=None, **kwargs):
    """subprocess.Popen of `mlx.launch -n n` (launch()), its stdin the text stdin, then IDLE_INPUT, held
    open (a thread writes it) until p.close_input(), to be called once it has exited."""
    cmd, env = launch(n, *args, env=env)
    read, write = os.pipe()
    try:
        p = subprocess.Popen(cmd, env=env, stdin=read, cwd=ROOT, **kwargs)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)

    def feed(data):
        try:
            while data:
                data = data[os.write(write, data):]
        except OSError:  # mlx.launch exited before it read all of it
            pass

    feeder = threading.Thread(target=feed, args=(stdin.encode() + IDLE_INPUT,), daemon=True)
    feeder.start()

    def close_input():
        feeder.join(timeout=60)  # (a write to a pipe nobody reads any more fails at once)
        os.close(write)

    p.close_input = close_input
    return p


def run_launch(n, *args, stdin="", timeout=300, env=None):
    p = popen_launch(n, *args, stdin=stdin, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        p.kill()
        p.communicate()
        raise
    finally:
        p.close_input()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# ---------------------------------------------------------------- in this process: the split

def whole_and_split(folder, norm, size):
    """The prepared model, and size copies of it each split to one rank's share (shard.split on
    FlashNorm's modules and concatenated linears, as shard.shard does)."""
    def fresh():
        return prepare(build_model(read_config(folder), read_safetensors(folder), progress=False), norm=norm)

    return fresh(), [split(fresh(), r, size) for r in range(size)]


def settled(y):
    """A flash FFN's output with its deferred scale applied."""
    return y.x * y.s if isinstance(y, flashnorm.Deferred) else y


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("arch", CONFIGS)
def test_split_modules_sum_to_whole(checkpoints, arch, norm):
    """Each attention and FFN of every layer: the ranks' outputs (row-parallel products not yet
    summed) add up to the whole module's, in float32; each rank holds half the heads."""
    whole, ranks = whole_and_split(checkpoints[arch], norm, 2)
    mx.random.seed(1)
    for i, layer in enumerate(whole.layers):
        attn, ffn = ("attn", "ffn") if "attn" in layer else ("self_attn", "mlp")
        x = mx.random.normal((1, 5, in_dim(layer[ffn])))
        for name, args in ((attn, (None, None)), (ffn, ())):
            ref = settled(layer[name](x, *args))
            parts = [settled(r.layers[i][name](x, *args)) for r in ranks]
            assert rel(parts[0] + parts[1], ref) < TOL, (i, name)
            assert rel(parts[0], ref) > 0.1  # one rank alone is not the whole
        for r in ranks:
            assert (r.layers[i][attn].n_heads * 2, r.layers[i][attn].n_kv_heads * 2) == \
                (layer[attn].n_heads, layer[attn].n_kv_heads)


def in_dim(ffn):
    """The model width an FFN reads."""
    name = next(n for n in ("gate_up_proj", "gate_proj", "proj_1") if n in ffn)
    return ffn[name]["weight"].shape[1]


def test_split_refuses_what_does_not_divide(checkpoints, tmp_path):
    """OpenELM's per-layer head counts: a layer whose KV heads do not divide is named in a
    UserError; a quantized row-parallel linear must keep whole groups."""
    folder, _ = make_checkpoint(tmp_path / "openelm", TINY_OPENELM)  # num_kv_heads [2, 1]
    model = build_model(read_config(folder), read_safetensors(folder), progress=False)
    with pytest.raises(UserError, match=r"layers\.1\.attn: its 1 key/value heads do not divide over 2"):
        split(model, 0, 2)
    model = prepare(build_model(read_config(checkpoints["llama"]), read_safetensors(checkpoints["llama"]),
                                progress=False), bits=4, group_size=32)
    with pytest.raises(UserError, match=r"down_proj: its 80 input columns .* groups of 32"):
        split(model, 1, 2)  # FFN 160 = 2 x 80 columns, 80 not a multiple of 32
    with pytest.raises(UserError, match=r"(heads|FFN columns) do not divide over 3 processes"):
        split(build_model(read_config(checkpoints["llama"]), read_safetensors(checkpoints["llama"]),
                          progress=False), 0, 3)


# ---------------------------------------------------------------- launched: ring processes

@pytest.fixture(scope="module")
def launched(checkpoints, tmp_path_factory):
    """One `mlx.launch -n 2` of tests/distributed_check.py over every architecture and norm."""
    out = tmp_path_factory.mktemp("tp-out")
    p = run_launch(2, str(ROOT / "tests" / "distributed_check.py"), str(out), str(PROMPT), str(NEW),
                   ",".join(NORMS), *map(str, checkpoints.values()))
    # (mlx.launch exits 0 where a rank failed: each rank's results must be there)
    assert p.returncode == 0 and all((out / f"rank{r}.json").is_file() for r in range(2)), \
        p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("arch", CONFIGS)
def test_two_processes_match_one(launched, arch, norm):
    """load() under mlx.launch -n 2: the logits of a prompt within float32 tolerance of one
    process's, bitwise the same on both ranks, the same greedy tokens from the compiled decode
    loop, and each rank holding exactly half of every split linear's weights, the embedding's and
    the LM head's (about half of all); shard.shard on a
    model loaded whole gives the same logits."""
    rank0, rank1 = (r[f"{arch}/{norm}"] for r in launched)
    assert launched[0]["size"] == 2
    assert rank0["rel"] < TOL and rank1["rel"] < TOL
    assert rank0["late_rel"] < TOL and rank1["late_rel"] < TOL  # shard.shard on a loaded model
    assert rank0["checksum"] == rank1["checksum"]
    assert rank0["tokens"] == rank0["ref_tokens"] == rank1["tokens"]
    assert len(rank0["tokens"]) == NEW
    assert rank0["split_bytes"] * 2 == rank0["ref_split_bytes"] == rank1["split_bytes"] * 2
    assert rank0["bytes"] < 0.55 * rank0["ref_bytes"]  # the norms (and row-parallel biases) stay whole
    assert [2 * h for h in rank0["n_heads"]] == rank0["ref_n_heads"]


HALF = {"float16": 2e-2, "bfloat16": 8e-2}  # dtype: tolerance


def test_two_processes_in_half_precision(checkpoints, tmp_path):
    """The split in float16 and in bfloat16 (rms and flash, Llama and Gemma 3: the sandwich norms and
    the scaled embedding), one launch for both: the logits within test_half.py's tolerances
    (relative to the largest logit) of one process in the same dtype, bitwise the same on both
    ranks. (MLX emulates half precision on this CPU, and compiles kernels for each dtype and shape
    on first use: one short prompt's forward pass; the compiled decode loop's split is checked in
    float32 above.)"""
    p = run_launch(2, str(ROOT / "tests" / "distributed_check.py"), str(tmp_path), "6", "0", ",".join(NORMS),
                   str(checkpoints["llama"]), str(checkpoints["gemma3"]), env={"DTYPE": ",".join(HALF)})
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    keys = [k for k in ranks[0] if k != "size"]
    assert sorted(keys) == sorted(f"{a}/{n}/{d}" for a in ("llama", "gemma3") for n in NORMS for d in HALF)
    for key in keys:
        tol = HALF[key.rsplit("/", 1)[1]]
        assert ranks[0][key]["rel"] < tol and ranks[0][key]["late_rel"] < tol, key
        assert ranks[0][key]["checksum"] == ranks[1][key]["checksum"], key
        assert ranks[0][key]["rel"] > 0  # it ran in half precision


def assert_embedded_split(out):
    """The results in out of tests/distributed_check.py over 3 ring processes, the embedded SmolLM2
    (Q4_1; 9 heads, 3 KV heads, FFN 1536) flash-normed (on its quantized weights, the gain kept on
    the activations), rank 0 with one process's reference: the same greedy tokens and logits within
    float32 tolerance of one process, a third of the weights per rank (blocks, embedding and tied
    head). (rms takes the same split: the architectures' test above runs both.)"""
    ref = json.loads((out / "rank0.json").read_text())["embedded/flash"]
    ref_logits = mx.array(np.load(out / "ref-embedded-flash.npy"))
    assert len(ref["ref_tokens"]) == 3
    for r in range(3):
        got = json.loads((out / f"rank{r}.json").read_text())["embedded/flash"]
        logits = mx.array(np.load(out / f"rank{r}-embedded-flash.npy"))
        # 4-bit weights, float32 activations: 30 layers of sums
        assert rel(logits, ref_logits) < 1e-4, r
        assert got["tokens"] == ref["ref_tokens"], r
        assert got["split_bytes"] * 3 == ref["ref_split_bytes"]
        # a third of all the weights: only norms stay whole
        assert got["bytes"] < 0.34 * ref["ref_bytes"]
        assert got["n_heads"] == [3] * 30
    assert ref["rel"] == rel(mx.array(np.load(out / "rank0-embedded-flash.npy")), ref_logits)


def ask(client):
    """A greedy chat answer of 5 tokens."""
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "w1 w2"}],
                                          max_tokens=5).choices[0].message.content


def ranks(launcher):
    """{rank: pid} of the processes an mlx.launch process started (Linux)."""
    pids = children(launcher.pid)
    return {int(dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0")
                     if "=" in v)["MLX_RANK"]): pid for pid in pids}


def serve_launched(n, *args, check=(), env=None):
    """`server` under mlx.launch -n n on any free port: (launcher, its API's URL). check: the
    arguments of a tests/distributed_check.py that the same processes run first (env: its
    variables)."""
    head = ([str(ROOT / "tests" / "distributed_check.py"), *check, "--"] if check
            else ["-m", "mlx_flashnorm.server"])
    server = popen_launch(n, *head, "--port", "0", *args, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
    # (a rank that fails or hangs before serving: all of them killed at 300 s, as run_launch's)
    killer = threading.Timer(300, os.killpg, (server.pid, signal.SIGKILL))
    killer.start()
    try:
        line = server.stdout.readline()
    finally:
        killer.cancel()
    if not line.startswith("serving "):
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        _, err = server.communicate()
        server.close_input()
        raise AssertionError(line + err[-3000:])
    return server, line.split()[-1]


def gone(pids, seconds=30):
    """Whether every process of pids has ended (and been reaped) within seconds."""
    end = time.monotonic() + seconds
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def test_server_and_chat_under_mlx_launch(checkpoints, tmp_path):
    """`server` under mlx.launch -n 2 (the batch engine on both ranks): rank 0 serves (the other
    rank listens nowhere), a greedy answer is one process's, and Ctrl-C to rank 0 (SIGINT) ends
    every rank with status 0 (mlx.launch warns of any other) and no error. `chat` under -n 2: rank
    0 reads the lines and prints the replies once, as one process does."""
    folder = checkpoints["llama"]
    model, tok = load(folder, distributed=False)
    with serving(Server(model, tok, "m", port=0, max_concurrent=1)) as alone:  # one process's answer
        want = ask(openai_client(alone))
    server, url = serve_launched(2, "--model", str(folder))
    try:
        pids = ranks(server)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        assert ask(client) == want
        # n choices, sampled with no seed (rank 0 draws one; each choice's follows from it on every
        # rank), a stop string dropping a choice where it comes: the ranks stay in step (the
        # token digest checks), the next answer is alike, /metrics counts rank 0's engine
        many = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "w3"}], max_tokens=8, n=3,
            temperature=1.0, stop=["w"])
        assert sorted(c.index for c in many.choices) == [0, 1, 2]
        assert ask(client) == want
        metrics = urllib.request.urlopen(url.replace("/v1", "/metrics"), timeout=30).read()
        predicted = re.search(rb"^llamacpp:tokens_predicted_total (\S+)$", metrics, re.M)
        assert predicted and float(predicted[1]) > 0, metrics
        assert urllib.request.urlopen(url.replace("/v1", "/health"), timeout=30).status == 200
        os.kill(pids[0], signal.SIGINT)
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.communicate()
        server.close_input()
    assert server.returncode == 0 and gone(pids.values()), err[-3000:]
    assert "SIGINT: stopping" in err and "WARN" not in err and "Traceback" not in err, err[-3000:]
    assert "terminate called" not in err, err[-3000:]  # (no thread of MLX's left to abort the exit)

    chat = Chat(model, tok, max_tokens=5)
    want = "".join(f"{''.join(chat.reply(line))}\n" for line in ("w1 w2", "w3"))
    two = run_launch(2, "-m", "mlx_flashnorm.chat", "--model", str(folder), "-m", "5", stdin="w1 w2\nw3\n/exit\n")
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == want


# the eight clients' prompts (a token or two each: the steps that feed a late prompt cost as much
# as those that generate), completed greedily in TOKENS tokens each (none stops sooner, and none
# of those tokens is a near tie: the ranks' sums add in another order than one process's)
PROMPTS = ["Paris", "Python", "Water", "Music", "Once upon", "Winter", "Football", "Dogs"]
TOKENS = 4
RANK_TIMEOUT = 10  # the launched server's --rank-timeout (a step may take 10 times as long)


def streamed(client, prompt, max_tokens=TOKENS):
    """A greedy streamed completion: (its text, its finish reason)."""
    text, finish = [], None
    for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                           stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def as_json(client):
    """A greedy streamed completion under response_format json_object (its rows' masks: every rank
    waits for them, BatchEngine's hold off): its text."""
    chunks = client.completions.create(model="m", prompt="A cat as JSON:", max_tokens=12,
                                       stream=True, extra_body={"response_format":
                                                                {"type": "json_object"}})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def hang_up(client):
    """A long streamed completion, sampled with no seed (rank 0 draws one for every rank), whose
    client leaves after its first token."""
    stream = client.completions.create(model="m", prompt="Summer", max_tokens=200, temperature=1.0,
                                       stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    stream.close()


def test_batching_server_over_three_processes(smollm2, tmp_path):
    """The batching server under mlx.launch -n 3 (the embedded SmolLM2: 9 heads, a third a rank),
    its processes having first run the split check (assert_embedded_split: the ranks start once):
    eight concurrent streaming clients get, token for token, the greedy answers of one process's
    server, and so does one under a JSON grammar, while another, sampled, hangs up after its first
    token (its row leaves every rank's
    batch: the ranks stay in step, which each step's token digest checks, and the next request is
    answered alike); then a rank killed (SIGKILL) while the server idles:
    the server ends within --rank-timeout and a margin, rank 0 with status 1 and a one-line error,
    no rank left running."""
    with serving(Server(*smollm2, "m", port=0, max_concurrent=8)) as alone:
        client = openai_client(alone)
        with ThreadPoolExecutor(9) as pool:
            ruled = pool.submit(as_json, client)
            want = list(pool.map(lambda q: streamed(client, q), PROMPTS))
            want_json = ruled.result()
    assert all(finish == "length" for _, finish in want), want  # (every answer runs all the steps)
    assert want_json.startswith("{"), want_json
    # (one process's reference: rank 0 loads it)
    server, url = serve_launched(3, "--norm", "rms", "--rank-timeout", str(RANK_TIMEOUT),
                                 check=(str(tmp_path), "4", "3", "flash", "embedded"),
                                 env={"REF_ON_RANK0": "1"})
    try:
        pids = ranks(server)
        assert_embedded_split(tmp_path)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        with ThreadPoolExecutor(10) as pool:
            left, ruled = pool.submit(hang_up, client), pool.submit(as_json, client)
            got = list(pool.map(lambda q: streamed(client, q), PROMPTS))
            left.result()
        assert got == want and ruled.result() == want_json
        assert streamed(client, PROMPTS[0]) == want[0]
        os.kill(pids[2], signal.SIGKILL)
        killed = time.monotonic()
        _, err = server.communicate(timeout=RANK_TIMEOUT + 60)
        took = time.monotonic() - killed
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.communicate()
        server.close_input()
    assert took < RANK_TIMEOUT + 30 and gone(pids.values()), err[-3000:]
    # (mlx.launch itself exits 0 whatever its ranks did: their exits are in its warnings)
    assert "Node with rank 2 exited with code -9" in err, err[-3000:]
    assert "Node with rank 0 exited with code 1" in err, err[-3000:]
    (error,) = [line for line in err.splitlines() if line.startswith("error: rank 0: ")]
    assert error.endswith("the server stops"), err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
