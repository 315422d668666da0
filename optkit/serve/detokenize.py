"""Incremental detokenization with stop strings, for streaming one request's output.

Decoding token by token (``decode([t])``) is wrong twice over: byte-level tokens can each
hold part of one UTF-8 character (an emoji is 4 byte tokens in a byte-level vocabulary), and
SentencePiece-style tokenizers decide a token's leading space from its neighbours. Decoding
the whole output every step is right but O(n^2). The vLLM / TGI method keeps two offsets into
the token list and decodes only a short window:

- ``prefix_text = decode(tokens[prefix_offset:read_offset])``: text already emitted;
- ``new_text = decode(tokens[prefix_offset:])``;
- if ``new_text`` is longer and does not end in U+FFFD (an incomplete UTF-8 sequence), emit
  ``new_text[len(prefix_text):]`` and move ``prefix_offset, read_offset = read_offset, len``;
  otherwise emit nothing and wait for the next token to complete the character.

The window starts inside the prompt's last few tokens, so the first output token is decoded
with context and its leading space matches decoding prompt + output together (for byte-level
BPE that is exactly ``decode(output_ids)``).

Stop strings follow OpenAI semantics: the matched stop string and everything after it are not
part of the output. While streaming, the last ``max(len(s)) - 1`` characters are held back, so
a stop string split across tokens is never partly streamed; :meth:`finish` releases them.
"""

from __future__ import annotations

# Prompt tokens of context the first window starts from: enough for a SentencePiece leading
# space or a multi-token character to resolve (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_PREFIX_CONTEXT = 5
# Extra prompt tokens kept beyond that, in case some are special tokens that decode to nothing.
_SPECIAL_SLACK = 2
_INCOMPLETE = "\ufffd"  # what a decoder writes for a truncated UTF-8 sequence


class IncrementalDetokenizer:
    """Turns one request's output tokens into streamable text.

    ``push(token_id)`` returns the new text that is safe to stream; ``finish()`` returns what
    is still held back at the end. ``text``: the whole output so far (truncated before a stop
    string once one matched); ``stopped``: a stop string matched (later pushes return "").
    Invariant: ``"".join(pushes) + finish() == text`` and, with no stop match and a
    byte-level tokenizer, ``text == tokenizer.decode(output_ids, skip_special_tokens=...)``.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {list(self.stop)!r}")
        # A stop string of n characters can have n - 1 of them in the text before it completes.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        # Only the prompt's tail is needed as decoding context.
        self._ids: list[int] = list(prompt_token_ids[-(_PREFIX_CONTEXT + _SPECIAL_SLACK) :])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PREFIX_CONTEXT, 0)
        self._text = ""  # decoded output (complete characters only), truncated at a stop match
        self._emitted = 0  # characters of _text already returned to the caller
        self.stopped = False
        self.output_token_ids: list[int] = []

    @property
    def text(self) -> str:
        return self._text

    def push(self, token_id: int) -> str:
        """Add one output token; return the text that became safe to stream."""
        if self.stopped:
            return ""
        self.output_token_ids.append(token_id)
        self._ids.append(token_id)
        self._text += self._decode_step(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush at the end of the request: text of a trailing incomplete character (as the
        full decode writes it, U+FFFD) and the held-back tail; "" after a stop match."""
        if self.stopped:
            return ""
        self._text += self._decode_step(final=True)
        return self._release(final=True)

    # --- internals -------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it looks at neighbours, so it is not
        # window-invariant (and byte-level tokenizers leave it off).
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False)

    def _decode_step(self, final: bool) -> str:
        """New complete text since the last call (vLLM's ``detokenize_incrementally``);
        ``final`` also accepts a trailing U+FFFD, since no later token can complete it."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_INCOMPLETE) and not final):
            # A special token that decodes to nothing, or a character still incomplete: keep
            # the window and try again with the next token.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # The window keeps growing only while characters stay incomplete; once they resolve
        # it shrinks back to the last emitted token(s), so each step decodes O(1) tokens.
        return new_text[len(prefix_text) :]

    def _release(self, final: bool) -> str:
        """Check stop strings, then return the streamable part of ``_text`` not yet returned."""
        if self.stop:
            # Everything before _emitted was checked with a full stop string's worth of
            # following text held back, so a new match cannot start before it: searching from
            # there keeps each step O(new text + longest stop string).
            hits = [i for i in (self._text.find(s, self._emitted) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)  # the earliest match wins
                self._text = self._text[:cut]
                self.stopped = True
                out = self._text[self._emitted :]
                self._emitted = cut
                return out
        safe = len(self._text) if final else max(self._emitted, len(self._text) - self._holdback)
        out = self._text[self._emitted : safe]
        self._emitted = safe
        return out
