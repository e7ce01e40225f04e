//! What the gateway, the worker and the cache service share as processes: how they log, how
//! they learn that they must stop, and how they talk gRPC to each other over Unix sockets.

pub mod logging;
pub mod memory;
pub mod model_kind;
pub mod parent;
pub mod private;
pub mod shutdown;
pub mod uds;
