"""Text tokenizer from a GGUF vocabulary or an HF directory, plus the chat template.

A GGUF stores what a tokenizer needs (tokens, token types, merges or scores,
special ids, the pre-tokenizer's name); model/vocab.py rebuilds the equivalent
HF `tokenizers` pipeline from it (byte-level BPE and SentencePiece), pinned by
llama.cpp's own vectors (tests/test_vocab_vectors.py). StreamDecoder turns
ids into text incrementally, with the preceding ids as context, so the streamed
pieces concatenate to `decode` of the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from skippy_zmq.files.filecheck import ModelFileError, read_json_capped, read_text_capped
from skippy_zmq.text.vocab import BOS_BY_DEFAULT, GGUFMetadata, UnsupportedVocab, build_from_gguf, check_vocab, field  # noqa: F401
from skippy_zmq.text.chat_template import ChatTemplates, generation_eos_ids, gguf_templates, merge_ids, read_hf_templates

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"

# Token texts that end a generation, as llama.cpp's end-of-generation set: the model's eos, its
# eot/eom ids, plus whichever of these the vocabulary matches whole.
_END_OF_GENERATION_TEXTS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<eos>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<EOT>",
)

_REPLACEMENT_CHAR = "\ufffd"


def _end_of_generation_ids(eos_id: int, end_ids: list[int], tokens: list[str],
                           special_ids: list[int]) -> list[int]:
    """eos first, then the file's eot/eom ids, then the other special end-of-turn/end-of-text tokens."""
    ids = [eos_id, *(i for i in dict.fromkeys(end_ids) if i != eos_id)]
    for token_id in special_ids:
        if tokens[token_id] in _END_OF_GENERATION_TEXTS and token_id not in ids:
            ids.append(token_id)
    return ids


