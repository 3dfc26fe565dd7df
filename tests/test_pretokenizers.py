"""tokenizer.ggml.pre: each model family's pre-tokenizer, checked against a Hugging Face `tokenizers`
reference built from the GGUF's own vocabulary and merges with the normalizer and pre-tokenizer
that the family's tokenizer.json states (written below as JSON, as those files hold them)."""
import json

import pytest
from gguf_files import smollm2_meta
from tokenizers import Tokenizer

from mlx_flashnorm.errors import UserError
from mlx_flashnorm.gguf import gguf_tokenizer

TEXT = ("I'm sure THEY'LL pay 1234567 or 3.14159 dollars, won't they?\n\n\n"
        "    indented   runs\tof\t\twhitespace  \r\n"
        "Zürich café naïve — Москва 東京都 مرحبا 12 345 9999999999 !!!\n  end ")

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
                "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
               "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def split_then_bytes(regex):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        dict(BYTE_LEVEL, use_regex=False)]}


# (normalizer, pre_tokenizer) of each family's tokenizer.json
FAMILIES = {
    "gpt2": (None, BYTE_LEVEL),
    "smollm": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}),
    "llama-bpe": (None, split_then_bytes(LLAMA3_REGEX)),
    "qwen2": ({"type": "NFC"}, split_then_bytes(QWEN2_REGEX)),
}


@pytest.fixture(scope="module")
def meta():
    return smollm2_meta()


def reference(meta, family):
    """The HF tokenizer of `family` over the GGUF's vocabulary and merges."""
    normalizer, pre = FAMILIES[family]
    tokens = list(meta["tokenizer.ggml.tokens"])
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "vocab": {t: i for i, t in enumerate(tokens)},
                      "merges": [m.split(" ", 1) for m in meta["tokenizer.ggml.merges"]]}}
    return Tokenizer.from_str(json.dumps(spec))


def pieces(tokenizer, text=TEXT):
    """The pieces the pre-tokenizer cuts the (normalized) text into, before any merge."""
    if tokenizer.normalizer is not None:
        text = tokenizer.normalizer.normalize_str(text)
    return [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_pre_rule_matches_its_families_reference(meta, family):
    name = "gpt-2" if family == "gpt2" else family  # llama.cpp's spelling
    ours = gguf_tokenizer(dict(meta, **{"tokenizer.ggml.pre": name, "tokenizer.ggml.add_bos_token": False}))
    ref = reference(meta, family)
    assert pieces(ours.backend_tokenizer) == pieces(ref)
    want = ref.encode(TEXT).ids
    assert ours.encode(TEXT, add_special_tokens=False) == want
    assert ours.decode(want) == TEXT


def test_the_rules_differ_on_the_text(meta):
    """The text tells the families' rules apart (their pieces differ), so a test above fails when a
    rule is swapped. (SmolLM2's vocabulary has single digits only, so some ids agree.)"""
    cut = {f: tuple(pieces(reference(meta, f))) for f in FAMILIES}
    assert len(set(cut.values())) == len(FAMILIES)


def test_unknown_pre_tokenizer_is_a_clear_error(meta):
    with pytest.raises(UserError, match="tokenizer.ggml.pre 'deepseek-llm' is not a pre-tokenizer we know"
                                        ".*--tokenizer"):
        gguf_tokenizer(dict(meta, **{"tokenizer.ggml.pre": "deepseek-llm"}))
