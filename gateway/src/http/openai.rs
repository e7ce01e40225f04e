//! OpenAI's API: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`,
//! streaming (SSE ending with `data: [DONE]`) and not.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Json, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use strata_proto::worker::{self as pb, generate_event};
use tokio_stream::wrappers::ReceiverStream;

use super::error::{ApiError, Flavor};
use super::generation::{self, Collected, from_value, read_value, response_id, unix_now};
use super::images::{self, ImageSource};
use super::tools::{self, Piece, ToolUse};
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
    prompt_pruning: Option<super::generation::PromptPruning>,
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
    /// Checks what the worker cannot (or should not have to), and builds its request.
    fn to_worker(
        &self,
        prompt: pb::Prompt,
        logprobs: Option<u32>,
        tenant: Option<&TenantKey>,
    ) -> Result<pb::GenerateRequest, ApiError> {
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
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        if max_tokens == Some(0) {
            return Err(ApiError::invalid("max_tokens must be at least 1").param("max_tokens"));
        }
        let stop = self
            .stop
            .as_ref()
            .map(|s| match s {
                Stop::One(s) => vec![s.clone()],
                Stop::Many(v) => v.clone(),
            })
            .unwrap_or_default();
        if self.prefill_breaks.len() > 64 {
            return Err(ApiError::invalid("at most 64 prefill_breaks").param("prefill_breaks"));
        }
        if stop.len() > 16 {
            return Err(ApiError::invalid("at most 16 stop sequences").param("stop"));
        }
        Ok(pb::GenerateRequest {
            request_id: String::new(),
            prompt: Some(prompt),
            // 0: as many as the context leaves room for.
            max_tokens: max_tokens.unwrap_or(0),
            sampling: Some(pb::Sampling {
                temperature: self.temperature.unwrap_or(1.0),
                top_p: self.top_p.unwrap_or(1.0),
                top_k: self.top_k.unwrap_or(0),
                min_p: self.min_p.unwrap_or(0.0),
                repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
                presence_penalty: self.presence_penalty.unwrap_or(0.0),
                frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
                seed: self.seed,
                logprobs,
            }),
            stop,
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_salt: super::cache_salt(tenant, self.cache_salt.as_deref()),
            prefill_breaks: self.prefill_breaks.clone(),
            constraint: None,
            speculative: self.speculative_decoding,
            prune_keep_ratio: super::generation::keep_ratio(self.prompt_pruning.as_ref())?,
        })
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
            std::iter::once(&m.id).chain(&m.aliases).map(move |id| {
                json!({"id": id, "object": "model", "created": created, "owned_by": "strata",
                       "kind": m.kind, "state": state})
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// The body of `POST /v1/chat/completions`, for the OpenAPI document (the handler reads the
/// two parts from one JSON value).
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
    let value = read_value(body, state.max_body_bytes, FLAVOR).await?;
    let common: Common = from_value(&value, FLAVOR)?;
    let req: ChatRequest = from_value(&value, FLAVOR)?;
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
        (Some(true), top) => Some(top.unwrap_or(0).min(20)),
        (_, Some(_)) => {
            return Err(
                ApiError::invalid("top_logprobs needs logprobs: true").param("top_logprobs")
            );
        }
        _ => None,
    };
    let as_ids = req.return_tokens_as_token_ids;
    let mut worker_req = common.to_worker(prompt, logprobs, tenant.as_deref())?;
    worker_req.constraint = constraint;
    let stream = generation::start(&state, &model, worker_req, FLAVOR).await?;
    let id = response_id("chatcmpl-");
    let created = unix_now();
    let model_name = common.model.clone();
    if common.stream {
        let include_usage = common.stream_options.is_some_and(|o| o.include_usage);
        // With tools offered, the text goes through the call parser: calls come out as
        // `tool_calls` deltas, the rest as content.
        let mut parser = parser;
        let mut calls_sent = 0;
        return Ok(sse(stream, move |part| {
            let chunk = |delta: Value, lp: Value, finish: Value| {
                json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
                })
            };
            match part {
                Part::Start => vec![chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    Value::Null,
                )],
                Part::Delta(d) => {
                    let mut lp = if d.logprobs.is_empty() {
                        Value::Null
                    } else {
                        chat_logprobs(&d.logprobs, as_ids)
                    };
                    let deltas = match parser.as_mut() {
                        None => vec![json!({"content": d.text})],
                        Some(p) => tool_deltas(p.push(&d.text), &mut calls_sent),
                    };
                    let mut out: Vec<Value> = deltas
                        .into_iter()
                        .map(|delta| chunk(delta, std::mem::take(&mut lp), Value::Null))
                        .collect();
                    if out.is_empty() && !lp.is_null() {
                        out.push(chunk(json!({"content": ""}), lp, Value::Null));
                    }
                    out
                }
                Part::Done(done) => {
                    let mut out: Vec<Value> = match parser.as_mut() {
                        None => Vec::new(),
                        Some(p) => tool_deltas(p.finish(), &mut calls_sent)
                            .into_iter()
                            .map(|delta| chunk(delta, Value::Null, Value::Null))
                            .collect(),
                    };
                    let reason = chat_finish_reason(generation::finish(done), calls_sent > 0);
                    let mut last = chunk(json!({}), Value::Null, json!(reason));
                    generation::annotate(&mut last, done);
                    out.push(last);
                    if include_usage {
                        out.push(json!({
                            "id": id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                            "choices": [], "usage": usage_json(&generation::usage(done)),
                        }));
                    }
                    out
                }
            }
        }));
    }
    let Collected {
        text,
        logprobs: lps,
        done,
    } = generation::collect(stream, FLAVOR).await?;
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
    let value = read_value(body, state.max_body_bytes, FLAVOR).await?;
    let common: Common = from_value(&value, FLAVOR)?;
    let req: CompletionRequest = from_value(&value, FLAVOR)?;
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
    let mut worker_req = common.to_worker(
        pb::Prompt { input: Some(input) },
        logprobs,
        tenant.as_deref(),
    )?;
    // The Completions API's documented default is 16 tokens (Chat's is the whole context).
    if worker_req.max_tokens == 0 {
        worker_req.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS;
    }
    let stream = generation::start(&state, &model, worker_req, FLAVOR).await?;
    let id = response_id("cmpl-");
    let created = unix_now();
    let model_name = common.model.clone();
    let as_ids = req.return_tokens_as_token_ids;
    let completion_logprobs = move |lps: &[pb::TokenLogprob]| {
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
            "top_logprobs": lps.iter().map(|l| l.top.iter().map(|t| (t.text.clone(), json!(t.logprob))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        })
    };
    if common.stream {
        let include_usage = common.stream_options.is_some_and(|o| o.include_usage);
        return Ok(sse(stream, move |part| match part {
            Part::Start => Vec::new(),
            Part::Delta(d) => {
                let lp = if d.logprobs.is_empty() {
                    Value::Null
                } else {
                    completion_logprobs(&d.logprobs)
                };
                vec![json!({
                    "id": id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": d.text, "logprobs": lp, "finish_reason": null}],
                })]
            }
            Part::Done(done) => {
                let mut last = json!({
                    "id": id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": finish_reason(generation::finish(done))}],
                });
                generation::annotate(&mut last, done);
                let mut out = vec![last];
                if include_usage {
                    out.push(json!({
                        "id": id, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [], "usage": usage_json(&generation::usage(done)),
                    }));
                }
                out
            }
        }));
    }
    let Collected {
        text,
        logprobs: lps,
        done,
    } = generation::collect(stream, FLAVOR).await?;
    let lp = if logprobs.is_some() {
        completion_logprobs(&lps)
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

/// What a stream produces, for the endpoint to turn into its chunks.
pub enum Part<'a> {
    Start,
    Delta(&'a pb::TokenDelta),
    Done(&'a pb::GenerateDone),
}

/// An OpenAI SSE response: the endpoint's chunks as `data:` lines, an error as a final
/// `data: {"error": …}`, then `data: [DONE]`. The worker stream is read by a task that stops
/// (dropping it, which cancels the generation) as soon as the client is gone.
pub fn sse(
    mut stream: generation::GenerationStream,
    mut chunks: impl FnMut(Part<'_>) -> Vec<Value> + Send + 'static,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(32);
    tokio::spawn(async move {
        let send = |v: &Value| Ok(Event::default().data(v.to_string()));
        for c in chunks(Part::Start) {
            if tx.send(send(&c)).await.is_err() {
                return;
            }
        }
        loop {
            let item = tokio::select! {
                item = stream.message() => item,
                // The client disconnected: stop reading; dropping the stream cancels the work.
                _ = tx.closed() => return,
            };
            let chunks_out = match item {
                Ok(Some(event)) => match event.event {
                    Some(generate_event::Event::Delta(d)) => chunks(Part::Delta(&d)),
                    Some(generate_event::Event::Started(_)) => Vec::new(),
                    Some(generate_event::Event::Done(done)) => {
                        for c in chunks(Part::Done(&done)) {
                            if tx.send(send(&c)).await.is_err() {
                                return;
                            }
                        }
                        break;
                    }
                    None => Vec::new(),
                },
                Ok(None) => {
                    let e = ApiError::new(
                        super::error::ErrorKind::Overloaded,
                        "the worker ended the generation without finishing it",
                    );
                    let _ = tx.send(send(&e.body())).await;
                    break;
                }
                Err(status) => {
                    let e = super::error::from_worker_status(&status);
                    tracing::warn!(error = %e, "stream ended by an error");
                    let _ = tx.send(send(&e.body())).await;
                    break;
                }
            };
            for c in chunks_out {
                if tx.send(send(&c)).await.is_err() {
                    return;
                }
            }
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
