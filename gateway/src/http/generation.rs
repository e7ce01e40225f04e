//! What both APIs share: reading a JSON body within limits, calling a worker's Generate with a
//! deadline, and collecting a stream into one answer. Dropping a stream (the client went away)
//! resets the gRPC stream, which cancels the generation in the worker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use serde::de::DeserializeOwned;
use strata_proto::worker::{self as pb, generate_event};
use tonic::Streaming;

use super::AppState;
use super::error::{ApiError, ErrorKind, Flavor, from_worker_status};
use super::metrics::GenerationMeter;
use crate::workers::{InFlight, ModelEntry};

/// Reads a JSON body: 413 past `limit` bytes, 400 when it is not JSON.
pub async fn read_value(
    body: Body,
    limit: usize,
    flavor: Flavor,
) -> Result<serde_json::Value, ApiError> {
    read_json(body, limit, flavor).await
}

/// Parses a request (or one part of it) from a JSON value, naming the field at fault.
pub fn from_value<T: DeserializeOwned>(
    value: &serde_json::Value,
    flavor: Flavor,
) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let mut err = if path == "." {
            ApiError::invalid(format!("invalid request: {inner}"))
        } else {
            ApiError::invalid(format!("invalid value for {path}: {inner}")).param(path)
        };
        err.flavor = flavor;
        err
    })
}

/// Reads and parses a JSON body: 413 past `limit` bytes, 400 naming the field at fault.
pub async fn read_json<T: DeserializeOwned>(
    body: Body,
    limit: usize,
    flavor: Flavor,
) -> Result<T, ApiError> {
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(
            ErrorKind::TooLarge,
            format!("the request body is larger than {limit} bytes"),
        )
        .flavor(flavor)
    })?;
    if bytes.is_empty() {
        return Err(ApiError::invalid("the request body is empty; expected JSON").flavor(flavor));
    }
    let de = &mut serde_json::Deserializer::from_slice(&bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("the request body is not valid JSON: {inner}")
        } else if path == "." {
            format!("invalid request: {inner}")
        } else {
            format!("invalid value for {path}: {inner}")
        };
        let mut err = ApiError::invalid(message).flavor(flavor);
        if path != "." {
            err = err.param(path);
        }
        err
    })
}

/// A short unique id for responses (`chatcmpl-…`, `msg_…`).
pub fn response_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}{:x}{:06x}{n:04x}",
        t as u64,
        std::process::id() & 0xff_ffff
    )
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Starts a generation; errors the worker finds before the first token (bad input, context
/// exceeded, queue full) come back here, so the HTTP status can still say so.
pub async fn start(
    state: &AppState,
    model: &Arc<ModelEntry>,
    request: pb::GenerateRequest,
    flavor: Flavor,
) -> Result<GenerationStream, ApiError> {
    let meter = GenerationMeter::new(&model.id);
    // Loads the model first when it is not (on first request, or after an LRU unload).
    let (mut client, in_flight) = state
        .registry
        .acquire(model)
        .await
        .map_err(|e| e.flavor(flavor))?;
    let mut req = tonic::Request::new(request);
    req.set_timeout(state.request_timeout);
    strata_runtime::logging::inject(&mut req);
    match client.generate(req).await {
        Ok(r) => Ok(GenerationStream {
            inner: r.into_inner(),
            meter,
            _in_flight: in_flight,
        }),
        Err(s) => {
            meter.failed();
            Err(from_worker_status(&s).flavor(flavor))
        }
    }
}

/// Sampling as the APIs without penalties or seeds ask for it (Anthropic, Responses): their
/// defaults are temperature 1 and no top-p or top-k cut.
pub fn sampling(temperature: Option<f32>, top_p: Option<f32>, top_k: Option<u32>) -> pb::Sampling {
    pb::Sampling {
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        top_k: top_k.unwrap_or(0),
        min_p: 0.0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: None,
        logprobs: None,
    }
}

/// An SSE event as the streaming endpoints queue it.
pub type SseEvent = Result<axum::response::sse::Event, std::convert::Infallible>;

/// Queues `events` in order; Err when the client has gone.
pub async fn send_all(
    tx: &tokio::sync::mpsc::Sender<SseEvent>,
    events: Vec<SseEvent>,
) -> Result<(), ()> {
    for e in events {
        tx.send(e).await.map_err(|_| ())?;
    }
    Ok(())
}

/// A worker's event stream, metered on the way through (TTFT, inter-token latency, usage).
pub struct GenerationStream {
    inner: Streaming<pb::GenerateEvent>,
    meter: GenerationMeter,
    /// The model stays loaded while the stream lasts.
    _in_flight: InFlight,
}

impl GenerationStream {
    pub async fn message(&mut self) -> Result<Option<pb::GenerateEvent>, tonic::Status> {
        let item = self.inner.message().await;
        match &item {
            Ok(Some(e)) => match &e.event {
                Some(generate_event::Event::Delta(_)) => self.meter.token(),
                Some(generate_event::Event::Done(d)) => self.meter.done(d),
                _ => {}
            },
            Ok(None) => {}
            Err(_) => self.meter.failed(),
        }
        item
    }
}

/// Counts tokens of a prompt as the model sees it.
pub async fn count_tokens(
    model: &ModelEntry,
    prompt: pb::Prompt,
    flavor: Flavor,
) -> Result<pb::TokenizeResponse, ApiError> {
    let mut client = model.ready_client().map_err(|e| e.flavor(flavor))?;
    let mut req = tonic::Request::new(pb::TokenizeRequest {
        prompt: Some(prompt),
    });
    req.set_timeout(Duration::from_secs(30));
    client
        .tokenize(req)
        .await
        .map(|r| r.into_inner())
        .map_err(|s| from_worker_status(&s).flavor(flavor))
}

/// A whole generation, for non-streaming responses.
#[derive(Default)]
pub struct Collected {
    pub text: String,
    pub logprobs: Vec<pb::TokenLogprob>,
    pub done: pb::GenerateDone,
}

pub async fn collect(mut stream: GenerationStream, flavor: Flavor) -> Result<Collected, ApiError> {
    let mut out = Collected::default();
    loop {
        match stream.message().await {
            Ok(Some(event)) => match event.event {
                Some(generate_event::Event::Delta(d)) => {
                    out.text.push_str(&d.text);
                    out.logprobs.extend(d.logprobs);
                }
                Some(generate_event::Event::Done(done)) => {
                    out.done = done;
                    return Ok(out);
                }
                Some(generate_event::Event::Started(_)) | None => {}
            },
            Ok(None) => {
                return Err(ApiError::new(
                    ErrorKind::Overloaded,
                    "the worker ended the generation without finishing it",
                )
                .flavor(flavor));
            }
            Err(status) => return Err(from_worker_status(&status).flavor(flavor)),
        }
    }
}

/// Extension field: where the cached prompt tokens came from (L0: the worker's memory, L1:
/// the cache service's RAM, L2: its disk).
pub fn tiers_json(u: &pb::Usage) -> serde_json::Value {
    serde_json::json!({"l0": u.cached_tokens_l0, "l1": u.cached_tokens_l1, "l2": u.cached_tokens_l2})
}

pub fn usage(done: &pb::GenerateDone) -> pb::Usage {
    done.usage.unwrap_or_default()
}

pub fn finish(done: &pb::GenerateDone) -> pb::FinishReason {
    pb::FinishReason::try_from(done.finish_reason).unwrap_or(pb::FinishReason::Unspecified)
}

/// Strata's extension: SpecPrefill-style prompt pruning. The draft model scores the prompt
/// and only `keep_ratio` of it is prefilled; the answer can differ from a full prefill's.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptPruning {
    /// The fraction of the prompt to prefill, in (0, 1].
    pub keep_ratio: f32,
}

