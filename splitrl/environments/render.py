"""Observations as token ids, rendered by the model's own chat template.

After a model turn that called tools, the trajectory continues with the tool messages and the
next assistant header exactly as the chat template writes them. The text is found by rendering
a stand-in conversation twice, with and without the tool messages, and taking what the second
adds; what the template writes after an assistant turn's end-of-turn token (ChatML's newline)
goes first, since the model's turn stopped at that token. The text is then encoded once: the
trajectory is the generated ids followed by these ids, never a re-tokenization of generated
text (docs/environments.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

_MARK = "\u2063splitrl-turn\u2063"  # an assistant turn's content in the stand-in conversation


class ObservationRenderer:
    """Token ids of tool results for ``tokenizer``'s chat template (``tools``: the schemas the
    prompt was rendered with)."""

    CACHED = 1024  # distinct (results, stopped) whose ids `ids` keeps

    def __init__(self, tokenizer, tools: Sequence[dict[str, Any]] = (),
                 stop_token_ids: Sequence[int] = ()):
        if tokenizer.chat_template is None:
            raise ValueError("an environment needs the tokenizer's chat template to render tool "
                             "results; this tokenizer has none")
        self.tokenizer = tokenizer
        self.tools = list(tools) or None
        self.stop_texts = sorted({tokenizer.decode([int(i)], skip_special_tokens=False)
                                  for i in stop_token_ids}, key=len, reverse=True)
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        head = self._render(base, generation_prompt=False)
        tail = head[head.rindex(_MARK) + len(_MARK):]
        self._tail_after_stop = tail
        for stop in self.stop_texts:
            if stop and tail.startswith(stop):
                self._tail_after_stop = tail[len(stop):]
                break
        self._tail = tail
        self._base, self._head = base, head
        self._encoded = functools.lru_cache(maxsize=self.CACHED)(self._encode)

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt)

    def text(self, results: Sequence[tuple[str, str]], stopped: bool = True) -> str:
        """The observation text of tool ``results`` ((tool name, content) pairs, in call order)
        after a turn that ended at a stop token (``stopped``) or not."""
        messages = [{"role": "tool", "name": name, "content": content}
                    for name, content in results]
        full = self._render(self._base + messages, generation_prompt=True)
        if not full.startswith(self._head):
            raise ValueError("the chat template renders an earlier turn differently once tool "
                             "messages follow it; cannot find the observation's text")
        return (self._tail_after_stop if stopped else self._tail) + full[len(self._head):]

    def ids(self, results: Sequence[tuple[str, str]], stopped: bool = True) -> list[int]:
        """`text` encoded (special tokens in it, like ``<|im_start|>``, become their ids).
        The most recent distinct results are kept (`CACHED`): a sampler renders the same
        results again and again (a tool's few answers, its error messages), and each render
        runs the chat template twice over."""
        return list(self._encoded(tuple((str(n), str(c)) for n, c in results), stopped))

    def _encode(self, results: tuple[tuple[str, str], ...], stopped: bool) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(self.text(results, stopped), add_special_tokens=False))
