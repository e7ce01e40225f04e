//! Anthropic's Messages API: `POST /v1/messages` (streaming with the full event sequence, and
//! not) and `POST /v1/messages/count_tokens`, as coding agents send them: system messages in
//! place, `?beta=true`, any `anthropic-beta` header. Fields that do not change the output here
//! (`metadata`, `cache_control`, `defer_loading`, thinking `display`) are accepted; features
//! asked for and not applied (thinking, effort, context edits, server tools) are reported in
//! `strata_warnings`, the log, the metrics and /admin.

use axum::body::Body;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_proto::worker as pb;

use super::error::{ApiError, Flavor};
use super::generation::{self, Collected, Encoder, Params, SseEvent, read_json, response_id};
use super::images::{self, ImageSource};
use super::tools::{self, CallParser, Piece, ToolCall, ToolUse};
use super::{AppState, TenantKey};
use crate::config::ModelKind;
use axum::Extension;

const FLAVOR: Flavor = Flavor::Anthropic;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct MessagesRequest {
    model: String,
    max_tokens: u32,
    messages: Vec<Value>,
    system: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    #[serde(default)]
    stream: bool,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    /// Extension: requests with different salts never share cached blocks.
    cache_salt: Option<String>,
    /// Strata's extension: speculative decoding for this request (false: off; true: asked
    /// for, with `strata_warnings` saying so when it cannot apply) [default: the model's
    /// configuration].
    speculative_decoding: Option<bool>,
    /// Strata's extension: SpecPrefill, `{"keep_ratio": 0.3}`.
    prompt_pruning: Option<generation::PromptPruning>,
    /// `{"type": "enabled" | "adaptive" | "disabled", "budget_tokens", "display"}`.
    thinking: Option<Value>,
    /// `{"effort": "low" | "medium" | "high", "format": {"type": "json_schema", "schema"}}`.
    output_config: Option<Value>,
    /// `{"edits": [...]}`: server-side context edits.
    context_management: Option<Value>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct CountTokensRequest {
    model: String,
    messages: Vec<Value>,
    system: Option<Value>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid(message).flavor(FLAVOR)
}

/// Text of a content value: a string, or the text blocks of an array.
fn text_of(content: &Value, what: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => match b.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => return Err(invalid(format!("{what}[{j}].text must be a string"))),
                    },
                    Some(kind @ ("image" | "document")) => {
                        return Err(invalid(format!(
                            "{what}[{j}] is an {kind} block: this model reads text only"
                        )));
                    }
                    Some(kind @ ("tool_use" | "tool_result")) => {
                        return Err(invalid(format!(
                            "{what}[{j}] is a {kind} block, which is not valid here (tool_use goes in assistant messages, tool_result in user messages)"
                        )));
                    }
                    // Thinking blocks from earlier turns carry nothing the model can use here.
                    Some("thinking" | "redacted_thinking") => {}
                    _ => return Err(invalid(format!("{what}[{j}] has an unknown type"))),
                }
            }
            Ok(text)
        }
        _ => Err(invalid(format!(
            "{what} must be a string or an array of content blocks"
        ))),
    }
}

/// A content value as template parts (vision models): text blocks, and an image part per image
/// block, whose source goes to `images`.
fn content_parts(
    content: &Value,
    what: &str,
    images: &mut Vec<ImageSource>,
) -> Result<Value, ApiError> {
    let Value::Array(blocks) = content else {
        return Ok(json!([{"type": "text", "text": text_of(content, what)?}]));
    };
    let mut parts = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        if b.get("type").and_then(Value::as_str) != Some("image") {
            let text = text_of(&Value::Array(vec![b.clone()]), what)
                .map_err(|_| invalid(format!("{what}[{j}]: not a text or image block")))?;
            if !text.is_empty() {
                parts.push(json!({"type": "text", "text": text}));
            }
            continue;
        }
        let source = b
            .get("source")
            .ok_or_else(|| invalid(format!("{what}[{j}].source: field required")))?;
        let field = |name: &str| {
            source
                .get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("{what}[{j}].source.{name}: field required")))
        };
        let image = match field("type")? {
            "base64" => images::decode_base64(field("data")?).map(ImageSource::Inline),
            "url" => images::parse_url(field("url")?),
            other => Err(format!(
                "source type {other:?} is not supported (base64 or url)"
            )),
        }
        .map_err(|e| invalid(format!("{what}[{j}]: {e}")))?;
        images.push(image);
        parts.push(json!({"type": "image"}));
    }
    Ok(Value::Array(parts))
}