/// The keep ratio a request asks for, checked.
pub fn keep_ratio(p: Option<&PromptPruning>) -> Result<Option<f32>, ApiError> {
    match p {
        None => Ok(None),
        Some(p) if p.keep_ratio.is_finite() && p.keep_ratio > 0.0 && p.keep_ratio <= 1.0 => {
            Ok(Some(p.keep_ratio))
        }
        Some(p) => Err(ApiError::invalid(format!(
            "prompt_pruning.keep_ratio must be in (0, 1], got {}",
            p.keep_ratio
        ))
        .param("prompt_pruning.keep_ratio")),
    }
}

/// The header that lists optional features asked for and not (fully) applied, as
/// `feature: message` entries separated by "; " (non-streaming responses; streams carry the
/// same in their last event's `strata_warnings`).
pub const WARNINGS_HEADER: &str = "x-strata-warnings";

/// Strata's extension fields of a finished generation, merged into the response object (or
/// a stream's last event): `strata_warnings` when a feature asked for did not (fully) apply,
/// `strata_speculative` when the draft model ran.
pub fn annotate(body: &mut serde_json::Value, done: &pb::GenerateDone) {
    let Some(obj) = body.as_object_mut() else {
        return;
    };
    if !done.notices.is_empty() {
        obj.insert(
            "strata_warnings".into(),
            done.notices
                .iter()
                .map(|n| serde_json::json!({"feature": n.feature, "message": n.message}))
                .collect(),
        );
    }
    if done.pruned_prompt_tokens > 0 {
        let prompt = done.usage.map_or(0, |u| u.prompt_tokens);
        obj.insert(
            "strata_prompt_pruning".into(),
            serde_json::json!({
                "pruned_tokens": done.pruned_prompt_tokens,
                "prefilled_tokens": prompt.saturating_sub(done.pruned_prompt_tokens),
            }),
        );
    }
    if let Some(s) = &done.speculation {
        obj.insert(
            "strata_speculative".into(),
            serde_json::json!({
                "steps": s.steps, "drafted_tokens": s.drafted, "accepted_tokens": s.accepted,
                "batched_steps": s.batched_steps,
            }),
        );
    }
}

/// A non-streaming response as JSON, with its extension fields and the warnings header.
pub fn respond(mut body: serde_json::Value, done: &pb::GenerateDone) -> axum::response::Response {
    use axum::response::IntoResponse;
    annotate(&mut body, done);
    let mut response = axum::Json(body).into_response();
    if !done.notices.is_empty() {
        let text: Vec<String> = done
            .notices
            .iter()
            .map(|n| format!("{}: {}", n.feature, n.message))
            .collect();
        // Header values must be visible ASCII; messages are ours, but be safe.
        let ascii: String = text
            .join("; ")
            .chars()
            .map(|c| {
                if c.is_ascii() && !c.is_ascii_control() {
                    c
                } else {
                    '?'
                }
            })
            .collect();
        if let Ok(v) = axum::http::HeaderValue::from_str(&ascii) {
            response.headers_mut().insert(WARNINGS_HEADER, v);
        }
    }
    response
}
