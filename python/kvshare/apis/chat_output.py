"""A chat choice's generated text as OpenAI message fields: reasoning split out of `content`
(`reasoning_content`, llama-server's reasoning_format), tool-call markup parsed into
`tool_calls` (kvshare.toolcalls, the model's format). The same pipeline runs whole (a
response) or incrementally (stream deltas); the deltas of a stream add up to the response.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.toolcalls.base import ToolFormat


@dataclass(frozen=True)
class OutputRules:
    """How one request's replies are read: `tool_format` (a kvshare.toolcalls format, or None:
    no tool parsing) and whether `<think>` blocks are split out (starting inside one when the
    prompt opened it)."""

    tool_format: ToolFormat | None = None
    reasoning: bool = False
    starts_in_reasoning: bool = False
    parallel_tool_calls: bool = True


class ChoiceOutput:
    def __init__(self, rules: OutputRules):
        self.rules = rules
        self._splitter = None
        if rules.reasoning:
            from kvshare.toolcalls import ReasoningSplitter

            self._splitter = ReasoningSplitter(in_reasoning=rules.starts_in_reasoning)
        self._tools = rules.tool_format.stream() if rules.tool_format is not None else None
        self.has_calls = False

    @property
    def broken_calls(self) -> frozenset[int]:
        """Indices of calls announced in a tool-call block that then broke (cut off by
        max_tokens): their markup follows as text."""
        return frozenset(self._tools.broken_calls) if self._tools is not None else frozenset()

    # ---- streaming ---------------------------------------------------------------------
    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        return self._route(*self._split(text, final=False))

    def finish(self) -> list[dict]:
        deltas = self._route(*self._split("", final=True)) if self._splitter else []
        if self._tools is not None:
            deltas += self._tools_out(self._tools.finish())
        return deltas

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self._splitter is None:
            return "", text
        return self._splitter.finish() if final else self._splitter.feed(text)

    def _route(self, reasoning: str, content: str) -> list[dict]:
        out: list[dict] = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if content:
            if self._tools is None:
                out.append({"content": content})
            else:
                out += self._tools_out(self._tools.feed(content))
        return out

    def _tools_out(self, deltas: list[dict]) -> list[dict]:
        if self._tools is not None:
            self.has_calls = self._tools.has_calls
        if not self.rules.parallel_tool_calls:  # one call at most: later ones are dropped
            for d in deltas:
                if d.get("tool_calls"):
                    d["tool_calls"] = [c for c in d["tool_calls"] if c.get("index", 0) == 0]
        return [d for d in deltas if d.get("content") or d.get("tool_calls")
                or d.get("reasoning_content")]

    # ---- whole -------------------------------------------------------------------------
    @staticmethod
    def message(rules: OutputRules, text: str) -> tuple[dict, bool]:
        """(the assistant message, whether it holds tool calls) for a whole reply."""
        reasoning = ""
        content = text
        if rules.reasoning:
            from kvshare.toolcalls import ReasoningSplitter

            sp = ReasoningSplitter(in_reasoning=rules.starts_in_reasoning)
            r1, c1 = sp.feed(text)
            r2, c2 = sp.finish()
            reasoning, content = r1 + r2, c1 + c2
        msg: dict = {"role": "assistant", "content": content}
        calls = []
        if rules.tool_format is not None:
            parsed = rules.tool_format.parse(content)
            calls = parsed.tool_calls
            if not rules.parallel_tool_calls:
                calls = calls[:1]
            msg["content"] = parsed.content
            reasoning += parsed.reasoning  # a format that carries it (harmony's analysis)
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
            if not msg["content"].strip():
                msg["content"] = None
        if rules.reasoning or reasoning:
            msg["reasoning_content"] = reasoning or None
        return msg, bool(calls)

