"""Progress bars (tqdm, as huggingface_hub draws them) on stderr when it is a terminal, and nothing
when it is not (a log file or a pipe gets no carriage-return lines)."""
import sys
from contextlib import contextmanager

from tqdm import tqdm


def on_terminal():
    return sys.stderr.isatty()


def bar(iterable=None, **kwargs):
    """A tqdm bar on stderr, drawn only on a terminal; it disappears once done (leave=False)."""
    return tqdm(iterable, disable=not on_terminal(), leave=False, file=sys.stderr, **kwargs)


def write(text):
    """A line on stderr that does not tear a bar being drawn."""
    tqdm.write(text, file=sys.stderr)
    sys.stderr.flush()


@contextmanager
def hub_bars():
    """huggingface_hub's download bars as ours: drawn on a terminal, off otherwise."""
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    if on_terminal() or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