def tokenizer_from_gguf(reader: gguf.GGUFReader | GGUFMetadata) -> tuple[Tokenizer, dict[str, Any]]:
    """Build the `tokenizers` pipeline and the metadata dict from a GGUF reader.

    An unsupported vocabulary type or pre-tokenizer raises vocab.UnsupportedVocab naming it."""
    model = field(reader, "tokenizer.ggml.model")
    if model == "no_vocab":
        # A GGUF without a vocabulary (random-weight models): the words <t0> ... <tV-1>.
        arch = field(reader, "general.architecture")
        return word_level_tokenizer(int(field(reader, f"{arch}.vocab_size")))
    _, pre = check_vocab(reader)
    tokenizer, kind, special_ids, tokens = build_from_gguf(reader)
    eos_id = int(field(reader, "tokenizer.ggml.eos_token_id"))
    end_ids = [int(field(reader, f"tokenizer.ggml.{key}_token_id", eos_id)) for key in ("eot", "eom")]
    meta = {
        "bos_id": int(field(reader, "tokenizer.ggml.bos_token_id", eos_id)),
        "eos_id": eos_id,
        "eos_ids": _end_of_generation_ids(eos_id, end_ids, tokens, special_ids),
        "pad_id": int(field(reader, "tokenizer.ggml.padding_token_id", eos_id)),
        "unk_id": int(field(reader, "tokenizer.ggml.unknown_token_id", eos_id)),
        # llama.cpp adds BOS to a SentencePiece or Llama 3 vocabulary that does not say otherwise
        "add_bos": bool(field(reader, "tokenizer.ggml.add_bos_token", kind == "spm" or pre in BOS_BY_DEFAULT)),
        "chat_template": str(field(reader, "tokenizer.chat_template", "")),
        "pre": pre,
        "kind": kind,
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


def tokenizer_file(path: Path) -> Tokenizer:
    """A tokenizer.json, its size capped before it is read; a bad one is a ModelFileError naming it."""
    text = read_text_capped(path, TOKENIZER_FILE)
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises its own Exception on a JSON it cannot build from
        raise ModelFileError(path, TOKENIZER_FILE, None, f"not a tokenizer: {exc}") from None


def _post_processor_bos(tokenizer: Tokenizer) -> int | None:
    """The id tokenizer.json's post-processor puts first on a single sequence, or None."""
    post = json.loads(tokenizer.to_str()).get("post_processor") or {}
    steps = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for step in steps:
        single = step.get("single") if step.get("type") == "TemplateProcessing" else None
        first = (single or [{}])[0].get("SpecialToken")
        if first is not None:
            return tokenizer.token_to_id(first["id"])
    return None


def _decoder_kind(tokenizer: Tokenizer) -> str:
    """"spm" when the decoder maps U+2581 to spaces or falls back to bytes, else "bpe"."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    return "spm" if {"ByteFallback", "Metaspace"} & kinds else "bpe"


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
        return cls(*tokenizer_from_gguf(GGUFMetadata(str(path))))   # metadata only: fast

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> TextTokenizer:
        """An HF model directory: tokenizer.json plus tokenizer_config.json (template, specials)."""
        directory = Path(directory)
        if not (directory / TOKENIZER_FILE).is_file():
            raise ValueError(f"{directory}: no {TOKENIZER_FILE}")
        tokenizer = tokenizer_file(directory / TOKENIZER_FILE)
        config_path = directory / "tokenizer_config.json"
        config = read_json_capped(config_path, "tokenizer_config.json") if config_path.is_file() else {}
        if not isinstance(config, dict):
            raise ModelFileError(config_path, "tokenizer_config.json", 0, "not a JSON object")

        def token_id(key: str) -> int:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            found = tokenizer.token_to_id(value) if isinstance(value, str) else None
            return -1 if found is None else found

        eos = token_id("eos_token")
        post_bos = _post_processor_bos(tokenizer)
        meta = {"bos_id": token_id("bos_token") if post_bos is None else post_bos, "eos_id": eos,
                "eos_ids": [eos] if eos >= 0 else [],
                "pad_id": token_id("pad_token"), "unk_id": token_id("unk_token"),
                "add_bos": bool(config.get("add_bos_token", False)) or post_bos is not None,
                "pre": "hf", "kind": _decoder_kind(tokenizer)}
        meta["chat_template"], meta["chat_templates"] = read_hf_templates(directory)
        meta["eos_ids"] = merge_ids(meta["eos_ids"], generation_eos_ids(directory))
        return cls(tokenizer, meta)

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        directory = Path(directory)
        tokenizer = tokenizer_file(directory / TOKENIZER_FILE)
        meta = read_json_capped(directory / META_FILE, META_FILE)
        if not isinstance(meta, dict):
            raise ModelFileError(directory / META_FILE, META_FILE, 0, "not a JSON object")
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
        gives exactly those bytes; a SentencePiece byte piece <0xNN> is that one byte and U+2581
        a space; other tokenizers give the UTF-8 of the token decoded alone."""
        piece = self.tokenizer.id_to_token(int(token_id))
        table = self._byte_table()
        if piece is not None and table is not None and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if piece is not None and self.meta.get("kind") == "spm":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([int(token_id)]).encode("utf-8")

    def _byte_table(self) -> dict[str, int] | None:
        """Byte-level BPE's character -> byte table (GPT-2's bytes_to_unicode), or None."""
        if not hasattr(self, "_bytes_of"):
            decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
            kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
            self._bytes_of = _byte_level_table() if "ByteLevel" in kinds else None
        return self._bytes_of

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens in the text are recognised. Through encode_batch:
        unlike encode it releases the GIL (same ids), so a long prompt tokenised in a worker thread
        does not stall the server's event loop (4 MB: 3.9 s of GIL held by encode)."""
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
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

    @property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can cover (its longest vocabulary string: a
        byte-level symbol stands for at most one character), so a text of L characters has at least
        L / max_token_chars tokens; None when a normalizer could delete characters (no such bound)."""
        if "_max_token_chars" not in self.__dict__:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            self._max_token_chars = None if self.tokenizer.normalizer is not None or not vocab else \
                max(len(piece) for piece in vocab)
        return self._max_token_chars

    def chat_template_names(self) -> list[str]:
        """The names of the model's chat templates (`default`, `tool_use`, ...): the only values
        `apply_chat_template(chat_template=...)` takes."""
        return self._templates.names()

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        # The template writes any BOS itself, so none is added here.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Incremental detokenizer: each push returns the text the new id adds to `decode` of all ids.

    Decoding a token alone is wrong twice over: byte-level BPE and byte fallback split characters
    across tokens (the piece ends in U+FFFD), and SentencePiece decoders strip the leading space of
    a sequence ("Hello world" would stream as "Helloworld"). So, as tokenizers' DecodeStream and
    vLLM do, the window [prefix, read) of ids already emitted is decoded again with the new ids
    and only the text past it is emitted, once it no longer ends in an incomplete character.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0   # start of the context window
        self._read = 0     # ids before this are emitted

    def _text(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special=self._skip_special)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done = self._text(self._prefix, self._read)
        text = self._text(self._prefix)
        if len(text) <= len(done) or text.endswith(_REPLACEMENT_CHAR) or not text.startswith(done):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        # keep only the window: the ids before it never change the text again
        self._ids, self._prefix, self._read = self._ids[self._prefix:], 0, self._read - self._prefix
        return text[len(done):]

    def flush(self) -> str:
        """Whatever is still held (possibly ending in U+FFFD); resets the decoder."""
        done, text = self._text(self._prefix, self._read), self._text(self._prefix)
        self._ids, self._prefix, self._read = [], 0, 0
        return text[len(done):] if text.startswith(done) else text
