"""`tokenizers` pipelines rebuilt from a GGUF vocabulary, as llama.cpp tokenizes it.

Two vocabulary types (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE. The text is split by the regexes llama.cpp's
  src/llama-vocab.cpp lists for the file's `tokenizer.ggml.pre` (applied one
  after another, each cutting the pieces the previous left, as llama.cpp's
  unicode_regex_split does), then mapped to GPT-2's byte alphabet and merged.
- "llama": SentencePiece BPE. Spaces become U+2581 and one is prepended
  (add_space_prefix, llama.cpp's default), merges follow the piece scores
  (best merged piece first, as llm_tokenizer_spm does), and a character
  outside the vocabulary falls back to its <0xNN> byte pieces.

Any other type is refused by name (`UnsupportedVocab`) before anything heavy.
"""

from __future__ import annotations

from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from skippy_zmq.files.gguf_layout import read_gguf_layout


class UnsupportedVocab(ValueError):
    """A GGUF vocabulary type or pre-tokenizer we do not implement (the message names it)."""


# llama.cpp's adapted regexes ((?i:...) spelt out) -- src/llama-vocab.cpp, llm_tokenizer_bpe.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Non-ASCII kept as escapes: an editor normalising to NFC would corrupt the ranges.
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
    "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+")
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_DEEPSEEK_LLM = ["[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, "\\s+$", _DEEPSEEK_CJK, "\\p{N}+"]
_DEEPSEEK_CODER = ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _DEEPSEEK_CJK, "\\p{N}"]
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"]
_STARCODER = [r"\p{N}", _GPT2]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> (regexes, ignore_merges). llama.cpp sets ignore_merges for llama3: a
# piece that is a whole vocabulary token is taken as it is.
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    **{name: ([_LLAMA3], True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{name: ([_LLAMA3], False) for name in ("dbrx", "smaug-bpe")},
    **{name: ([_QWEN2], False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
    "qwen35": ([_QWEN35], False),
    "deepseek-llm": (_DEEPSEEK_LLM, False),
    "deepseek-coder": (_DEEPSEEK_CODER, False),
    "falcon": (_FALCON, False),
    **{name: (_STARCODER, False) for name in ("starcoder", "refact", "command-r", "smollm")},
    **{name: ([_GPT2], False) for name in ("gpt-2", "gpt2", "mpt", "olmo", "phi-2")},
    "default": (_DEFAULT, False),
}

# llama.cpp sets add_bos for these pre-tokenizers (the file's add_bos_token, if any, decides)
BOS_BY_DEFAULT = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")

SUPPORTED_MODELS = ("gpt2", "llama", "no_vocab")

# gguf.TokenType: 2 UNKNOWN, 3 CONTROL are special (skipped when decoding with skip_special);
# 4 USER_DEFINED (e.g. <think>) is matched whole but is text.
_SPECIAL_TYPES = (int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL))
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)


def field(reader: gguf.GGUFReader | GGUFMetadata, key: str, default: Any = None) -> Any:
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def check_vocab(reader: gguf.GGUFReader | GGUFMetadata) -> tuple[str, str]:
    """(model, pre) of the file's vocabulary, or UnsupportedVocab naming what is not implemented."""
    model = field(reader, "tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise UnsupportedVocab(f"unsupported tokenizer.ggml.model {model!r} (supported: {', '.join(SUPPORTED_MODELS)})")
    pre = field(reader, "tokenizer.ggml.pre") or "default"
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise UnsupportedVocab(f"unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    return model, pre


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    regexes, _ = PRE_TOKENIZERS[pre]
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_byte_level(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    vocab = {text: token_id for token_id, text in enumerate(tokens)}
    # Byte-level symbols never contain a literal space, so "a b" splits once.
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                     ignore_merges=PRE_TOKENIZERS[pre][1]))
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the pieces: every split of a piece into two pieces,
    best-scored result first (llm_tokenizer_spm merges the highest-scored bigram)."""
    vocab = {text: token_id for token_id, text in enumerate(tokens)}
    found = []
    for token_id, piece in enumerate(tokens):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[token_id], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def build_sentencepiece(tokens: list[str], scores: list[float], unk: str | None,
                        add_space_prefix: bool) -> Tokenizer:
    vocab = {text: token_id for token_id, text in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=score_merges(tokens, scores), unk_token=unk,
                                     fuse_unk=True, byte_fallback=True))
    # A normalizer, not Metaspace: llama.cpp prepends the space even before leading spaces.
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    tail = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    return tokenizer


def add_typed_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> list[int]:
    """Control/unknown tokens as special, user-defined ones as plain added tokens; the special ids."""
    special = [i for i, kind in enumerate(token_types) if int(kind) in _SPECIAL_TYPES]
    user = [i for i, kind in enumerate(token_types) if int(kind) == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    return special + user


def build_from_gguf(reader: gguf.GGUFReader | GGUFMetadata) -> tuple[Tokenizer, str, list[int], list[str]]:
    """(tokenizer, vocabulary kind "bpe"/"spm", ids matched whole, token texts) of a GGUF vocabulary."""
    model, pre = check_vocab(reader)
    tokens: list[str] = list(field(reader, "tokenizer.ggml.tokens"))
    token_types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if model == "gpt2":
        tokenizer = build_byte_level(tokens, list(field(reader, "tokenizer.ggml.merges", [])), pre)
        kind = "bpe"
    else:
        unk_id = field(reader, "tokenizer.ggml.unknown_token_id")
        tokenizer = build_sentencepiece(tokens, list(field(reader, "tokenizer.ggml.scores")),
                                        None if unk_id is None else tokens[int(unk_id)],
                                        bool(field(reader, "tokenizer.ggml.add_space_prefix", True)))
        kind = "spm"
    return tokenizer, kind, add_typed_tokens(tokenizer, tokens, token_types), tokens


# ---------------------------------------------------------------- metadata only, fast


class MetaField:
    """One GGUF metadata value, read as gguf.ReaderField.contents() gives it."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def contents(self) -> Any:
        return self._value


class GGUFMetadata:
    """A GGUF file's key/value metadata without its tensors: gguf.GGUFReader parses every array
    element into numpy views (half a minute for a 150k-token vocabulary); this reads them at once,
    every length checked against the file first (gguf_layout; a bad file is a ModelFileError)."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.fields = {key: MetaField(value) for key, value in read_gguf_layout(path).fields.items()}
