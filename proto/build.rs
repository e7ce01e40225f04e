fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_prost_build::configure()
        // Payloads are megabytes: `Bytes` lets the RAM tier hand out shared buffers instead
        // of copying each block into every response.
        .bytes(".strata.kvcache.v1.Block.payload")
        .compile_protos(&["strata/kvcache.proto", "strata/worker.proto"], &["."])?;
    Ok(())
}
