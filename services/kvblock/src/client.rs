//! The worker's side of the cache service: a cheap handle over the gRPC channel that fetches
//! blocks the fast way. Blocks in the service's RAM come over gRPC (shared buffers on the
//! service side, one copy through the socket); blocks on disk only come back as file
//! references that this side reads and verifies itself, in parallel, so the payload crosses
//! no socket at all.

use std::path::Path;
use std::time::Duration;

use strata_proto::kvcache::kv_cache_client::KvCacheClient;
use strata_proto::kvcache::{Block, FetchRequest, ReportRequest};
use tonic::transport::Channel;

use crate::block::{self, BlockKey};

/// Largest message (one block) the service accepts or sends, and so the client too.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// Files read at once by one fetch: one per core, 4 to 16 (`STRATA_FILE_READS` sets it, for
/// measuring). Each read copies a block from the page cache into fresh memory and checksums
/// it on one core: on the 16 cores of the lent H100 machine, 4 at once read 3.0 GB/s and 8 at
/// once 3.2-5.5 GB/s (one run each).
fn parallel_file_reads() -> usize {
    static READS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *READS.get_or_init(|| {
        std::env::var("STRATA_FILE_READS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(4, |n| n.get().clamp(4, 16))
            })
    })
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cache service: {0}")]
    Rpc(#[from] tonic::Status),
    #[error("block {index}: {why}")]
    BadBlock { index: usize, why: String },
}

#[derive(Clone)]
pub struct CacheClient {
    rpc: KvCacheClient<Channel>,
}

impl CacheClient {
    pub fn connect(socket: &Path, connect_timeout: Duration) -> Self {
        let rpc = KvCacheClient::new(strata_runtime::uds::channel(socket, connect_timeout))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Self { rpc }
    }

    /// The raw gRPC client, for the calls this wrapper does not cover.
    pub fn rpc(&mut self) -> &mut KvCacheClient<Channel> {
        &mut self.rpc
    }

    /// Tells the service that the file of `key` did not verify (bounded wait; a failure only
    /// means the service finds out on its own later).
    async fn report(&mut self, namespace: &str, key: &BlockKey) {
        let mut req = tonic::Request::new(ReportRequest {
            namespace: namespace.to_string(),
            key: key.0.to_vec(),
        });
        req.set_timeout(Duration::from_secs(1));
        match self.rpc.report(req).await {
            Ok(r) => tracing::info!(dropped = r.into_inner().dropped, "bad block file reported"),
            Err(e) => tracing::warn!(error = %e.message(), "reporting a bad block file failed"),
        }
    }

    /// The leading blocks of `keys` that the service still holds and that verify, in order.
    /// A block that is gone or fails verification ends the prefix (the caller computes the
    /// rest): fewer blocks than keys is a partial hit, not an error. With
    /// `Snapshots::LastOnly` (a hybrid model's hit), every block but the last one returned
    /// may carry its K/V part alone (`block::carries_snapshots`).
    pub async fn fetch_prefix(
        &mut self,
        namespace: &str,
        keys: &[BlockKey],
        deadline: Duration,
        snapshots: Snapshots,
    ) -> Result<Vec<Block>, ClientError> {
        let mut out = self
            .fetch_blocks(namespace, keys, deadline, snapshots)
            .await?;
        if let Some(last) = out.last()
            && !block::carries_snapshots(last)
        {
            // The prefix ended early, at a block read without its snapshot: read that one
            // whole. Without it the blocks before give nothing a recurrent layer can resume
            // from.
            let at = out.len() - 1;
            let whole = self
                .fetch_blocks(namespace, &keys[at..=at], deadline, Snapshots::Every)
                .await?;
            match whole.into_iter().next() {
                Some(b) => out[at] = b,
                None => {
                    tracing::warn!(
                        blocks = out.len(),
                        "the last cached block's snapshot could not be read; computing the prompt"
                    );
                    out.clear();
                }
            }
        }
        Ok(out)
    }

