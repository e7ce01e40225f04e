//! The one generation pipeline of the three APIs (OpenAI chat and completions, Anthropic
//! messages, OpenAI responses): each API decodes its body into `Params`, `start` checks them
//! and calls the worker's Generate with a deadline, and the answer is either collected whole
//! (`collect`) or streamed through the API's `Encoder` (`stream`). Notices of features asked
//! for and not applied travel with the generation and come out once, in every API's shape.
//! Dropping a stream (the client went away) resets the gRPC stream, which cancels the
//! generation in the worker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use serde::de::DeserializeOwned;
use strata_proto::worker::{self as pb, generate_event};
use tonic::Streaming;

use axum::response::Response;

use super::error::{ApiError, ErrorKind, Flavor, from_worker_status};
use super::metrics::GenerationMeter;
use super::{AppState, TenantKey};
use crate::workers::{InFlight, ModelEntry};

/// Reads a JSON body: 413 past `limit` bytes, 400 when it is not JSON.
/// How long a request body may take to arrive.
pub const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A timeout, or in a debug build the milliseconds in the test switch `env` (so that the fault
/// tests need not wait a minute). A release build ignores the variable.
fn timeout_or_test_override(
    cell: &'static std::sync::OnceLock<std::time::Duration>,
    env: &str,
    default: std::time::Duration,
) -> std::time::Duration {
    *cell.get_or_init(|| {
        std::env::var(env)
            .ok()
            .filter(|_| cfg!(debug_assertions))
            .and_then(|v| v.parse().ok())
            .map_or(default, std::time::Duration::from_millis)
    })
}

/// `BODY_READ_TIMEOUT`, or `STRATA_TEST_BODY_TIMEOUT_MS` in a debug build.
pub fn body_read_timeout() -> std::time::Duration {
    static CELL: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    timeout_or_test_override(&CELL, "STRATA_TEST_BODY_TIMEOUT_MS", BODY_READ_TIMEOUT)
}

/// `STALLED_CLIENT_TIMEOUT`, or `STRATA_TEST_STALL_TIMEOUT_MS` in a debug build.
pub fn stalled_client_timeout() -> std::time::Duration {
    static CELL: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    timeout_or_test_override(
        &CELL,
        "STRATA_TEST_STALL_TIMEOUT_MS",
        STALLED_CLIENT_TIMEOUT,
    )
}

/// Request bodies being read at once, in KiB: 256 MiB (16 bodies at the default 16 MiB
/// limit; a typical agent request is 50-200 KiB). A body waits for room, it is not refused.
const BODY_KIB_IN_FLIGHT: u32 = 256 << 10;

/// One bound for the process: bodies are read before any state is looked at.
fn bodies_in_flight() -> &'static tokio::sync::Semaphore {
    static IN_FLIGHT: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    IN_FLIGHT.get_or_init(|| tokio::sync::Semaphore::new(BODY_KIB_IN_FLIGHT as usize))
}

/// Reads and parses a JSON body: 413 past `limit` bytes, 400 naming the field at fault.
pub async fn read_json<T: DeserializeOwned>(
    body: Body,
    limit: usize,
    flavor: Flavor,
) -> Result<T, ApiError> {
    let bytes = read_body(body, limit, flavor).await?;
    parse_json(&bytes, flavor).await
}

/// A request that two typed parts describe (fields both endpoints share, then the endpoint's
/// own): each is decoded from the body's bytes, skipping the other's fields. Nothing builds
/// a tree of the whole body (a `serde_json::Value` costs many times the body's size) or
/// copies it.
pub async fn read_json_parts<A: DeserializeOwned, B: DeserializeOwned>(
    body: Body,
    limit: usize,
    flavor: Flavor,
) -> Result<(A, B), ApiError> {
    let bytes = read_body(body, limit, flavor).await?;
    // Counted and admitted once; each part skips the other's fields.
    let _room = room_to_parse(&bytes, flavor).await?;
    Ok((decode_json(&bytes, flavor)?, decode_json(&bytes, flavor)?))
}

