//! `strata-kvcache`: holds KV blocks for every worker and outlives them (DESIGN.md sections 2-4).

pub mod bench;
// The block format and the client live in their own crate (workers use them without the
// store); re-exported so that `strata_kvcache::block` stays a path.
pub use strata_kvblock::{block, client};
pub mod grpc;
pub mod store;
