//! OpenAI's Responses API, `POST /v1/responses`, as far as the chat path goes: text or item
//! input (messages, earlier function calls and their outputs), instructions, function tools
//! with `tool_choice`, `text.format` (JSON object or schema), streaming with the semantic event
//! sequence. Responses are not stored: `previous_response_id` is refused with a clear error,
//! and clients resend the conversation, as chat clients do.

use std::convert::Infallible;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_proto::worker::{self as pb, generate_event};
use tokio_stream::wrappers::ReceiverStream;

use super::error::{ApiError, ErrorKind, Flavor, from_worker_status};
use super::generation::{self, Collected, SseEvent, read_json, response_id, unix_now};
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
                let call = json!({"id": field("call_id")?, "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?}});
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

/// Responses' flat function tools as chat tools.
fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut f = t.clone();
                if let Some(m) = f.as_object_mut() {
                    m.remove("type");
                }
                Ok(json!({"type": "function", "function": f}))
            }
            other => Err(ApiError::invalid(format!(
                "tools[{i}].type {:?} is not supported: this server runs function tools only",
                other.unwrap_or("")
            ))
            .param(format!("tools[{i}].type"))),
        })
        .collect()
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
    if req.max_output_tokens == Some(0) {
        return Err(
            ApiError::invalid("max_output_tokens must be at least 1").param("max_output_tokens")
        );
    }
    let model = state.registry.resolve(&req.model)?;
    let chat_tools = chat_tools(req.tools.as_deref().unwrap_or_default())?;
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
    let worker_req = pb::GenerateRequest {
        request_id: String::new(),
        prompt: Some(pb::Prompt {
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
        }),
        max_tokens: req.max_output_tokens.unwrap_or(0),
        sampling: Some(generation::sampling(req.temperature, req.top_p, None)),
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        cache_salt: super::cache_salt(tenant.as_deref(), req.cache_salt.as_deref()),
        prefill_breaks: Vec::new(),
        constraint,
        speculative: req.speculative_decoding,
        prune_keep_ratio: generation::keep_ratio(req.prompt_pruning.as_ref())?,
    };
    let stream = generation::start(&state, &model, worker_req, FLAVOR).await?;
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
        }),
    };
    if req.stream {
        return Ok(stream_events(stream, shell, parser));
    }
    let Collected { text, done, .. } = generation::collect(stream, FLAVOR).await?;
    let pieces = match parser {
        Some(p) => p.pieces(&text),
        None => vec![Piece::Text(text)],
    };
    let mut output = Output::default();
    for piece in pieces {
        output.add(piece);
    }
    Ok(generation::respond(
        shell.response(&output.items, Some(&done)),
        &done,
    ))
}

/// What every response object repeats: its id, the model and the request's settings.
struct Shell {
    id: String,
    created_at: u64,
    model: String,
    echo: Value,
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

    fn call(call: &ToolCall, status: &str) -> Value {
        json!({"type": "function_call", "id": tools::call_id("fc_"),
               "call_id": tools::call_id("call_"), "name": call.name,
               "arguments": call.arguments, "status": status})
    }

    fn add(&mut self, piece: Piece) {
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
                self.items.push(Self::call(&c, "completed"));
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
fn stream_events(
    mut stream: generation::GenerationStream,
    shell: Shell,
    mut parser: Option<CallParser>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(32);
    tokio::spawn(async move {
        let mut seq = 0u64;
        let mut event = |kind: &str, mut data: Value| {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(seq);
            seq += 1;
            Ok::<_, Infallible>(Event::default().event(kind).data(data.to_string()))
        };
        let created = shell.response(&[], None);
        let start = vec![
            event("response.created", json!({"response": created})),
            event("response.in_progress", json!({"response": created})),
        ];
        if generation::send_all(&tx, start).await.is_err() {
            return;
        }
        let mut items: Vec<Value> = Vec::new();
        // The message item being written: its id and text.
        let mut open: Option<(String, String)> = None;
        loop {
            let item = tokio::select! {
                item = stream.message() => item,
                _ = tx.closed() => return,
            };
            let mut out = Vec::new();
            let (pieces, done) = match item {
                Ok(Some(ev)) => match ev.event {
                    Some(generate_event::Event::Delta(d)) if !d.text.is_empty() => (
                        match parser.as_mut() {
                            Some(p) => p.push(&d.text),
                            None => vec![Piece::Text(d.text)],
                        },
                        None,
                    ),
                    Some(generate_event::Event::Done(done)) => (
                        parser.as_mut().map(CallParser::finish).unwrap_or_default(),
                        Some(done),
                    ),
                    _ => continue,
                },
                Ok(None) => {
                    let e = ApiError::new(
                        ErrorKind::Overloaded,
                        "the worker ended the generation without finishing it",
                    );
                    let _ = tx.send(event("error", e.body()["error"].clone())).await;
                    return;
                }
                Err(status) => {
                    let e = from_worker_status(&status);
                    tracing::warn!(error = %e, "stream ended by an error");
                    let _ = tx.send(event("error", e.body()["error"].clone())).await;
                    return;
                }
            };
            for piece in pieces {
                match piece {
                    Piece::Text(t) => {
                        let index = items.len();
                        let (id, text) = open.get_or_insert_with(|| {
                            let id = response_id("msg_");
                            out.push(event("response.output_item.added", json!({"output_index": index,
                                "item": {"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []}})));
                            out.push(event("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0,
                                "part": {"type": "output_text", "text": "", "annotations": []}})));
                            (id, String::new())
                        });
                        text.push_str(&t);
                        out.push(event("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t})));
                    }
                    Piece::Call(c) => {
                        close_message(&mut open, &mut items, &mut out, &mut event);
                        let index = items.len();
                        let item = Output::call(&c, "completed");
                        let mut added = item.clone();
                        added["arguments"] = json!("");
                        added["status"] = json!("in_progress");
                        out.push(event(
                            "response.output_item.added",
                            json!({"output_index": index, "item": added}),
                        ));
                        out.push(event("response.function_call_arguments.delta", json!({"item_id": item["id"].clone(), "output_index": index, "delta": c.arguments})));
                        out.push(event("response.function_call_arguments.done", json!({"item_id": item["id"].clone(), "output_index": index, "arguments": c.arguments})));
                        out.push(event(
                            "response.output_item.done",
                            json!({"output_index": index, "item": item}),
                        ));
                        items.push(item);
                    }
                }
            }
            if let Some(done) = done {
                close_message(&mut open, &mut items, &mut out, &mut event);
                let response = shell.response(&items, Some(&done));
                let kind = if response["status"] == "incomplete" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                out.push(event(kind, json!({"response": response})));
                let _ = generation::send_all(&tx, out).await;
                return;
            }
            if generation::send_all(&tx, out).await.is_err() {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Ends the message item being written, if any: its text, part and item done events.
fn close_message(
    open: &mut Option<(String, String)>,
    items: &mut Vec<Value>,
    out: &mut Vec<SseEvent>,
    event: &mut dyn FnMut(&str, Value) -> SseEvent,
) {
    let Some((id, text)) = open.take() else {
        return;
    };
    let index = items.len();
    let part = json!({"type": "output_text", "text": text, "annotations": []});
    out.push(event(
        "response.output_text.done",
        json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
    ));
    out.push(event(
        "response.content_part.done",
        json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
    ));
    let item = Output::message(&id, &text, "completed");
    out.push(event(
        "response.output_item.done",
        json!({"output_index": index, "item": item}),
    ));
    items.push(item);
}
