"""The Responses stream grammar, checked on a list of decoded events (integration and e2e tests share it).

    response.created, response.in_progress,
    per item (one at a time, output_index 0, 1, ...): output_item.added,
        message:   content_part.added, output_text.delta*, output_text.done, content_part.done
        reasoning: content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
        function_call: function_call_arguments.delta*, function_call_arguments.done
    output_item.done; then exactly one terminal event (completed | incomplete | failed), last.
"""

from __future__ import annotations

import json
from typing import Any

TERMINALS = ("response.completed", "response.incomplete", "response.failed")
_PART_EVENTS = {"message": "output_text", "reasoning": "reasoning_text"}


def check_grammar(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Assert the grammar; return the terminal event's response (its items checked against the stream)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:3]
    assert sum(k in TERMINALS for k in kinds) == 1 and kinds[-1] in TERMINALS, kinds
    response_id = events[0]["response"]["id"]
    assert response_id.startswith("resp_")
    assert events[1]["response"]["id"] == events[-1]["response"]["id"] == response_id
    streamed: list[dict[str, Any]] = []
    i = 2
    while events[i]["type"] not in TERMINALS:
        i = _check_item(events, i, len(streamed), streamed)
    assert i == len(events) - 1
    final = events[-1]["response"]
    final_by_id = {item["id"]: item for item in final["output"]}
    if events[-1]["type"] != "response.failed":
        assert final["output"] == streamed, (final["output"], streamed)
    else:
        for item in streamed:  # what was finished before the failure is in the failed response as sent
            assert final_by_id[item["id"]] == item
    return final


def _check_item(events: list[dict[str, Any]], i: int, index: int, streamed: list[dict[str, Any]]) -> int:
    """Check one item's events starting at `events[i]`; return the index after them."""
    added = events[i]
    assert added["type"] == "response.output_item.added", added
    assert added["output_index"] == index and added["item"]["status"] == "in_progress"
    item = added["item"]
    kind, item_id = item["type"], item["id"]
    i += 1
    deltas: list[str] = []
    if kind in _PART_EVENTS:
        part = _PART_EVENTS[kind]
        assert events[i]["type"] == "response.content_part.added" and events[i]["item_id"] == item_id
        i += 1
        while events[i]["type"] == f"response.{part}.delta":
            assert events[i]["item_id"] == item_id and events[i]["output_index"] == index
            deltas.append(events[i]["delta"])
            i += 1
        if events[i]["type"] == "response.failed":
            return i  # failed mid-item: the terminal event ends it
        done = events[i]
        assert done["type"] == f"response.{part}.done" and done["text"] == "".join(deltas), done
        assert events[i + 1]["type"] == "response.content_part.done"
        assert events[i + 1]["part"]["text"] == done["text"]
        i += 2
    else:
        assert kind == "function_call" and item["call_id"], item
        while events[i]["type"] == "response.function_call_arguments.delta":
            assert events[i]["item_id"] == item_id
            deltas.append(events[i]["delta"])
            i += 1
        done = events[i]
        assert done["type"] == "response.function_call_arguments.done", done
        assert done["item_id"] == item_id and done["arguments"] == "".join(deltas)
        json.loads(done["arguments"] or "{}")  # the arguments are complete JSON
        i += 1
    finished = events[i]
    assert finished["type"] == "response.output_item.done" and finished["output_index"] == index, finished
    assert finished["item"]["id"] == item_id and finished["item"]["status"] in ("completed", "incomplete")
    if kind == "function_call":
        assert finished["item"]["call_id"] == item["call_id"]
        assert finished["item"]["arguments"] == "".join(deltas)
    else:
        assert finished["item"]["content"][0]["text"] == "".join(deltas)
    streamed.append(finished["item"])
    return i + 1
