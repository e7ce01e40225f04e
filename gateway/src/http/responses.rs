//! OpenAI's Responses API, `POST /v1/responses`, as far as the chat path goes: text or item
//! input (messages, `developer` messages, earlier function calls and their outputs),
//! instructions, function tools and `namespace` tools with `tool_choice`, `text.format` (JSON
//! object or schema), streaming with the semantic event sequence. Hosted tools (`web_search`,
//! `file_search`, …) and `reasoning` are declined with a notice, not a 400, so agents such as
//! Codex run. Responses are not stored: `previous_response_id` is refused with a clear error,
//! and clients resend the conversation (`store: false`), as Codex does.

use std::collections::HashMap;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_proto::worker as pb;

use super::error::{ApiError, Flavor};
use super::generation::{
    self, Collected, Encoder, Params, SseEvent, read_json, response_id, unix_now,
};
use super::openai::normalize_messages;
use super::tools::{self, CallParser, Piece, ToolCall, ToolUse};
use super::{AppState, TenantKey};

const FLAVOR: Flavor = Flavor::OpenAi;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct ResponsesRequest {
    model: String,
    /// A string (one user message) or a list of input items.
    input: Value,
    instructions: Option<String>,
    max_output_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    #[serde(default)]
    stream: bool,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    text: Option<Value>,
    previous_response_id: Option<String>,
    /// Extension, as on chat completions: requests with different salts share no blocks.
    cache_salt: Option<String>,
    /// Extension, as on chat completions: speculative decoding for this request.
    speculative_decoding: Option<bool>,
    /// Extension, as on chat completions: SpecPrefill, `{"keep_ratio": 0.3}`.
    prompt_pruning: Option<generation::PromptPruning>,
    /// `{"effort", "summary"}`: reasoning models only; declined with a notice.
    reasoning: Option<Value>,
    /// Whether to keep the response for `previous_response_id`: this server keeps none.
    store: Option<bool>,
}

/// The request's input items as chat messages (OpenAI chat shape).
fn input_messages(instructions: Option<&str>, input: &Value) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(text) = instructions.filter(|t| !t.is_empty()) {
        out.push(json!({"role": "system", "content": text}));
    }
    let items = match input {
        Value::String(text) => {
            out.push(json!({"role": "user", "content": text}));
            return Ok(out);
        }
        Value::Array(items) if !items.is_empty() => items,
        _ => {
            return Err(ApiError::invalid(
                "input must be a string or a non-empty list of input items",
            )
            .param("input"));
        }
    };
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let field = |name: &str| {
            item.get(name).and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(format!("{at}.{name} must be a string"))
                    .param(format!("{at}.{name}"))
            })
        };
        match item.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let content = match item.get("content") {
                    Some(Value::Array(parts)) => Value::Array(
                        parts
                            .iter()
                            .enumerate()
                            .map(|(j, part)| match part.get("type").and_then(Value::as_str) {
                                Some("input_text" | "output_text" | "text") => Ok(
                                    json!({"type": "text", "text": part.get("text").cloned().unwrap_or_default()}),
                                ),
                                Some("input_image") => Ok(json!({"type": "image_url",
                                    "image_url": {"url": part.get("image_url").cloned().unwrap_or_default()}})),
                                _ => Err(ApiError::invalid(format!(
                                    "{at}.content[{j}] has a type this server does not read (input_text, output_text, input_image)"
                                ))
                                .param(format!("{at}.content[{j}]"))),
                            })
                            .collect::<Result<Vec<_>, _>>()?,
                    ),
                    Some(other) => other.clone(),
                    None => Value::Null,
                };
                out.push(json!({"role": field("role")?, "content": content}));
            }
            Some("function_call") => {
                let name = match item.get("namespace").and_then(Value::as_str) {
                    Some(ns) => namespaced(ns, field("name")?),
                    None => field("name")?.to_string(),
                };
                let call = json!({"id": field("call_id")?, "type": "function",
                    "function": {"name": name, "arguments": field("arguments")?}});
                // Consecutive calls belong to one assistant turn.
                match out.last_mut() {
                    Some(prev)
                        if prev["role"] == "assistant" && prev.get("tool_calls").is_some() =>
                    {
                        if let Some(calls) = prev["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => {
                        out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                    }
                }
            }
            Some("function_call_output") => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                out.push(
                    json!({"role": "tool", "tool_call_id": field("call_id")?, "content": output}),
                );
            }
            // Reasoning items carry a model's own encrypted reasoning; this server makes none,
            // and the text the model needs is in the other items.
            Some("reasoning") => {}
            Some(other) => {
                return Err(ApiError::invalid(format!(
                    "{at}.type {other:?} is not supported (message, function_call, function_call_output)"
                ))
                .param(format!("{at}.type")));
            }
        }
    }
    Ok(out)
}

