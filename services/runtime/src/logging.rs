//! Logging and tracing set-up. `RUST_LOG` decides the filter (default `info`); logs go to
//! stderr so that a supervisor can capture a child's output. With an OTLP endpoint, spans are
//! also exported over OTLP/gRPC (off otherwise). The OpenTelemetry layer is part of the
//! subscriber from the start: installed later through `reload`, it would hide itself from
//! `tracing-opentelemetry`'s context lookups, and no trace context would cross a process.

use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The environment variable that carries the OTLP endpoint to child processes.
pub const OTLP_ENDPOINT_ENV: &str = "STRATA_OTLP_ENDPOINT";

/// Installs the global subscriber once, without trace export; later calls are ignored (tests
/// call it repeatedly).
pub fn init(process: &str) {
    install(process, None);
}

/// Installs the global subscriber, exporting spans to `endpoint` (OTLP/gRPC, e.g.
/// `http://127.0.0.1:4317`) as service `service` when one is given. Call inside the tokio
/// runtime: the exporter's gRPC channel lives on it. An exporter that cannot be built is logged
/// and tracing goes on without it; an unreachable collector costs a warning per batch.
pub fn init_with_traces(
    process: &str,
    service: &str,
    endpoint: Option<&str>,
) -> Option<TraceExport> {
    let Some(endpoint) = endpoint else {
        install(process, None);
        return None;
    };
    match provider(service, endpoint) {
        Ok(provider) => {
            install(process, Some(provider.clone()));
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            tracing::info!(service, endpoint, "exporting traces over OTLP");
            Some(TraceExport { provider })
        }
        Err(why) => {
            install(process, None);
            tracing::error!(endpoint, %why, "traces are NOT exported");
            None
        }
    }
}

/// `init_with_traces` with the endpoint from `STRATA_OTLP_ENDPOINT` (how the gateway hands
/// it to the processes it starts).
pub fn init_from_env(process: &str, service: &str) -> Option<TraceExport> {
    let endpoint = std::env::var(OTLP_ENDPOINT_ENV).ok();
    init_with_traces(process, service, endpoint.as_deref())
}

fn install(process: &str, provider: Option<SdkTracerProvider>) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let otel = provider.map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("strata")));
    let installed = tracing_subscriber::registry()
        .with(otel)
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_target(false),
        )
        .try_init()
        .is_ok();
    if installed {
        tracing::debug!(process, "logging initialised");
    }
}

fn provider(service: &str, endpoint: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(3))
        .build()
        .map_err(|e| e.to_string())?;
    // Half a second between batches: traces show up promptly in the UI (and in tests).
    let batches = BatchConfigBuilder::default()
        .with_scheduled_delay(Duration::from_millis(500))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(
            BatchSpanProcessor::builder(exporter)
                .with_batch_config(batches)
                .build(),
        )
        .with_resource(
            // service.instance.id tells the processes of one service apart (a restarted
            // worker is a new instance); Jaeger groups spans by it.
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service.to_string())
                .with_attribute(opentelemetry::KeyValue::new(
                    "service.instance.id",
                    format!("{service}-{}", std::process::id()),
                ))
                .build(),
        )
        .build())
}

/// Exports spans while it lives; flushes and stops when dropped.
pub struct TraceExport {
    provider: SdkTracerProvider,
}

impl Drop for TraceExport {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "flushing traces failed");
        }
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            value.parse(),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Puts the current span's W3C trace context (`traceparent`) into an outgoing gRPC request.
pub fn inject<T>(req: &mut tonic::Request<T>) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetadataInjector(req.metadata_mut()))
    });
}

/// Makes `span` a child of the trace context an incoming gRPC request carries, if any.
pub fn adopt_parent(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)));
    let _ = span.set_parent(cx);
}
