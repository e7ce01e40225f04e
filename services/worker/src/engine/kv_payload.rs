//! A finished block's payload, read back from the device when it is taken.
//!
//! On CUDA the engine gathers a pass's blocks into one device array and hands them over
//! still on the device: copying 241 MB of an 8K-token prompt's KV to the host took 117-125 ms
//! of a 196 ms cold request on an H100, and nothing in the first token needs it. The block
//! finisher (`prefix_cache::finisher`) copies each block out while the engine goes on with
//! the first token and decode. A hybrid model's recurrent states at the block's end stay on
//! the device too: at Qwen3.6-35B-A3B's shape each is 66 MB, and reading them back on the
//! engine thread took 1.0 s of a 6.2 s cold 32K-token prompt on an H100. On the CPU the bytes
//! are in host memory from the start.

use std::ops::{Deref, Range};
use std::sync::{Arc, OnceLock};

use mlx_rs::Array;

use super::{EngineError, Result};

/// A block's bytes in `KvCache::export`'s layout.
pub struct KvPayload(Repr);

enum Repr {
    Host(Vec<u8>),
    Device {
        rows: Arc<EvaluatedRows>,
        /// This block's bytes in `rows`.
        at: Range<usize>,
        /// What follows the K/V part (a hybrid model's recurrent states), in order.
        tail: Vec<TailPart>,
        /// The bytes once read through `Deref`.
        read: OnceLock<Vec<u8>>,
    },
}

/// An evaluated `u8` array that blocks of one pass share.
pub(crate) struct EvaluatedRows(Array);

// SAFETY: the array is evaluated before it is wrapped, so no thread runs a graph on it again:
// the finisher only reads its data pointer and drops it, and MLX's allocator (which the drop
// reaches) serialises its own state. `Array` itself is already `Send` in mlx-rs.
unsafe impl Sync for EvaluatedRows {}

impl EvaluatedRows {
    /// `rows` must be evaluated.
    pub(crate) fn new(rows: Array) -> Arc<Self> {
        Arc::new(Self(rows))
    }

    pub(crate) fn len(&self) -> usize {
        self.0.size()
    }

    fn bytes(&self) -> Result<&[u8]> {
        self.0
            .try_as_slice::<u8>()
            .map_err(|e| EngineError::Mlx(format!("reading KV bytes: {e}")))
    }
}

/// A piece of what follows a block's K/V part: bytes on the host, or an evaluated `u8` view
/// of a state on the device.
pub(crate) enum TailPart {
    Host(Vec<u8>),
    Device(Arc<EvaluatedRows>),
}

impl KvPayload {
    pub(crate) fn on_device(
        rows: Arc<EvaluatedRows>,
        at: Range<usize>,
        tail: Vec<TailPart>,
    ) -> Self {
        Self(Repr::Device {
            rows,
            at,
            tail,
            read: OnceLock::new(),
        })
    }

    /// The bytes in host memory (copied from the device now if they are still there).
    pub fn into_vec(self) -> Result<Vec<u8>> {
        match self.0 {
            Repr::Host(v) => Ok(v),
            Repr::Device {
                rows,
                at,
                tail,
                read,
            } => match read.into_inner() {
                Some(v) => Ok(v),
                None => copy_out(&rows, at, &tail),
            },
        }
    }
}

fn copy_out(rows: &EvaluatedRows, at: Range<usize>, tail: &[TailPart]) -> Result<Vec<u8>> {
    let all = rows.bytes()?;
    let kv = all.get(at.clone()).ok_or_else(|| {
        EngineError::Config(format!(
            "block bytes {at:?} outside gathered rows of {}",
            all.len()
        ))
    })?;
    let tail_bytes: usize = tail
        .iter()
        .map(|p| match p {
            TailPart::Host(v) => v.len(),
            TailPart::Device(rows) => rows.len(),
        })
        .sum();
    let mut out = Vec::with_capacity(kv.len() + tail_bytes);
    crate::device_copy::append_beside(&mut out, kv);
    for part in tail {
        match part {
            TailPart::Host(v) => out.extend_from_slice(v),
            TailPart::Device(rows) => crate::device_copy::append_beside(&mut out, rows.bytes()?),
        }
    }
    Ok(out)
}

impl From<Vec<u8>> for KvPayload {
    fn from(v: Vec<u8>) -> Self {
        Self(Repr::Host(v))
    }
}

/// Reads the bytes (copied from the device at the first read). A copy that fails reads as no
/// bytes, which no import accepts as a block: it is logged, never used.
impl Deref for KvPayload {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Host(v) => v,
            Repr::Device {
                rows,
                at,
                tail,
                read,
            } => read.get_or_init(|| {
                copy_out(rows, at.clone(), tail).unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "a finished block could not be read back");
                    Vec::new()
                })
            }),
        }
    }
}

impl std::fmt::Debug for KvPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Repr::Host(v) => write!(f, "KvPayload::Host({} bytes)", v.len()),
            Repr::Device { at, tail, .. } => {
                write!(
                    f,
                    "KvPayload::Device({} bytes + {} parts)",
                    at.len(),
                    tail.len()
                )
            }
        }
    }
}
