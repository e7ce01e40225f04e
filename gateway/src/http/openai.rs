//! OpenAI's API: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`,
//! streaming (SSE ending with `data: [DONE]`) and not.

use axum::body::Body;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_proto::worker as pb;

use super::error::{ApiError, Flavor};
use super::generation::{
    self, Collected, Encoder, Params, PromptPruning, SseEvent, read_json_parts, response_id,
    unix_now,
};
use super::images::{self, ImageSource};
use super::tools::{self, CallParser, Piece, ToolUse};

/// OpenAI's bound on `top_logprobs`.
const MAX_TOP_LOGPROBS: u32 = 20;
use super::{AppState, TenantKey};
use crate::config::ModelKind;
use axum::Extension;

const FLAVOR: Flavor = Flavor::OpenAi;
const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default, utoipa::ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields both endpoints share. Unknown fields are accepted and ignored, as OpenAI's own SDKs
/// add new ones over time.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct Common {
    model: String,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    stop: Option<Stop>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    seed: Option<u64>,
    /// vLLM's extension: requests with different salts never share cached blocks.
    cache_salt: Option<String>,
    /// vLLM's extension: keep generating past the end-of-sequence token (benchmarks).
    ignore_eos: Option<bool>,
    /// Strata's extension: speculative decoding for this request (false: off; true: asked
    /// for, with `strata_warnings` saying so when it cannot apply) [default: the model's
    /// configuration].
    speculative_decoding: Option<bool>,
    /// Strata's extension: SpecPrefill, `{"keep_ratio": 0.3}` (see `PromptPruning`).
    prompt_pruning: Option<PromptPruning>,
    /// Strata's extension: extra prefill chunk ends (token positions), to reproduce exactly
    /// the arithmetic of a run that resumed from a cached partial block (verification).
    #[serde(default)]
    prefill_breaks: Vec<u32>,
    // Extensions several servers accept.
    top_k: Option<u32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct ChatRequest {
    messages: Vec<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    /// vLLM's extension: logprobs name tokens as "token_id:N", so that tokens whose text is
    /// not valid UTF-8 on its own (byte-fallback pieces) can be told apart.
    #[serde(default)]
    return_tokens_as_token_ids: bool,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    response_format: Option<Value>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct CompletionRequest {
    prompt: PromptInput,
    /// Completions API: number of top logprobs (0-5).
    logprobs: Option<u32>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<u32>,
    /// vLLM's extension: logprob tokens as "token_id:ID" instead of text.
    #[serde(default)]
    return_tokens_as_token_ids: bool,
}

impl Common {
    /// The pipeline's parameters for this request's `prompt`, after the checks that are
    /// OpenAI's own.
    fn params(&self, prompt: pb::Prompt, logprobs: Option<u32>) -> Result<Params, ApiError> {
        if self.model.is_empty() {
            return Err(ApiError::invalid("model must not be empty").param("model"));
        }
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::invalid(format!(
                "n={n} is not supported: this server returns one choice per request (send n=1 or leave it out)"
            ))
            .param("n"));
        }
        let sampling = pb::Sampling {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed,
            logprobs,
        };
        let mut p = Params::new(prompt, sampling);
        p.max_tokens = self.max_completion_tokens.or(self.max_tokens);
        if self.max_completion_tokens.is_some() {
            p.max_tokens_param = "max_completion_tokens";
        }
        p.stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        p.ignore_eos = self.ignore_eos.unwrap_or(false);
        p.cache_salt = self.cache_salt.clone();
        p.prefill_breaks = self.prefill_breaks.clone();
        p.speculative = self.speculative_decoding;
        p.prompt_pruning = self.prompt_pruning;
        Ok(p)
    }
}

