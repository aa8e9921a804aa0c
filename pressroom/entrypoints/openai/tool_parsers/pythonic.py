"""`pythonic`: calls written as a Python list of calls, `[get_weather(city="Paris", days=3), get_time()]`, as
Llama 3.2/4's pythonic templates ask for (Llama 4 may wrap the list in `<|python_start|>`...`<|python_end|>`).

An output is calls only when it starts with the list (after whitespace or the wrapper); anything else is content,
as is a list that is not calls. Arguments are keyword arguments with literal values: strings, numbers, lists,
dicts, tuples, and True/False/None (or JSON's true/false/null, which JSON-rendering templates write). Text after
the list is content. The list is read once its closing bracket came (found by a scanner that skips strings).
"""
from __future__ import annotations

import ast
import json
from typing import Any

from pressroom.entrypoints.openai.tool_parsers.base import ToolCallStream

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicToolStream(ToolCallStream):
    MARKERS = (PYTHON_START, PYTHON_END)

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._text = ""  # held text: the start of the output, or the list so far
        self._phase = "start"  # start -> list -> after -> content, or start -> content
        self._prefix = ""  # what came before the list (whitespace, the wrapper): content if it is no list
        self._scan = _ListScanner()

    def _feed(self, delta: str) -> None:
        if self._phase == "content":
            self.add_content(delta)
            return
        self._text += delta
        if self._phase == "start":
            self._start()
        if self._phase == "list":
            self._list()
        if self._phase == "after":
            self._after()

    def _start(self) -> None:
        head = self._text.lstrip()
        if head.startswith(PYTHON_START):
            head = head[len(PYTHON_START):].lstrip()
        if head.startswith("["):
            self._phase, self._prefix = "list", self._text[:len(self._text) - len(head)]
            self._text = head
        elif head and not PYTHON_START.startswith(head):
            self._phase = "content"
            self.add_content(self._text)
            self._text = ""

    def _list(self) -> None:
        end = self._scan.feed(self._text)
        if end < 0:
            return
        source, rest = self._text[:end + 1], self._text[end + 1:]
        calls = _calls(source)
        if calls is None:
            self._phase, self._text = "content", ""
            self.add_content(self._prefix + source + rest)
            return
        for name, arguments in calls:
            self.add_call(name, arguments)
        self._phase, self._text = "after", rest

    def _after(self) -> None:
        """After the list: the wrapper's closing is dropped, the rest is content."""
        head = self._text.lstrip()
        if head.startswith(PYTHON_END):
            head = head[len(PYTHON_END):]
        elif not head or PYTHON_END.startswith(head):
            return  # may still be the closing
        self._phase, self._text = "content", ""
        self.add_content(head)

    def _finish(self) -> None:
        if self._phase == "list":
            self.add_content(self._prefix + self._text)  # the list never closed
        elif self._phase == "start" or (self._phase == "after" and self._text.strip()):
            self.add_content(self._text)
        self._text = ""


class _ListScanner:
    """Finds the bracket that closes a list opened at text[0], skipping brackets inside string literals; fed the
    growing text, it resumes where it stopped."""

    def __init__(self) -> None:
        self.at, self.depth, self.quote, self.escaped = 0, 0, "", False

    def feed(self, text: str) -> int:
        for i in range(self.at, len(text)):
            ch = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.at = i + 1
                    return i
        self.at = len(text)
        return -1


def _calls(source: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a Python list of calls, or None if it is not one."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
        except ValueError:
            return None
        if len(arguments) != len(node.keywords):
            return None  # **kwargs
        calls.append((ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
    return calls


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_key(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    value = ast.literal_eval(node)  # ValueError for anything that is not a literal
    if isinstance(value, (set, bytes, complex)):
        raise ValueError("not a JSON value")
    return value


def _key(node: ast.expr | None) -> str:
    key = _literal(node)
    if not isinstance(key, str):
        raise ValueError("a dict key that is not a string")
    return key
