//! `strata`: the gateway. It never loads a model and never holds KV data; it supervises the
//! cache service and the workers and serves the HTTP APIs.

pub mod config;
pub mod discovery;
pub mod http;
pub mod pull;
pub mod stderr_tail;
pub mod supervisor;
pub mod workers;
