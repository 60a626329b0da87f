"""Tokenizer wrapper (Hugging Face directory or GGUF file) and a per-request streaming detokenizer.

Everything here is offline: tokenizers load with local_files_only. A GGUF file's tokenizer is
converted by transformers once (seconds) and cached as a plain tokenizer directory.

A worker needs a tokenizer only to decode its tokens and to know the stop and special tokens; importing
transformers for that costs ~1.5 s of every worker's start on 2 cores. So a directory whose tokenizer.json
transformers would load unchanged (a `TokenizersBackend` with no setting that alters it, as the converted GGUF
directory is) is read with the `tokenizers` library alone, and transformers' tokenizer is loaded the first
time something needs it (a chat template, a grammar's vocabulary).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.derived import cached_conversion

# Tokens that end a turn in the common chat formats (ChatML, Llama 3, Gemma, Phi-3, Llama 2). Like
# llama.cpp, generation stops on whichever of them the vocabulary holds as a special token: the
# tokenizer's eos is often only one of them (e.g. Qwen's eos is <|endoftext|> but chats end at
# <|im_end|>).
_END_OF_TURN_MARKERS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
)

# Written next to a converted GGUF tokenizer: the stop ids GGUF metadata names beyond eos.
_GENERATION_CONFIG = "generation_config.json"


class Tokenizer:
    """Encode/decode and chat templating over a transformers tokenizer, with the stop-token set."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self._tok = hf_tokenizer
        self._eos = _stop_ids(hf_tokenizer.eos_token_id, extra_eos_token_ids, self.special_tokens)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a Hugging Face model directory or a .gguf file (converted once, then cached)."""
        path = Path(path)
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
            path = _cached_gguf_tokenizer_dir(path)
        elif path.is_file():
            raise ValueError(f"a tokenizer loads from a model directory or a .gguf file, not {path}")
        elif not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        read = _read_unchanged(path)
        if read is not None:
            return _JsonTokenizer(path, *read, _generation_eos_ids(path))
        return cls(_load_hf(path), _generation_eos_ids(path))

    @property
    def hf_tokenizer(self) -> Any:
        return self._tok

    @property
    def special_tokens(self) -> dict[int, str]:
        """The special added tokens (bos, eos, chat markers): id -> text."""
        return {int(i): t.content for i, t in self.hf_tokenizer.added_tokens_decoder.items() if t.special}

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return len(self._tok)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos, then end-of-turn tokens of chat formats."""
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return self._tok.chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """The chat template's text (the default one where the tokenizer names several)."""
        template = self._tok.chat_template
        if isinstance(template, dict):
            template = template.get("default", next(iter(template.values()), None))
        return template

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a request's tools (its text uses the `tools` variable)."""
        return "tools" in (self.chat_template or "")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens (bos) are added only if the tokenizer's config says so."""
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
        """Render `messages` with the model's chat template and tokenize the result. tools: the functions the
        template is given (OpenAI's shape); template_kwargs: the template's own variables (enable_thinking, ...).
        A template that raises (a conversation it refuses) is a ValueError."""
        from jinja2 import TemplateError

        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead of messages")
        try:
            rendered = self._tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True,
                **template_kwargs
            )
        except TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None
        # transformers 5 returns a BatchEncoding here, older versions a bare list
        ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
        return [int(i) for i in ids]


class _JsonTokenizer(Tokenizer):
    """A directory's tokenizer.json read with the `tokenizers` library: encode, decode, the vocabulary and the
    special tokens, as transformers' tokenizer of the directory gives them (_read_unchanged decides that it
    would load the file unchanged); that tokenizer itself is loaded on first use (chat templates, grammars)."""

    def __init__(self, directory: Path, raw: Any, config: dict[str, Any], extra_eos_token_ids: Iterable[int]):
        self._dir, self._raw, self._hf = directory, raw, None
        self._bos = self._id_of(config.get("bos_token"))
        self._eos = _stop_ids(self._id_of(config.get("eos_token")), extra_eos_token_ids, self.special_tokens)

    def _id_of(self, token: str | dict | None) -> int | None:
        return None if token is None else self._raw.token_to_id(_token_text(token))

    @property
    def _tok(self) -> Any:
        if self._hf is None:  # two threads may both load it: the same tokenizer either way
            self._hf = _load_hf(self._dir)
        return self._hf

    @property
    def special_tokens(self) -> dict[int, str]:
        return {int(i): t.content for i, t in self._raw.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self._raw.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    def encode(self, text: str) -> list[int]:
        return self._raw.encode(text).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._raw.decode(list(ids), skip_special_tokens=skip_special_tokens)


# tokenizer_config.json keys that leave tokenizer.json as transformers' TokenizersBackend loads it (a named special
# token is checked to be in the file already: one that is not, transformers adds). Any other key (add_bos_token,
# split_special_tokens, added_tokens_decoder, ...) may change how it encodes or decodes: such a directory loads
# with transformers.
_PLAIN_CONFIG_KEYS = {"backend", "tokenizer_class", "bos_token", "eos_token", "unk_token", "pad_token", "is_local",
                      "local_files_only", "model_max_length", "chat_template", "clean_up_tokenization_spaces"}
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_unchanged(directory: Path) -> tuple[Any, dict[str, Any]] | None:
    """(the tokenizers.Tokenizer of directory/tokenizer.json, tokenizer_config.json) where transformers would load
    that file as it is, else None."""
    config_path, json_path = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not (config_path.is_file() and json_path.is_file()):
        return None
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") not in ("TokenizersBackend", "PreTrainedTokenizerFast") \
            or set(config) - _PLAIN_CONFIG_KEYS or config.get("clean_up_tokenization_spaces"):
        return None
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(json_path))
    added = {t.content for t in raw.get_added_tokens_decoder().values()}
    named = {_token_text(config[k]) for k in _NAMED_TOKENS if config.get(k) is not None}
    # Past 100k ids transformers may patch the pre-tokenizer (a Mistral regex fix); no post-processor: it makes one;
    # truncation or padding in the file: transformers turns them off for a plain encode, the file's reader would not.
    if raw.post_processor is None or raw.get_vocab_size() > 100_000 or not named <= added \
            or raw.truncation is not None or raw.padding is not None:
        return None
    return raw, config