/// Anthropic messages (system apart, user/assistant alternating) as template messages; for a
/// vision model (`vision`) with content as parts and the images read.
async fn chat_prompt(
    state: &AppState,
    vision: bool,
    system: Option<&Value>,
    messages: &[Value],
    tool_use: Option<&ToolUse>,
) -> Result<pb::Prompt, ApiError> {
    if messages.is_empty() {
        return Err(invalid("messages: at least one message is required"));
    }
    if messages.len() > generation::MAX_MESSAGES {
        return Err(invalid(format!(
            "messages: {} sent, at most {} are accepted",
            messages.len(),
            generation::MAX_MESSAGES
        )));
    }
    let mut out = Vec::new();
    let mut sources = Vec::new();
    let mut call_ids: Vec<String> = Vec::new();
    if let Some(system) = system {
        let text = text_of(system, "system")?;
        if !text.is_empty() {
            let content = if vision {
                json!([{"type": "text", "text": text}])
            } else {
                Value::String(text)
            };
            out.push(json!({"role": "system", "content": content}));
        }
    }
    for (i, m) in messages.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            // Agents put system messages between turns (Claude Code: its environment after the
            // first user message). Rendered where they stand: moving them to the front would
            // change every token after them, and the prefix cache with it.
            Some("system") => "system",
            Some(other) => {
                return Err(invalid(format!(
                    "messages.{i}.role: {other:?} is not user, assistant or system"
                )));
            }
            None => return Err(invalid(format!("messages.{i}.role: field required"))),
        };
        let content = m
            .get("content")
            .ok_or_else(|| invalid(format!("messages.{i}.content: field required")))?;
        let what = format!("messages.{i}.content");
        let has_tool_blocks = content.as_array().is_some_and(|blocks| {
            blocks.iter().any(|b| {
                matches!(
                    b.get("type").and_then(Value::as_str),
                    Some("tool_use" | "tool_result")
                )
            })
        });
        if has_tool_blocks {
            out.extend(tool_turn(role, content, &what, &mut call_ids)?);
            continue;
        }
        let content = if vision {
            content_parts(content, &what, &mut sources)?
        } else {
            Value::String(text_of(content, &what)?)
        };
        out.push(json!({"role": role, "content": content}));
    }
    let images = images::load(sources, &state.images, FLAVOR).await?;
    // A trailing assistant message is a prefill: the answer continues it.
    let prefill = out.last().is_some_and(|m| m["role"] == "assistant");
    Ok(pb::Prompt {
        input: Some(pb::prompt::Input::Chat(pb::Chat {
            messages_json: Value::Array(out).to_string(),
            tools_json: tool_use
                .and_then(ToolUse::template_tools)
                .map(|t| t.to_string())
                .unwrap_or_default(),
            add_generation_prompt: !prefill,
            images,
        })),
    })
}