/// Chat messages as the template expects them: roles checked; content flattened to text, or
/// for a vision model (`vision`) a list of text and `{"type": "image"}` parts, as the
/// processors' templates read it, with the images' sources in order.
pub(crate) fn normalize_messages(
    messages: Vec<Value>,
    vision: bool,
) -> Result<(Vec<Value>, Vec<ImageSource>), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty").param("messages"));
    }
    if messages.len() > generation::MAX_MESSAGES {
        return Err(ApiError::invalid(format!(
            "{} messages sent, at most {} are accepted",
            messages.len(),
            generation::MAX_MESSAGES
        ))
        .param("messages"));
    }
    let mut images = Vec::new();
    let messages = messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            let Value::Object(mut m) = m else {
                return Err(ApiError::invalid(format!("{param} must be an object")).param(param));
            };
            let role = match m.get("role").and_then(Value::as_str) {
                Some(r @ ("system" | "user" | "assistant" | "tool")) => r.to_string(),
                // OpenAI's newer name for system instructions.
                Some("developer") => "system".to_string(),
                Some(other) => {
                    return Err(ApiError::invalid(format!(
                        "{param}.role {other:?} is not one of system, developer, user, assistant, tool"
                    ))
                    .param(format!("{param}.role")));
                }
                None => {
                    return Err(ApiError::invalid(format!("{param}.role is missing"))
                        .param(format!("{param}.role")));
                }
            };
            let content = if vision {
                content_parts(m.remove("content"), &param, &mut images)?
            } else {
                Value::String(content_text(m.remove("content"), &param)?)
            };
            m.insert("role".into(), Value::String(role));
            m.insert("content".into(), content);
            Ok(Value::Object(m))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok((messages, images))
}

/// A message's content as template parts (vision models): text parts, and an image part per
/// `image_url`, whose source goes to `images`.
fn content_parts(
    content: Option<Value>,
    param: &str,
    images: &mut Vec<ImageSource>,
) -> Result<Value, ApiError> {
    let parts = match content {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => return Ok(json!([{"type": "text", "text": s}])),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "{param}.content must be a string or an array of content parts"
            )));
        }
    };
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{param}.content[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("text") => match part.get("text").and_then(Value::as_str) {
                Some(t) => out.push(json!({"type": "text", "text": t})),
                None => return Err(ApiError::invalid(format!("{at}.text must be a string"))),
            },
            Some("image_url") => {
                let url = part
                    .get("image_url")
                    .and_then(|u| u.get("url").or(Some(u)))
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(format!("{at}.image_url.url is missing")))?;
                let source =
                    images::parse_url(url).map_err(|e| ApiError::invalid(format!("{at}: {e}")))?;
                images.push(source);
                out.push(json!({"type": "image"}));
            }
            Some(kind @ ("input_audio" | "file")) => {
                return Err(ApiError::invalid(format!(
                    "{at} is {kind}: this model reads text and images only"
                )));
            }
            _ => return Err(ApiError::invalid(format!("{at} has an unknown type"))),
        }
    }
    Ok(Value::Array(out))
}

/// A message's content as text: a string, or the text parts of an array.
fn content_text(content: Option<Value>, param: &str) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => match part.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => {
                            return Err(ApiError::invalid(format!(
                                "{param}.content[{j}].text must be a string"
                            )));
                        }
                    },
                    Some(kind @ ("image_url" | "input_audio" | "file")) => {
                        return Err(ApiError::invalid(format!(
                            "{param}.content[{j}] is {kind}: this model reads text only"
                        )));
                    }
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "{param}.content[{j}] has an unknown type"
                        )));
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::invalid(format!(
            "{param}.content must be a string or an array of content parts"
        ))),
    }
}

fn finish_reason(f: pb::FinishReason) -> &'static str {
    match f {
        pb::FinishReason::Length => "length",
        _ => "stop",
    }
}

/// Chat's finish reason: a complete answer that made calls ends with "tool_calls".
fn chat_finish_reason(f: pb::FinishReason, made_calls: bool) -> &'static str {
    match f {
        pb::FinishReason::Length => "length",
        _ if made_calls => "tool_calls",
        _ => "stop",
    }
}

/// Stream deltas for parsed pieces: content, or a call as two `tool_calls` fragments (id and
/// name, then the arguments), numbered from `next`.
fn tool_deltas(pieces: Vec<Piece>, next: &mut usize) -> Vec<Value> {
    let mut out = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => out.push(json!({"content": t})),
            Piece::Call(c) => {
                let index = *next;
                *next += 1;
                out.push(
                    json!({"tool_calls": [{"index": index, "id": tools::call_id("call_"),
                    "type": "function", "function": {"name": c.name, "arguments": ""}}]}),
                );
                out.push(json!({"tool_calls": [{"index": index,
                    "function": {"arguments": c.arguments}}]}));
            }
        }
    }
    out
}

fn usage_json(u: &pb::Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "strata_cached_tokens_by_tier": generation::tiers_json(u),
    })
}

