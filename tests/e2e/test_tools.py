"""Tool calls and structured output through both official SDKs, against the real binaries and
SmolLM2. SmolLM2 was not trained for tools and its template has none: the worker writes the
tools into its prompt (Hermes format), and the calls here are forced (`required` / a named
tool), so that the grammar engine (llguidance, in the worker) makes them well-formed. `auto`
with a tool-trained model (Qwen2.5-Coder) is exercised outside CI (docs/BENCHMARKS.md)."""
import json
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

# The SDK client fixtures of test_api, bound to this module's cluster.
from test_api import MODEL, claude, oai, raw_post, running_cluster  # noqa: F401

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
OAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_SCHEMA, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME_SCHEMA, "strict": True}},
]
CLAUDE_TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA,
     "cache_control": {"type": "ephemeral"}},
    {"name": "get_time", "description": "Current time in a timezone", "input_schema": TIME_SCHEMA},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("tools")) as c:
        yield c


def check_call(name, arguments):
    assert name in SCHEMAS, name
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_openai_weather_round_trip_call_result_answer(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=OAI_TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    args = check_call(calls[0].function.name, calls[0].function.arguments)
    # No markup leaks into the content.
    assert not (choice.message.content or "").strip()

    # The result goes back; the final answer is text (tool_choice none: the tools stay in the
    # prompt, nothing is parsed or forced; what SmolLM2 writes is its own business).
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id,
         "content": json.dumps({"city": args.get("city"), "temperature": 18, "sky": "clear"})},
    ]
    final = oai.chat.completions.create(model=MODEL, messages=history, tools=OAI_TOOLS,
                                        tool_choice="none", temperature=0, max_tokens=40)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None
    # The tool result was part of the prompt.
    assert final.usage.prompt_tokens > r.usage.prompt_tokens