/// A message with tool blocks, as template messages: an assistant's text and `tool_use`
/// blocks become one message with `tool_calls`; a user's `tool_result` blocks become `tool`
/// messages (each answering a call made earlier), then its text, if any.
fn tool_turn(
    role: &str,
    content: &Value,
    what: &str,
    call_ids: &mut Vec<String>,
) -> Result<Vec<Value>, ApiError> {
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut out = Vec::new();
    for (j, b) in content.as_array().into_iter().flatten().enumerate() {
        let at = format!("{what}.{j}");
        let field = |name: &str| {
            b.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("{at}.{name}: field required")))
        };
        match b.get("type").and_then(Value::as_str) {
            Some("tool_use") if role == "assistant" => {
                let id = field("id")?;
                let input = b
                    .get("input")
                    .filter(|i| i.is_object())
                    .ok_or_else(|| invalid(format!("{at}.input: must be an object")))?;
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": field("name")?, "arguments": input}}));
                call_ids.push(id.to_string());
            }
            Some("tool_result") if role == "user" => {
                let id = field("tool_use_id")?;
                if !call_ids.iter().any(|known| known == id) {
                    return Err(invalid(format!(
                        "{at}.tool_use_id: {id:?} does not match a tool_use block of an earlier assistant message"
                    )));
                }
                let mut result = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(c, &format!("{at}.content"))?,
                };
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    result = format!("Error: {result}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            }
            Some(kind @ ("tool_use" | "tool_result")) => {
                return Err(invalid(format!(
                    "{at}: a {kind} block cannot be in a {role} message"
                )));
            }
            _ => text.push_str(&text_of(&Value::Array(vec![b.clone()]), &at)?),
        }
    }
    if role == "assistant" {
        out.push(json!({"role": "assistant", "content": text, "tool_calls": calls}));
    } else if !text.is_empty() {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(out)
}

fn stop_reason(f: pb::FinishReason, made_calls: bool) -> &'static str {
    match f {
        pb::FinishReason::Length => "max_tokens",
        _ if made_calls => "tool_use",
        _ => "end_turn",
    }
}

/// A call as a `tool_use` content block.
fn tool_use_block(call: &ToolCall) -> Value {
    let input: Value =
        serde_json::from_str(&call.arguments).unwrap_or_else(|_| Value::Object(Default::default()));
    json!({"type": "tool_use", "id": tools::call_id("toolu_"), "name": call.name, "input": input})
}

fn usage_json(u: &pb::Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "strata_cached_tokens_by_tier": generation::tiers_json(u),
    })
}

#[utoipa::path(post, path = "/v1/messages", tag = "Anthropic",
    request_body = MessagesRequest,
    responses(
        (status = 200, description = "A message; with stream=true, the server-sent event sequence"),
        super::openapi::ErrorResponses,
    ))]
pub async fn messages(
    State(state): State<AppState>,
    tenant: Option<Extension<TenantKey>>,
    body: Body,
) -> Result<Response, ApiError> {
    let req: MessagesRequest = read_json(body, state.max_body_bytes, FLAVOR).await?;
    let model = state
        .registry
        .resolve(&req.model)
        .map_err(|e| e.flavor(FLAVOR))?;
    let mut notices = Vec::new();
    let tools = server_tools_declined(req.tools.as_deref(), &mut notices);
    let tool_use =
        ToolUse::anthropic(Some(&tools), req.tool_choice.as_ref()).map_err(|e| e.flavor(FLAVOR))?;
    let parser = tool_use.as_ref().and_then(ToolUse::parser);
    let prompt = chat_prompt(
        &state,
        model.kind == ModelKind::Vlm,
        req.system.as_ref(),
        &req.messages,
        tool_use.as_ref(),
    )
    .await?;
    let mut params = Params::new(
        prompt,
        generation::sampling(req.temperature, req.top_p, req.top_k),
    );
    params.notices = notices;
    params.max_tokens = Some(req.max_tokens);
    params.stop = req.stop_sequences.clone().unwrap_or_default();
    params.cache_salt = req.cache_salt.clone();
    params.speculative = req.speculative_decoding;
    params.prompt_pruning = req.prompt_pruning;
    params.constraint = match output_format(req.output_config.as_ref())? {
        Some(format) => Some(format),
        None => tool_use.as_ref().and_then(ToolUse::constraint),
    };
    report_unapplied(&req, &mut params);
    let stream = generation::start(&state, &model, params, tenant.as_deref(), FLAVOR).await?;
    let id = response_id("msg_");
    if req.stream {
        return Ok(generation::stream(
            stream,
            MessageEvents {
                id,
                model: req.model,
                parser,
                blocks: Blocks::default(),
            },
        ));
    }
    let Collected { text, done, .. } = generation::collect(stream).await?;
    let (text, calls) = match parser {
        Some(p) => p.split(&text),
        None => (text, Vec::new()),
    };
    let mut content = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    content.extend(calls.iter().map(tool_use_block));
    let body = json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop_reason(generation::finish(&done), !calls.is_empty()),
        "stop_sequence": null,
        "usage": usage_json(&generation::usage(&done)),
    });
    Ok(generation::respond(body, &done))
}