/// Reads a request body: 413 past `limit` bytes, 408 when it takes too long to arrive.
async fn read_body(
    body: Body,
    limit: usize,
    flavor: Flavor,
) -> Result<axum::body::Bytes, ApiError> {
    // Bytes of bodies being read at once are bounded (each may be up to `limit`), and so is
    // how long one may take to arrive: a client trickling a body holds a buffer, not forever.
    use axum::body::HttpBody;
    let expected = body
        .size_hint()
        .upper()
        .map_or(limit, |n| (n as usize).min(limit));
    let kib = u32::try_from(expected.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    let in_flight = bodies_in_flight();
    let _permit = in_flight
        .acquire_many(kib.min(BODY_KIB_IN_FLIGHT))
        .await
        .map_err(|_| {
            ApiError::new(ErrorKind::Internal, "the gateway is stopping").flavor(flavor)
        })?;
    let bytes =
        match tokio::time::timeout(body_read_timeout(), axum::body::to_bytes(body, limit)).await {
            Ok(read) => read.map_err(|_| {
                ApiError::new(
                    ErrorKind::TooLarge,
                    format!("the request body is larger than {limit} bytes"),
                )
                .flavor(flavor)
            })?,
            Err(_) => {
                return Err(ApiError::new(
                    ErrorKind::RequestTimeout,
                    format!(
                        "the request body did not arrive within {:?}",
                        body_read_timeout()
                    ),
                )
                .flavor(flavor));
            }
        };
    if bytes.is_empty() {
        return Err(ApiError::invalid("the request body is empty; expected JSON").flavor(flavor));
    }
    Ok(bytes)
}

/// JSON values one body may hold. The largest agent requests seen (Claude Code with 27 tools
/// and a 200K-token history) hold tens of thousands; text of any length is one value.
pub const MAX_JSON_VALUES: usize = 1_000_000;
/// What one parsed value may cost in memory where a request keeps it as a JSON tree
/// (messages, tools): measured 22 bytes for an empty object; rounded up.
const BYTES_PER_JSON_VALUE: usize = 48;
/// Memory for JSON trees being built at once, in KiB, apart from the bodies' bytes.
const PARSE_KIB_IN_FLIGHT: u32 = 512 << 10;

fn parses_in_flight() -> &'static tokio::sync::Semaphore {
    static IN_FLIGHT: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    IN_FLIGHT.get_or_init(|| tokio::sync::Semaphore::new(PARSE_KIB_IN_FLIGHT as usize))
}

/// About how many values a JSON text holds: containers and separators outside strings. One
/// pass over the bytes, so that a body of many tiny values (`[{},{},…]`, tens of bytes of
/// tree per byte of text) is refused or waits for room before any tree is built.
fn count_json_values(bytes: &[u8]) -> usize {
    let (mut n, mut in_string, mut escaped) = (1usize, false, false);
    for &b in bytes {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'{' | b'[' | b',' => n += 1,
                _ => {}
            }
        }
    }
    n
}

/// Parses a JSON body into `T`: 400 naming the field at fault; 413 past `MAX_JSON_VALUES`.
/// The memory of trees being built at once is bounded (`PARSE_KIB_IN_FLIGHT`).
async fn parse_json<T: DeserializeOwned>(bytes: &[u8], flavor: Flavor) -> Result<T, ApiError> {
    let _room = room_to_parse(bytes, flavor).await?;
    decode_json(bytes, flavor)
}

/// Counts the body's JSON values (413 past `MAX_JSON_VALUES`) and waits for room for their
/// trees; held while the body is decoded.
async fn room_to_parse(
    bytes: &[u8],
    flavor: Flavor,
) -> Result<tokio::sync::SemaphorePermit<'static>, ApiError> {
    let values = count_json_values(bytes);
    if values > MAX_JSON_VALUES {
        return Err(ApiError::new(
            ErrorKind::TooLarge,
            format!(
                "the request body holds about {values} JSON values; at most {MAX_JSON_VALUES} are accepted"
            ),
        )
        .flavor(flavor));
    }
    let kib = u32::try_from((values * BYTES_PER_JSON_VALUE).div_ceil(1024).max(1))
        .unwrap_or(u32::MAX)
        .min(PARSE_KIB_IN_FLIGHT);
    parses_in_flight()
        .acquire_many(kib)
        .await
        .map_err(|_| ApiError::new(ErrorKind::Internal, "the gateway is stopping").flavor(flavor))
}

/// Decodes `T` from JSON bytes, naming the field at fault.
fn decode_json<T: DeserializeOwned>(bytes: &[u8], flavor: Flavor) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
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

/// What every API's request comes down to before it goes to a worker: the one request
/// builder of the three APIs. Each API decodes its own body into this; the checks that do not
/// depend on the API are made here, once.
pub struct Params {
    pub prompt: pb::Prompt,
    /// None: as many as the context leaves room for (the worker clamps larger values).
    pub max_tokens: Option<u32>,
    /// The API's name for `max_tokens`, for error messages.
    pub max_tokens_param: &'static str,
    pub sampling: pb::Sampling,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub cache_salt: Option<String>,
    pub prefill_breaks: Vec<u32>,
    pub constraint: Option<pb::Constraint>,
    pub speculative: Option<bool>,
    pub prompt_pruning: Option<PromptPruning>,
    /// Optional features the request asked for that the gateway already knows will not apply
    /// (thinking on a model without it, hosted tools, …): reported with the worker's own.
    pub notices: Vec<pb::Notice>,
}

