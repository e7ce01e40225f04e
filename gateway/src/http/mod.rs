//! The gateway's HTTP surface. For now: `/health`, which reports every supervised child.
//! The OpenAI and Anthropic APIs join here with the gateway issue.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json};
use axum::routing::get;
use serde::Serialize;
use tokio::sync::watch;

use crate::supervisor::{ChildState, Phase};

/// Shared, cheap-to-clone handles the HTTP handlers read.
#[derive(Clone)]
pub struct AppState {
    pub children: Vec<watch::Receiver<ChildState>>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/health", get(health))
        .with_state(state)
}

#[derive(Serialize)]
struct HealthBody {
    /// "ok" when every child is ready, else "degraded".
    status: &'static str,
    version: &'static str,
    children: Vec<ChildState>,
}

async fn health(State(state): State<AppState>) -> impl IntoResponse {
    let children: Vec<ChildState> = state.children.iter().map(|c| c.borrow().clone()).collect();
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