/// The request's tools without Anthropic's server tools (`web_search_…`, `code_execution_…`,
/// typed `bash`/`text_editor` …), which run on Anthropic's side: each declined one is noted,
/// and the model is offered the custom tools only.
fn server_tools_declined(tools: Option<&[Value]>, notices: &mut Vec<pb::Notice>) -> Vec<Value> {
    let mut kept = Vec::new();
    for t in tools.unwrap_or_default() {
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => kept.push(t.clone()),
            Some(kind) => notices.push(pb::Notice {
                feature: "server_tools".into(),
                message: format!(
                    "the server tool {kind:?} ({}) runs on Anthropic's side and is not offered to this model",
                    t.get("name").and_then(Value::as_str).unwrap_or("unnamed")
                ),
            }),
        }
    }
    kept
}

/// `output_config.format` (structured outputs) as a constraint on the answer.
fn output_format(config: Option<&Value>) -> Result<Option<pb::Constraint>, ApiError> {
    let Some(format) = config
        .and_then(|c| c.get("format"))
        .filter(|f| !f.is_null())
    else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .ok_or_else(|| invalid("output_config.format.schema: field required"))?;
            let chat_shape =
                json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}});
            tools::response_format(Some(&chat_shape)).map_err(|e| e.flavor(FLAVOR))
        }
        other => Err(invalid(format!(
            "output_config.format.type: {:?} is not supported (json_schema)",
            other.unwrap_or("")
        ))),
    }
}

/// Notes what the request asks for that this server does not do, so the answer says so.
fn report_unapplied(req: &MessagesRequest, params: &mut Params) {
    let thinking = req
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str);
    if let Some(kind @ ("enabled" | "adaptive")) = thinking {
        params.not_applied(
            "thinking",
            format!("thinking {kind:?} asked for: this model has no thinking mode, so it answered without thinking"),
        );
    }
    if let Some(effort) = req
        .output_config
        .as_ref()
        .and_then(|c| c.get("effort"))
        .and_then(Value::as_str)
    {
        params.not_applied(
            "effort",
            format!("output_config.effort {effort:?} has no setting on this model; it answered as always"),
        );
    }
    if let Some(edits) = req
        .context_management
        .as_ref()
        .and_then(|c| c.get("edits"))
        .and_then(Value::as_array)
        .filter(|e| !e.is_empty())
    {
        let kinds: Vec<&str> = edits
            .iter()
            .filter_map(|e| e.get("type").and_then(Value::as_str))
            .collect();
        params.not_applied(
            "context_management",
            format!(
                "{} context edit(s) ({}) were not applied: the model read the conversation as sent",
                edits.len(),
                kinds.join(", ")
            ),
        );
    }
}

/// A streamed message: message_start, ping, then content blocks (text as text_delta events;
/// with tools offered, each call as a tool_use block with its input as one input_json_delta),
/// message_delta (stop reason and usage), message_stop; an error ends it with an `error`
/// event.
struct MessageEvents {
    id: String,
    model: String,
    parser: Option<CallParser>,
    blocks: Blocks,
}

