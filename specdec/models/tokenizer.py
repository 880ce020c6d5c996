"""Text <-> token ids for the models we serve, built from a GGUF file or a Hugging Face tokenizer folder.

Contract:
- `Tokenizer.from_gguf` reads only the header of a GGUF (metadata, and the tensor table to spot truncation) and
  builds a byte-level BPE with the `tokenizers` library. It gives the same ids as transformers' GGUF
  tokenizer: no Unicode normalization (the GGUF carries none; llama.cpp applies none either), control tokens
  (type 3) as special added tokens, user-defined ones (type 4) as plain added tokens. A missing, truncated or
  unsupported file raises `ModelFileError`. With `cache_dir`, a warm load reads cache_dir/tokenizer.json and
  cache_dir/tokenizer_meta.json only; a cache whose recorded source file size differs is rebuilt. Cache files are
  written atomically (temporary name in the same folder, then os.replace).
- `from_hf_dir` takes the vocabulary from tokenizer.json, so `vocab_size` there is the tokenizer's (151665 for
  Qwen2.5), not the model's padded embedding size, and `never_sample_ids` is empty.
- `encode` matches special tokens written in the text as single ids and prepends BOS only when `add_bos`.
- `eos_token_ids` lists every id that ends generation; `never_sample_ids` lists ids the sampler must mask.
- Chat templates render in a sandboxed Jinja environment (`compile_chat_template`, shared with the CLI's early
  check); `with_chat_template` gives a copy with another template and leaves the shared tokenizer alone.
- `IncrementalDetokenizer` streams text without ever emitting part of a UTF-8 character, and its deltas join
  to `decode(all ids)` once the ids end on a whole character.
"""
from __future__ import annotations

import codecs
import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

from specdec.fileio import atomic_write_text
from specdec.models.gguf_loader import ModelFileError, read_metadata

