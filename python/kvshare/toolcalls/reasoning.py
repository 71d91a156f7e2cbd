"""Reasoning split from the reply as llama-server's `reasoning_format: deepseek` does: a
`<think>...</think>` block at the start of the reply (after whitespace), or from the start when
the prompt already opened it, becomes `reasoning_content`; the rest is `content`.

The reasoning is stripped of surrounding whitespace and the content of the whitespace right
after the end tag; a block never closed (max_tokens) is all reasoning. Tags are never emitted in
part: a piece that could still become a tag is held until it can't. A `<think>` later in the
reply is content. Feed the content it returns to a `ToolCallStream`: calls inside reasoning are
not calls.
"""

from __future__ import annotations

from kvshare.toolcalls.stream import held

__all__ = ["ReasoningSplitter", "template_has_thinking", "prompt_opens_reasoning"]

_WS = " \t\r\n"


class ReasoningSplitter:
    """`feed(text)` -> (reasoning delta, content delta); `finish()` flushes what was held."""

    def __init__(self, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False):
        self.start, self.end = start, end
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""
        self._sent_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._pump(final=False)

    def finish(self) -> tuple[str, str]:
        return self._pump(final=True)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a complete reply (a fresh splitter's feed + finish)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _pump(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            buf = self._buf
            if self._state == "start":
                rest = buf.lstrip(_WS)
                if rest.startswith(self.start):
                    self._state, self._buf = "reasoning", rest[len(self.start):]
                    continue
                if not final and self.start.startswith(rest):
                    break  # only whitespace, or the start tag in part
                self._state = "content"
            elif self._state == "reasoning":
                i = buf.find(self.end)
                if i >= 0:
                    reasoning.append(self._reasoning(buf[:i].rstrip(_WS)))
                    self._state, self._buf = "after", buf[i + len(self.end):]
                    continue
                cut = len(buf) if final else len(buf) - held(buf, self.end)
                while cut > 0 and buf[cut - 1] in _WS:
                    cut -= 1
                reasoning.append(self._reasoning(buf[:cut]))
                self._buf = "" if final else buf[cut:]
                break
            elif self._state == "after":
                rest = buf.lstrip(_WS)
                self._buf = rest
                if rest:
                    self._state = "content"
                else:
                    break
            else:
                content.append(buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def _reasoning(self, text: str) -> str:
        if not self._sent_reasoning:
            text = text.lstrip(_WS)
        if text:
            self._sent_reasoning = True
        return text


def template_has_thinking(template_source: str | None) -> bool:
    """Whether a chat template knows reasoning blocks (`<think>`, `enable_thinking`,
    `reasoning_content`)."""
    src = template_source or ""
    return any(s in src for s in ("<think>", "</think>", "enable_thinking", "reasoning_content"))


def prompt_opens_reasoning(prompt: str, start: str = "<think>", end: str = "</think>") -> bool:
    """Whether a rendered prompt ends inside an open reasoning block (the template added
    `<think>` to the generation prompt): then pass `in_reasoning=True` to the splitter."""
    i = prompt.rfind(start)
    return i >= 0 and prompt.find(end, i) < 0
