//! The admin API (`/admin/api/…`): worker states and restarts, cache statistics and clearing.
//! It needs the admin token (`Authorization: Bearer TOKEN`) and answers only loopback clients.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use strata_proto::kvcache::kv_cache_client::KvCacheClient;
use strata_proto::kvcache::{self as kv};
use tokio::sync::mpsc;

use super::AppState;
use super::error::{ApiError, ErrorKind};
use crate::supervisor::Control;

#[derive(Clone)]
pub struct AdminState {
    pub token: Arc<String>,
    /// Restarts the cache service, when this gateway supervises it.
    pub kvcache_control: Option<mpsc::Sender<Control>>,
    pub kvcache_socket: PathBuf,
}

pub fn router(state: AppState) -> Router<AppState> {
    Router::new()
        .route("/admin/api/workers", get(workers))
        .route("/admin/api/workers/{name}/restart", post(restart))
        .route("/admin/api/models/{id}/{action}", post(model_action))
        .route("/admin/api/cache/stats", get(cache_stats))
        .route("/admin/api/cache/clear", post(cache_clear))
        .route("/admin/api/cache/probe", post(cache_probe))
        .route("/admin/api/dashboard", get(dashboard))
        .route_layer(middleware::from_fn_with_state(state, require_admin))
}

async fn require_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let loopback = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .is_none_or(|ci| ci.0.ip().is_loopback());
    if !loopback {
        return ApiError::new(ErrorKind::NotFound, "no such route").into_response();
    }
    let token = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match token {
        Some(t) if super::constant_time_eq(t.as_bytes(), state.admin.token.as_bytes()) => {
            next.run(req).await
        }
        _ => ApiError::new(
            ErrorKind::Authentication,
            "the admin API needs Authorization: Bearer ADMIN_TOKEN (see the run dir's admin-token file)",
        )
        .into_response(),
    }
}

async fn workers(State(state): State<AppState>) -> Json<Value> {
    let mut out: Vec<Value> = state
        .kvcache
        .iter()
        .map(|k| serde_json::to_value(&*k.borrow()).unwrap_or(Value::Null))
        .collect();
    for m in state.registry.models() {
        let mut v = match m.state() {
            Some(s) => serde_json::to_value(&s).unwrap_or(Value::Null),
            None => json!({"name": m.worker_name(), "kind": "worker", "phase": "unloaded"}),
        };
        v["loaded"] = json!(m.state().is_some());
        if let Ok(mut client) = m.ready_client() {
            let mut req = tonic::Request::new(strata_proto::worker::StatsRequest {});
            req.set_timeout(Duration::from_secs(1));
            if let Ok(s) = client.stats(req).await {
                let s = s.into_inner();
                v["stats"] = json!({
                    "requests_total": s.requests_total,
                    "requests_failed": s.requests_failed,
                    "queue_depth": s.queue_depth,
                    "queue_capacity": s.queue_capacity,
                    "running": s.running,
                    "max_batch": s.max_batch,
                    "prompt_tokens_total": s.prompt_tokens_total,
                    "generated_tokens_total": s.generated_tokens_total,
                    "decode_batch_histogram": s.decode_batch_histogram.iter()
                        .map(|(k, v)| (k.to_string(), json!(v)))
                        .collect::<serde_json::Map<_, _>>(),
                    "resident_bytes": s.resident_bytes,
                    "memory_budget_bytes": s.memory_budget_bytes,
                    "features": s.features.iter().collect::<std::collections::BTreeMap<_, _>>(),
                    "prefix_cache": s.prefix_cache.map(|p| json!({
                        "lookups": p.lookups,
                        "lookup_failures": p.lookup_failures,
                        "blocks_fetched": p.blocks_fetched,
                        "partial_hits": p.partial_hits,
                        "blocks_stored": p.blocks_stored,
                        "blocks_store_dropped": p.blocks_store_dropped,
                        "store_failures": p.store_failures,
                        "fetches_skipped_by_cost": p.fetches_skipped_by_cost,
                        "fetch_bytes_per_sec": p.fetch_bytes_per_sec,
                        "prefill_tokens_per_sec": p.prefill_tokens_per_sec,
                        "parked_caches": p.parked_caches,
                        "parked_bytes": p.parked_bytes,
                        "parked_resumes": p.parked_resumes,
                        "parked_resumed_tokens": p.parked_resumed_tokens,
                        "parked_evicted": p.parked_evicted,
                        "parked_refused": p.parked_refused,
                        "snapshot_bytes_skipped": p.snapshot_bytes_skipped,
                    })),
                });
            }
        }
        // Features requests asked for and did not get (thinking, context edits, clamped
        // max_tokens, …), counted by the gateway whichever side decided it.
        v["not_applied"] = super::metrics::not_applied_json(&m.id);
        v["model"] = json!({"model": m.id, "aliases": m.aliases, "kind": m.kind,
                            "pinned": m.pinned(), "path": m.path,
                            "memory_bytes": m.memory_bytes, "in_flight": m.in_flight()});
        out.push(v);
    }
    Json(json!({
        "workers": out,
        "models_memory": {
            "budget_bytes": state.registry.budget_bytes(),
            "used_bytes": state.registry.used_bytes(),
        },
    }))
}