_CACHE_FORMAT = 1
_TYPE_UNUSED, _TYPE_CONTROL, _TYPE_USER = 5, 3, 4
# Turn-ending tokens of the chat formats we know; any of them present as a special token stops generation.
_EOT_STRINGS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split each `tokenizer.ggml.pre` names (llama.cpp's llama-vocab.cpp is the reference)."""
    if pre in ("qwen2", "llama-bpe"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":
        # As SmolLM2's own tokenizer.json and llama.cpp: every digit alone, then the GPT-2 split. transformers' GGUF
        # path skips the digit split, so it differs where whitespace precedes a digit ("\n    1" in code).
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ModelFileError(f"unsupported tokenizer.ggml.pre {pre!r} "
                         "(supported: qwen2, smollm, llama-bpe, gpt-2, default)")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # these get the characters from U+0100 on, in order
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}

# --- GGUF metadata ---------------------------------------------------------------------------------
# gguf.GGUFReader builds numpy views for every vocabulary string (~20 s for Qwen's 151936 tokens + 151387
# merges), so the metadata section is walked here directly; it takes a fraction of a second.
def _build_from_meta(meta: dict[str, Any]) -> tuple[_RustTokenizer, dict[str, Any]]:
    kind, pre_name = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ModelFileError(f"unsupported tokenizer.ggml.model {kind!r} (only byte-level BPE 'gpt2' is supported)")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelFileError("the GGUF has no tokenizer.ggml.tokens")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    byte_map = _bytes_to_unicode()
    alphabet = set(byte_map.values())

    def spelled(t: str) -> str:  # a token outside the byte alphabet is stored as its UTF-8 bytes (as transformers)
        return t if set(t) <= alphabet else "".join(byte_map[b] for b in t.encode("utf-8"))

    # llama.cpp (like Llama 3's tokenizer.json) takes a whole pre-token found in the vocabulary as is
    # ("ignore_merges"), and adds BOS unless the file says otherwise.
    llama3 = pre_name == "llama-bpe"
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = _RustTokenizer(models.BPE(vocab={spelled(t): i for i, t in enumerate(tokens)}, merges=merges,
                                    continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                    ignore_merges=llama3))
    tok.pre_tokenizer = _pre_tokenizer(pre_name)
    tok.decoder = decoders.ByteLevel()
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel: transformers skips it, so do we.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _TYPE_CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _TYPE_USER and set(t) <= alphabet])
    ids = {t: i for i, t in enumerate(tokens)}
    special_ids = sorted(i for i, ty in enumerate(types) if ty == _TYPE_CONTROL)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = ([eos] if eos is not None else []) + [ids[s] for s in _EOT_STRINGS if ids.get(s) in special_ids]
    return tok, {
        "token_strings": tokens, "special_ids": special_ids, "eos_token_ids": list(dict.fromkeys(eos_ids)),
        "never_sample_ids": [i for i, ty in enumerate(types) if ty == _TYPE_UNUSED],
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", llama3)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(text: str) -> jinja2.Template:
    """A Jinja chat template, compiled in the environment transformers uses: templates are untrusted
    code, so sandboxed. Raises ValueError (one line) when it does not parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None


def read_chat_template(value: str) -> str:
    """The template a `chat_template` setting names: a file's text, or the value itself when it is
    template text (holds `{{` or `{%`). Raises ValueError for a file that cannot be read."""
    if "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {value}: {getattr(e, 'strerror', None) or e}") from None


class Tokenizer:
    """A byte-level BPE tokenizer plus the special-token facts the engine needs (see module docstring)."""

    def __init__(self, tok: _RustTokenizer, info: dict[str, Any]) -> None:
        self._tok = tok
        self.token_strings: list[str] = info["token_strings"]
        self.vocab_size: int = len(self.token_strings)
        self._special: frozenset[int] = frozenset(info["special_ids"])
        self.never_sample_ids: list[int] = info["never_sample_ids"]
        self.eos_token_ids: list[int] = info["eos_token_ids"]
        self.bos_token_id: int | None = info["bos_token_id"]
        self.pad_token_id: int | None = info["pad_token_id"]
        self.add_bos: bool = info["add_bos"]
        self.chat_template: str | None = info["chat_template"]
        self._byte_level = isinstance(tok.decoder, decoders.ByteLevel)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: Path | None = None) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise ModelFileError(f"model file not found: {path}")
        size = path.stat().st_size
        if cache_dir is not None:
            tok_file, meta_file = Path(cache_dir) / "tokenizer.json", Path(cache_dir) / "tokenizer_meta.json"
            if tok_file.is_file() and meta_file.is_file():
                try:
                    info = json.loads(meta_file.read_text(encoding="utf-8"))
                    # A stat is cheap: a cache built from another file (or in an older format) is rebuilt, not used.
                    if info.get("format") == _CACHE_FORMAT and info.get("source_size") == size:
                        return cls(_RustTokenizer.from_file(str(tok_file)), info)
                except Exception:  # an unreadable cache is only a slower load, never an error
                    pass
        tok, info = _build_from_meta(read_metadata(path))
        if cache_dir is not None:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            atomic_write_text(tok_file, tok.to_str())
            atomic_write_text(meta_file, json.dumps({**info, "format": _CACHE_FORMAT, "source_size": size}))
        return cls(tok, info)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelFileError(f"no tokenizer.json in {path}")
        tok = _RustTokenizer.from_file(str(path / "tokenizer.json"))
        cfg, gen = ({} if not (path / n).is_file() else json.loads((path / n).read_text(encoding="utf-8"))
                    for n in ("tokenizer_config.json", "generation_config.json"))
        vocab = tok.get_vocab(with_added_tokens=True)
        strings = [""] * (max(vocab.values()) + 1)
        for s, i in vocab.items():
            strings[i] = s
        special = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

        def token_id(value: Any) -> int | None:  # tokenizer_config spells special tokens as str or {"content": str}
            return vocab.get(value.get("content") if isinstance(value, dict) else value) if value else None

        gen_eos = gen.get("eos_token_id")
        eos = [token_id(cfg.get("eos_token")), *(gen_eos if isinstance(gen_eos, list) else [gen_eos])]
        eos += [vocab[s] for s in _EOT_STRINGS if vocab.get(s) in special]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # the multi-template form: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        bos, add_bos = token_id(cfg.get("bos_token")), cfg.get("add_bos_token")
        if add_bos is None:  # no flag: do what tokenizer.json's post-processor does (Llama 3 adds BOS there)
            add_bos = bos is not None and tok.encode("a").ids[:1] == [bos]
        return cls(tok, {"token_strings": strings, "special_ids": special, "never_sample_ids": [],
                         "eos_token_ids": list(dict.fromkeys(i for i in eos if i is not None)), "bos_token_id": bos,
                         "pad_token_id": token_id(cfg.get("pad_token")), "add_bos": bool(add_bos),
                         "chat_template": template})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The Rust post-processor is never run: BOS is ours to add, exactly once.
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        except TypeError as e:  # a lone surrogate ("\ud800", legal in JSON) has no UTF-8 form
            raise ValueError(f"text is not valid Unicode: {e}") from e
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer in the `tokenizers` JSON format (what grammar engines read)."""
        return self._tok.to_str()

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the vocabulary: token ids saved under one fingerprint mean the same text."""
        return hashlib.sha256("\x00".join(self.token_strings).encode("utf-8", "surrogatepass")).hexdigest()[:16]

    def with_chat_template(self, setting: str) -> Tokenizer:
        """A copy that renders chats with another template (`setting`: a file or the template text,
        as ModelConfig.chat_template); the loaded model's tokenizer, which other engines may share,
        keeps its own. Raises ValueError for a file that cannot be read or a template that does not parse."""
        tok = copy.copy(self)
        tok.chat_template = read_chat_template(setting)
        tok._template = compile_chat_template(tok.chat_template)
        return tok

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The conversation as the model's prompt; `tools`: OpenAI tool definitions, which the template
        renders in its own format (Qwen2.5's <tools> block)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)

        def name(i: int | None) -> str | None:
            return self.token_strings[i] if i is not None and 0 <= i < self.vocab_size else None

        eos = name(self.eos_token_ids[0]) if self.eos_token_ids else None
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=name(self.bos_token_id), eos_token=eos, tools=tools or None)

    def _ends_mid_char(self, ids: list[int], skip_special_tokens: bool) -> bool:
        """Whether the decoded bytes of `ids` end inside a multi-byte UTF-8 character."""
        if not self._byte_level:  # no byte view: a trailing replacement char is the only sign
            return self.decode(ids, skip_special_tokens).endswith("\ufffd")
        tail = b""
        for i in reversed(ids[-8:]):  # a character is <= 4 bytes, so a few tokens back is enough
            if skip_special_tokens and i in self._special:
                continue
            s = self._tok.id_to_token(i) or ""
            tail = (bytes(_BYTE_OF[c] for c in s) if all(c in _BYTE_OF for c in s) else s.encode()) + tail
            if len(tail) >= 4:
                break
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        dec.decode(tail, final=False)
        return bool(dec.getstate()[0])  # bytes held back = an unfinished character


class IncrementalDetokenizer:
    """Streams text for a growing list of generated token ids, never emitting part of a character.

    Decodes a short window (from `_prefix` to the end) and emits what it adds beyond the already emitted
    `_prefix.._read` part; decoding with some context keeps decoder effects (e.g. leading-space rules) identical
    to a full decode, so the deltas join to `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are emitted and never decoded again
        self._read = 0  # ids before it are emitted
        self._text: list[str] = []

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        if self._read == len(self._ids) or self._tokenizer._ends_mid_char(self._ids[self._read:], self._skip):
            return ""  # wait for the rest of the character
        done = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip)
        window = self._tokenizer.decode(self._ids[self._prefix:], self._skip)
        delta = window[len(done):]
        if not delta:
            return ""  # e.g. only skipped special tokens so far: keep them in the window
        self._prefix, self._read = self._read, len(self._ids)
        self._text.append(delta)
        return delta

    @property
    def text(self) -> str:
        return "".join(self._text)