def test_openai_named_choice_and_parallel_calls(oai):
    r = oai.chat.completions.create(
        model=MODEL, tools=OAI_TOOLS, temperature=0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    check_call("get_time", calls[0].function.arguments)

    # Parallel calls allowed: one or more calls, each well-formed, with distinct ids.
    r = oai.chat.completions.create(
        model=MODEL, tools=OAI_TOOLS, tool_choice="required", temperature=1, seed=5,
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Paris and in Rome, and the time in Tokyo?"}])
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    if r.choices[0].finish_reason == "tool_calls":
        assert 1 <= len(calls) <= 8
        assert len({c.id for c in calls}) == len(calls)
        for c in calls:
            check_call(c.function.name, c.function.arguments)


def test_openai_streamed_tool_calls_are_reassembled_by_the_sdk(oai):
    with oai.chat.completions.stream(model=MODEL, messages=ASK, tools=OAI_TOOLS,
                                     tool_choice="required", parallel_tool_calls=False,
                                     temperature=0, max_tokens=80) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not (choice.message.content or "").strip()
    streamed = choice.message.tool_calls[0]
    check_call(streamed.function.name, streamed.function.arguments)
    # Greedy: the same call as without streaming.
    plain = oai.chat.completions.create(model=MODEL, messages=ASK, tools=OAI_TOOLS,
                                        tool_choice="required", parallel_tool_calls=False,
                                        temperature=0, max_tokens=80).choices[0].message.tool_calls[0]
    assert (plain.function.name, json.loads(plain.function.arguments)) == \
        (streamed.function.name, json.loads(streamed.function.arguments))


def test_json_schema_outputs_always_validate_at_temperature_1(oai):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                     "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    finishes = []
    for seed in range(20):
        r = oai.chat.completions.create(
            model=MODEL, temperature=1, seed=seed, max_tokens=120,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": schema, "strict": True}})
        choice = r.choices[0]
        finishes.append(choice.finish_reason)
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
    # The schema is bounded to fit max_tokens: every answer completes.
    assert finishes == ["stop"] * 20, finishes

    r = oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=60,
                                    messages=[{"role": "user", "content": "Give me a JSON object."}],
                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        # Cut short: reported as such, never passed off as complete.
        assert r.choices[0].finish_reason == "length"


def test_anthropic_weather_round_trip_with_fields_agents_send(claude):
    system = [{"type": "text", "text": "You are a helpful assistant.",
               "cache_control": {"type": "ephemeral"}}]
    r = claude.messages.create(model=MODEL, max_tokens=80, system=system, messages=ASK,
                               tools=CLAUDE_TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                               metadata={"user_id": "u-1"}, extra_body={"temperature": 0},
                               extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    check_call(uses[0].name, uses[0].input)
    assert all(b.type != "text" or not b.text.strip() for b in r.content)

    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C and clear"},
            {"type": "text", "text": "Thanks. Summarise it."}]},
    ]
    final = claude.messages.create(model=MODEL, max_tokens=40, system=system, messages=history,
                                   tools=CLAUDE_TOOLS, tool_choice={"type": "none"},
                                   extra_body={"temperature": 0})
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > r.usage.input_tokens


def test_anthropic_streamed_tool_use_with_input_json_delta(claude):
    with claude.messages.stream(model=MODEL, max_tokens=80, messages=ASK, tools=CLAUDE_TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(uses) == 1
    check_call(uses[0].name, uses[0].input)


def test_bad_tool_requests_get_400s_in_each_apis_shape(cluster, oai, claude):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    assert e.value.body["param"] == "tools[0].function.parameters"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK + [
            {"role": "tool", "tool_call_id": "call_unknown", "content": "x"}])
    assert e.value.body["param"] == "messages[1].tool_call_id"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=OAI_TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    # A schema the grammar engine cannot enforce: a clear 400, never a silent fallback.
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/remote.json"}}})
    assert "grammar engine rejected" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, tool_choice="required",
                                    tools=[{"type": "function", "function": {
                                        "name": "f", "parameters": {
                                            "type": "object",
                                            "properties": {"x": {"$ref": "#/$defs/missing"}}}}}])
    assert "grammar engine rejected" in e.value.body["message"]

    # An unsatisfiable schema: refused (at compile time or at its first token), never a 5xx.
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 2}}})
    assert "constraint" in e.value.body["message"] or "grammar" in e.value.body["message"]

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=5, tools=CLAUDE_TOOLS, messages=ASK + [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}])
    assert e.value.body["type"] == "error" and "tool_use_id" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=5, messages=ASK,
                               tools=[{"name": "f", "input_schema": {"type": "array"}}])
    assert "input_schema" in e.value.body["error"]["message"]
    status, _, body = raw_post(cluster, "/v1/messages", {
        "model": MODEL, "max_tokens": 5, "messages": ASK, "tools": CLAUDE_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "thinking": {"type": "disabled"}, "betas": ["x"]})
    assert status == 200 and body["stop_reason"] in ("tool_use", "max_tokens")

    # The admin API says which features the model has now.
    token = (cluster.run_dir / "admin-token").read_text().strip()
    req = urllib.request.Request(cluster.url + "/admin/api/workers",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        workers = {w["name"]: w for w in json.load(r)["workers"]}
    features = workers[f"worker-{MODEL}"]["stats"]["features"]
    assert features["structured_output"].startswith("on (llguidance")
    assert "Hermes" in features["tool_calls"]


def test_responses_api_text_items_streaming_and_function_calls(oai):
    question = "What is the capital of France?"
    chat = oai.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}])
    r = oai.responses.create(model=MODEL, instructions="Be brief.", temperature=0, max_output_tokens=12,
                             input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}])
    # The same prompt through either API: the same greedy text.
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens

    events = list(oai.responses.create(model=MODEL, input=question, temperature=0,
                                       max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text and streamed

    tools = [{"type": "function", "name": "get_weather", "description": "Current weather",
              "parameters": WEATHER_SCHEMA, "strict": True}]
    r = oai.responses.create(model=MODEL, input=ASK[0]["content"], tools=tools, tool_choice="required",
                             parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    check_call(calls[0].name, calls[0].arguments)
    follow = oai.responses.create(
        model=MODEL, tools=tools, tool_choice="none", temperature=0, max_output_tokens=20,
        input=[ASK[0], {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                        "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, clear"}])
    assert follow.output_text and not [o for o in follow.output if o.type == "function_call"]
    assert follow.usage.input_tokens > r.usage.input_tokens

    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
