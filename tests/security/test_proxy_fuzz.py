"""A property of the agent proxy's request handling, over real HTTP to ``rollstream proxy``:
whatever body a harness sends (valid requests, valid ones with one field replaced by
arbitrary JSON, removed or given an unknown key, arbitrary JSON, arbitrary bytes), the answer
is a chat completion or a 400 whose ``param`` names the field; never a 5xx, and the server
never logs a traceback."""

from __future__ import annotations

import copy
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCALARS = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | \
    st.text(max_size=20)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
TEXT = st.text(alphabet="abc 12+\n<|>{}\"", max_size=40) | st.text(max_size=12)


CALL = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries(
        {"name": st.just("calculator")},
        optional={"arguments": st.just('{"expression": "1+2"}') | TEXT})},
    optional={"id": st.just("call_0"), "type": st.just("function")})
CONTENT = TEXT | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                             "text": TEXT}), max_size=2)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"])},
                          optional={"content": CONTENT, "name": TEXT}),
    st.fixed_dictionaries({"role": st.just("assistant")},
                          optional={"content": CONTENT, "tool_calls": st.lists(CALL,
                                                                               max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": CONTENT},
                          optional={"tool_call_id": st.just("call_0")}))
TOOL = {"type": "function", "function": {
    "name": "calculator", "parameters": {"type": "object", "properties": {
        "expression": {"type": "string"}}}}}
VALID = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 3)},
    optional={"model": TEXT, "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
              "top_k": st.integers(-1, 5), "seed": st.integers(-(1 << 63), (1 << 63) - 1),
              "stream": st.booleans(), "n": st.just(1), "tools": st.just([TOOL]),
              "stop": st.none() | st.just([]), "tool_choice": st.just("auto"),
              "max_completion_tokens": st.integers(1, 3), "user": TEXT,
              "metadata": st.just({}), "logprobs": st.just(False)})


def _paths(node, at=()):
    """Every place in a JSON tree: (path, container, key)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, value in items:
        yield at + (key,), node, key
        yield from _paths(value, at + (key,))


@st.composite
def bodies(draw) -> tuple[bytes, tuple | None]:
    """A body and the path of the one defect put into a valid request (None: a valid
    request, or not a request at all)."""
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "mutated", "json", "bytes"]))
    if kind == "json":
        return json.dumps(draw(JSON)).encode(), None
    if kind == "bytes":
        return draw(st.binary(max_size=64)), None
    request = copy.deepcopy(draw(VALID))  # its constants (TOOL) are shared
    if kind == "valid":
        return json.dumps(request).encode(), None
    path, container, key = draw(st.sampled_from(list(_paths(request))))
    how = draw(st.sampled_from(["replace", "replace", "delete", "extra"]))
    if how == "delete" and isinstance(container, dict):
        del container[key]
    elif how == "extra" and isinstance(container[key], dict):
        container[key]["frobnicate"] = draw(JSON)
        path += ("frobnicate",)
    else:
        container[key] = draw(JSON)
    return json.dumps(request).encode(), path


def test_no_body_gives_a_5xx_and_every_refusal_names_its_field(cli_proxy) -> None:
    url = f"{cli_proxy.base_url}/chat/completions"
    headers = {"Authorization": f"Bearer {cli_proxy.keys[2]}",
               "Content-Type": "application/json"}
    seen: dict[int, int] = {}
    with httpx.Client(timeout=60) as http:

        @settings(derandomize=True, max_examples=300, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=bodies())
        def check(case: tuple[bytes, tuple | None]) -> None:
            body, defect = case
            r = http.post(url, content=body, headers=headers)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (r.status_code, r.text, body)
            if r.status_code == 400:
                error = r.json()["error"]
                assert error["param"] and error["message"].startswith(error["param"]), error
                if defect is not None:  # it names where the defect is (or what holds it)
                    assert error["param"].split(".")[0] == str(defect[0]), (error, defect)
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.endswith("data: [DONE]\n\n")
            else:
                assert r.json()["choices"][0]["message"]["role"] == "assistant"

        check()
    assert seen.get(200, 0) >= 20 and seen.get(400, 0) >= 100, seen  # both paths exercised
    assert "Traceback" not in cli_proxy.stderr.read_text()
