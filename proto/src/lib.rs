//! Strata's wire contracts, generated from the `.proto` files next to this crate.

pub mod kvcache {
    tonic::include_proto!("strata.kvcache.v1");
}

pub mod worker {
    tonic::include_proto!("strata.worker.v1");
}