fn chat_logprobs(lps: &[pb::TokenLogprob], as_ids: bool) -> Value {
    let entry = |id: u32, text: &str, logprob: f32| {
        let token = if as_ids {
            format!("token_id:{id}")
        } else {
            text.to_string()
        };
        json!({"token": token, "logprob": logprob, "bytes": text.as_bytes()})
    };
    json!({
        "content": lps.iter().map(|l| {
            let mut e = entry(l.token, &l.text, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|t| entry(t.token, &t.text, t.logprob)).collect();
            e
        }).collect::<Vec<_>>()
    })
}

#[utoipa::path(get, path = "/v1/models", tag = "OpenAI",
    responses((status = 200, description = "Every configured model, with its kind and state")))]
pub async fn models(State(state): State<AppState>) -> Json<Value> {
    let created = state.started_unix;
    let data: Vec<Value> = state
        .registry
        .models()
        .iter()
        .flat_map(|m| {
            // Extensions: what kind of model it is and whether its worker is up now.
            let state = m
                .state()
                .map(|s| format!("{:?}", s.phase).to_lowercase())
                .unwrap_or_else(|| "unloaded".into());
            // Alias patterns (`claude-*`) route names; they are not names to list.
            let names = std::iter::once(&m.id).chain(m.aliases.iter().filter(|a| !a.contains('*')));
            names.map(move |id| {
                // OpenAI's fields, then Anthropic's (its SDKs and Claude Code's gateway model
                // discovery read `type`, `display_name`, `created_at`).
                json!({"id": id, "object": "model", "created": created, "owned_by": "strata",
                       "type": "model", "display_name": id, "created_at": rfc3339(created),
                       "kind": m.kind, "state": state})
            })
        })
        .collect();
    let first_id = data.first().map(|m| m["id"].clone()).unwrap_or(Value::Null);
    let last_id = data.last().map(|m| m["id"].clone()).unwrap_or(Value::Null);
    Json(json!({"object": "list", "data": data, "has_more": false,
                "first_id": first_id, "last_id": last_id}))
}

/// Seconds since the Unix epoch as an RFC 3339 UTC time (Anthropic's `created_at`). Civil
/// date from days since the epoch, as in Howard Hinnant's `civil_from_days`; a date crate for
/// one timestamp is not worth the dependency.
fn rfc3339(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// The body of `POST /v1/chat/completions`, for the OpenAPI document (the handler reads the
/// two parts from the same bytes).
#[derive(Deserialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ChatCompletionBody {
    #[serde(flatten)]
    common: Common,
    #[serde(flatten)]
    chat: ChatRequest,
}

/// The body of `POST /v1/completions`, for the OpenAPI document.
#[derive(Deserialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct CompletionBody {
    #[serde(flatten)]
    common: Common,
    #[serde(flatten)]
    completion: CompletionRequest,
}

#[utoipa::path(post, path = "/v1/chat/completions", tag = "OpenAI",
    request_body = ChatCompletionBody,
    responses(
        (status = 200, description = "A chat completion; with stream=true, server-sent chunks ending with [DONE]"),
        super::openapi::ErrorResponses,
    ))]
pub async fn chat_completions(
    State(state): State<AppState>,
    tenant: Option<Extension<TenantKey>>,
    body: Body,
) -> Result<Response, ApiError> {
    let (common, req): (Common, ChatRequest) =
        read_json_parts(body, state.max_body_bytes, FLAVOR).await?;
    let model = state.registry.resolve(&common.model)?;
    let tool_use = ToolUse::openai(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    let constraint = tools::constraint(
        tools::response_format(req.response_format.as_ref())?,
        tool_use.as_ref(),
        "response_format",
    )?;
    let parser = tool_use.as_ref().and_then(ToolUse::parser);
    let (mut messages, sources) = normalize_messages(req.messages, model.kind == ModelKind::Vlm)?;
    tools::openai_history(&mut messages)?;
    let images = images::load(sources, &state.images, FLAVOR).await?;
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
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), Some(top)) if top > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(format!(
                "top_logprobs is {top}: at most {MAX_TOP_LOGPROBS}"
            ))
            .param("top_logprobs"));
        }
        (Some(true), top) => Some(top.unwrap_or(0)),
        (_, Some(_)) => {
            return Err(
                ApiError::invalid("top_logprobs needs logprobs: true").param("top_logprobs")
            );
        }
        _ => None,
    };
    let as_ids = req.return_tokens_as_token_ids;
    let mut params = common.params(prompt, logprobs)?;
    params.constraint = constraint;
    let stream = generation::start(&state, &model, params, tenant.as_deref(), FLAVOR).await?;
    let id = response_id("chatcmpl-");
    let created = unix_now();
    let model_name = common.model.clone();
    if common.stream {
        // With tools offered, the text goes through the call parser: calls come out as
        // `tool_calls` deltas, the rest as content.
        return Ok(generation::stream(
            stream,
            ChatChunks {
                id,
                created,
                model: model_name,
                include_usage: common.stream_options.is_some_and(|o| o.include_usage),
                parser,
                calls_sent: 0,
                as_ids,
            },
        ));
    }
    let Collected {
        text,
        logprobs: lps,
        done,
    } = generation::collect(stream).await?;
    let lp = if logprobs.is_some() {
        chat_logprobs(&lps, as_ids)
    } else {
        Value::Null
    };
    let (content, calls) = match parser {
        Some(p) => p.split(&text),
        None => (text, Vec::new()),
    };
    let mut message = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = calls
            .iter()
            .map(|c| {
                json!({"id": tools::call_id("call_"), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect();
    }
    let body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model_name,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": lp,
            "finish_reason": chat_finish_reason(generation::finish(&done), !calls.is_empty()),
        }],
        "usage": usage_json(&generation::usage(&done)),
    });
    Ok(generation::respond(body, &done))
}

