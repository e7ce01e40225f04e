//! `strata-kvblock`: what workers and the cache service share of a KV block: its key chain,
//! header and file format, the checks a block must pass before it is served, and the gRPC
//! client of the cache service. The service's store (sled, the tiers) stays in
//! `strata-kvcache`, so that a worker does not link it.

pub mod block;
pub mod client;