/// Most stop sequences a request may send, and the longest one in bytes.
const MAX_STOP_SEQUENCES: usize = 16;
/// Most messages one request may hold. A long agent session is a few thousand (Claude Code
/// compacts its history near the context limit); the body limit bounds their bytes.
pub const MAX_MESSAGES: usize = 10_000;
const MAX_STOP_BYTES: usize = 1024;

impl Params {
    pub fn new(prompt: pb::Prompt, sampling: pb::Sampling) -> Self {
        Self {
            prompt,
            max_tokens: None,
            max_tokens_param: "max_tokens",
            sampling,
            stop: Vec::new(),
            ignore_eos: false,
            cache_salt: None,
            prefill_breaks: Vec::new(),
            constraint: None,
            speculative: None,
            prompt_pruning: None,
            notices: Vec::new(),
        }
    }

    /// Notes an optional feature that was asked for and is not applied (logged, counted and
    /// shown in /admin with the rest when the generation ends).
    pub fn not_applied(&mut self, feature: &str, message: impl Into<String>) {
        self.notices.push(pb::Notice {
            feature: feature.to_string(),
            message: message.into(),
        });
    }

    /// The worker's request, after the checks every API shares.
    fn into_worker(
        self,
        model: &ModelEntry,
        tenant: Option<&TenantKey>,
    ) -> Result<(pb::GenerateRequest, Vec<pb::Notice>), ApiError> {
        let mut notices = self.notices;
        if self.max_tokens == Some(0) {
            return Err(
                ApiError::invalid(format!("{} must be at least 1", self.max_tokens_param))
                    .param(self.max_tokens_param),
            );
        }
        // The model's own cap on answers (its config), applied before the context's.
        let max_tokens = match (self.max_tokens, model.max_output_tokens) {
            (Some(n), Some(cap)) if n > cap => {
                notices.push(pb::Notice {
                    feature: "max_tokens".into(),
                    message: format!(
                        "{} {n} clamped to {cap}, this model's max_output_tokens",
                        self.max_tokens_param
                    ),
                });
                cap
            }
            (None, Some(cap)) => cap,
            (Some(n), _) => n,
            (None, None) => 0,
        };
        if self.stop.len() > MAX_STOP_SEQUENCES {
            return Err(
                ApiError::invalid(format!("at most {MAX_STOP_SEQUENCES} stop sequences"))
                    .param("stop"),
            );
        }
        if self.stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid(format!(
                "a stop sequence may be at most {MAX_STOP_BYTES} bytes long"
            ))
            .param("stop"));
        }
        if self.prefill_breaks.len() > 64 {
            return Err(ApiError::invalid("at most 64 prefill_breaks").param("prefill_breaks"));
        }
        let request = pb::GenerateRequest {
            request_id: String::new(),
            prompt: Some(self.prompt),
            max_tokens,
            sampling: Some(self.sampling),
            stop: self.stop,
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos,
            cache_salt: super::cache_salt(tenant, self.cache_salt.as_deref()),
            prefill_breaks: self.prefill_breaks,
            constraint: self.constraint,
            speculative: self.speculative,
            prune_keep_ratio: keep_ratio(self.prompt_pruning.as_ref())?,
        };
        Ok((request, notices))
    }
}