    async fn fetch_blocks(
        &mut self,
        namespace: &str,
        keys: &[BlockKey],
        deadline: Duration,
        snapshots: Snapshots,
    ) -> Result<Vec<Block>, ClientError> {
        let mut req = tonic::Request::new(FetchRequest {
            namespace: namespace.to_string(),
            keys: keys.iter().map(|k| k.0.to_vec()).collect(),
            file_reads: true,
            snapshot_of_last_only: snapshots == Snapshots::LastOnly,
        });
        req.set_timeout(deadline);
        strata_runtime::logging::inject(&mut req);
        let mut stream = self.rpc.fetch(req).await?.into_inner();
        let mut pending = std::collections::VecDeque::new();
        let mut out = Vec::with_capacity(keys.len());
        let mut index = 0;
        let mut ended = false;
        let parallel = parallel_file_reads();
        loop {
            // Keep up to `parallel` reads going while more messages arrive.
            while !ended && pending.len() < parallel {
                let message = match stream.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => {
                        ended = true;
                        break;
                    }
                    // NotFound ends the held prefix; anything else is reported.
                    Err(s) if s.code() == tonic::Code::NotFound => {
                        ended = true;
                        break;
                    }
                    Err(s) => return Err(s.into()),
                };
                let Some(&key) = keys.get(index) else {
                    return Err(ClientError::BadBlock {
                        index,
                        why: "more blocks than keys".into(),
                    });
                };
                let whole = snapshots == Snapshots::Every || index + 1 == keys.len();
                index += 1;
                let namespace = namespace.to_string();
                pending.push_back(tokio::task::spawn_blocking(move || {
                    resolve(message, &key, &namespace, whole)
                }));
            }
            let Some(next) = pending.pop_front() else {
                break;
            };
            match next.await {
                Ok(Ok(block)) => out.push(block),
                Ok(Err(bad)) => {
                    tracing::warn!(why = bad.why, "cache block unusable; computing from here");
                    if bad.from_file {
                        self.report(namespace, &keys[out.len()]).await;
                    }
                    break;
                }
                Err(e) => {
                    return Err(ClientError::BadBlock {
                        index: out.len(),
                        why: e.to_string(),
                    });
                }
            }
        }
        Ok(out)
    }
}

/// Which fetched blocks must carry their recurrent snapshots (hybrid models' blocks end with
/// them; attention-only models' have none, and both values fetch the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Snapshots {
    Every,
    /// A hit resumes the recurrent layers from its last block: the others are read without
    /// their snapshots (for Qwen3.6-35B-A3B's shape at 2048-token blocks, 62% of the bytes).
    LastOnly,
}

/// A fetched message as a verified block: read from its file when the service sent a
/// reference, and checked either way (key, namespace, checksum): the worker trusts nothing it
/// did not verify. `whole`: the block must carry its snapshots; otherwise its K/V part alone
/// is read where that can be verified on its own.
fn resolve(
    message: Block,
    key: &BlockKey,
    namespace: &str,
    whole: bool,
) -> Result<Block, Unusable> {
    let bad = |why: String, from_file: bool| Unusable { why, from_file };
    let block = match &message.file {
        Some(file) => {
            let path = Path::new(&file.path);
            let read = if whole {
                block::read_file_verified(path, key)
            } else {
                block::read_file_kv_verified(path, key)
            };
            read.map_err(|e| bad(format!("{}: {e}", file.path), true))?
        }
        None => {
            let verified = if whole || block::carries_snapshots(&message) {
                block::verify(&message)
            } else {
                block::verify_kv_part(&message)
            };
            match verified {
                Ok(k) if k == *key => {}
                Ok(_) => return Err(bad("the service sent another block".into(), false)),
                Err(e) => return Err(bad(e.to_string(), false)),
            }
            message
        }
    };
    match block.header.as_ref() {
        Some(h) if h.namespace == namespace => Ok(block),
        _ => Err(bad("block of another namespace".into(), false)),
    }
}

/// Why a fetched block was not used, and whether it was read from a file (then the service,
/// which has not seen the bad bytes, is told).
struct Unusable {
    why: String,
    from_file: bool,
}
