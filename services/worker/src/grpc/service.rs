use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use strata_proto::worker::worker_server::Worker;
use strata_proto::worker::{
    self as pb, EmbedRequest, EmbedResponse, GenerateEvent, HealthRequest, HealthResponse,
    InfoRequest, InfoResponse, StatsRequest, StatsResponse, TokenizeRequest, TokenizeResponse,
    generate_event, prompt,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::embedder::Embedder;
use crate::engine::EngineError;
use crate::engine::generate::{FinishReason, GenerateRequest};
use crate::engine::multimodal::{ImageInput, PromptImage, cache_tokens};
use crate::engine::sample::{Sampled, SamplingParams};
use crate::grammar::{Constraint, GrammarEngine};
use crate::prefix_cache::PrefixCache;
use crate::scheduler::{JobEvent, Scheduler, SubmitError};
use crate::template::{ChatMessage, ChatTemplate};
use crate::tokenizer::{Span, Tokenizer};

/// What the worker serves, fixed at start-up.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub model_path: Option<PathBuf>,
    pub mlx_version: String,
    pub device: String,
}

/// The loaded model as the handlers see it: shared read-only parts, and the engine handle.
pub struct Serving {
    pub model_id: String,
    pub info: InfoResponse,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub scheduler: Scheduler,
    /// The cache service, when the worker was given its socket.
    pub prefix_cache: Option<PrefixCache>,
    /// Largest prompt + max_tokens accepted (the model's context).
    pub context_length: usize,
    pub kv_layout: crate::engine::kv::KvLayout,
    pub admission: crate::admission::Admission,
    /// Optional features and how they are set, for the stats (never a silent "off").
    pub features: Vec<(String, String)>,
    /// Vision-language models: how images enter prompts.
    pub images: Option<ImageInput>,
    /// Structured output's grammar engine, or why this model has none.
    pub grammar: Result<Arc<GrammarEngine>, String>,
}

/// An embedding model as the handlers see it.
pub struct EmbeddingServing {
    pub model_id: String,
    pub info: InfoResponse,
    pub embedder: Embedder,
    pub features: Vec<(String, String)>,
}

/// What this worker serves: a generating model (llm) or an embedding model.
pub enum Served {
    Llm(Box<Serving>),
    Embedding(Box<EmbeddingServing>),
}

pub struct WorkerService {
    info: ModelInfo,
    serving: Option<Arc<Serving>>,
    embedding: Option<Arc<EmbeddingServing>>,
    started: Instant,
}

impl WorkerService {
    pub fn new(info: ModelInfo, served: Option<Served>) -> Self {
        let (serving, embedding) = match served {
            Some(Served::Llm(s)) => (Some(Arc::from(s)), None),
            Some(Served::Embedding(e)) => (None, Some(Arc::from(e))),
            None => (None, None),
        };
        Self {
            info,
            serving,
            embedding,
            started: Instant::now(),
        }
    }

    /// The generating model, or why this worker has none.
    fn serving(&self) -> Result<&Arc<Serving>, Status> {
        if let Some(s) = &self.serving {
            return Ok(s);
        }
        Err(match &self.embedding {
            Some(e) => Status::invalid_argument(format!(
                "model {} is an embedding model; it does not generate text (use /v1/embeddings)",
                e.model_id
            )),
            None => Status::unimplemented("this worker was started without a model"),
        })
    }
}

/// A chat message as the client sent it (OpenAI shape): role, content, and any other fields,
/// which the template may read (tool calls, names).
fn parse_messages(json: &str) -> Result<Vec<ChatMessage>, Status> {
    let raw: Vec<serde_json::Map<String, serde_json::Value>> = serde_json::from_str(json)
        .map_err(|e| Status::invalid_argument(format!("messages: {e}")))?;
    if raw.is_empty() {
        return Err(Status::invalid_argument("messages must not be empty"));
    }
    raw.into_iter()
        .enumerate()
        .map(|(i, mut m)| {
            let role = match m.remove("role") {
                Some(serde_json::Value::String(r)) => r,
                _ => {
                    return Err(Status::invalid_argument(format!(
                        "messages[{i}].role must be a string"
                    )));
                }
            };
            let content = m.remove("content").unwrap_or(serde_json::Value::Null);
            Ok(ChatMessage {
                role,
                content,
                extra: m,
            })
        })
        .collect()
}

