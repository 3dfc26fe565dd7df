"""Chunked greedy decoding: one request's tokens STEPS a launch (kernels.decode_chunk: the
whole-step kernel's layers, the final norm, the LM head and the argmax, looped on the device), for
decoding.generate_step where the caller reads no log-probabilities and no sampler, logits processor
or constraint needs the host between tokens. The first token still comes from the one-token step
(the time to it is not a chunk's); the host streams each chunk's tokens one at a time while the
next chunk runs. Stop tokens and max_tokens are the host's: a chunk never runs past max_tokens,
and where the consumer stops, the tokens after are dropped and the cache keeps what was fed up to
there (Run.kept), as one step at a time keeps it."""
import mlx.core as mx

from . import kernels
from .flashnorm.chunk import chunk_spec, chunk_supported, decode_chunk
from .models import llama, openelm

STEPS = 8  # decode steps a launch, at most (the bench measures others: --chunk-steps)


def parts(model):
    """(embedding, blocks, final norm, head) of a model whose logits are
    head(norm(blocks(embedding(token)))) as Llama's and OpenELM's files compute them (head None:
    the embedding as a linear); None for any other (Gemma 3 scales its embeddings)."""
    if type(model).__call__ is llama.Model.__call__ and type(model.model) is llama.LlamaModel:
        trunk = model.model
    elif type(model) is openelm.Model and type(model.transformer) is openelm.OpenELMModel:
        trunk = model.transformer
    else:
        return None
    return model.embed_tokens, trunk.layers, trunk.norm, model.get("lm_head")


def spec(model):
    """decode_chunk's arguments for model (flashnorm's chunk_spec) with k = STEPS (read once: a
    compiled chunk step keeps its k), or None."""
    found = parts(model)
    found = found and chunk_spec(*found)
    return found and dict(found, k=STEPS)


class Compiled:
    """A model's compiled chunk step, fn(y, offset, kv, steps) -> (tokens, offset, kv) (made by
    decoding.compiled_decode over forward), its spec (None: the model has no chunk form) and k,
    the most steps a launch."""

    def __init__(self, spec, fn):
        self.spec, self.fn, self.k = spec, fn, spec["k"] if spec else STEPS

    def __call__(self, *args):
        return self.fn(*args)

    def runs(self, kv):
        """Whether the chunk kernel runs here for the caches kv, after its self-check (on first
        use: kernels.check.LAZY); where it does not, a request takes one step at a time. Not
        checked where decode_layers, whose body it runs, is off: the check would compare the
        fallback with itself, and its pass is kept on disk."""
        if self.spec is None or not all(map(kernels.use_decode_layers,
                                            ("decode_chunk", "decode_layers"))):
            return False
        kernels.self_check(["decode_chunk"])
        return chunk_supported(self.spec, kv)


def forward(spec, y, cache, steps):
    """The compiled chunk step's work: `steps` (at most spec's k) greedy tokens after y over the
    static caches `cache` (flashnorm's decode_chunk)."""
    return decode_chunk(spec, y, cache, steps)


class Run:
    """One request's chunks: the compiled chunk step `decode` from the offset and caches (kv) after
    its first token's step; base, the cache's offset then (the prompt fed). Once tokens() ends,
    offset and kv are the last chunk's, and kept the offset the cache keeps: base and the tokens
    taken that were fed."""

    def __init__(self, decode, offset, kv, base):
        self.decode, self.offset, self.kv, self.base = decode, offset, kv, base
        self.kept = base

    def _queue(self, y, left):
        """The next chunk queued after token y ((1,)): (its tokens, how many), or None where
        none is left."""
        if left <= 0:
            return None
        count = min(self.decode.k, left)
        tokens, self.offset, self.kv = self.decode(y.astype(mx.uint32), self.offset, self.kv,
                                                   kernels.constant(mx.int32, count))
        mx.async_eval(tokens)
        return tokens, count

    def tokens(self, y, max_tokens):
        """Yield (token, None) for y, the first token (its step queued), then for the
        max_tokens - 1 after it, k a launch; each chunk is queued before the one before it is
        read (a slice of it would be read after the next one), so the device runs while the host
        streams."""
        taken = 0
        try:
            chunk = self._queue(y, max_tokens - 1)
            left = max_tokens - 1 - (chunk[1] if chunk else 0)
            taken += 1
            yield y.item(), None
            while chunk is not None:
                tokens, count = chunk
                chunk = self._queue(tokens[count - 1:count], left)
                left -= chunk[1] if chunk else 0
                for token in tokens.tolist()[:count]:
                    taken += 1
                    yield token, None
        finally:
            # every token taken was fed to the model but the last of max_tokens, which no step
            # reads: as one step at a time, which queues a token's step before handing it out
            self.kept = self.base + min(taken, max_tokens - 1)
