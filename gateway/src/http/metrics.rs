//! `GET /metrics` in Prometheus text format, through the `metrics` facade and its Prometheus
//! exporter. Request counts and latencies come from a middleware; generation metrics (TTFT,
//! inter-token latency, tokens, cached tokens by tier) from the generation stream; the cache
//! service's and the workers' state (tier bytes, evictions, SSD writes and budget, restarts,
//! queue depth) is read from them when Prometheus scrapes, so it is never stale.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use strata_proto::kvcache as kv;
use strata_proto::worker as pb;

use super::AppState;
use crate::supervisor::Phase;

/// Seconds, from a fast L0 hit to a long cold prefill on a CPU.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder (once; later calls reuse it).
pub fn install() -> anyhow::Result<()> {
    if HANDLE.get().is_some() {
        return Ok(());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
        .install_recorder()?;
    let _ = HANDLE.set(handle);
    Ok(())
}

/// Counts every HTTP request by route pattern (not raw path: bounded label values) and status.
pub async fn track(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let started = Instant::now();
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    let labels = [("route", route), ("status", status)];
    counter!("strata_http_requests_total", &labels).increment(1);
    histogram!("strata_http_request_duration_seconds", &labels)
        .record(started.elapsed().as_secs_f64());
    response
}

/// Cumulative prompt and cached tokens per model, for the hit ratio.
fn token_totals() -> &'static Mutex<HashMap<String, (u64, u64)>> {
    static TOTALS: OnceLock<Mutex<HashMap<String, (u64, u64)>>> = OnceLock::new();
    TOTALS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Per model and feature: how many requests asked for it and did not get it, and the last
/// message, for /admin (the gateway's notices and the workers' alike).
type NotApplied = HashMap<String, std::collections::BTreeMap<String, (u64, String)>>;

fn not_applied_totals() -> &'static Mutex<NotApplied> {
    static TOTALS: OnceLock<Mutex<NotApplied>> = OnceLock::new();
    TOTALS.get_or_init(|| Mutex::new(HashMap::new()))
}

fn record_not_applied(model: &str, feature: &str, message: &str) {
    let mut totals = not_applied_totals()
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let entry = totals
        .entry(model.to_string())
        .or_default()
        .entry(feature.to_string())
        .or_default();
    entry.0 += 1;
    entry.1 = message.to_string();
}

/// `{feature: {"requests": n, "last": message}}` for one model, for /admin.
pub fn not_applied_json(model: &str) -> serde_json::Value {
    let totals = not_applied_totals()
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    totals
        .get(model)
        .map(|features| {
            features
                .iter()
                .map(|(f, (n, last))| (f.clone(), serde_json::json!({"requests": n, "last": last})))
                .collect::<serde_json::Map<_, _>>()
        })
        .map(serde_json::Value::Object)
        .unwrap_or_else(|| serde_json::json!({}))
}

/// Watches one generation's events: TTFT at the first token, the gap between later ones,
/// and the usage at the end.
pub struct GenerationMeter {
    model: String,
    started: Instant,
    last: Option<Instant>,
}

impl GenerationMeter {
    pub fn new(model: &str) -> Self {
        Self {
            model: model.to_string(),
            started: Instant::now(),
            last: None,
        }
    }

    pub fn token(&mut self) {
        let now = Instant::now();
        let model = [("model", self.model.clone())];
        match self.last {
            None => histogram!("strata_time_to_first_token_seconds", &model)
                .record((now - self.started).as_secs_f64()),
            Some(prev) => histogram!("strata_inter_token_latency_seconds", &model)
                .record((now - prev).as_secs_f64()),
        }
        self.last = Some(now);
    }

