//! The cache service's gRPC server (`strata.kvcache.v1.KvCache`), served on a Unix socket.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use strata_proto::kvcache::kv_cache_server::KvCache;
use strata_proto::kvcache::{
    Block, BlockLocation, ClearRequest, ClearResponse, FetchRequest, HealthRequest, HealthResponse,
    LookupRequest, LookupResponse, ReportRequest, ReportResponse, StatsRequest, StatsResponse,
    StoreResponse,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::block::{self, BlockKey, Continuation};
use crate::store::Store;

/// Bounds on one request, so that a bad client cannot make the service allocate without limit.
pub const MAX_KEYS_PER_REQUEST: usize = 65_536;
/// Largest message (one block) accepted or sent; the client's own bound.
pub use strata_kvblock::client::MAX_MESSAGE_BYTES;
/// Blocks read ahead of the one being sent in a Fetch.
const FETCH_AHEAD: usize = 4;

/// Payload bytes the service may hold outside the RAM tier at once (blocks read from disk
/// on their way out, blocks received on their way in), across all requests: with the sled
/// cache and the runtime, this keeps peak RSS under `--ram` + 64 MiB whatever the load.
pub const TRANSIENT_BYTES: u64 = 24 << 20;
const PERMIT_UNIT: u64 = 1024;

pub struct KvCacheService {
    store: Store,
    started: Instant,
    transient: Arc<Semaphore>,
}

impl KvCacheService {
    pub fn new(store: Store) -> Self {
        Self {
            store,
            started: Instant::now(),
            transient: Arc::new(Semaphore::new((TRANSIENT_BYTES / PERMIT_UNIT) as usize)),
        }
    }
}

fn units(bytes: u64) -> u32 {
    bytes
        .div_ceil(PERMIT_UNIT)
        .clamp(1, TRANSIENT_BYTES / PERMIT_UNIT) as u32
}

fn try_reserve(budget: &Arc<Semaphore>, bytes: u64) -> Option<OwnedSemaphorePermit> {
    budget.clone().try_acquire_many_owned(units(bytes)).ok()
}

/// Waits until `bytes` more may be held (a block larger than the whole budget waits for all
/// of it, so it is alone).
async fn reserve(budget: &Arc<Semaphore>, bytes: u64) -> Result<OwnedSemaphorePermit, Status> {
    budget
        .clone()
        .acquire_many_owned(units(bytes))
        .await
        .map_err(|_| Status::unavailable("shutting down"))
}

fn keys(raw: &[Vec<u8>]) -> Result<Vec<BlockKey>, Status> {
    if raw.len() > MAX_KEYS_PER_REQUEST {
        return Err(Status::invalid_argument(format!(
            "{} keys in one request (at most {MAX_KEYS_PER_REQUEST})",
            raw.len()
        )));
    }
    raw.iter()
        .enumerate()
        .map(|(i, k)| {
            BlockKey::from_slice(k)
                .ok_or_else(|| Status::invalid_argument(format!("key {i} is not 32 bytes")))
        })
        .collect()
}

fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

impl KvCacheService {
    async fn do_lookup(
        &self,
        req: Request<LookupRequest>,
    ) -> Result<Response<LookupResponse>, Status> {
        let req = req.into_inner();
        let keys = keys(&req.keys)?;
        if req.prompt_tokens.len() > MAX_KEYS_PER_REQUEST * 64 {
            return Err(Status::invalid_argument("prompt_tokens too long"));
        }
        let store = self.store.clone();
        let (found, partial) = tokio::task::spawn_blocking(move || {
            let found = store.lookup(&keys);
            let block = req.block_tokens as usize;
            let partial = if block > 0 && !req.prompt_tokens.is_empty() && !req.namespace.is_empty()
            {
                let parent = found
                    .last()
                    .map(|(k, _)| *k)
                    .unwrap_or_else(|| crate::block::root_of(&req.namespace));
                let tail = req.prompt_tokens.get(found.len() * block..).unwrap_or(&[]);
                let how = if req.common_prefix {
                    Continuation::CommonPrefix
                } else {
                    Continuation::WholePartial {
                        block_tokens: block,
                    }
                };
                store.find_child(&parent, tail, how)
            } else {
                None
            };
            (found, partial)
        })
        .await
        .map_err(internal)?;
        let span = tracing::Span::current();
        span.record("held", found.len());
        span.record(
            "partial_tokens",
            partial.as_ref().map(|p| p.tokens).unwrap_or(0),
        );
        Ok(Response::new(LookupResponse {
            blocks: found
                .into_iter()
                .map(|(k, tier)| BlockLocation {
                    key: k.0.to_vec(),
                    tier: tier as i32,
                    payload_bytes: 0,
                })
                .collect(),
            partial_tokens: partial.as_ref().map(|p| p.tokens as u32).unwrap_or(0),
            partial: partial.map(|p| BlockLocation {
                key: p.key.0.to_vec(),
                tier: p.tier as i32,
                payload_bytes: 0,
            }),
        }))
    }

    async fn do_fetch(
        &self,
        req: Request<FetchRequest>,
    ) -> Result<Response<ReceiverStream<Result<Block, Status>>>, Status> {
        let req = req.into_inner();
        let keys = keys(&req.keys)?;
        if req.namespace.is_empty() {
            return Err(Status::invalid_argument("namespace is empty"));
        }
        // One block waits in the channel; the budget covers the ones being read.
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let store = self.store.clone();
        let budget = self.transient.clone();
        let namespace: std::sync::Arc<str> = req.namespace.into();
        let file_reads = req.file_reads;
        let last_key = keys.last().copied();
        let snapshot_of_last_only = req.snapshot_of_last_only;
        tokio::spawn(
            async move {
                // Up to FETCH_AHEAD blocks are read at once (disk reads run in parallel and overlap
                // with sending); they are sent in request order.
                let mut pending = std::collections::VecDeque::new();
                let mut sent = 0u64;
                let mut keys = keys.into_iter().peekable();
                loop {
                    while pending.len() < FETCH_AHEAD {
                        let Some(&key) = keys.peek() else { break };
                        let sizing = store.clone();
                        let size = tokio::task::spawn_blocking(move || sizing.payload_size(&key))
                            .await
                            .ok()
                            .flatten()
                            .unwrap_or(0);
                        // Wait for budget only with nothing in hand; otherwise send what is read
                        // first (waiting while holding permits could starve every stream).
                        let permit = if pending.is_empty() {
                            match reserve(&budget, size).await {
                                Ok(p) => p,
                                Err(_) => return,
                            }
                        } else {
                            match try_reserve(&budget, size) {
                                Some(p) => p,
                                None => break,
                            }
                        };
                        keys.next();
                        let (store, namespace) = (store.clone(), namespace.clone());
                        pending.push_back(tokio::task::spawn_blocking(move || {
                            let found = if file_reads {
                                store.fetch_or_locate(&namespace, &key)
                            } else {
                                store.fetch(&namespace, &key)
                            };
                            let item = match found {
                                // The caller resumes from the last block's snapshot only:
                                // the others' are not sent.
                                Ok(Some(b)) if snapshot_of_last_only && Some(key) != last_key => {
                                    Ok(block::without_snapshots(&b))
                                }
                                Ok(Some(b)) => Ok((*b).clone()),
                                Ok(None) => {
                                    Err(Status::not_found(format!("block {} not held", key.hex())))
                                }
                                Err(e) => Err(internal(e)),
                            };
                            (item, permit)
                        }));
                    }
                    let Some(next) = pending.pop_front() else {
                        break;
                    };
                    let (item, permit) = match next.await {
                        Ok(done) => done,
                        Err(e) => {
                            let _ = tx.send(Err(internal(e))).await;
                            break;
                        }
                    };
                    let stop = item.is_err();
                    if let Ok(b) = &item {
                        sent += 1;
                        let span = tracing::Span::current();
                        span.record("blocks", sent);
                        if b.file.is_some() {
                            span.record("as_files", true);
                        }
                    }
                    // The client went away (dropped the stream): stop reading blocks for it.
                    let gone = tx.send(item).await.is_err();
                    // In the channel now; the encoder takes it next. The budget is released here,
                    // so each stream holds at most two blocks beyond it.
                    drop(permit);
                    if gone || stop {
                        break;
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn do_store(
        &self,
        req: Request<Streaming<Block>>,
    ) -> Result<Response<StoreResponse>, Status> {
        let mut stream = req.into_inner();
        let mut response = StoreResponse::default();
        while let Some(block) = stream.message().await? {
            // The received message plus the copy the RAM tier keeps, while it is made.
            let _permit = reserve(&self.transient, block.payload.len() as u64).await?;
            let store = self.store.clone();
            let result = tokio::task::spawn_blocking(move || store.store(block))
                .await
                .map_err(internal)?;
            match result {
                Ok(()) => response.accepted += 1,
                Err(why) => {
                    response.refused += 1;
                    if response.refusals.len() < 16 {
                        response.refusals.push(why);
                    }
                }
            }
        }
        let span = tracing::Span::current();
        span.record("accepted", response.accepted);
        span.record("refused", response.refused);
        Ok(Response::new(response))
    }
}

#[tonic::async_trait]
impl KvCache for KvCacheService {
    // Each call is one span, a child of the caller's (W3C trace context in the metadata).
    async fn lookup(
        &self,
        req: Request<LookupRequest>,
    ) -> Result<Response<LookupResponse>, Status> {
        let span = tracing::info_span!(
            "kvcache.lookup",
            otel.kind = "server",
            keys = req.get_ref().keys.len(),
            held = tracing::field::Empty,
            partial_tokens = tracing::field::Empty,
        );
        strata_runtime::logging::adopt_parent(&span, req.metadata());
        self.do_lookup(req).instrument(span).await
    }

    type FetchStream = ReceiverStream<Result<Block, Status>>;

    async fn fetch(
        &self,
        req: Request<FetchRequest>,
    ) -> Result<Response<Self::FetchStream>, Status> {
        let span = tracing::info_span!(
            "kvcache.fetch",
            otel.kind = "server",
            keys = req.get_ref().keys.len(),
            blocks = tracing::field::Empty,
            as_files = tracing::field::Empty,
        );
        strata_runtime::logging::adopt_parent(&span, req.metadata());
        self.do_fetch(req).instrument(span).await
    }

    async fn store(
        &self,
        req: Request<Streaming<Block>>,
    ) -> Result<Response<StoreResponse>, Status> {
        let span = tracing::info_span!(
            "kvcache.store",
            otel.kind = "server",
            accepted = tracing::field::Empty,
            refused = tracing::field::Empty,
        );
        strata_runtime::logging::adopt_parent(&span, req.metadata());
        self.do_store(req).instrument(span).await
    }

    async fn stats(&self, _req: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        let store = self.store.clone();
        let stats = tokio::task::spawn_blocking(move || store.stats())
            .await
            .map_err(internal)?;
        Ok(Response::new(stats))
    }

    async fn clear(&self, req: Request<ClearRequest>) -> Result<Response<ClearResponse>, Status> {
        let namespace = req.into_inner().namespace;
        let store = self.store.clone();
        let removed = tokio::task::spawn_blocking(move || store.clear(&namespace))
            .await
            .map_err(internal)?
            .map_err(internal)?;
        Ok(Response::new(ClearResponse {
            blocks_removed: removed,
        }))
    }

    async fn report(
        &self,
        req: Request<ReportRequest>,
    ) -> Result<Response<ReportResponse>, Status> {
        let key = BlockKey::from_slice(&req.into_inner().key)
            .ok_or_else(|| Status::invalid_argument("a key is 32 bytes"))?;
        let store = self.store.clone();
        let dropped = tokio::task::spawn_blocking(move || store.verify_reported(&key))
            .await
            .map_err(internal)?
            .map_err(internal)?;
        Ok(Response::new(ReportResponse { dropped }))
    }

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