/// Starts a generation: builds the worker's request, loads the model if needed and waits for
/// the worker's first event. Errors the worker finds before the first token (bad input,
/// context exceeded, queue full) come back here, so the HTTP status can still say so.
pub async fn start(
    state: &AppState,
    model: &Arc<ModelEntry>,
    params: Params,
    tenant: Option<&TenantKey>,
    flavor: Flavor,
) -> Result<GenerationStream, ApiError> {
    let max_tokens_param = params.max_tokens_param;
    let (request, notices) = params
        .into_worker(model, tenant)
        .map_err(|e| e.flavor(flavor))?;
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
    let mut inner = match client.generate(req).await {
        Ok(r) => r.into_inner(),
        Err(s) => {
            meter.failed();
            return Err(from_worker_status(&s).flavor(flavor));
        }
    };
    // The worker sends Started as soon as it accepts the request.
    let started = match inner.message().await {
        Ok(Some(pb::GenerateEvent {
            event: Some(generate_event::Event::Started(s)),
        })) => s,
        Ok(_) => {
            meter.failed();
            return Err(ApiError::new(
                ErrorKind::Overloaded,
                "the worker ended the generation without starting it",
            )
            .flavor(flavor));
        }
        Err(s) => {
            meter.failed();
            return Err(from_worker_status(&s).flavor(flavor));
        }
    };
    // The worker names the field `max_tokens`; say it in the API's own words.
    let notices = notices
        .into_iter()
        .chain(started.notices.iter().cloned().map(|mut n| {
            if n.feature == "max_tokens"
                && let Some(rest) = n.message.strip_prefix("max_tokens ")
            {
                n.message = format!("{max_tokens_param} {rest}");
            }
            n
        }))
        .collect();
    Ok(GenerationStream {
        inner,
        meter,
        started,
        notices,
        flavor,
        timeout: state.request_timeout,
        deadline: tokio::time::Instant::now() + state.request_timeout,
        _in_flight: in_flight,
    })
}

/// How long a stream waits for a client that stopped reading (its buffers full) before it
/// gives up on it, which cancels the generation in the worker.
pub const STALLED_CLIENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// An SSE event as the streaming endpoints queue it.
pub type SseEvent = Result<axum::response::sse::Event, std::convert::Infallible>;

/// Queues `events` in order; Err when the client has gone.
pub async fn send_all(
    tx: &tokio::sync::mpsc::Sender<SseEvent>,
    events: Vec<SseEvent>,
) -> Result<(), ()> {
    for e in events {
        match tokio::time::timeout(stalled_client_timeout(), tx.send(e)).await {
            Ok(sent) => sent.map_err(|_| ())?,
            Err(_) => {
                tracing::warn!(
                    "a client read nothing for {:?}: its stream is cut",
                    stalled_client_timeout()
                );
                ::metrics::counter!("strata_streams_cut_total", "reason" => "client_stalled")
                    .increment(1);
                return Err(());
            }
        }
    }
    Ok(())
}

/// A worker's event stream, metered on the way through (TTFT, inter-token latency, usage).
pub struct GenerationStream {
    inner: Streaming<pb::GenerateEvent>,
    meter: GenerationMeter,
    /// The worker's first event: the prompt's size, what it changed in the request.
    pub started: pb::GenerateStarted,
    /// Every notice known before the first token (the gateway's and the worker's Started
    /// ones); merged into the Done event's.
    pub notices: Vec<pb::Notice>,
    flavor: Flavor,
    /// `request_timeout_secs`, and when it runs out: it bounds the whole generation, not only
    /// its start.
    timeout: std::time::Duration,
    deadline: tokio::time::Instant,
    /// The model stays loaded while the stream lasts.
    _in_flight: InFlight,
}

/// One step of a generation, as the pipeline hands it to an API's encoder.
pub enum Step {
    Delta(pb::TokenDelta),
    /// The end, with every notice of the request (gateway's and worker's) in `notices`.
    Done(pb::GenerateDone),
}

impl GenerationStream {
    /// The next delta or the end; an error when the worker failed or went away.
    pub async fn next(&mut self) -> Result<Step, ApiError> {
        loop {
            let Ok(item) = tokio::time::timeout_at(self.deadline, self.inner.message()).await
            else {
                self.meter.failed();
                ::metrics::counter!("strata_streams_cut_total", "reason" => "request_timeout")
                    .increment(1);
                // Returning drops nothing yet; the caller's drop of this stream cancels the
                // worker's generation.
                return Err(ApiError::new(
                    ErrorKind::Timeout,
                    format!(
                        "the generation ran past request_timeout_secs ({} s)",
                        self.timeout.as_secs()
                    ),
                )
                .flavor(self.flavor));
            };
            match item {
                Ok(Some(e)) => match e.event {
                    Some(generate_event::Event::Delta(d)) => {
                        self.meter.token();
                        return Ok(Step::Delta(d));
                    }
                    Some(generate_event::Event::Done(mut d)) => {
                        let early = std::mem::take(&mut self.notices);
                        d.notices.splice(0..0, early);
                        self.meter.done(&d);
                        return Ok(Step::Done(d));
                    }
                    Some(generate_event::Event::Started(_)) | None => {}
                },
                Ok(None) => {
                    self.meter.failed();
                    return Err(ApiError::new(
                        ErrorKind::Overloaded,
                        "the worker ended the generation without finishing it",
                    )
                    .flavor(self.flavor));
                }
                Err(status) => {
                    self.meter.failed();
                    return Err(from_worker_status(&status).flavor(self.flavor));
                }
            }
        }
    }
}