/// An OpenAI stream's `data:` event.
fn data(v: &Value) -> SseEvent {
    Ok(Event::default().data(v.to_string()))
}

/// OpenAI streams end with `data: [DONE]`, after an error too.
fn done_marker() -> SseEvent {
    Ok(Event::default().data("[DONE]"))
}

/// An error inside an OpenAI stream: a last `data: {"error": …}`, then `[DONE]`.
fn stream_error(e: ApiError) -> Vec<SseEvent> {
    vec![data(&e.flavor(FLAVOR).body()), done_marker()]
}

/// Chat completion chunks: the role first, then content (or `tool_calls`) deltas, the finish
/// reason with Strata's extension fields, the usage chunk when asked for, `[DONE]`.
struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    parser: Option<CallParser>,
    calls_sent: usize,
    as_ids: bool,
}

impl ChatChunks {
    fn chunk(&self, delta: Value, logprobs: Value, finish: Value) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        })
    }
}

impl Encoder for ChatChunks {
    fn start(&mut self, _: &pb::GenerateStarted) -> Vec<SseEvent> {
        let first = self.chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
            Value::Null,
        );
        vec![data(&first)]
    }

    fn delta(&mut self, d: pb::TokenDelta) -> Vec<SseEvent> {
        let mut lp = if d.logprobs.is_empty() {
            Value::Null
        } else {
            chat_logprobs(&d.logprobs, self.as_ids)
        };
        let deltas = match self.parser.as_mut() {
            None => vec![json!({"content": d.text})],
            Some(p) => tool_deltas(p.push(&d.text), &mut self.calls_sent),
        };
        let mut out: Vec<SseEvent> = deltas
            .into_iter()
            .map(|delta| data(&self.chunk(delta, std::mem::take(&mut lp), Value::Null)))
            .collect();
        if out.is_empty() && !lp.is_null() {
            out.push(data(&self.chunk(json!({"content": ""}), lp, Value::Null)));
        }
        out
    }

    fn done(&mut self, done: pb::GenerateDone) -> Vec<SseEvent> {
        let rest = match self.parser.as_mut() {
            None => Vec::new(),
            Some(p) => tool_deltas(p.finish(), &mut self.calls_sent),
        };
        let mut out: Vec<SseEvent> = rest
            .into_iter()
            .map(|delta| data(&self.chunk(delta, Value::Null, Value::Null)))
            .collect();
        let reason = chat_finish_reason(generation::finish(&done), self.calls_sent > 0);
        let mut last = self.chunk(json!({}), Value::Null, json!(reason));
        generation::annotate(&mut last, &done);
        out.push(data(&last));
        if self.include_usage {
            out.push(data(&json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage_json(&generation::usage(&done)),
            })));
        }
        out.push(done_marker());
        out
    }

    fn error(&mut self, e: ApiError) -> Vec<SseEvent> {
        stream_error(e)
    }
}

/// Text completion chunks: text deltas, the finish reason, the usage chunk when asked for.
struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    as_ids: bool,
}

impl CompletionChunks {
    fn chunk(&self, text: &str, logprobs: Value, finish: Value) -> Value {
        json!({
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        })
    }
}