impl Serving {
    /// The prompt's text (for a chat: the rendered template), its token ids (each image's
    /// placeholder expanded to its positions) and its images, decoded and preprocessed.
    pub fn tokenize(&self, prompt: Option<pb::Prompt>) -> Result<Tokenized, Status> {
        let input = prompt
            .and_then(|p| p.input)
            .ok_or_else(|| Status::invalid_argument("prompt is missing"))?;
        match input {
            prompt::Input::Text(text) => {
                let ids = self.tokenizer.encode(&text).map_err(internal)?;
                Ok(Tokenized::text(text, ids))
            }
            prompt::Input::TokenIds(ids) => Ok(Tokenized::text(String::new(), ids.ids)),
            prompt::Input::Chat(chat) => {
                let messages = parse_messages(&chat.messages_json)?;
                let tools = if chat.tools_json.is_empty() {
                    None
                } else {
                    Some(
                        serde_json::from_str::<serde_json::Value>(&chat.tools_json)
                            .map_err(|e| Status::invalid_argument(format!("tools: {e}")))?,
                    )
                };
                // A template without tools gets them, and past calls and results, written
                // into the messages.
                let has_tool_turns = messages.iter().any(|m| {
                    m.role == "tool" || m.extra.get("tool_calls").is_some_and(|c| !c.is_null())
                });
                let (messages, tools) =
                    if !self.template.reads_tools && (tools.is_some() || has_tool_turns) {
                        (crate::template::fold_tools(&messages, tools.as_ref()), None)
                    } else {
                        (messages, tools)
                    };
                let mut notices = Vec::new();
                let text = match self.template.render(
                    &messages,
                    chat.add_generation_prompt,
                    tools.as_ref(),
                ) {
                    Ok(text) => text,
                    // A system message in place (agents put one after the first user turn)
                    // that this template refuses: its text joins the next user message.
                    Err(first) if messages.iter().skip(1).any(|m| m.role == "system") => {
                        let (folded, moved) = crate::template::fold_late_system_messages(&messages);
                        let text = self
                            .template
                            .render(&folded, chat.add_generation_prompt, tools.as_ref())
                            .map_err(|_| Status::invalid_argument(first.to_string()))?;
                        let at: Vec<String> = moved.iter().map(|i| i.to_string()).collect();
                        notices.push(pb::Notice {
                            feature: "system_messages".into(),
                            message: format!(
                                "this model's chat template cannot render a system message after the first message ({first}); the text of the system message(s) at position {} was put at the start of the next user message",
                                at.join(", ")
                            ),
                        });
                        text
                    }
                    // The template rejected the conversation (e.g. a role it does not know).
                    Err(e) => return Err(Status::invalid_argument(e.to_string())),
                };
                // Hybrid models also find where messages end (only where rendering kept the
                // messages as sent: a fold moves text), from each token's byte span: one
                // tokenization either way.
                let find_ends = self.kv_layout.recurrent.is_some()
                    && self.images.is_none()
                    && notices.is_empty();
                let (ids, spans) = if find_ends {
                    let (ids, spans) = self.tokenizer.encode_with_spans(&text).map_err(internal)?;
                    (ids, Some(spans))
                } else {
                    (self.tokenizer.encode(&text).map_err(internal)?, None)
                };
                let Some(input) = &self.images else {
                    if !chat.images.is_empty() {
                        return Err(Status::invalid_argument(format!(
                            "model {} reads text only; it cannot take images",
                            self.model_id
                        )));
                    }
                    let message_ends = match &spans {
                        Some(spans) => self.message_ends(&messages, tools.as_ref(), &text, spans),
                        None => Vec::new(),
                    };
                    return Ok(Tokenized {
                        notices,
                        message_ends,
                        ..Tokenized::text(text, ids)
                    });
                };
                // Images are decoded one after another: the largest one's decode is what
                // admission must hold room for while they are.
                let mut largest = (0, 0);
                for (i, bytes) in chat.images.iter().enumerate() {
                    let cost = input.decode_bytes(bytes).map_err(|e| {
                        Status::invalid_argument(format!("image {}: {}", i + 1, engine_message(e)))
                    })?;
                    if cost > largest.1 {
                        largest = (i, cost);
                    }
                }
                let _decoding = self
                    .admission
                    .reserve_bytes(largest.1, &format!("image {}", largest.0 + 1))
                    .map_err(|e| match e {
                        crate::admission::Refusal::Busy { .. } => {
                            Status::resource_exhausted(e.to_string())
                        }
                        _ => Status::failed_precondition(e.to_string()),
                    })?;
                let images = chat
                    .images
                    .iter()
                    .enumerate()
                    .map(|(i, bytes)| {
                        input.image(bytes).map_err(|e| {
                            Status::invalid_argument(format!(
                                "image {}: {}",
                                i + 1,
                                engine_message(e)
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let ids = input
                    .expand(&ids, images.len())
                    .map_err(|e| Status::invalid_argument(engine_message(e)))?;
                Ok(Tokenized {
                    text,
                    ids,
                    images,
                    notices,
                    message_ends: Vec::new(),
                })
            }
        }
    }

    /// Where a conversation's messages end in its prompt (`spans`: each token's bytes in
    /// `text`), so that a later prompt sharing the conversation up to any message (a system
    /// prompt, a history with a new question, a branch at an earlier turn) resumes exactly
    /// there. A message end counts where the conversation up to it renders to a prefix of
    /// `text` and no token straddles that byte (templates that rewrite earlier turns, or a
    /// token across the end, give none). At most one per block, the last: each costs a partial
    /// block with the recurrent states, so that disk use stays linear in tokens however many
    /// turns a chat has.
    fn message_ends(
        &self,
        messages: &[crate::template::ChatMessage],
        tools: Option<&serde_json::Value>,
        text: &str,
        spans: &[Span],
    ) -> Vec<usize> {
        let mut found = Vec::new();
        for k in 1..messages.len() {
            let Ok(prefix) = self.template.render(&messages[..k], false, tools) else {
                continue;
            };
            if prefix.is_empty() || !text.starts_with(&prefix) {
                continue;
            }
            if let Some(n) = tokens_before(spans, prefix.len())
                && n < spans.len()
            {
                found.push(n);
            }
        }
        last_per_block(found, self.info.block_tokens as usize)
    }

    /// The ids the KV cache knows a prompt by (image positions carry their image's hash).
    fn cache_tokens(&self, t: &Tokenized) -> Result<Vec<u32>, Status> {
        match &self.images {
            Some(i) => cache_tokens(&t.ids, i.image_token, i.image_tokens, &t.images)
                .map_err(|e| Status::invalid_argument(engine_message(e))),
            None => Ok(t.ids.clone()),
        }
    }

    /// A request's constraint, compiled off the async threads (a large schema takes a while).
    async fn compile_constraint(
        &self,
        kind: pb::constraint::Kind,
    ) -> Result<crate::grammar::Guide, Status> {
        // A 400 for the request (this model cannot honour it), never a silent free answer.
        let engine = self.grammar.clone().map_err(|why| {
            Status::invalid_argument(format!(
                "structured output (response_format, forced tool calls) is not available for model {}: {why}",
                self.model_id
            ))
        })?;
        let constraint = match kind {
            pb::constraint::Kind::JsonSchema(text) => Constraint::JsonSchema(
                serde_json::from_str(&text)
                    .map_err(|e| Status::invalid_argument(format!("json schema: {e}")))?,
            ),
            pb::constraint::Kind::Lark(text) => Constraint::Lark(text),
        };
        tokio::task::spawn_blocking(move || engine.compile(&constraint))
            .await
            .map_err(internal)?
            .map_err(|e| Status::invalid_argument(e.to_string()))
    }

    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    fn logprob(&self, s: &Sampled) -> pb::TokenLogprob {
        pb::TokenLogprob {
            token: s.token,
            text: self.token_text(s.token),
            logprob: s.logprob.unwrap_or(0.0),
            top: s
                .top
                .iter()
                .map(|&(token, logprob)| pb::TopLogprob {
                    token,
                    text: self.token_text(token),
                    logprob,
                })
                .collect(),
        }
    }
}

/// A prompt ready for the engine.
pub struct Tokenized {
    pub text: String,
    pub ids: Vec<u32>,
    pub images: Vec<PromptImage>,
    /// What rendering changed in the conversation, for the response.
    pub notices: Vec<pb::Notice>,
    /// Hybrid models: where chat messages end in `ids` (see `GenerateRequest::message_ends`).
    pub message_ends: Vec<usize>,
}

impl Tokenized {
    fn text(text: String, ids: Vec<u32>) -> Self {
        Self {
            text,
            ids,
            images: Vec::new(),
            notices: Vec::new(),
            message_ends: Vec::new(),
        }
    }
}

/// An engine error's message without the "invalid request: " prefix of its Display.
fn engine_message(e: EngineError) -> String {
    match e {
        EngineError::InvalidRequest(m) => m,
        other => other.to_string(),
    }
}

fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

fn sampling(s: Option<pb::Sampling>) -> SamplingParams {
    let Some(s) = s else {
        return SamplingParams::default();
    };
    SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k as usize,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        logprobs: s.logprobs.map(|n| n as usize),
    }
}

fn engine_status(e: EngineError) -> Status {
    match e {
        EngineError::InvalidRequest(m) => Status::invalid_argument(m),
        other => Status::internal(other.to_string()),
    }
}

fn finish_reason(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn health(
        &self,
        _req: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
        // A dead engine thread cannot serve anything: unhealthy, so the supervisor restarts us.
        if let Ok(serving) = self.serving()
            && !serving.scheduler.is_running()
        {
            return Err(Status::unavailable(
                "the engine thread has stopped; this worker cannot generate until it restarts",
            ));
        }
        Ok(Response::new(HealthResponse {
            status: "serving".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            pid: u64::from(std::process::id()),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            mlx_version: self.info.mlx_version.clone(),
            device: self.info.device.clone(),
            model_path: self
                .info
                .model_path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            prefill_chunk_tokens: self
                .serving()
                .map(|s| s.info.prefill_chunk_tokens)
                .unwrap_or(0),
        }))
    }

    async fn info(&self, _req: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        if let Some(e) = &self.embedding {
            return Ok(Response::new(e.info.clone()));
        }
        Ok(Response::new(self.serving()?.info.clone()))
    }

    async fn tokenize(
        &self,
        req: Request<TokenizeRequest>,
    ) -> Result<Response<TokenizeResponse>, Status> {
        let serving = self.serving()?.clone();
        let prompt = req.into_inner().prompt;
        let t = tokio::task::spawn_blocking(move || serving.tokenize(prompt))
            .await
            .map_err(internal)??;
        Ok(Response::new(TokenizeResponse {
            count: t.ids.len() as u32,
            ids: t.ids,
            text: t.text,
        }))
    }

    type GenerateStream = ReceiverStream<Result<GenerateEvent, Status>>;

    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let serving = self.serving()?.clone();
        // One span per request, a child of the gateway's; the engine thread adds queue,
        // prefill and decode under it, the prefix cache its lookup, fetch and store.
        let span = tracing::info_span!(
            "worker.generate",
            otel.kind = "server",
            model = %serving.model_id,
            request_id = %req.get_ref().request_id,
            prompt_tokens = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
            cached_l0 = tracing::field::Empty,
            cached_l1 = tracing::field::Empty,
            cached_l2 = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
        );
        strata_runtime::logging::adopt_parent(&span, req.metadata());
        let req = req.into_inner();
        let request_id = req.request_id.clone();
        let salt = req.cache_salt.clone();
        let prompt = req.prompt;
        let s2 = serving.clone();
        let tokenize_span = tracing::info_span!(parent: &span, "tokenize");
        let tokenized = tokio::task::spawn_blocking(move || {
            let _entered = tokenize_span.enter();
            s2.tokenize(prompt)
        })
        .await
        .map_err(internal)??;
        let key_tokens = serving.cache_tokens(&tokenized)?;
        let Tokenized {
            ids,
            images,
            notices: render_notices,
            message_ends,
            ..
        } = tokenized;
        let prompt_tokens = ids.len();
        span.record("prompt_tokens", prompt_tokens);
        let (max_tokens, clamp_notice) =
            output_budget(serving.context_length, prompt_tokens, req.max_tokens)?;
        if let Some(n) = &clamp_notice {
            tracing::info!(request_id, feature = %n.feature, "not applied: {}", n.message);
        }
        let grammar = match req.constraint.and_then(|c| c.kind) {
            None => None,
            Some(kind) => Some(serving.compile_constraint(kind).await?),
        };
        let request = GenerateRequest {
            grammar,
            prompt: ids,
            max_tokens,
            sampling: sampling(req.sampling),
            stop: req.stop,
            stop_token_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            prefill_breaks: req.prefill_breaks.iter().map(|&b| b as usize).collect(),
            message_ends,
            images,
            speculative: req.speculative,
            prune_keep_ratio: req.prune_keep_ratio,
        };
        // Refuse what the engine would refuse, and what would not fit in memory, before
        // queueing it.
        validate(&serving, &request)?;
        let view = serving.prefix_cache.as_ref().map(|pc| pc.for_tenant(&salt));
        let reserve = || {
            serving
                .admission
                .reserve(request.prompt.len(), request.max_tokens)
        };
        let reservation = match reserve() {
            // Parked caches hold memory only while no request needs it.
            Err(crate::admission::Refusal::Busy { .. })
                if view.as_ref().is_some_and(|v| v.make_room_for(&key_tokens)) =>
            {
                reserve()
            }
            r => r,
        }
        .map_err(|e| {
            tracing::warn!(request_id, "refused: {e}");
            match e {
                crate::admission::Refusal::Busy { .. } => Status::resource_exhausted(e.to_string()),
                _ => Status::failed_precondition(e.to_string()),
            }
        })?;
        // A pruned prompt's KV is not the prompt's KV: it neither reads nor feeds the cache.
        let prepared = match view {
            Some(_) if request.prune_keep_ratio.is_some() => None,
            Some(pc) => Some(pc.prepare(&key_tokens).instrument(span.clone()).await),
            None => None,
        };
        let tiers = prepared.as_ref().map(|p| p.tiers).unwrap_or_default();
        let cache_notice = prepared
            .as_ref()
            .and_then(|p| p.notice.clone())
            .map(|message| {
                tracing::info!(
                    request_id,
                    feature = "prefix_cache",
                    "not applied: {message}"
                );
                pb::Notice {
                    feature: "prefix_cache".into(),
                    message,
                }
            });
        span.record("cached_l0", tiers.l0);
        span.record("cached_l1", tiers.l1);
        span.record("cached_l2", tiers.l2);
        let cost_model = serving.prefix_cache.clone();
        let mut events = serving
            .scheduler
            .submit(request, prepared, span.clone())
            .map_err(|e| match e {
                SubmitError::Busy(_) => Status::resource_exhausted(e.to_string()),
                SubmitError::Stopped => Status::unavailable(e.to_string()),
            })?;
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let started = GenerateEvent {
            event: Some(generate_event::Event::Started(pb::GenerateStarted {
                prompt_tokens: prompt_tokens as u32,
                notices: render_notices.into_iter().chain(clamp_notice).collect(),
                max_tokens: max_tokens as u32,
            })),
        };
        // The channel is empty: this cannot fail for lack of room.
        let _ = tx.try_send(Ok(started));
        tokio::spawn(async move {
            // Held until the job has finished (or its client has gone).
            let _reservation = reservation;
            while let Some(event) = events.recv().await {
                let message = match event {
                    JobEvent::Token(t) => {
                        let logprobs = if t.sampled.logprob.is_some() {
                            vec![serving.logprob(&t.sampled)]
                        } else {
                            Vec::new()
                        };
                        Ok(GenerateEvent {
                            event: Some(generate_event::Event::Delta(pb::TokenDelta {
                                text: t.text,
                                token_ids: vec![t.token],
                                logprobs,
                            })),
                        })
                    }
                    JobEvent::Done { result, queued } => {
                        let result = *result;
                        if let Ok(g) = &result {
                            tracing::debug!(
                                request_id,
                                prompt_tokens = g.prompt_tokens,
                                cached_tokens = g.cached_tokens,
                                queue_ms = queued.as_secs_f64() * 1e3,
                                prefill_ms = g.timings.prefill.as_secs_f64() * 1e3,
                                ttft_ms = g.timings.time_to_first_token.as_secs_f64() * 1e3,
                                "generation done"
                            );
                            span.record("cached_tokens", g.cached_tokens);
                            span.record("completion_tokens", g.tokens.len());
                            span.record("finish_reason", format!("{:?}", g.finish));
                        }
                        if let (Ok(g), Some(pc)) = (&result, &cost_model) {
                            pc.record_prefill(g.prompt_tokens - g.cached_tokens, g.timings.prefill);
                        }
                        result.map_err(engine_status).map(|g| GenerateEvent {
                            event: Some(generate_event::Event::Done(pb::GenerateDone {
                                notices: cache_notice
                                    .iter()
                                    .cloned()
                                    .chain(g.notices.iter().map(|n| pb::Notice {
                                        feature: n.feature.clone(),
                                        message: n.message.clone(),
                                    }))
                                    .collect(),
                                speculation: g.speculation.map(|s| pb::Speculation {
                                    steps: s.steps as u32,
                                    drafted: s.drafted as u32,
                                    accepted: s.accepted as u32,
                                    batched_steps: s.batched_steps as u32,
                                }),
                                pruned_prompt_tokens: g.pruned_tokens as u32,
                                finish_reason: finish_reason(g.finish) as i32,
                                usage: Some(pb::Usage {
                                    prompt_tokens: g.prompt_tokens as u32,
                                    completion_tokens: g.tokens.len() as u32,
                                    cached_tokens: g.cached_tokens as u32,
                                    // Per tier, when every planned block was used (a block
                                    // the engine refused means the prompt was computed).
                                    cached_tokens_l0: tier_tokens(&g, tiers.l0, tiers),
                                    cached_tokens_l1: tier_tokens(&g, tiers.l1, tiers),
                                    cached_tokens_l2: tier_tokens(&g, tiers.l2, tiers),
                                }),
                                timings: Some(pb::Timings {
                                    queue_ms: queued.as_secs_f64() * 1e3,
                                    prefill_ms: g.timings.prefill.as_secs_f64() * 1e3,
                                    decode_ms: g.timings.decode.as_secs_f64() * 1e3,
                                    time_to_first_token_ms: g
                                        .timings
                                        .time_to_first_token
                                        .as_secs_f64()
                                        * 1e3,
                                }),
                            })),
                        })
                    }
                };
                if let Err(e) = &message {
                    tracing::warn!(request_id, error = %e, "generation failed");
                }
                // The gateway dropped the stream: dropping `events` cancels the job.
                if tx.send(message).await.is_err() {
                    tracing::info!(request_id, "client went away; generation cancelled");
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn embed(&self, req: Request<EmbedRequest>) -> Result<Response<EmbedResponse>, Status> {
        let Some(e) = self.embedding.clone() else {
            let serving = self.serving()?;
            return Err(Status::invalid_argument(format!(
                "model {} is a {} model; embeddings need an embedding model",
                serving.model_id, serving.info.kind
            )));
        };
        let req = req.into_inner();
        let dims = e.embedder.dimensions;
        if req.dimensions != 0 && req.dimensions as usize != dims {
            return Err(Status::invalid_argument(format!(
                "model {} makes vectors of {dims} dimensions and was not trained for shorter ones; \
                 leave out dimensions or set it to {dims}",
                e.model_id
            )));
        }
        if req.inputs.is_empty() {
            return Err(Status::invalid_argument("input must not be empty"));
        }
        let span =
            tracing::info_span!("worker.embed", model = %e.model_id, inputs = req.inputs.len());
        let e2 = e.clone();
        let ids = tokio::task::spawn_blocking(move || {
            req.inputs
                .into_iter()
                .enumerate()
                .map(|(i, input)| {
                    let ids = match input.input {
                        Some(pb::embed_input::Input::Text(text)) => e2.embedder.tokenize(&text),
                        Some(pb::embed_input::Input::TokenIds(t)) => Ok(e2.embedder.frame(&t.ids)),
                        None => Err(EngineError::InvalidRequest("the input is empty".into())),
                    }
                    .map_err(|err| Status::invalid_argument(format!("input[{i}]: {err}")))?;
                    // Checked here, so that one bad input never fails a batch it shares.
                    if let Some(bad) = ids.iter().find(|&&t| t as usize >= e2.embedder.vocab_size) {
                        return Err(Status::invalid_argument(format!(
                            "input[{i}]: token id {bad} is outside the vocabulary of {}",
                            e2.embedder.vocab_size
                        )));
                    }
                    if ids.len() > e2.embedder.max_tokens {
                        return Err(Status::invalid_argument(format!(
                            "input[{i}] has {} tokens; model {} takes at most {}",
                            ids.len(),
                            e2.model_id,
                            e2.embedder.max_tokens
                        )));
                    }
                    Ok(ids)
                })
                .collect::<Result<Vec<_>, Status>>()
        })
        .instrument(span.clone())
        .await
        .map_err(internal)??;
        let prompt_tokens = ids.iter().map(|i| i.len() as u32).sum();
        let reply = e.embedder.submit(ids).map_err(|err| match err {
            crate::embedder::SubmitError::Full(_) => Status::resource_exhausted(err.to_string()),
            crate::embedder::SubmitError::Stopped => Status::unavailable(err.to_string()),
        })?;
        let vectors = reply
            .instrument(span)
            .await
            .map_err(|_| Status::internal("the embedding engine dropped the request"))?
            .map_err(|err| match err {
                EngineError::InvalidRequest(why) => Status::invalid_argument(why),
                other => Status::internal(other.to_string()),
            })?;
        Ok(Response::new(EmbedResponse {
            embeddings: vectors
                .into_iter()
                .map(|values| pb::Embedding { values })
                .collect(),
            prompt_tokens,
        }))
    }

    async fn probe(
        &self,
        req: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeResponse>, Status> {
        let serving = self.serving()?.clone();
        let req = req.into_inner();
        let (prompt, salt) = (req.prompt, req.cache_salt);
        let s2 = serving.clone();
        let tokenized = tokio::task::spawn_blocking(move || s2.tokenize(prompt))
            .await
            .map_err(internal)??;
        let ids = serving.cache_tokens(&tokenized)?;
        let (blocks, partial) = match &serving.prefix_cache {
            Some(pc) => pc.for_tenant(&salt).probe(&ids).await,
            None => (
                vec!["none"; ids.len() / serving.info.block_tokens as usize],
                None,
            ),
        };
        Ok(Response::new(pb::ProbeResponse {
            prompt_tokens: ids.len() as u32,
            block_tokens: serving.info.block_tokens,
            blocks: blocks.into_iter().map(String::from).collect(),
            partial_tier: partial.map(|(t, _)| t.to_string()).unwrap_or_default(),
            partial_tokens: partial.map_or(0, |(_, n)| n as u32),
        }))
    }

    async fn clear_cache(
        &self,
        _req: Request<pb::ClearCacheRequest>,
    ) -> Result<Response<pb::ClearCacheResponse>, Status> {
        let blocks_removed = match self.serving() {
            Ok(serving) => serving.prefix_cache.as_ref().map_or(0, |pc| pc.clear_l0()),
            // An embedding worker holds no KV.
            Err(_) => 0,
        };
        tracing::info!(blocks_removed, "L0 cleared");
        Ok(Response::new(pb::ClearCacheResponse { blocks_removed }))
    }

    async fn stats(&self, _req: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        if let Some(e) = &self.embedding {
            let c = &e.embedder.counters;
            return Ok(Response::new(StatsResponse {
                requests_total: c.requests.load(Ordering::Relaxed),
                requests_failed: c.failed.load(Ordering::Relaxed),
                prompt_tokens_total: c.tokens.load(Ordering::Relaxed),
                queue_capacity: e.embedder.queue_capacity as u32,
                // For an embedding model: forward passes by how many inputs ran together.
                decode_batch_histogram: c
                    .batches
                    .lock()
                    .map(|h| h.iter().map(|(k, v)| (*k, *v)).collect())
                    .unwrap_or_default(),
                max_batch: crate::embedder::MAX_BATCH as u32,
                resident_bytes: crate::admission::resident_bytes(),
                memory_budget_bytes: e.info.memory_budget_bytes,
                features: e.features.iter().cloned().collect(),
                ..Default::default()
            }));
        }
        let serving = self.serving()?;
        let c = &serving.scheduler.counters;
        Ok(Response::new(StatsResponse {
            requests_total: c.requests.load(Ordering::Relaxed),
            requests_failed: c.failed.load(Ordering::Relaxed),
            queue_depth: c.queued.load(Ordering::Relaxed) as u32,
            running: c.running.load(Ordering::Relaxed) as u32,
            prompt_tokens_total: c.prompt_tokens.load(Ordering::Relaxed),
            generated_tokens_total: c.generated_tokens.load(Ordering::Relaxed),
            queue_capacity: serving.scheduler.capacity as u32,
            decode_batch_histogram: c
                .decode_batches
                .lock()
                .map(|h| h.iter().map(|(k, v)| (*k, *v)).collect())
                .unwrap_or_default(),
            max_batch: serving.scheduler.max_batch as u32,
            prefix_cache: serving.prefix_cache.as_ref().map(|pc| pc.stats_message()),
            resident_bytes: crate::admission::resident_bytes(),
            memory_budget_bytes: serving.info.memory_budget_bytes,
            features: live_features(serving),
        }))
    }
}

/// The number of tokens before byte `at` of the text, if no token straddles it (bytes no token
/// covers, such as whitespace a tokenizer drops, may lie on either side).
fn tokens_before(spans: &[Span], at: usize) -> Option<usize> {
    let n = spans.partition_point(|&(_, end)| end <= at);
    let clean = spans.get(n).is_none_or(|&(start, _)| start >= at);
    (n > 0 && clean).then_some(n)
}

/// The last of `positions` in each block of `block` tokens, in order.
fn last_per_block(mut positions: Vec<usize>, block: usize) -> Vec<usize> {
    positions.sort_unstable();
    positions.dedup();
    let block = block.max(1);
    let mut out: Vec<usize> = Vec::with_capacity(positions.len());
    for p in positions {
        match out.last_mut() {
            Some(last) if *last / block == p / block => *last = p,
            _ => out.push(p),
        }
    }
    out
}

/// /admin's feature entry of the load-time warm-up (`strata-worker serve --warmup-tokens`).
pub const WARMUP_FEATURE: &str = "kernel_warmup";

/// The features as configured, with what the accelerators did so far.
fn live_features(serving: &Serving) -> std::collections::HashMap<String, String> {
    let c = &serving.scheduler.counters;
    let mut out: std::collections::HashMap<String, String> =
        serving.features.iter().cloned().collect();
    let (drafted, accepted) = (
        c.drafted.load(Ordering::Relaxed),
        c.accepted.load(Ordering::Relaxed),
    );
    if let Some(v) = out.get_mut(crate::engine::speculative::FEATURE)
        && drafted > 0
    {
        v.push_str(&format!(
            "; so far {drafted} tokens drafted, {accepted} accepted ({:.0}%)",
            100.0 * accepted as f64 / drafted as f64
        ));
    }
    let pruned = c.pruned_requests.load(Ordering::Relaxed);
    if let Some(v) = out.get_mut(crate::engine::spec_prefill::FEATURE)
        && pruned > 0
    {
        v.push_str(&format!(
            "; so far {pruned} prompts pruned, {} tokens left out",
            c.pruned_tokens.load(Ordering::Relaxed)
        ));
    }
    if let Some(v) = out.get_mut(WARMUP_FEATURE) {
        match c.warmup_ms.load(Ordering::Relaxed) {
            0 => {}
            ms if c.warmup_failed.load(Ordering::Relaxed) => v.push_str(&format!(
                "; FAILED after {:.1} s (see the log)",
                ms as f64 / 1e3
            )),
            ms => v.push_str(&format!("; took {:.1} s", ms as f64 / 1e3)),
        }
    }
    if let Some(v) = out.get_mut("kv_readback") {
        let (driver, fallback) = (
            crate::device_copy::DRIVER_COPIES.load(Ordering::Relaxed),
            crate::device_copy::FALLBACK_COPIES.load(Ordering::Relaxed),
        );
        if driver + fallback > 0 {
            v.push_str(&format!(
                "; so far {driver} copies by the driver, {fallback} read directly after it failed"
            ));
        }
        let side = crate::device_copy::FAILED_SIDE_COPIES.load(Ordering::Relaxed);
        if side > 0 {
            v.push_str(&format!(
                "; {side} block copies could not use the finisher's own stream (made on the \
                 default stream, which waits for the engine's work)"
            ));
        }
        let (moved, refused) = (
            crate::device_copy::PREFETCHES.load(Ordering::Relaxed),
            crate::device_copy::FAILED_PREFETCHES.load(Ordering::Relaxed),
        );
        if moved + refused > 0 {
            v.push_str(&format!(
                "; imported KV: {moved} buffers moved to the device in bulk, {refused} refused by the driver"
            ));
        }
        let (written, failed) = (
            crate::device_copy::DEVICE_WRITES.load(Ordering::Relaxed),
            crate::device_copy::FAILED_DEVICE_WRITES.load(Ordering::Relaxed),
        );
        if written + failed > 0 {
            v.push_str(&format!(
                "; imported KV: {written} buffers written on the device by the driver, {failed} \
                 written through host pointers after it failed"
            ));
        }
    }
    out
}

fn tier_tokens(
    g: &crate::engine::generate::Generation,
    tokens: usize,
    all: crate::prefix_cache::Tiers,
) -> u32 {
    if all.total() > 0 && g.cached_tokens == all.total() {
        tokens as u32
    } else {
        0
    }
}

/// The tokens a generation may produce: `requested` (0: as many as the context leaves), cut
/// to what the context leaves after the prompt. Agents ask for far more than a local model's
/// context holds (Claude Code sends 32000 for any model it does not know), so a larger value
/// is clamped and reported, and the answer ends with the length finish reason at the cut. A
/// prompt that leaves no room at all is refused, in Anthropic's own wording, which agents look
/// for to compact their history.
fn output_budget(
    context: usize,
    prompt_tokens: usize,
    requested: u32,
) -> Result<(usize, Option<pb::Notice>), Status> {
    let room = context.saturating_sub(prompt_tokens);
    if room == 0 {
        return Err(Status::out_of_range(format!(
            "prompt is too long: {prompt_tokens} tokens > {} maximum (the model's context of {context} tokens must also hold the answer)",
            context.saturating_sub(1)
        )));
    }
    let requested = requested as usize;
    if requested == 0 {
        return Ok((room, None));
    }
    if requested <= room {
        return Ok((requested, None));
    }
    let notice = pb::Notice {
        feature: "max_tokens".into(),
        message: format!(
            "max_tokens {requested} clamped to {room}: the prompt ({prompt_tokens} tokens) leaves {room} of the model's context of {context} tokens"
        ),
    };
    Ok((room, Some(notice)))
}

/// The engine's own request checks, done here so that a bad request never waits in the queue.
fn validate(serving: &Serving, req: &GenerateRequest) -> Result<(), Status> {
    let context = serving.context_length;
    if req.prompt.is_empty() {
        return Err(Status::invalid_argument("the prompt is empty"));
    }
    if req.max_tokens == 0 {
        return Err(Status::invalid_argument("max_tokens must be at least 1"));
    }
    if req.prompt.len() + req.max_tokens > context {
        return Err(Status::out_of_range(format!(
            "prompt ({} tokens) plus max_tokens ({}) exceeds the context of {context} tokens",
            req.prompt.len(),
            req.max_tokens
        )));
    }
    if let Some(ratio) = req.prune_keep_ratio {
        crate::engine::spec_prefill::validate_ratio(ratio).map_err(Status::invalid_argument)?;
    }
    req.sampling.validate().map_err(Status::invalid_argument)
}

#[cfg(test)]
mod tests {
    use super::{last_per_block, output_budget, tokens_before};

    #[test]
    fn a_message_end_counts_only_where_no_token_straddles_it() {
        // A BOS, then tokens over bytes 0..3, 4..7 (a space before it) and 7..12.
        let spans = [(0, 0), (0, 3), (4, 7), (7, 12)];
        assert_eq!(tokens_before(&spans, 3), Some(2));
        assert_eq!(
            tokens_before(&spans, 4),
            Some(2),
            "the space belongs to no token"
        );
        assert_eq!(tokens_before(&spans, 7), Some(3));
        assert_eq!(tokens_before(&spans, 12), Some(4));
        assert_eq!(tokens_before(&spans, 5), None, "inside the token 4..7");
    }

    #[test]
    fn message_ends_keep_the_last_one_of_each_block() {
        assert_eq!(
            last_per_block(vec![300, 20, 90, 600, 310, 90], 256),
            vec![90, 310, 600]
        );
        assert!(last_per_block(Vec::new(), 256).is_empty());
    }

    #[test]
    fn an_output_budget_past_the_context_is_clamped_and_a_full_prompt_is_refused() {
        assert_eq!(output_budget(100, 40, 10).map(|r| r.0).ok(), Some(10));
        assert_eq!(output_budget(100, 40, 0).map(|r| r.0).ok(), Some(60));
        let (n, notice) = output_budget(100, 40, 32000).unwrap_or_default();
        assert_eq!(n, 60);
        let notice = notice.unwrap_or_default();
        assert_eq!(notice.feature, "max_tokens");
        assert!(
            notice.message.contains("32000 clamped to 60"),
            "{}",
            notice.message
        );
        let refused = output_budget(100, 100, 5)
            .err()
            .map(|s| s.message().to_string());
        assert!(
            refused
                .as_deref()
                .is_some_and(|m| m.starts_with("prompt is too long: 100 tokens > 99 maximum")),
            "{refused:?}"
        );
    }
}