/// How an API writes a generation as server-sent events. The pipeline calls `start` once,
/// `delta` per worker delta, then `done` or `error` last.
pub trait Encoder: Send + 'static {
    fn start(&mut self, started: &pb::GenerateStarted) -> Vec<SseEvent>;
    fn delta(&mut self, delta: pb::TokenDelta) -> Vec<SseEvent>;
    fn done(&mut self, done: pb::GenerateDone) -> Vec<SseEvent>;
    fn error(&mut self, error: ApiError) -> Vec<SseEvent>;
}

/// The one streaming pipeline of the three APIs: a task reads the worker's stream and sends
/// what the encoder makes of each step. Cancellation is the pipeline being dropped: when the
/// client goes, the task stops reading and drops the worker stream, which resets the gRPC
/// stream and cancels the generation in the worker.
pub fn stream(mut generation: GenerationStream, mut encoder: impl Encoder) -> Response {
    use axum::response::IntoResponse;
    use axum::response::sse::{KeepAlive, Sse};
    let warnings = warnings_header(&generation.notices);
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(32);
    tokio::spawn(async move {
        if send_all(&tx, encoder.start(&generation.started))
            .await
            .is_err()
        {
            return;
        }
        loop {
            let step = tokio::select! {
                step = generation.next() => step,
                // The client disconnected: stop reading; dropping the stream cancels the work.
                _ = tx.closed() => return,
            };
            let (events, last) = match step {
                Ok(Step::Delta(d)) => (encoder.delta(d), false),
                Ok(Step::Done(done)) => (encoder.done(done), true),
                Err(e) => {
                    tracing::warn!(error = %e, "stream ended by an error");
                    (encoder.error(e), true)
                }
            };
            if send_all(&tx, events).await.is_err() || last {
                return;
            }
        }
    });
    let mut response = Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response();
    if let Some(v) = warnings {
        response.headers_mut().insert(WARNINGS_HEADER, v);
    }
    response
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

pub async fn collect(mut stream: GenerationStream) -> Result<Collected, ApiError> {
    let mut out = Collected::default();
    loop {
        match stream.next().await? {
            Step::Delta(d) => {
                out.text.push_str(&d.text);
                out.logprobs.extend(d.logprobs);
            }
            Step::Done(done) => {
                out.done = done;
                return Ok(out);
            }
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
#[derive(Debug, Clone, Copy, serde::Deserialize, utoipa::ToSchema)]
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

/// The warnings header's value for these notices: `feature: message` entries separated by
/// "; ", as visible ASCII (header values must be).
fn warnings_header(notices: &[pb::Notice]) -> Option<axum::http::HeaderValue> {
    if notices.is_empty() {
        return None;
    }
    let text: Vec<String> = notices
        .iter()
        .map(|n| format!("{}: {}", n.feature, n.message))
        .collect();
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
    axum::http::HeaderValue::from_str(&ascii).ok()
}

/// A non-streaming response as JSON, with its extension fields and the warnings header.
pub fn respond(mut body: serde_json::Value, done: &pb::GenerateDone) -> Response {
    use axum::response::IntoResponse;
    annotate(&mut body, done);
    let mut response = axum::Json(body).into_response();
    if let Some(v) = warnings_header(&done.notices) {
        response.headers_mut().insert(WARNINGS_HEADER, v);
    }
    response
}

#[cfg(test)]
mod body_tests {
    use super::*;

    #[test]
    fn json_values_are_counted_outside_strings_only() {
        assert_eq!(count_json_values(b"{}"), 2);
        assert_eq!(count_json_values(br#"{"a": [1, 2, 3]}"#), 5);
        // Brackets and commas inside strings, escaped quotes included, are text.
        assert_eq!(count_json_values(br#"{"a": "[,{,\",]"}"#), 2);
        let many: String = format!("[{}]", vec!["{}"; 1000].join(","));
        assert!(count_json_values(many.as_bytes()) >= 1000);
    }

    #[tokio::test]
    async fn a_body_of_too_many_values_is_refused_before_it_is_parsed() {
        let body = format!("[{}]", vec!["0"; MAX_JSON_VALUES + 1].join(","));
        let e = parse_json::<serde_json::Value>(body.as_bytes(), Flavor::OpenAi)
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::TooLarge);
        assert!(e.message.contains("JSON values"), "{}", e.message);
        let fine: serde_json::Value = parse_json(b"[0, 1]", Flavor::OpenAi).await.unwrap();
        assert_eq!(fine, serde_json::json!([0, 1]));
    }
}
