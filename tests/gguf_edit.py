"""Where each field of a GGUF file's header lies, written independently of mlx_flashnorm's reader,
so that the malformed-file tests can rewrite one field of a real file in place (same length)."""
import struct
from typing import NamedTuple

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
SOME = 3  # of a long array of strings, the length fields of its first SOME items are listed


class Field(NamedTuple):
    offset: int  # in the file
    fmt: str  # struct format, little-endian
    what: str  # e.g. "version", "value llama.context_length", "dim 0 of blk.0.attn_q.weight"
    section: str = "metadata"  # "header" (version, counts), "metadata" or "tensors" (the directory)


def fields(buf):
    """Every fixed-size field of the header of the GGUF bytes buf (a long string array's items
    only by their first SOME length fields), in file order; and the tensor directory's end."""
    out = [Field(4, "<I", "version", "header"), Field(8, "<Q", "tensor count", "header"),
           Field(16, "<Q", "metadata count", "header")]
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24

    def string(pos, what, record=True):
        if record:
            out.append(Field(pos, "<Q", f"length of {what}"))
        n = struct.unpack_from("<Q", buf, pos)[0]
        return pos + 8 + n, bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", "replace")

    for _ in range(n_kv):
        pos, key = string(pos, "a key")
        kind = struct.unpack_from("<I", buf, pos)[0]
        out.append(Field(pos, "<I", f"type of {key}"))
        pos += 4
        if kind in SCALARS:
            out.append(Field(pos, "<" + SCALARS[kind], f"value {key}"))
            pos += struct.calcsize(SCALARS[kind])
        elif kind == 8:
            pos, _ = string(pos, f"value {key}")
        else:  # an array (of scalars or strings: all this format's files use)
            item, n = struct.unpack_from("<IQ", buf, pos)
            out += [Field(pos, "<I", f"item type of {key}"), Field(pos + 4, "<Q", f"length of {key}")]
            pos += 12
            if item in SCALARS:
                pos += n * struct.calcsize(SCALARS[item])
            else:
                for i in range(n):
                    pos, _ = string(pos, f"item {i} of {key}", record=i < SOME)
    n_meta = len(out)
    for _ in range(n_tensors):
        pos, name = string(pos, "a tensor name")
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        out.append(Field(pos, "<I", f"dimension count of {name}"))
        pos += 4
        for d in range(n_dims):
            out.append(Field(pos, "<Q", f"dim {d} of {name}"))
            pos += 8
        out += [Field(pos, "<I", f"type of {name}"), Field(pos + 4, "<Q", f"offset of {name}")]
        pos += 12
    return out[:n_meta] + [f._replace(section="tensors") for f in out[n_meta:]], pos


def find(buf, what):
    """The one field named what."""
    found = [f for f in fields(buf)[0] if f.what == what]
    assert len(found) == 1, what
    return found[0]


def read(buf, field):
    return struct.unpack_from(field.fmt, buf, field.offset)[0]


def write(path, field, value):
    """Rewrite one field of the file at path in place."""
    with open(path, "r+b") as f:
        f.seek(field.offset)
        f.write(struct.pack(field.fmt, value))

