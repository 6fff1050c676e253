"""Structured outputs in the engine: grammars compiled with llguidance, once per distinct
constraint, and each request's matcher (torch-free).

`GrammarCompiler` (one per engine) builds llguidance's view of the tokenizer the first
time a request asks for a constraint (about a second for a 50k vocabulary; engines that
never see one never pay it), compiles each distinct constraint once into a template
matcher kept in a bounded LRU cache, and hands every request a copy of it
(`GrammarState`). The state advances with each accepted token (OutputProcessor); the
runner reads it when it samples, to mask the logits (engine/grammar_mask.py).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import llguidance
import llguidance.hf

from sparsevllm.structured_outputs import StructuredOutputsParams

# Compiled constraints kept (each holds its grammar's lexer; a hostile client sending a
# fresh schema per request must not grow the cache without bound).
MAX_CACHED_GRAMMARS = 256
# What JSON may hold between two of its tokens by default: one space, or one line break
# and up to 8 spaces of indentation (pretty-printed JSON); llguidance matches it once
# per gap, so a gap is bounded. JSON's own "any whitespace" lets a small model at
# temperature 1 fall into emitting newlines until max_tokens cuts the document (1 in 100
# did on SmolLM2-135M), and a looser bound (8 spaces or tabs, or a line break and 32 of
# indentation) still let one of 100 pad its gaps with tab runs until max_tokens cut it.
DEFAULT_JSON_WHITESPACE = r"\x20|\x0A\x20{0,8}"
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


class HFTokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module reads (llguidance reads the rest)."""

    eos_token_id: int | None


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (or a model that cannot serve any): a client
    error, raised at validation time, before anything is queued."""

    param = "structured_outputs"  # the request field the server reports


class GrammarState:
    """One request's place in its grammar: advanced with every accepted token."""

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int) -> None:
        self.matcher = matcher
        self.mask_words = mask_words  # 32-bit words of one token bitmask

    def accept(self, token: int) -> None:
        """Advance by a sampled token; raises RuntimeError if the grammar forbids it
        (the logits were masked, so that means a bug: the request fails alone)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(
                f"the sampled token {token} is not allowed by the request's structured-"
                f"output grammar: {self.matcher.get_error()}"
            )

    @property
    def is_finished(self) -> bool:
        """Nothing more can follow (the constraint is complete, or ended by EOS)."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints for one engine's tokenizer and caches them."""

    def __init__(
        self, tokenizer: HFTokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._cache: OrderedDict[tuple[str, str, bool, str | None], llguidance.LLMatcher] = (
            OrderedDict()
        )

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile `spec` (or find it compiled); raises StructuredOutputError."""
        self._template(spec)

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one request (a copy of the compiled template)."""
        return GrammarState(self._template(spec).deep_copy(), self.mask_words)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _template(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        key = spec.cache_key()
        template = self._cache.get(key)
        if template is not None:
            self._cache.move_to_end(key)
            return template
        template = self._compile(spec)
        self._cache[key] = template
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return template

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        what = _WHAT[spec.kind]
        try:
            grammar = _grammar_text(spec)
        except ValueError as e:
            raise StructuredOutputError(f"invalid {what}: {e}") from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"invalid {what}: {matcher.get_error().strip()}")
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built once (a failure is remembered too)."""
        if self._tokenizer is not None:
            return self._tokenizer
        if self._tokenizer_error is None:
            try:
                self._tokenizer = self._build_tokenizer()
                return self._tokenizer
            except Exception as e:  # whatever llguidance raises: this model cannot serve
                self._tokenizer_error = str(e) or type(e).__name__
        raise StructuredOutputError(
            "structured outputs are not available for this model: llguidance cannot "
            f"read its tokenizer ({self._tokenizer_error})"
        )

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        if self._hf is None:
            raise ValueError("the model has no tokenizer")
        # Every EOS id of the model ends a constrained output once the grammar accepts;
        # n_vocab is the logits' width, which may exceed the tokenizer's own vocabulary.
        eos = self._eos or ([self._hf.eos_token_id] if self._hf.eos_token_id is not None else [])
        return llguidance.hf.from_tokenizer(
            self._hf,  # type: ignore[arg-type]  # any fast tokenizer, not only the Fast class
            n_vocab=self.vocab_size,
            eos_token=eos or None,
        )


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for `spec` (not checked yet: the matcher does that)."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        options: llguidance._lib.JsonCompileOptions = {"whitespace_flexible": False}
        if not spec.disable_any_whitespace:
            options["whitespace_pattern"] = spec.whitespace_pattern or DEFAULT_JSON_WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source(), defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source())
    if kind == "choice":
        return llguidance.grammar_from("choice", spec.source())
    return llguidance.grammar_from("grammar", spec.source())


def fill_bitmasks(states: Sequence[GrammarState], address: int, row_bytes: int) -> None:
    """Write each state's allowed-token bitmask (bit t of word t // 32: token t) into
    row i of a C-contiguous int32 buffer at `address` (one `row_bytes` row per state).

    Unsafe by llguidance's design (a raw pointer); the caller owns a buffer that large.
    Several rows are computed in parallel by llguidance's own threads (without the GIL).
    """
    if len(states) == 1:
        states[0].matcher.unsafe_compute_mask_ptr(address, row_bytes)
    elif states:
        rows = [(state.matcher, i) for i, state in enumerate(states)]
        _executor().unsafe_compute_mask_ptr(rows, address, row_bytes, len(states))


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for batched masks, one per process (created on first use)."""
    return llguidance.LLExecutor()