async fn dashboard() -> Json<Value> {
    Json(super::metrics::dashboard_json())
}

async fn restart(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    // A worker name or a model id; "kvcache" for the cache service when it is ours.
    let (target, control) = match state.registry.find(&name) {
        Some(m) => (
            m.worker_name().to_string(),
            m.control().ok_or_else(|| {
                ApiError::new(
                    ErrorKind::InvalidRequest,
                    format!("model {} is not loaded", m.id),
                )
            })?,
        ),
        None if name == "kvcache" => (
            name.clone(),
            state.admin.kvcache_control.clone().ok_or_else(|| {
                ApiError::invalid(
                    "the cache service is run by the system (launchd/systemd), not by this gateway",
                )
            })?,
        ),
        None => {
            return Err(ApiError::new(
                ErrorKind::NotFound,
                format!("no worker named {name:?}"),
            ));
        }
    };
    control
        .send(Control::Restart)
        .await
        .map_err(|_| ApiError::new(ErrorKind::Overloaded, "the gateway is shutting down"))?;
    Ok(Json(json!({"restarting": target})).into_response())
}

/// load | unload | pin | unpin, acting on the model's worker process.
async fn model_action(
    State(state): State<AppState>,
    Path((id, action)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let model = state.registry.find(&id).ok_or_else(|| {
        ApiError::new(
            ErrorKind::NotFound,
            format!("no model {id:?} is configured"),
        )
    })?;
    let changed = match action.as_str() {
        "load" => state.registry.load(&model).await?,
        "unload" => {
            if model.pinned() {
                return Err(ApiError::new(
                    ErrorKind::InvalidRequest,
                    format!("model {id} is pinned; unpin it before unloading"),
                ));
            }
            model.unload().await
        }
        "pin" => {
            let was = model.pinned();
            model.set_pinned(true);
            !was
        }
        "unpin" => {
            let was = model.pinned();
            model.set_pinned(false);
            was
        }
        other => {
            return Err(ApiError::new(
                ErrorKind::NotFound,
                format!("unknown action {other:?} (load, unload, pin, unpin)"),
            ));
        }
    };
    Ok(Json(json!({
        "model": model.id,
        "action": action,
        "changed": changed,
        "loaded": model.state().is_some(),
        "pinned": model.pinned(),
    }))
    .into_response())
}

pub(crate) fn kv_client(state: &AppState) -> KvCacheClient<tonic::transport::Channel> {
    KvCacheClient::new(strata_runtime::uds::channel(
        &state.admin.kvcache_socket,
        Duration::from_secs(2),
    ))
}

fn tier(t: Option<kv::TierStats>) -> Value {
    let t = t.unwrap_or_default();
    json!({"blocks": t.blocks, "bytes": t.bytes, "hits": t.hits, "evictions": t.evictions})
}

async fn cache_stats(State(state): State<AppState>) -> Result<Response, ApiError> {
    let mut req = tonic::Request::new(kv::StatsRequest {});
    req.set_timeout(Duration::from_secs(5));
    let s = kv_client(&state)
        .stats(req)
        .await
        .map_err(|e| {
            ApiError::new(
                ErrorKind::Overloaded,
                format!("cache service: {}", e.message()),
            )
        })?
        .into_inner();
    Ok(Json(json!({
        "ram": tier(s.ram),
        "disk": tier(s.disk),
        "misses": s.misses,
        "corrupt_blocks": s.corrupt_blocks,
        "disk_bytes_written": s.disk_bytes_written,
        "disk_bytes_written_today": s.disk_bytes_written_today,
        "disk_write_budget_bytes": s.disk_write_budget_bytes,
        "disk_write_budget_left": s.disk_write_budget_left,
        "ram_limit_bytes": s.ram_limit_bytes,
        "disk_limit_bytes": s.disk_limit_bytes,
        "stores_refused": s.stores_refused,
        "disk_write_failures": s.disk_write_failures,
        "writes_deferred": s.writes_deferred,
        "evicted_unwritten": s.evicted_unwritten,
        "disk_degraded": s.disk_degraded,
        "namespaces": s.namespaces.into_iter().map(|n| json!({
            "namespace": n.namespace,
            "ram": tier(n.ram),
            "disk": tier(n.disk),
            "misses": n.misses,
            "disk_quota_bytes": n.disk_quota_bytes,
        })).collect::<Vec<_>>(),
        "namespaces_omitted": s.namespaces_omitted,
    }))
    .into_response())
}

/// Body: `{"model": ID, "messages": [...]}` (a chat, as for chat completions) or
/// `{"model": ID, "prompt": "..."}`: where each full block of that prompt is cached now.
async fn cache_probe(
    State(state): State<AppState>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Probe {
        model: String,
        messages: Option<Vec<Value>>,
        prompt: Option<String>,
        cache_salt: Option<String>,
    }
    let req: Probe =
        super::generation::read_json(body, state.max_body_bytes, super::error::Flavor::OpenAi)
            .await?;
    let model = state.registry.resolve(&req.model)?;
    let input = match (req.messages, req.prompt) {
        (Some(messages), None) => {
            let vision = model.kind == crate::config::ModelKind::Vlm;
            let (messages, sources) = super::openai::normalize_messages(messages, vision)?;
            let images =
                super::images::load(sources, &state.images, super::error::Flavor::OpenAi).await?;
            strata_proto::worker::prompt::Input::Chat(strata_proto::worker::Chat {
                messages_json: Value::Array(messages).to_string(),
                tools_json: String::new(),
                add_generation_prompt: true,
                images,
            })
        }
        (None, Some(text)) => strata_proto::worker::prompt::Input::Text(text),
        _ => return Err(ApiError::invalid("send either messages or prompt")),
    };
    let mut client = model.ready_client()?;
    let mut probe = tonic::Request::new(strata_proto::worker::ProbeRequest {
        prompt: Some(strata_proto::worker::Prompt { input: Some(input) }),
        cache_salt: super::cache_salt(None, req.cache_salt.as_deref()),
    });
    probe.set_timeout(Duration::from_secs(30));
    let r = client
        .probe(probe)
        .await
        .map_err(|e| super::error::from_worker_status(&e))?
        .into_inner();
    let body = r.prompt_tokens.saturating_sub(1);
    let leading = r.blocks.iter().take_while(|t| *t != "none").count() as u32 * r.block_tokens;
    let mut usable = leading.min(body / r.block_tokens * r.block_tokens);
    let partial = if r.partial_tokens > 0 {
        usable += r.partial_tokens;
        json!({"tier": r.partial_tier, "tokens": r.partial_tokens})
    } else {
        Value::Null
    };
    Ok(Json(json!({
        "model": model.id,
        "prompt_tokens": r.prompt_tokens,
        "block_tokens": r.block_tokens,
        "blocks": r.blocks,
        "partial": partial,
        "cached_prefix_tokens": usable,
    }))
    .into_response())
}

/// Body: `{"model": "ID"}` clears that model's blocks (its namespace is its fingerprint);
/// `{}` clears everything.
async fn cache_clear(
    State(state): State<AppState>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize, Default)]
    struct Clear {
        model: Option<String>,
    }
    let req: Clear = super::generation::read_json(body, 4096, super::error::Flavor::OpenAi)
        .await
        .or_else(|e| {
            if e.message.contains("empty") {
                Ok(Clear::default())
            } else {
                Err(e)
            }
        })?;
    let model_name = req.model.clone();
    let namespace = match &req.model {
        Some(name) => {
            let model = state.registry.resolve(name)?;
            let mut client = model.ready_client()?;
            client
                .info(strata_proto::worker::InfoRequest {})
                .await
                .map_err(|e| super::error::from_worker_status(&e))?
                .into_inner()
                .fingerprint
        }
        None => String::new(),
    };
    let mut req = tonic::Request::new(kv::ClearRequest {
        namespace: namespace.clone(),
    });
    req.set_timeout(Duration::from_secs(30));
    let removed = kv_client(&state)
        .clear(req)
        .await
        .map_err(|e| {
            ApiError::new(
                ErrorKind::Overloaded,
                format!("cache service: {}", e.message()),
            )
        })?
        .into_inner()
        .blocks_removed;
    // The workers' own RAM tiers too: the named model's, or every running worker's.
    let models = match &model_name {
        Some(name) => vec![state.registry.resolve(name)?],
        None => state.registry.models().to_vec(),
    };
    let mut l0_removed = 0;
    for model in models {
        // A worker that is not running holds no L0.
        let Ok(mut client) = model.ready_client() else {
            continue;
        };
        let mut clear = tonic::Request::new(strata_proto::worker::ClearCacheRequest {});
        clear.set_timeout(Duration::from_secs(10));
        match client.clear_cache(clear).await {
            Ok(r) => l0_removed += r.into_inner().blocks_removed,
            Err(e) => {
                return Err(ApiError::new(
                    ErrorKind::Overloaded,
                    format!("worker of {}: {}", model.id, e.message()),
                ));
            }
        }
    }
    Ok(
        Json(json!({"namespace": namespace, "blocks_removed": removed,
                   "l0_blocks_removed": l0_removed}))
        .into_response(),
    )
}