/// The name the model sees for function `name` of namespace `ns`.
fn namespaced(ns: &str, name: &str) -> String {
    format!("{ns}__{name}")
}

/// The request's tools as chat function tools: flat function tools as they are, the functions
/// of each `namespace` tool under `namespace__name` (`namespaces` maps them back). Hosted tools
/// run on OpenAI's side: each is declined with a notice, not a 400.
fn chat_tools(
    tools: &[Value],
    namespaces: &mut HashMap<String, (String, String)>,
    notices: &mut Vec<pb::Notice>,
) -> Vec<Value> {
    let function = |t: &Value, name: Option<String>| {
        let mut f = t.clone();
        if let Some(m) = f.as_object_mut() {
            m.remove("type");
            // Fields of the Responses tool that chat's function has no place for.
            for k in ["defer_loading", "allowed_callers", "async", "output_schema"] {
                m.remove(k);
            }
            if let Some(name) = name {
                m.insert("name".into(), Value::String(name));
            }
        }
        json!({"type": "function", "function": f})
    };
    let mut out = Vec::new();
    for t in tools {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => out.push(function(t, None)),
            Some("namespace") => {
                let ns = t.get("name").and_then(Value::as_str).unwrap_or_default();
                for inner in t
                    .get("tools")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let name = inner
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    if inner.get("type").and_then(Value::as_str) != Some("function") {
                        notices.push(pb::Notice {
                            feature: "tools".into(),
                            message: format!("tool {name:?} of namespace {ns:?} is not a function tool; it was not offered"),
                        });
                        continue;
                    }
                    let full = namespaced(ns, name);
                    namespaces.insert(full.clone(), (ns.to_string(), name.to_string()));
                    out.push(function(inner, Some(full)));
                }
            }
            other => notices.push(pb::Notice {
                feature: "hosted_tools".into(),
                message: format!(
                    "the hosted tool {:?} runs on OpenAI's side; it was not offered to this model",
                    other.unwrap_or("")
                ),
            }),
        }
    }
    out
}

/// `tool_choice` in chat's shape (Responses names a function without the `function` level).
fn chat_tool_choice(choice: Option<&Value>) -> Option<Value> {
    match choice {
        Some(Value::Object(m)) if m.get("type").and_then(Value::as_str) == Some("function") => {
            Some(
                json!({"type": "function", "function": {"name": m.get("name").cloned().unwrap_or_default()}}),
            )
        }
        other => other.cloned(),
    }
}

#[utoipa::path(post, path = "/v1/responses", tag = "OpenAI",
    request_body = ResponsesRequest,
    responses(
        (status = 200, description = "A response; with stream=true, the server-sent event sequence"),
        super::openapi::ErrorResponses,
    ))]
