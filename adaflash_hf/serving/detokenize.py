"""The text of a stream of generated tokens: incremental detokenization and OpenAI stop strings.

    text = IncrementalText(tokenizer, stop=["\\n\\n"])
    for token in new_tokens:
        send(text.push(token))        # the text that can be sent now ("" while it may still change)
        if text.stopped:              # a stop string appeared: the request ends here
            break
    send(text.finish())               # the request ended otherwise (EOS, length): what was held back

Decoding follows the prefix/read offsets of TGI and vLLM: a token's text is the difference between decoding a short
window of tokens with it and without it, so a byte-level token that ends inside a UTF-8 character (decoded as
U+FFFD) waits for the next one, and a tokenizer that decodes a token differently after a space still gets it right.
The concatenated pieces equal ``tokenizer.decode(tokens, skip_special_tokens=True)``.

Stop strings: the text ends just before the first occurrence of any stop string, which is not returned (OpenAI's
rule); text that could still become the start of a stop string is held back until it cannot. ``tokens_used`` counts
the tokens up to the one that completed the stop string, so the text and the count depend only on the tokens, never
on how many tokens a step committed at once.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # decode window: tokens[prefix:read] are already in ``text``
        self.text = ""
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False

    @property
    def tokens_used(self) -> int:
        return len(self.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, force: bool) -> None:
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if len(after) > len(before) and (force or not after.endswith(REPLACEMENT)):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.tokens)

    def push(self, token: int) -> str:
        """Add one generated token; returns the new text that can be sent."""
        if self.stopped:
            raise ValueError("token: expected none after the stop string, got one")
        self.tokens.append(int(token))
        self._advance(force=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended without a stop string: the rest of the text, incomplete characters included."""
        if self.stopped:
            return ""
        self._advance(force=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if found:
            end = min(found)
            self.text, self.stopped = self.text[:end], True
        else:
            end = len(self.text) if final else len(self.text) - self._held_back()
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def _held_back(self) -> int:
        """Characters at the end of the unsent text that are the start of a stop string."""
        unsent = self.text[self.sent :]
        for size in range(min(len(unsent), max(map(len, self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(unsent[-size:]) for s in self.stop):
                return size
        return 0
