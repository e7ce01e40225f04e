use std::path::PathBuf;
use std::time::Instant;

use strata_proto::worker::worker_server::Worker;
use strata_proto::worker::{HealthRequest, HealthResponse};
use tonic::{Request, Response, Status};

/// What the worker serves, fixed at start-up.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub model_path: Option<PathBuf>,
    pub mlx_version: String,
    pub device: String,
}

pub struct WorkerService {
    info: ModelInfo,
    started: Instant,
}

impl WorkerService {
    pub fn new(info: ModelInfo) -> Self {
        Self {
            info,
            started: Instant::now(),
        }
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn health(
        &self,
        _req: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
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
        }))
    }
}