pub async fn create(
    State(state): State<AppState>,
    tenant: Option<Extension<TenantKey>>,
    body: Body,
) -> Result<Response, ApiError> {
    let req: ResponsesRequest = read_json(body, state.max_body_bytes, FLAVOR).await?;
    if req.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            "previous_response_id is not supported: this server does not store responses; send the whole conversation as input items",
        )
        .param("previous_response_id"));
    }
    if req.model.is_empty() {
        return Err(ApiError::invalid("model must not be empty").param("model"));
    }
    let model = state.registry.resolve(&req.model)?;
    let mut notices = Vec::new();
    let mut namespaces = HashMap::new();
    let chat_tools = chat_tools(
        req.tools.as_deref().unwrap_or_default(),
        &mut namespaces,
        &mut notices,
    );
    let tool_use = ToolUse::openai(
        Some(chat_tools.as_slice()),
        chat_tool_choice(req.tool_choice.as_ref()).as_ref(),
        req.parallel_tool_calls,
    )?;
    let format = req.text.as_ref().and_then(|t| t.get("format"));
    // Responses puts the schema beside the type, chat under `json_schema`.
    let format = format.map(|f| match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => json!({"type": "json_schema", "json_schema": f}),
        _ => f.clone(),
    });
    let constraint = tools::constraint(
        tools::response_format(format.as_ref())?,
        tool_use.as_ref(),
        "text.format",
    )?;
    let parser = tool_use.as_ref().and_then(ToolUse::parser);
    let messages = input_messages(req.instructions.as_deref(), &req.input)?;
    let (mut messages, sources) =
        normalize_messages(messages, model.kind == crate::config::ModelKind::Vlm)?;
    tools::openai_history(&mut messages)?;
    let images = super::images::load(sources, &state.images, FLAVOR).await?;
    let prompt = pb::Prompt {
        input: Some(pb::prompt::Input::Chat(pb::Chat {
            messages_json: Value::Array(messages).to_string(),
            tools_json: tool_use
                .as_ref()
                .and_then(ToolUse::template_tools)
                .map(|t| t.to_string())
                .unwrap_or_default(),
            add_generation_prompt: true,
            images,
        })),
    };
    let mut params = Params::new(
        prompt,
        generation::sampling(req.temperature, req.top_p, None),
    );
    params.notices = notices;
    params.max_tokens = req.max_output_tokens;
    params.max_tokens_param = "max_output_tokens";
    params.cache_salt = req.cache_salt.clone();
    params.constraint = constraint;
    params.speculative = req.speculative_decoding;
    params.prompt_pruning = req.prompt_pruning;
    if let Some(r) = req.reasoning.as_ref().filter(|r| {
        r.get("effort").and_then(Value::as_str) != Some("none")
            && r.as_object()
                .is_some_and(|o| o.values().any(|v| !v.is_null()))
    }) {
        params.not_applied(
            "reasoning",
            format!("reasoning {r} asked for: this model has no reasoning mode, so the response has no reasoning items"),
        );
    }
    if req.store == Some(true) {
        params.not_applied(
            "store",
            "store: true asked for: this server keeps no responses; send the whole conversation each turn",
        );
    }
    let stream = generation::start(&state, &model, params, tenant.as_deref(), FLAVOR).await?;
    let shell = Shell {
        id: response_id("resp_"),
        created_at: unix_now(),
        model: req.model.clone(),
        echo: json!({
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature.unwrap_or(1.0),
            "top_p": req.top_p.unwrap_or(1.0),
            "tools": req.tools.unwrap_or_default(),
            "tool_choice": req.tool_choice.unwrap_or(json!("auto")),
            "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
            "text": req.text.unwrap_or(json!({"format": {"type": "text"}})),
            "reasoning": req.reasoning.unwrap_or(Value::Null),
        }),
        namespaces,
    };
    if req.stream {
        return Ok(generation::stream(
            stream,
            ResponseEvents {
                shell,
                parser,
                seq: 0,
                items: Vec::new(),
                open: None,
            },
        ));
    }
    let Collected { text, done, .. } = generation::collect(stream).await?;
    let pieces = match parser {
        Some(p) => p.pieces(&text),
        None => vec![Piece::Text(text)],
    };
    let mut output = Output::default();
    for piece in pieces {
        output.add(piece, &shell.namespaces);
    }
    Ok(generation::respond(
        shell.response(&output.items, Some(&done)),
        &done,
    ))
}