def _token_text(token: str | dict) -> str:
    """A token as tokenizer_config.json names it: its text, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else token


def _load_hf(directory: Path) -> Any:
    from transformers import AutoTokenizer  # heavy import, only when transformers' tokenizer is needed

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _stop_ids(eos: int | None, extra: Iterable[int], special: dict[int, str]) -> tuple[int, ...]:
    """Every id that ends generation: eos first, then `extra` and the end-of-turn markers the vocabulary holds as
    special tokens, in a stable order, no duplicates."""
    by_text = {text: i for i, text in special.items()}
    candidates = [eos, *extra, *(by_text[m] for m in _END_OF_TURN_MARKERS if m in by_text)]
    return tuple(dict.fromkeys(int(i) for i in candidates if i is not None))


class IncrementalDetokenizer:
    """Turns one request's stream of token ids into text deltas, decoding only a small window.

    Decoding a token alone is wrong in two ways: a multi-byte character may be split across tokens
    (its partial decode ends in U+FFFD), and some tokenizers decode a suffix differently from the
    whole (SentencePiece drops the leading space of the first token). So add() decodes a window:
    the tokens of the previous emission as context, then the held and new ones, and emits what the
    window's text has beyond the part already emitted. Text ending in U+FFFD is held back until the
    character completes. Each add() thus costs O(window), independent of the output length.
    Call flush() when the stream ends, to emit anything still held.
    """

    # Prompt tokens kept as context for the first output tokens.
    _CONTEXT_TOKENS = 5
    # A UTF-8 char is at most 4 bytes, so an unfinished one is at most 3 bytes, which decode to at
    # most 3 U+FFFD (one in byte-level BPE, one per byte with SentencePiece byte fallback). Any
    # U+FFFD before those is final: malformed output, not a char still being completed.
    _MAX_PENDING_FFFD = 3
    # Valid text rarely holds back more than a few tokens; past this many, emit the final part
    # rather than stall the stream on malformed output.
    _MAX_HELD_TOKENS = 8

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The window: _ids[:_read] is already emitted (context), _ids[_read:] is held back.
        self._ids = list(prompt_token_ids[max(len(prompt_token_ids) - self._CONTEXT_TOKENS, 0) :])
        self._read = len(self._ids)
        self._emitted = len(self._decode(self._ids))  # chars of the window's text already emitted
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._parts)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the newly decodable text (possibly empty)."""
        self._ids.extend(token_ids)
        window_text = self._decode(self._ids)
        if window_text.endswith("\ufffd"):
            if len(self._ids) - self._read <= self._MAX_HELD_TOKENS:
                return ""
            trailing = len(window_text) - len(window_text.rstrip("\ufffd"))
            final_end = max(len(window_text) - min(trailing, self._MAX_PENDING_FFFD), self._emitted)
            delta = window_text[self._emitted : final_end]
            self._emitted = final_end
            return self._emit(delta)
        if len(window_text) <= self._emitted:
            return ""  # e.g. a skipped special token: nothing new to show yet
        delta = window_text[self._emitted :]
        # Slide the window: the tokens just emitted become the context of the next add().
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._emitted = len(self._decode(self._ids))
        return self._emit(delta)

    def flush(self) -> str:
        """At the end of the stream, emit held-back text (an incomplete character decodes as U+FFFD)."""
        window_text = self._decode(self._ids)
        delta = window_text[self._emitted :]
        self._emitted = max(len(window_text), self._emitted)
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def _cached_gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """A tokenizer directory converted from `gguf_path`, made on first use and reused afterwards."""

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        path = gguf_path.resolve()
        hf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        hf_tokenizer.save_pretrained(tmp)
        (tmp / _GENERATION_CONFIG).write_text(json.dumps({"eos_token_id": _gguf_stop_ids(path)}))

    return cached_conversion("tokenizers", gguf_path, "tokenizer_config.json", build)


def _gguf_stop_ids(gguf_path: Path) -> list[int]:
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [int(fields[k].contents()) for k in keys if k in fields]


def _generation_eos_ids(model_dir: Path) -> list[int]:
    """eos ids from generation_config.json (an int or a list), if the directory has one."""
    config_path = model_dir / _GENERATION_CONFIG
    if not config_path.is_file():
        return []
    eos = json.loads(config_path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]
