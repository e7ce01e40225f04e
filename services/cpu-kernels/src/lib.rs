//! CPU kernels the engine needs and MLX's CPU backend does not provide fast: products of a few
//! rows against a weight matrix, softmax rows, a decode step's attention over the KV cache, and
//! Gated DeltaNet's recurrence.
//! Plain Rust on borrowed f32 slices (no MLX), vectorised by `target_feature` dispatch and
//! spread over the cores with rayon. A crate of its own so that it is optimised in debug
//! builds too (see the workspace profile): the worker's tests run real inference through it.

pub mod activation;
pub mod attention;
pub mod blas;
pub mod gated_delta;
pub mod matmul;
pub mod packed;
pub mod softmax;
/// Pseudo-random inputs shared by this crate's tests and the benches (here and the worker's).
#[doc(hidden)]
pub mod test_values;
