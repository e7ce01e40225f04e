//! `strata-kvcache`: holds KV blocks for every worker and outlives them (DESIGN.md sections 2-4).

pub mod bench;
pub mod block;
pub mod client;
pub mod grpc;
pub mod store;