    pub fn done(&self, done: &pb::GenerateDone) {
        let usage = done.usage.unwrap_or_default();
        let usage = &usage;
        record_recent(&self.model, usage, done.timings.as_ref());
        let model = [("model", self.model.clone())];
        counter!("strata_prompt_tokens_total", &model).increment(u64::from(usage.prompt_tokens));
        counter!("strata_completion_tokens_total", &model)
            .increment(u64::from(usage.completion_tokens));
        for (tier, n) in [
            ("l0", usage.cached_tokens_l0),
            ("l1", usage.cached_tokens_l1),
            ("l2", usage.cached_tokens_l2),
        ] {
            counter!("strata_cached_tokens_total", "model" => self.model.clone(), "tier" => tier)
                .increment(u64::from(n));
        }
        counter!("strata_generations_total", "model" => self.model.clone(), "outcome" => "ok")
            .increment(1);
        for n in &done.notices {
            record_not_applied(&self.model, &n.feature, &n.message);
            tracing::info!(model = %self.model, feature = %n.feature, "feature not applied: {}", n.message);
            counter!("strata_feature_not_applied_total", "model" => self.model.clone(), "feature" => n.feature.clone())
                .increment(1);
        }
        counter!("strata_pruned_prompt_tokens_total", &model)
            .increment(u64::from(done.pruned_prompt_tokens));
        if let Some(s) = &done.speculation {
            counter!("strata_speculative_drafted_tokens_total", &model)
                .increment(u64::from(s.drafted));
            counter!("strata_speculative_accepted_tokens_total", &model)
                .increment(u64::from(s.accepted));
        }
        let mut totals = token_totals().lock().unwrap_or_else(|p| p.into_inner());
        let entry = totals.entry(self.model.clone()).or_default();
        entry.0 += u64::from(usage.prompt_tokens);
        entry.1 += u64::from(usage.cached_tokens);
        if entry.0 > 0 {
            gauge!("strata_cache_hit_ratio", &model).set(entry.1 as f64 / entry.0 as f64);
        }
    }

    pub fn failed(&self) {
        counter!("strata_generations_total", "model" => self.model.clone(), "outcome" => "error")
            .increment(1);
    }
}

/// Recent requests per model, for the dashboard (percentiles, speeds, plots over time).
const RECENT_PER_MODEL: usize = 200;

#[derive(Default)]
struct ModelWindow {
    requests: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached: [u64; 3],
    recent: std::collections::VecDeque<Recent>,
}

#[derive(Clone, Copy)]
struct Recent {
    unix: f64,
    ttft_s: f64,
    prompt_tokens: u32,
    cached_tokens: u32,
    prefill_tps: Option<f64>,
    decode_tps: Option<f64>,
}

fn windows() -> &'static Mutex<HashMap<String, ModelWindow>> {
    static WINDOWS: OnceLock<Mutex<HashMap<String, ModelWindow>>> = OnceLock::new();
    WINDOWS.get_or_init(|| Mutex::new(HashMap::new()))
}

fn record_recent(model: &str, usage: &pb::Usage, timings: Option<&pb::Timings>) {
    let t = timings.copied().unwrap_or_default();
    let computed = usage.prompt_tokens.saturating_sub(usage.cached_tokens);
    let rate =
        |tokens: u32, ms: f64| (tokens > 0 && ms > 0.0).then(|| f64::from(tokens) * 1e3 / ms);
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut all = windows().lock().unwrap_or_else(|p| p.into_inner());
    let w = all.entry(model.to_string()).or_default();
    w.requests += 1;
    w.prompt_tokens += u64::from(usage.prompt_tokens);
    w.completion_tokens += u64::from(usage.completion_tokens);
    w.cached[0] += u64::from(usage.cached_tokens_l0);
    w.cached[1] += u64::from(usage.cached_tokens_l1);
    w.cached[2] += u64::from(usage.cached_tokens_l2);
    if w.recent.len() == RECENT_PER_MODEL {
        w.recent.pop_front();
    }
    w.recent.push_back(Recent {
        unix,
        ttft_s: t.time_to_first_token_ms / 1e3,
        prompt_tokens: usage.prompt_tokens,
        cached_tokens: usage.cached_tokens,
        prefill_tps: rate(computed, t.prefill_ms),
        decode_tps: rate(usage.completion_tokens.saturating_sub(1), t.decode_ms),
    });
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let at = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted.get(at).copied()
}

