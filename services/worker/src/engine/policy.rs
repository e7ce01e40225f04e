//! The dtype policy: how weights, activations and the KV cache are stored on this device.
//! MLX's CPU backend runs only f32 GEMM fast (OpenBLAS), so on CPU quantised weights are
//! expanded to f32 at load; Metal and CUDA keep them quantised (`quantized_matmul`) with
//! half-precision activations and KV. The policy is part of the model fingerprint: blocks
//! computed under one policy are never served to another.

use std::fmt;
use std::str::FromStr;

use mlx_rs::Dtype;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DtypePolicy {
    /// Keep GGUF / mlx-lm quantised weights packed and multiply with `quantized_matmul`.
    pub quantized_weights: bool,
    /// Activations (and dense weights).
    pub compute: Dtype,
    /// The KV cache, as held live and as stored in blocks.
    pub kv: Dtype,
}

impl DtypePolicy {
    /// CPU: dense f32 everywhere.
    pub const F32: Self = Self {
        quantized_weights: false,
        compute: Dtype::Float32,
        kv: Dtype::Float32,
    };
    /// Metal / CUDA: quantised weights, f16 activations and KV.
    pub const QUANTIZED_F16: Self = Self {
        quantized_weights: true,
        compute: Dtype::Float16,
        kv: Dtype::Float16,
    };
    /// As above with bf16 (wider range, for models that overflow f16).
    pub const QUANTIZED_BF16: Self = Self {
        quantized_weights: true,
        compute: Dtype::Bfloat16,
        kv: Dtype::Bfloat16,
    };

    /// The default for a device kind as reported by `mlx_device::default_device_kind`.
    pub fn for_device(kind: &str) -> Self {
        if kind == "gpu" {
            Self::QUANTIZED_F16
        } else {
            Self::F32
        }
    }

    pub fn name(&self) -> &'static str {
        match *self {
            Self::F32 => "f32",
            Self::QUANTIZED_F16 => "quantized-f16",
            Self::QUANTIZED_BF16 => "quantized-bf16",
            _ => "custom",
        }
    }
}

impl fmt::Display for DtypePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DtypePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Self::F32),
            "quantized-f16" => Ok(Self::QUANTIZED_F16),
            "quantized-bf16" => Ok(Self::QUANTIZED_BF16),
            other => Err(format!(
                "unknown dtype policy {other:?} (expected f32, quantized-f16 or quantized-bf16)"
            )),
        }
    }
}

/// Tokens per prefill pass on a device kind (`mlx_device::default_device_kind`), when the
/// operator names none. On the CPU a 256-token pass already keeps OpenBLAS's matrix products
/// busy, and a longer one only grows the attention scores held at once. On a GPU a pass is a
/// few hundred small kernels, and short ones leave the card idle: on the H200 the engine alone
/// prefilled 8K tokens in 0.30 s with 256-token passes, 0.12 s with 1,024 and 0.065 s with
/// 4,096 (docs/BENCHMARKS.md). Blocks for the cache are cut from the finished KV afterwards,
/// whatever the pass.
pub fn default_prefill_chunk_tokens(device_kind: &str) -> usize {
    if device_kind == "gpu" { 4096 } else { 256 }
}

/// How much memory finished sequences' live KV caches may keep by default
/// (`prefix_cache::Parking`). A GPU has room for several long contexts (a 64K-token prompt of
/// a 1.5B model is 1.8 GB in f16) and gains most: its cache hits otherwise copy host bytes
/// onto the device. On a CPU a 4K-token SmolLM2 cache is ~190 MB of f32; 1 GiB keeps a few
/// conversations. Parked caches give way to requests either way.
pub fn default_parked_bytes(device_kind: &str) -> u64 {
    if device_kind == "gpu" {
        8 << 30
    } else {
        1 << 30
    }
}

/// Bytes per element of the dtypes we store.
pub fn dtype_bytes(dtype: Dtype) -> usize {
    match dtype {
        Dtype::Float16 | Dtype::Bfloat16 => 2,
        Dtype::Float64 | Dtype::Int64 | Dtype::Uint64 | Dtype::Complex64 => 8,
        Dtype::Bool | Dtype::Int8 | Dtype::Uint8 => 1,
        Dtype::Int16 | Dtype::Uint16 => 2,
        _ => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_prefills_in_longer_passes_than_the_cpu() {
        assert_eq!(default_prefill_chunk_tokens("cpu"), 256);
        assert_eq!(default_prefill_chunk_tokens("gpu"), 4096);
    }
}
