//! The cache service's gRPC server (`strata.kvcache.v1.KvCache`), served on a Unix socket.

use std::time::Instant;

use strata_proto::kvcache::kv_cache_server::KvCache;
use strata_proto::kvcache::{HealthRequest, HealthResponse};
use tonic::{Request, Response, Status};

pub struct KvCacheService {
    started: Instant,
}

impl KvCacheService {
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
        }
    }
}

impl Default for KvCacheService {
    fn default() -> Self {
        Self::new()
    }
}

#[tonic::async_trait]
impl KvCache for KvCacheService {
    async fn health(
        &self,
        _req: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(HealthResponse {
            status: "serving".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            pid: u64::from(std::process::id()),
            uptime_ms: self.started.elapsed().as_millis() as u64,
        }))
    }
}
