"""Progress bars: drawn when stderr is a terminal (a real pseudo-terminal here), silent when it is
a pipe; huggingface_hub's download bars follow the same rule."""
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from conftest import cli

from mlx_flashnorm import progress

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 4


def on_terminal(*args):
    """Run `python -m args` with stderr on a pseudo-terminal: (return code, stdout, terminal output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100 characters
    p = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=slave,
                         stdin=subprocess.DEVNULL)
    os.close(slave)
    seen = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        seen += data
    out = p.stdout.read().decode()
    p.wait(timeout=600)
    os.close(master)
    return p.returncode, out, seen.decode(errors="replace")


def test_perplexity_bar_on_a_terminal_only(tiny_llama_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = ("mlx_flashnorm.perplexity", "--model", str(tiny_llama_dir), "--text", str(text), "--window", "8")
    code, out, terminal = on_terminal(*args)
    assert code == 0 and "perplexity:" in out
    assert "perplexity:" in terminal and "window/s" in terminal  # the bar: windows done, their rate
    piped = cli(*args)
    assert piped.returncode == 0 and "window/s" not in piped.stderr and "\r" not in piped.stderr


def test_convert_bar_on_a_terminal_only(tiny_llama_dir, tmp_path):
    code, _, terminal = on_terminal("mlx_flashnorm.convert", "--model", str(tiny_llama_dir), "--flashnorm",
                                    "--out", str(tmp_path / "a"))
    assert code == 0 and "convert:" in terminal and "folding the norms" in terminal
    piped = cli("mlx_flashnorm.convert", "--model", str(tiny_llama_dir), "--flashnorm", "--out", str(tmp_path / "b"))
    assert piped.returncode == 0 and "\r" not in piped.stderr and "convert:" not in piped.stderr


def test_hub_bars_off_without_a_terminal(monkeypatch):
    from huggingface_hub.utils import are_progress_bars_disabled

    assert not are_progress_bars_disabled()
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    with progress.hub_bars():
        assert are_progress_bars_disabled()
    assert not are_progress_bars_disabled()
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    with progress.hub_bars():
        assert not are_progress_bars_disabled()
