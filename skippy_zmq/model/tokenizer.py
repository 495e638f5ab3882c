"""Text tokenizer built from a GGUF file's BPE vocabulary, plus the chat template.

The GGUF stores everything a byte-level BPE tokenizer needs (tokens, token
types, merges, special ids, and the name of the pre-tokenizer in
`tokenizer.ggml.pre`); we rebuild the equivalent HF `tokenizers` pipeline from
it so the driver never needs a model hub. The reference ids in
`shared/parity/` pin the result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from skippy_zmq.model.chat_template import (
    ChatTemplates, generation_eos_ids, gguf_templates, merge_ids, read_hf_templates)

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"

# llama.cpp token types (gguf TokenType): CONTROL and USER_DEFINED tokens are
# matched verbatim in text before BPE runs.
_SPECIAL_TOKEN_TYPES = (int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED))

# Token texts that end a generation, as llama.cpp's end-of-generation set does:
# the model's eos plus whichever of these the vocabulary marks as special.
_END_OF_GENERATION_TEXTS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<eos>",
)

_REPLACEMENT_CHAR = "\ufffd"


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer equivalent to llama.cpp's `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM2's tokenizer.json: digits split one per token, then GPT-2 bytes.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in ("gpt2", "default"):
        # Plain GPT-2 regex split; "default" is what older converters wrote for
        # gpt2-model files without a dedicated pre-tokenizer.
        return byte_level
    raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: smollm, gpt2, default)")


def _special_token_ids(tokens: list[str], token_types: list[int]) -> list[int]:
    return [i for i, kind in enumerate(token_types) if int(kind) in _SPECIAL_TOKEN_TYPES]


def _end_of_generation_ids(eos_id: int, tokens: list[str], special_ids: list[int]) -> list[int]:
    """eos first, then the other special end-of-turn/end-of-text tokens."""
    ids = [eos_id]
    for token_id in special_ids:
        if tokens[token_id] in _END_OF_GENERATION_TEXTS and token_id not in ids:
            ids.append(token_id)
    return ids


def _build_bpe(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    vocab = {text: token_id for token_id, text in enumerate(tokens)}
    # Byte-level symbols never contain a literal space, so "a b" splits once.
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> tuple[Tokenizer, dict[str, Any]]:
    """Build the `tokenizers` pipeline and the metadata dict from a GGUF reader."""
    model = _field(reader, "tokenizer.ggml.model")
    if model == "no_vocab":
        # A GGUF without a vocabulary (random-weight models): the words <t0> ... <tV-1>.
        arch = _field(reader, "general.architecture")
        return word_level_tokenizer(int(_field(reader, f"{arch}.vocab_size")))
    if model != "gpt2":
        raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (supported: gpt2, no_vocab)")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    _pre_tokenizer(pre)  # fail on an unknown pre-tokenizer before the heavy work
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges: list[str] = list(_field(reader, "tokenizer.ggml.merges", []))

    tokenizer = _build_bpe(tokens, merges, pre)
    special_ids = _special_token_ids(tokens, token_types)
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in special_ids]
    )
    eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    meta = {
        "bos_id": int(_field(reader, "tokenizer.ggml.bos_token_id", eos_id)),
        "eos_id": eos_id,
        "eos_ids": _end_of_generation_ids(eos_id, tokens, special_ids),
        "pad_id": int(_field(reader, "tokenizer.ggml.padding_token_id", eos_id)),
        "unk_id": int(_field(reader, "tokenizer.ggml.unknown_token_id", eos_id)),
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": str(_field(reader, "tokenizer.chat_template", "")),
        "pre": pre,
    }
    meta["chat_template"], meta["chat_templates"] = gguf_templates(reader)
    return tokenizer, meta


def word_level_tokenizer(vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """The words `<t0> ... <tV-1>`, split on whitespace, each its own id; each decodes to its word
    and a space (so streamed tokens stay apart; encode(decode(ids)) == ids).

    An unknown word is an error (there is no unknown token). No BOS, no EOS, no chat template.
    """
    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Replace(">", "> ")
    meta = {"bos_id": -1, "eos_id": -1, "eos_ids": [], "pad_id": -1, "unk_id": -1, "add_bos": False,
            "chat_template": "", "pre": "words"}
    return tokenizer, meta


def _byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character standing for each byte in a piece."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the GGUF metadata and chat template."""

    def __init__(self, tokenizer: Tokenizer, meta: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.meta = dict(meta)
        self._templates = ChatTemplates(self.meta.get("chat_template") or "", self.meta.get("chat_templates"))

    @classmethod
    def from_gguf(cls, path: str | Path) -> TextTokenizer:
        return cls(*tokenizer_from_gguf(gguf.GGUFReader(str(path))))

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> TextTokenizer:
        """An HF model directory: tokenizer.json plus tokenizer_config.json (template, specials)."""
        directory = Path(directory)
        if not (directory / TOKENIZER_FILE).is_file():
            raise ValueError(f"{directory}: no {TOKENIZER_FILE}")
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}

        def token_id(key: str) -> int:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            found = tokenizer.token_to_id(value) if isinstance(value, str) else None
            return -1 if found is None else found

        eos = token_id("eos_token")
        meta = {"bos_id": token_id("bos_token"), "eos_id": eos, "eos_ids": [eos] if eos >= 0 else [],
                "pad_id": token_id("pad_token"), "unk_id": token_id("unk_token"),
                "add_bos": bool(config.get("add_bos_token", False)),
                "pre": "hf"}
        meta["chat_template"], meta["chat_templates"] = read_hf_templates(directory)
        meta["eos_ids"] = merge_ids(meta["eos_ids"], generation_eos_ids(directory))
        return cls(tokenizer, meta)

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        directory = Path(directory)
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
        return cls(tokenizer, meta)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / TOKENIZER_FILE))
        (directory / META_FILE).write_text(
            json.dumps(self.meta, ensure_ascii=False, indent=1), encoding="utf-8"
        )

    @property
    def eos_ids(self) -> list[int]:
        return list(self.meta["eos_ids"])

    @property
    def bos_id(self) -> int:
        return int(self.meta["bos_id"])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (special tokens: their text). Byte-level BPE maps each
        byte to one character of the token's piece, so a token holding part of a UTF-8 character
        gives exactly those bytes; other tokenizers give the UTF-8 of the token decoded alone."""
        piece = self.tokenizer.id_to_token(int(token_id))
        table = self._byte_table()
        if piece is not None and table is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.decode([int(token_id)]).encode("utf-8")

    def _byte_table(self) -> dict[str, int] | None:
        """Byte-level BPE's character -> byte table (GPT-2's bytes_to_unicode), or None."""
        if not hasattr(self, "_bytes_of"):
            decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
            kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
            self._bytes_of = _byte_level_table() if "ByteLevel" in kinds else None
        return self._bytes_of

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens in the text are recognised."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.meta["add_bos"] if add_bos is None else add_bos:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> str:
        """The rendered conversation, as transformers renders it: `chat_template` names one of the
        model's templates (with tools, `tool_use` is the default when the model has it); `kwargs`:
        documents and chat_template_kwargs (e.g. enable_thinking), which may override bos/eos_token."""
        template = self._templates.select(chat_template, tools)
        special = {"bos_token": self.token_text(self.meta["bos_id"]),
                   "eos_token": self.token_text(self.meta["eos_id"])}
        return template.render(messages, add_generation_prompt, tools=tools, **{**special, **kwargs})

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        # The template writes any BOS itself, so none is added here.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Incremental detokenizer: emits text only once its UTF-8 bytes are complete.

    Byte-level BPE can split one character across tokens, so decoding a token
    alone may end in U+FFFD. Tokens are held until their decoded text no longer
    ends with U+FFFD; byte-level decoding is concatenative, so emitting the
    pending window's text and starting afresh is exact.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        self._pending.append(int(token_id))
        text = self._tokenizer.decode(self._pending, skip_special=self._skip_special)
        if text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Whatever is still held (possibly ending in U+FFFD); resets the decoder."""
        text = self._tokenizer.decode(self._pending, skip_special=self._skip_special)
        self._pending.clear()
        return text
