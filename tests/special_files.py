"""Special files in place of a model's, a tokenizer's or a cache's file (issue 64): a FIFO (opening
it for reading waits for a writer forever), a folder, a symbolic link to itself, an unreadable
file; a JSON document nested deeper than Python's parser recurses; and the means to test them:
a deadline for a test that would otherwise hang, and permissions that apply even to root."""
import ctypes
import os
import shutil
import signal
from contextlib import contextmanager

import pytest

KINDS = ("fifo", "folder", "symlink loop", "unreadable")
DEEP = 100_000  # levels of nesting: far past Python's recursion limit


def replace(path, kind):
    """Put a special file of kind at path: "unreadable" keeps the file and takes its permissions
    away (they bind root only under unprivileged()); the others replace it."""
    if kind == "unreadable":
        if not path.exists():
            path.write_bytes(b"{}")
        os.chmod(path, 0)
        return path
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "symlink loop":
        os.symlink(path.name, path)  # a link to itself: opening it fails with ELOOP
    else:
        raise ValueError(kind)
    return path


def deep_json(depth=DEEP):
    """A JSON object whose one value nests depth lists."""
    return '{"a": ' + "[" * depth + "]" * depth + "}"


@contextmanager
def within(seconds=120):
    """Fail with TimeoutError where the block still runs after `seconds` (a FIFO opened as a file
    waits for a writer forever): a deadline far beyond what the block takes, not a speed test."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: blocked on a special file?")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH: what lets root read anything


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


@contextmanager
def unprivileged():
    """File permissions bind this thread within the block, as they bind a user: as root, the
    capabilities that bypass them leave its effective set (restored after); skips the test where
    that cannot be done."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _Header(0x20080522, 0), (_Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip("running as root, and the capabilities cannot be read")
    saved = data[0].effective
    data[0].effective &= ~DAC
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip("running as root, and the capabilities cannot be dropped")
    try:
        yield
    finally:
        data[0].effective = saved
        libc.capset(ctypes.byref(header), data)