/// `GET /v1/responses` with `Upgrade: websocket`: Codex tries the Responses WebSocket
/// transport first. This server speaks it over HTTP only: 426 without an upgrade tells the
/// client at once (it then posts over HTTP), instead of a 404 or 405 it would retry.
pub async fn websocket(headers: HeaderMap) -> Response {
    let upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let message = if upgrade {
        "the Responses API is served over HTTP only here: POST /v1/responses (no WebSocket transport)"
    } else {
        "GET /v1/responses is not served: responses are not stored; POST /v1/responses to create one"
    };
    let status = if upgrade {
        StatusCode::UPGRADE_REQUIRED
    } else {
        StatusCode::NOT_FOUND
    };
    let body = ApiError::invalid(message).flavor(FLAVOR).body();
    (status, axum::Json(body)).into_response()
}

/// What every response object repeats: its id, the model and the request's settings.
struct Shell {
    id: String,
    created_at: u64,
    model: String,
    echo: Value,
    /// The model's names of namespaced functions -> (namespace, name).
    namespaces: HashMap<String, (String, String)>,
}

impl Shell {
    /// The response object; `done` None while in progress.
    fn response(&self, output: &[Value], done: Option<&pb::GenerateDone>) -> Value {
        let (status, incomplete, usage) = match done {
            None => ("in_progress", Value::Null, Value::Null),
            Some(d) => {
                let u = generation::usage(d);
                let cut = generation::finish(d) == pb::FinishReason::Length;
                (
                    if cut { "incomplete" } else { "completed" },
                    if cut {
                        json!({"reason": "max_output_tokens"})
                    } else {
                        Value::Null
                    },
                    json!({
                        "input_tokens": u.prompt_tokens,
                        "input_tokens_details": {"cached_tokens": u.cached_tokens},
                        "output_tokens": u.completion_tokens,
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": u.prompt_tokens + u.completion_tokens,
                        "strata_cached_tokens_by_tier": generation::tiers_json(&u),
                    }),
                )
            }
        };
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": null, "incomplete_details": incomplete,
            "model": self.model, "output": output, "usage": usage, "store": false,
            "metadata": {},
        });
        if let (Some(r), Some(echo)) = (r.as_object_mut(), self.echo.as_object()) {
            for (k, v) in echo {
                r.insert(k.clone(), v.clone());
            }
        }
        if let Some(d) = done {
            generation::annotate(&mut r, d);
        }
        r
    }
}

/// The output items of a whole response: messages (text) and function calls, in order.
#[derive(Default)]
struct Output {
    items: Vec<Value>,
    /// The last item is a message that more text joins.
    text_open: bool,
}

impl Output {
    fn message(id: &str, text: &str, status: &str) -> Value {
        json!({"type": "message", "id": id, "status": status, "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": []}]})
    }

    /// A call as a `function_call` item; a namespaced function's call names its namespace
    /// apart, as the Responses API returns them.
    fn call(
        call: &ToolCall,
        status: &str,
        namespaces: &HashMap<String, (String, String)>,
    ) -> Value {
        let mut item = json!({"type": "function_call", "id": tools::call_id("fc_"),
               "call_id": tools::call_id("call_"), "name": call.name,
               "arguments": call.arguments, "status": status});
        if let Some((ns, name)) = namespaces.get(&call.name) {
            item["name"] = json!(name);
            item["namespace"] = json!(ns);
        }
        item
    }

    fn add(&mut self, piece: Piece, namespaces: &HashMap<String, (String, String)>) {
        match piece {
            Piece::Text(t) => {
                if self.text_open
                    && let Some(text) = self
                        .items
                        .last_mut()
                        .and_then(|m| m.pointer_mut("/content/0/text"))
                {
                    let joined = format!("{}{t}", text.as_str().unwrap_or_default());
                    *text = Value::String(joined);
                    return;
                }
                self.items
                    .push(Self::message(&response_id("msg_"), &t, "completed"));
                self.text_open = true;
            }
            Piece::Call(c) => {
                self.items.push(Self::call(&c, "completed", namespaces));
                self.text_open = false;
            }
        }
    }
}