fn median_of(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

/// Per model since the gateway started: requests, tokens, cached tokens by tier; over the
/// recent requests: TTFT p50/p95, median prefill and decode speed, and the points to plot.
pub fn dashboard_json() -> serde_json::Value {
    let all = windows().lock().unwrap_or_else(|p| p.into_inner());
    let models: serde_json::Map<String, serde_json::Value> = all
        .iter()
        .map(|(id, w)| {
            let mut ttft: Vec<f64> = w.recent.iter().map(|r| r.ttft_s).collect();
            ttft.sort_by(f64::total_cmp);
            let value = serde_json::json!({
                "requests": w.requests,
                "prompt_tokens": w.prompt_tokens,
                "completion_tokens": w.completion_tokens,
                "cached_tokens": {"l0": w.cached[0], "l1": w.cached[1], "l2": w.cached[2]},
                "ttft_p50_s": percentile(&ttft, 0.5),
                "ttft_p95_s": percentile(&ttft, 0.95),
                "prefill_tokens_per_s": median_of(w.recent.iter().filter_map(|r| r.prefill_tps)),
                "decode_tokens_per_s": median_of(w.recent.iter().filter_map(|r| r.decode_tps)),
                "recent": w.recent.iter().map(|r| serde_json::json!({
                    "t": r.unix, "ttft_s": r.ttft_s,
                    "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                })).collect::<Vec<_>>(),
            });
            (id.clone(), value)
        })
        .collect();
    serde_json::json!({ "models": models })
}

/// The scrape: refreshes the gauges read from the processes, then renders everything.
pub async fn scrape(State(state): State<AppState>) -> Response {
    refresh_children(&state);
    refresh_cache_service(&state).await;
    refresh_workers(&state).await;
    let body = HANDLE.get().map(|h| h.render()).unwrap_or_default();
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        body,
    )
        .into_response()
}

fn refresh_children(state: &AppState) {
    for child in super::children(state) {
        let process = [("process", child.name.clone())];
        counter!("strata_process_restarts_total", &process).absolute(u64::from(child.restarts));
        gauge!("strata_process_up", &process).set(if child.phase == Phase::Ready {
            1.0
        } else {
            0.0
        });
    }
}

async fn refresh_cache_service(state: &AppState) {
    let mut req = tonic::Request::new(kv::StatsRequest {});
    req.set_timeout(Duration::from_secs(1));
    let Ok(s) = super::admin::kv_client(state).stats(req).await else {
        gauge!("strata_kvcache_reachable").set(0.0);
        return;
    };
    let s = s.into_inner();
    gauge!("strata_kvcache_reachable").set(1.0);
    for (tier, t, limit) in [
        ("ram", s.ram.unwrap_or_default(), s.ram_limit_bytes),
        ("disk", s.disk.unwrap_or_default(), s.disk_limit_bytes),
    ] {
        gauge!("strata_kvcache_bytes", "tier" => tier).set(t.bytes as f64);
        gauge!("strata_kvcache_limit_bytes", "tier" => tier).set(limit as f64);
        gauge!("strata_kvcache_blocks", "tier" => tier).set(t.blocks as f64);
        // Counters of the service's lifetime (they restart with it).
        counter!("strata_kvcache_hits_total", "tier" => tier).absolute(t.hits);
        counter!("strata_kvcache_evictions_total", "tier" => tier).absolute(t.evictions);
    }
    counter!("strata_kvcache_misses_total").absolute(s.misses);
    counter!("strata_kvcache_corrupt_blocks_total").absolute(s.corrupt_blocks);
    counter!("strata_ssd_bytes_written_total").absolute(s.disk_bytes_written);
    gauge!("strata_ssd_bytes_written_today").set(s.disk_bytes_written_today as f64);
    gauge!("strata_ssd_write_budget_bytes").set(s.disk_write_budget_bytes as f64);
    gauge!("strata_ssd_write_budget_left_bytes").set(s.disk_write_budget_left as f64);
}

async fn refresh_workers(state: &AppState) {
    for model in state.registry.models() {
        let Ok(mut client) = model.ready_client() else {
            continue;
        };
        let mut req = tonic::Request::new(pb::StatsRequest {});
        req.set_timeout(Duration::from_secs(1));
        let Ok(s) = client.stats(req).await else {
            continue;
        };
        let s = s.into_inner();
        let id = [("model", model.id.clone())];
        gauge!("strata_queue_depth", &id).set(f64::from(s.queue_depth));
        gauge!("strata_running_sequences", &id).set(f64::from(s.running));
    }
}
