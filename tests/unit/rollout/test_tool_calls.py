"""Tool-call parsers: text of a model turn -> content and OpenAI tool calls."""

from __future__ import annotations

import json

import pytest

from miles.registry import RegistryError
from miles.engine_api.tool_calls import TOOL_PARSERS, ParsedTurn, get_tool_parser


def test_hermes_parser_takes_calls_out_and_keeps_the_rest_as_content():
    p = get_tool_parser("qwen3")
    turn = p.parse('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>\n'
                   '<tool_call>{"name": "shell", "arguments": "{\\"cmd\\": \\"ls\\"}"}</tool_call>')
    assert turn.content == "Let me compute."
    assert [(c.name, json.loads(c.arguments)) for c in turn.calls] == [("calc", {"x": 1}), ("shell", {"cmd": "ls"})]


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>[1, 2]</tool_call>"])
def test_hermes_parser_leaves_malformed_blocks_as_content(text):
    assert get_tool_parser("hermes").parse(text) == ParsedTurn(text)


def test_parser_registry_names_the_choices_and_takes_user_parsers():
    with pytest.raises(RegistryError, match="hermes"):
        get_tool_parser("mistral-ish")
    with pytest.raises(RegistryError, match="lacks \\['parse'\\]"):
        TOOL_PARSERS.get("miles.engine_api.tool_calls:ParsedCall")
    assert get_tool_parser("miles.engine_api.tool_calls:NoParser").parse("<tool_call>{}</tool_call>").calls == ()


def test_llama3_json_parser_reads_a_bare_call_object():
    p = get_tool_parser("llama3_json")
    (call,) = p.parse('<|python_tag|>{"name": "calc", "parameters": {"x": 2}}').calls
    assert (call.name, json.loads(call.arguments)) == ("calc", {"x": 2})
    assert p.parse('The answer is {"name": 1}') == ParsedTurn('The answer is {"name": 1}')