/// The streamed event sequence: response.created, response.in_progress; per message item
/// output_item.added, content_part.added, output_text.delta…, output_text.done,
/// content_part.done, output_item.done; per function call output_item.added,
/// function_call_arguments.delta and .done, output_item.done; then response.completed (or
/// response.incomplete when cut by max_output_tokens). An error ends it with an `error` event.
struct ResponseEvents {
    shell: Shell,
    parser: Option<CallParser>,
    seq: u64,
    items: Vec<Value>,
    /// The message item being written: its id and text.
    open: Option<(String, String)>,
}

impl ResponseEvents {
    fn event(&mut self, kind: &str, mut data: Value) -> SseEvent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Ok(Event::default().event(kind).data(data.to_string()))
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => {
                    let index = self.items.len();
                    if self.open.is_none() {
                        let id = response_id("msg_");
                        let added = self.event("response.output_item.added", json!({"output_index": index,
                            "item": {"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []}}));
                        let part = self.event(
                            "response.content_part.added",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                            "part": {"type": "output_text", "text": "", "annotations": []}}),
                        );
                        out.extend([added, part]);
                        self.open = Some((id, String::new()));
                    }
                    let id = match self.open.as_mut() {
                        Some((id, text)) => {
                            text.push_str(&t);
                            id.clone()
                        }
                        None => continue,
                    };
                    out.push(self.event("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t})));
                }
                Piece::Call(c) => {
                    out.extend(self.close_message());
                    let index = self.items.len();
                    let item = Output::call(&c, "completed", &self.shell.namespaces);
                    let mut added = item.clone();
                    added["arguments"] = json!("");
                    added["status"] = json!("in_progress");
                    let id = item["id"].clone();
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": added}),
                    ));
                    out.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": c.arguments}),
                    ));
                    out.push(self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": index, "arguments": c.arguments}),
                    ));
                    out.push(self.event(
                        "response.output_item.done",
                        json!({"output_index": index, "item": item}),
                    ));
                    self.items.push(item);
                }
            }
        }
        out
    }

    /// Ends the message item being written, if any: its text, part and item done events.
    fn close_message(&mut self) -> Vec<SseEvent> {
        let Some((id, text)) = self.open.take() else {
            return Vec::new();
        };
        let index = self.items.len();
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let item = Output::message(&id, &text, "completed");
        let out = vec![
            self.event(
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
            ),
            self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ),
        ];
        self.items.push(item);
        out
    }
}

impl Encoder for ResponseEvents {
    fn start(&mut self, _: &pb::GenerateStarted) -> Vec<SseEvent> {
        let created = self.shell.response(&[], None);
        vec![
            self.event("response.created", json!({"response": created})),
            self.event("response.in_progress", json!({"response": created})),
        ]
    }

    fn delta(&mut self, d: pb::TokenDelta) -> Vec<SseEvent> {
        if d.text.is_empty() {
            return Vec::new();
        }
        let pieces = match self.parser.as_mut() {
            Some(p) => p.push(&d.text),
            None => vec![Piece::Text(d.text)],
        };
        self.pieces(pieces)
    }

    fn done(&mut self, done: pb::GenerateDone) -> Vec<SseEvent> {
        let rest = self
            .parser
            .as_mut()
            .map(CallParser::finish)
            .unwrap_or_default();
        let mut out = self.pieces(rest);
        out.extend(self.close_message());
        let response = self.shell.response(&self.items, Some(&done));
        let kind = if response["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.event(kind, json!({"response": response})));
        out
    }

    fn error(&mut self, e: ApiError) -> Vec<SseEvent> {
        let body = e.flavor(FLAVOR).body()["error"].clone();
        vec![self.event("error", body)]
    }
}