impl Encoder for CompletionChunks {
    fn start(&mut self, _: &pb::GenerateStarted) -> Vec<SseEvent> {
        Vec::new()
    }

    fn delta(&mut self, d: pb::TokenDelta) -> Vec<SseEvent> {
        let lp = if d.logprobs.is_empty() {
            Value::Null
        } else {
            completion_logprobs(&d.logprobs, self.as_ids)
        };
        vec![data(&self.chunk(&d.text, lp, Value::Null))]
    }

    fn done(&mut self, done: pb::GenerateDone) -> Vec<SseEvent> {
        let reason = finish_reason(generation::finish(&done));
        let mut last = self.chunk("", Value::Null, json!(reason));
        generation::annotate(&mut last, &done);
        let mut out = vec![data(&last)];
        if self.include_usage {
            out.push(data(&json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage_json(&generation::usage(&done)),
            })));
        }
        out.push(done_marker());
        out
    }

    fn error(&mut self, e: ApiError) -> Vec<SseEvent> {
        stream_error(e)
    }
}

/// The Completions API's logprobs: tokens, their logprobs and the top alternatives.
fn completion_logprobs(lps: &[pb::TokenLogprob], as_ids: bool) -> Value {
    let name = |token: u32, text: &str| {
        if as_ids {
            format!("token_id:{token}")
        } else {
            text.to_string()
        }
    };
    json!({
        "tokens": lps.iter().map(|l| name(l.token, &l.text)).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| l.top.iter()
            .map(|t| (t.text.clone(), json!(t.logprob)))
            .collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
    })
}

#[utoipa::path(post, path = "/v1/completions", tag = "OpenAI",
    request_body = CompletionBody,
    responses(
        (status = 200, description = "A text completion; with stream=true, server-sent chunks ending with [DONE]"),
        super::openapi::ErrorResponses,
    ))]
pub async fn completions(
    State(state): State<AppState>,
    tenant: Option<Extension<TenantKey>>,
    body: Body,
) -> Result<Response, ApiError> {
    let (common, req): (Common, CompletionRequest) =
        read_json_parts(body, state.max_body_bytes, FLAVOR).await?;
    let model = state.registry.resolve(&common.model)?;
    if req.echo == Some(true) {
        return Err(ApiError::invalid("echo is not supported").param("echo"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(
            ApiError::invalid("suffix (fill-in-the-middle) is not supported").param("suffix"),
        );
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid("best_of must be 1").param("best_of"));
    }
    let input = match req.prompt {
        PromptInput::Text(t) => pb::prompt::Input::Text(t),
        PromptInput::Texts(mut v) if v.len() == 1 => pb::prompt::Input::Text(v.remove(0)),
        PromptInput::Texts(v) => {
            return Err(ApiError::invalid(format!(
                "prompt has {} strings; send one prompt per request",
                v.len()
            ))
            .param("prompt"));
        }
        PromptInput::Ids(ids) => pb::prompt::Input::TokenIds(pb::TokenIds { ids }),
    };
    if matches!(&input, pb::prompt::Input::Text(t) if t.is_empty()) {
        return Err(ApiError::invalid("prompt must not be empty").param("prompt"));
    }
    let logprobs = req.logprobs.map(|n| n.min(5));
    let mut params = common.params(pb::Prompt { input: Some(input) }, logprobs)?;
    // The Completions API's documented default is 16 tokens (Chat's is the whole context).
    params.max_tokens = params.max_tokens.or(Some(COMPLETIONS_DEFAULT_MAX_TOKENS));
    let stream = generation::start(&state, &model, params, tenant.as_deref(), FLAVOR).await?;
    let id = response_id("cmpl-");
    let created = unix_now();
    let model_name = common.model.clone();
    let as_ids = req.return_tokens_as_token_ids;
    if common.stream {
        return Ok(generation::stream(
            stream,
            CompletionChunks {
                id,
                created,
                model: model_name,
                include_usage: common.stream_options.is_some_and(|o| o.include_usage),
                as_ids,
            },
        ));
    }
    let Collected {
        text,
        logprobs: lps,
        done,
    } = generation::collect(stream).await?;
    let lp = if logprobs.is_some() {
        completion_logprobs(&lps, as_ids)
    } else {
        Value::Null
    };
    let body = json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason(generation::finish(&done))}],
        "usage": usage_json(&generation::usage(&done)),
    });
    Ok(generation::respond(body, &done))
}
