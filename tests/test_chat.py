"""The chat command over standard input, on the embedded SmolLM2 (greedy, a few tokens a turn)."""
import builtins
import importlib
import io

import pytest

from mlx_flashnorm import chat

gen = importlib.import_module("mlx_flashnorm.decoding")  # the module (the package attribute is the function)

from conftest import cli

Q1, Q2 = "What is the capital of France?", "What is the population of that city?"


@pytest.fixture
def run_chat(smollm2, monkeypatch, capsys):
    """Run chat.main in this process on the session's SmolLM2, feeding `stdin`; returns
    (stdout lines, stderr) and records each generate_step call as (cache offset, tokens prefilled)."""
    calls = []
    step = gen.generate_step

    def spy(prompt, model, *args, cache=None, **kwargs):
        calls.append((cache[0].offset if cache else 0, prompt.size))
        return step(prompt, model, *args, cache=cache, **kwargs)

    monkeypatch.setattr(gen, "generate_step", spy)
    monkeypatch.setattr(chat, "load_from_args", lambda args: smollm2)

    def run(stdin, *argv):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        chat.main(list(argv))
        out = capsys.readouterr()
        return out.out.splitlines(), out.err

    run.calls = calls
    return run


def test_second_turn_has_the_first_in_context_and_prefills_only_new_tokens(smollm2, run_chat):
    model, tokenizer = smollm2
    lines, err = run_chat(f"{Q1}\n{Q2}\n", "--max-tokens", "8")
    assert len(lines) == 2, (lines, err)
    assert "Paris" in lines[0]
    assert "Paris" in lines[1]  # "that city" was resolved from the first turn
    first = tokenizer.apply_chat_template([{"role": "user", "content": Q1}], add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": Q1}, {"role": "assistant", "content": lines[0]},
         {"role": "user", "content": Q2}], add_generation_prompt=True)
    (offset1, fed1), (offset2, fed2) = run_chat.calls
    assert (offset1, fed1) == (0, len(first))
    # turn 2 starts from the cache (turn 1's prompt and answer) and feeds only the rest
    assert offset2 > len(first) and offset2 + fed2 == len(whole)
    assert fed2 < len(whole) - len(first)
    # ... and answers exactly as the whole conversation run from scratch does
    assert lines[1] == gen.generate(model, tokenizer, whole, max_tokens=8)


def test_too_long_reset_exit(smollm2, run_chat, monkeypatch):
    model, _ = smollm2
    monkeypatch.setattr(model.args, "max_position_embeddings", 64)  # a 64-token context
    lines, err = run_chat("Hi\n" + "very " * 80 + "long\nHello\n/reset\n/exit\nnot read\n",
                          "--max-tokens", "2", "--system-prompt", "Be brief.")
    assert "error: the conversation would have" in err and "context is 64" in err
    assert len(lines) == 3 and lines[2] == "[new conversation]"  # two answers, then the reset
    assert [fed for _, fed in run_chat.calls][1] < 15  # the refused message never reached the model


def test_ctrl_c_stops_cleanly(run_chat, monkeypatch):
    def interrupted(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", interrupted)
    lines, err = run_chat("")
    assert err == "" and run_chat.calls == []


def test_chat_command(tiny_llama_dir):
    r = cli("mlx_flashnorm.chat", "--model", str(tiny_llama_dir), "--max-tokens", "3", "--warmup",
            stdin="hello\n/reset\nhi again\n")
    assert r.returncode == 0, r.stderr
    assert "[new conversation]" in r.stdout.splitlines()  # (a random model: its answers may hold newlines)
    r = cli("mlx_flashnorm.chat", "--model", str(tiny_llama_dir), "--max-tokens", "0", stdin="hi\n")
    assert r.returncode == 2 and r.stderr.startswith("error: max-tokens") and "Traceback" not in r.stderr
    r = cli("mlx_flashnorm.chat", "--model", str(tiny_llama_dir), "--temp", "-1", stdin="hi\n")
    assert r.returncode == 2 and r.stderr.startswith("error: temp must be at least 0") and "Traceback" not in r.stderr


def test_ctrl_c_stops_the_answer_not_the_chat(smollm2, monkeypatch, capsys):
    """A real SIGINT while an answer streams stops that answer ("[stopped]"); the message and its
    partial answer are dropped, and the next message is answered as the first of the conversation."""
    import signal

    model, tokenizer = smollm2
    step = gen.generate_step

    def interrupted_once(*args, **kwargs):
        for n, out in enumerate(step(*args, **kwargs)):
            if n == 2 and not interrupted_once.done:
                interrupted_once.done = True
                signal.raise_signal(signal.SIGINT)  # to this thread (os.kill may land on another one)
            yield out

    interrupted_once.done = False
    monkeypatch.setattr(gen, "generate_step", interrupted_once)
    monkeypatch.setattr(chat, "load_from_args", lambda args: smollm2)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Write a long poem about the sea.\n{Q1}\n"))
    # Python's own Ctrl-C handler, as on a terminal: a shell's background job (a test run started
    # with `&`) starts with SIGINT ignored, and the signal raised above would then do nothing
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        chat.main(["--max-tokens", "8"])
    finally:
        signal.signal(signal.SIGINT, old)
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert interrupted_once.done and "[stopped]" in lines, out
    answer = lines[lines.index("[stopped]") + 1]
    assert answer == gen.generate(model, tokenizer, Q1, max_tokens=8).strip().splitlines()[0]
    assert "Paris" in answer


@pytest.mark.parametrize("command", ["chat", "server"])
def test_help_shows_defaults(command):
    help_text = importlib.import_module(f"mlx_flashnorm.{command}").arg_parser().format_help()
    assert "(default: flash)" in help_text and "(default: 256)" in help_text  # --norm, --max-tokens
