"""Chat requests: messages and tools into the model's chat template, and the model's text back
out as the answer, its reasoning and its tool calls.

Both directions are mlx_lm.server's, reused rather than rewritten, so a request renders into
the same prompt tokens and its output parses into the same calls as there: every message
field the template reads (`tool_calls` with their arguments as objects, `tool_call_id`,
`name`, text content parts) and the tools go to `apply_chat_template`; the output goes through
mlx-lm's text state machine (`<think>` ... `</think>` is reasoning, the tokenizer's tool-call
markers delimit calls) and each call through the tokenizer's own tool parser.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Optional

from ...base.log import log
from ..errors import ApiError


def text_content(content: Any, where: str, part_types: tuple = ("text",)) -> str:
    """A message's text: a string, or a list of text parts (of `part_types`: each API names its
    own), joined; None (an assistant turn that only called tools) is no text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in part_types or \
                    not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{where}[{i}]' must be a text part "
                               f"({{\"type\": \"{part_types[0]}\", \"text\": ...}}); this model reads text only",
                               where, "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"'{where}' must be a string or a list of text parts", where, "invalid_type")


def _template_messages(messages: Any) -> List[dict]:
    """The messages as the chat template reads them (mlx_lm.server's normalisation)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects",
                       "messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"'messages[{i}]' must be an object with a string 'role'",
                           f"messages[{i}].role", "invalid_type")
        message = copy.deepcopy(m)
        message["content"] = text_content(m.get("content", ""), f"messages[{i}].content")
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ApiError(400, f"'messages[{i}].tool_calls' must be a list", f"messages[{i}].tool_calls",
                               "invalid_type")
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ApiError(400, f"'messages[{i}].tool_calls[{j}]' must be {{\"type\": \"function\", "
                                   "\"function\": {\"name\": ..., \"arguments\": ...}}",
                                   f"messages[{i}].tool_calls", "invalid_type")
                arguments = function.get("arguments")
                if isinstance(arguments, str) and arguments:
                    # Templates render the arguments as an object, as mlx_lm.server hands them.
                    try:
                        function["arguments"] = json.loads(arguments)
                    except json.JSONDecodeError as exc:
                        raise ApiError(400, f"'messages[{i}].tool_calls[{j}].function.arguments' is not "
                                       f"JSON ({exc})", f"messages[{i}].tool_calls", "invalid_value") from None
        out.append(message)
    return out


def chat_tools(body: dict, tokenizer) -> Optional[list]:
    """The tools the template gets (None: none), from `tools` and `tool_choice` (a forced call
    is a grammar: serve.structured)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' names a tool but 'tools' is empty", "tool_choice",
                           "invalid_value")
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance(t.get("function"), dict) for t in tools):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}",
                       "tools", "invalid_type")
    if choice == "none":
        return None  # the model is not told about them, so it calls none
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ApiError(400, "'tools' given, but this model's tokenizer has no tool-call format "
                       "mlx-lm knows (no tool parser): its calls could not be returned", "tools",
                       "unsupported_parameter")
    return tools


def chat_prompt(tokenizer, messages: Any, tools: Optional[list] = None) -> List[int]:
    """The model's chat template over `messages` (and `tools`), the assistant's turn opened."""
    rendered = _template_messages(messages)
    if getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(rendered, tools=tools, add_generation_prompt=True,
                                                tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template rejects messages with its own errors
            raise ApiError(400, f"the model's chat template rejected the messages: {exc}",
                           "messages", "invalid_value") from None
        # Some tokenizer versions answer a BatchEncoding instead of the ids.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    # No template: mlx-lm's plain role-prefixed rendering.
    from mlx_lm.server import convert_chat

    return list(tokenizer.encode(convert_chat(rendered)))


class ChatText:
    """One chat answer's text, split as it streams into content, reasoning and tool calls."""

    def __init__(self, tokenizer, prompt: List[int], tools: Optional[list], streaming: bool):
        from mlx_lm.generate import TextStateMachine, make_text_state_machine
        from mlx_lm.server import ToolCallFormatter

        self._sm = TextStateMachine
        initial = "normal"
        if getattr(tokenizer, "has_thinking", False) and \
                tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            initial = "reasoning"  # the template opened the thinking for the model
        initial = getattr(tokenizer, "response_initial_state", None) or initial
        self._state = make_text_state_machine(tokenizer).make_state(initial)
        self._previous = initial
        self._tool_text = ""
        self._format = ToolCallFormatter(getattr(tokenizer, "tool_parser", None), tools, streaming)
        self.made_tool_call = False

    def _take(self, segments) -> Dict[str, Any]:
        out: Dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": []}
        calls = []
        for state, text in segments:
            if state == "reasoning":
                out["reasoning"] += text
            elif state == "tool":
                self._tool_text += text
            elif state == "normal":
                out["content"] += text
            if self._previous == "tool" and state != "tool" and self._tool_text:
                calls.append(self._tool_text)
                self._tool_text = ""
            self._previous = state
        for call in calls:
            out["tool_calls"].extend(self._read_call(call))
        self.made_tool_call |= bool(out["tool_calls"])
        return out

    def _read_call(self, text: str) -> List[dict]:
        """One call's text through the tokenizer's parser: the calls it holds. mlx-lm drops a
        call its parser refuses (cut short); one that breaks it otherwise (JSON that is not an
        object, ...) is dropped alike, named in the log, rather than failing the answer."""
        try:
            return self._format([text])
        except Exception as exc:  # noqa: BLE001 - the model's text, whatever a parser makes of it
            log(f"a tool call could not be read ({type(exc).__name__}: {exc}); dropped: {text[:200]!r}")
            return []

    def add(self, text: str) -> Dict[str, Any]:
        """This piece of the answer's text: {"content", "reasoning", "tool_calls"}."""
        self._state, segments = self._sm.split(self._state, text)
        return self._take(segments)

    def finish(self, finish_reason: str) -> Dict[str, Any]:
        """What the end of the answer releases: text held back as a possible marker (kept at
        a length stop, dropped after a stop), and a call still open when it ended."""
        held = ""
        if finish_reason == "length":
            self._state, held, state = self._sm.flush(self._state)
        else:
            self._state, state = self._sm.discard(self._state)
        # The end, a segment of no state, closes a call still open as any other state would.
        return self._take([(state, held), (None, "")])