impl Encoder for MessageEvents {
    fn start(&mut self, started: &pb::GenerateStarted) -> Vec<SseEvent> {
        vec![
            sse_event(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": started.prompt_tokens, "output_tokens": 0},
                }}),
            ),
            sse_event("ping", json!({"type": "ping"})),
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
        self.blocks.events(pieces)
    }

    fn done(&mut self, done: pb::GenerateDone) -> Vec<SseEvent> {
        let rest = self
            .parser
            .as_mut()
            .map(CallParser::finish)
            .unwrap_or_default();
        let mut events = self.blocks.events(rest);
        events.extend(self.blocks.close_all());
        let u = generation::usage(&done);
        let reason = stop_reason(generation::finish(&done), self.blocks.calls > 0);
        let mut delta = json!({"type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": null},
            "usage": usage_json(&u)});
        generation::annotate(&mut delta, &done);
        events.push(sse_event("message_delta", delta));
        events.push(sse_event("message_stop", json!({"type": "message_stop"})));
        events
    }

    fn error(&mut self, e: ApiError) -> Vec<SseEvent> {
        vec![sse_event("error", e.flavor(FLAVOR).body())]
    }
}

fn sse_event(name: &str, data: Value) -> SseEvent {
    Ok(Event::default().event(name).data(data.to_string()))
}

/// The content blocks of a streamed message: a text block stays open while text comes; a
/// call is a whole tool_use block.
#[derive(Default)]
struct Blocks {
    /// Blocks started so far.
    count: usize,
    text_open: bool,
    calls: usize,
}

impl Blocks {
    fn events(&mut self, pieces: Vec<Piece>) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) => {
                    if !self.text_open {
                        out.push(sse_event(
                            "content_block_start",
                            json!({"type": "content_block_start", "index": self.count,
                            "content_block": {"type": "text", "text": ""}}),
                        ));
                        self.count += 1;
                        self.text_open = true;
                    }
                    out.push(sse_event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": self.count - 1,
                        "delta": {"type": "text_delta", "text": text}}),
                    ));
                }
                Piece::Call(call) => {
                    out.extend(self.close_text());
                    let index = self.count;
                    self.count += 1;
                    self.calls += 1;
                    let block = tool_use_block(&call);
                    out.push(sse_event(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index,
                        "content_block": {"type": "tool_use", "id": block["id"].clone(),
                            "name": call.name, "input": {}}}),
                    ));
                    out.push(sse_event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
                    ));
                    out.push(sse_event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": index}),
                    ));
                }
            }
        }
        out
    }

    fn close_text(&mut self) -> Vec<SseEvent> {
        if !self.text_open {
            return Vec::new();
        }
        self.text_open = false;
        vec![sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": self.count - 1}),
        )]
    }

    /// At the end: the open text block closed; a message with no block gets an empty text
    /// block, as a non-streamed one has.
    fn close_all(&mut self) -> Vec<SseEvent> {
        if self.count == 0 {
            let mut out = self.events(vec![Piece::Text(String::new())]);
            out.pop();
            out.extend(self.close_text());
            return out;
        }
        self.close_text()
    }
}

#[utoipa::path(post, path = "/v1/messages/count_tokens", tag = "Anthropic",
    request_body = CountTokensRequest,
    responses(
        (status = 200, description = "The prompt's token count"),
        super::openapi::ErrorResponses,
    ))]
pub async fn count_tokens(State(state): State<AppState>, body: Body) -> Result<Response, ApiError> {
    let req: CountTokensRequest = read_json(body, state.max_body_bytes, FLAVOR).await?;
    let model = state
        .registry
        .resolve(&req.model)
        .map_err(|e| e.flavor(FLAVOR))?;
    let tools = server_tools_declined(req.tools.as_deref(), &mut Vec::new());
    let tool_use =
        ToolUse::anthropic(Some(&tools), req.tool_choice.as_ref()).map_err(|e| e.flavor(FLAVOR))?;
    let prompt = chat_prompt(
        &state,
        model.kind == ModelKind::Vlm,
        req.system.as_ref(),
        &req.messages,
        tool_use.as_ref(),
    )
    .await?;
    let counted = generation::count_tokens(&model, prompt, FLAVOR).await?;
    Ok(Json(json!({"input_tokens": counted.count})).into_response())
}
