//! The gateway's HTTP surface: OpenAI and Anthropic APIs under `/v1`, the admin API under
//! `/admin/api`, and `/health`. Handlers translate and validate; workers compute.

pub mod admin;
pub mod anthropic;
pub mod embeddings;
pub mod error;
pub mod generation;
pub mod guard;
pub mod images;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod responses;
pub mod serve;
pub mod tools;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use serde::Serialize;
use tokio::sync::watch;

use crate::supervisor::{ChildState, Phase};
use crate::workers::Registry;
use error::{ApiError, ErrorKind, Flavor};

/// Shared, cheap-to-clone handles the HTTP handlers read.
#[derive(Clone)]
pub struct AppState {
    /// The cache service, when this gateway supervises it (None: launchd/systemd owns it).
    pub kvcache: Option<watch::Receiver<ChildState>>,
    pub registry: Registry,
    /// Keys accepted on /v1; empty means open.
    pub api_keys: Arc<Vec<String>>,
    pub admin: admin::AdminState,
    pub request_timeout: Duration,
    pub max_body_bytes: usize,
    pub started_unix: u64,
    /// When each API key is its own cache namespace: the secret its salt is keyed with.
    pub tenant_salt_key: Option<Arc<[u8; 32]>>,
    /// Where images for vision models may come from.
    pub images: Arc<images::ImagePolicy>,
    /// Which hosts and browser origins may use the server.
    pub browser: Arc<guard::BrowserPolicy>,
}

pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route(
            "/v1/responses",
            post(responses::create).get(responses::websocket),
        )
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(v1)
        .merge(admin::router(state.clone()))
        .route("/health", get(health))
        // Connection probes: agents send `HEAD /` or `HEAD /api/hello` (Claude Code) before
        // their first request; answered at once, without a key (they carry none).
        .route("/", get(hello))
        .route("/api/hello", get(hello))
        .route("/openapi.json", get(openapi::document))
        .route("/metrics", get(metrics::scrape))
        // The pages hold no data: their scripts fetch it with the admin token (or API key).
        .route("/admin", get(dashboard_page))
        .route("/admin/chat", get(chat_page))
        .route_layer(middleware::from_fn(metrics::track))
        .route_layer(middleware::from_fn(traced))
        .fallback(not_found)
        // Outermost: a foreign Host or origin, or a body not declared JSON, reaches no route.
        .layer(middleware::from_fn_with_state(
            state.browser.clone(),
            guard::browser_guard,
        ))
        .with_state(state)
}

async fn hello() -> &'static str {
    "Strata is running\n"
}

async fn dashboard_page() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("dashboard.html"))
}

async fn chat_page() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("chat.html"))
}

/// One span per request (the root of its trace), named by the route pattern; the gRPC calls it
/// makes carry its context to the workers.
async fn traced(req: Request, next: Next) -> Response {
    use tracing::Instrument;
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let span = tracing::info_span!(
        "http.request",
        otel.name = %format!("{} {route}", req.method()),
        otel.kind = "server",
        http.request.method = %req.method(),
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
    );
    let response = next.run(req).instrument(span.clone()).await;
    span.record(
        "http.response.status_code",
        u64::from(response.status().as_u16()),
    );
    response
}

/// Anthropic's clients call /v1/messages…; everything else gets OpenAI's error shape.
pub(crate) fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

/// The tenant a request was let in as, when API keys separate tenants' caches: a keyed hash
/// of its API key (the key itself never reaches a worker, and the namespaces and counters
/// derived from it cannot be checked against guessed keys without the secret).
#[derive(Clone)]
pub struct TenantKey(pub String);

impl TenantKey {
    pub fn of(secret: &[u8; 32], api_key: &str) -> Self {
        let hash = blake3::keyed_hash(secret, api_key.as_bytes());
        Self(hash.to_hex()[..32].to_string())
    }
}

/// The cache salt of a request: its tenant's key (when configured so) and its own
/// `cache_salt` field. Empty: the model's blocks are shared by every request.
pub fn cache_salt(tenant: Option<&TenantKey>, requested: Option<&str>) -> String {
    match (tenant, requested.filter(|s| !s.is_empty())) {
        (None, None) => String::new(),
        (Some(t), None) => format!("key:{}", t.0),
        (None, Some(r)) => format!("req:{r}"),
        (Some(t), Some(r)) => format!("key:{}\nreq:{r}", t.0),
    }
}

/// `Authorization: Bearer KEY` (OpenAI SDKs) or `x-api-key: KEY` (Anthropic SDKs).
async fn require_api_key(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    if state.api_keys.is_empty() {
        return next.run(req).await;
    }
    let headers = req.headers();
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    let presented = bearer.or(x_api_key);
    match presented {
        Some(key)
            if state
                .api_keys
                .iter()
                .any(|k| constant_time_eq(k.as_bytes(), key.as_bytes())) =>
        {
            if let Some(secret) = &state.tenant_salt_key {
                let tenant = TenantKey::of(secret, key);
                req.extensions_mut().insert(tenant);
            }
            next.run(req).await
        }
        Some(_) => ApiError::new(ErrorKind::Authentication, "invalid API key")
            .flavor(flavor_of(req.uri().path()))
            .into_response(),
        None => ApiError::new(
            ErrorKind::Authentication,
            "missing API key: send Authorization: Bearer KEY or x-api-key: KEY",
        )
        .flavor(flavor_of(req.uri().path()))
        .into_response(),
    }
}

/// Compares secrets without stopping at the first difference.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> Response {
    ::metrics::counter!("strata_http_requests_total", "route" => "unmatched", "status" => "404")
        .increment(1);
    ApiError::new(
        ErrorKind::NotFound,
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
    .flavor(flavor_of(req.uri().path()))
    .into_response()
}

#[derive(Serialize)]
struct HealthBody {
    /// "ok" when every child is ready, else "degraded".
    status: &'static str,
    version: &'static str,
    children: Vec<ChildState>,
}

/// Every supervised child: the cache service (if ours) and the loaded models' workers.
pub fn children(state: &AppState) -> Vec<ChildState> {
    state
        .kvcache
        .iter()
        .map(|k| k.borrow().clone())
        .chain(state.registry.models().iter().filter_map(|m| m.state()))
        .collect()
}

#[utoipa::path(get, path = "/health", tag = "Operations",
    responses((status = 200, description = "Every process is ready"),
              (status = 503, description = "Some process is starting or restarting")))]
async fn health(State(state): State<AppState>) -> impl IntoResponse {
    let children = children(&state);
    let all_ready = children.iter().all(|c| c.phase == Phase::Ready);
    let code = if all_ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = HealthBody {
        status: if all_ready { "ok" } else { "degraded" },
        version: env!("CARGO_PKG_VERSION"),
        children,
    };
    (code, Json(body))
}
