//! Gated DeltaNet layers of hybrid models (Qwen3.5, Qwen3.6): four projections of the
//! normalised input (the convolution's channels `qkv`, the output gate `z`, and per value head
//! `b` and `a`), then the token mixer of `strata_cpu_kernels::gated_delta` (causal convolution,
//! gated delta rule, gated RMSNorm) on each sequence's own recurrent state, then `out_proj`.
//! The arithmetic of mlx-lm's `qwen3_5.GatedDeltaNet`; Qwen3-Next stores the same four
//! projections fused per key head (`in_proj_qkvz`, `in_proj_ba`), whose outputs are
//! reordered into them.
//!
//! On a CPU the mixer runs in that host kernel (the fastest there: one pass over each head's
//! state a token). On a GPU it runs as MLX operations (`delta_rule_device`), its state kept
//! on the device between passes and read back only for the snapshots the cache exports.

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use strata_cpu_kernels::gated_delta::{self, Shape};

use super::super::config::LinearAttention;
use super::super::policy::DtypePolicy;
use super::super::weights::{Linear, TensorStore};
use super::super::{EngineError, Result};
use super::SeqChunk;
use super::delta_rule_device::{self, DeviceInputs, DeviceWeights};

pub(super) struct GatedDeltaNet {
    projections: Projections,
    out: Linear,
    /// The depthwise convolution, `[channels, kernel]`.
    conv: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    /// The gated RMSNorm's weight (a plain weight, never stored as an offset from 1).
    norm: Vec<f32>,
    eps: f32,
    shape: Shape,
    /// The same weights on the device where the recurrence runs there (a GPU).
    device: Option<DeviceWeights>,
}

/// The layer's input projections as stored.
enum Projections {
    /// Qwen3.5: `in_proj_qkv` (q of every key head, then k, then v), `in_proj_z`,
    /// `in_proj_b`, `in_proj_a`.
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
    /// Qwen3-Next: `in_proj_qkvz` (per key head its q, k, then the v and z of its value
    /// heads) and `in_proj_ba` (per key head the b, then the a of its value heads), with the
    /// output columns that make Qwen3.5's four, in their order.
    Fused {
        qkvz: Linear,
        ba: Linear,
        qkv_columns: Array,
        z_columns: Array,
        b_columns: Array,
        a_columns: Array,
    },
}

impl Projections {
    /// Qwen3-Next's column orders for `shape` (mlx-lm's `fix_query_key_value_ordering`).
    fn fused(qkvz: Linear, ba: Linear, shape: Shape) -> Result<Self> {
        let (nk, dk) = (shape.key_heads, shape.key_dim);
        let per = shape.value_heads / nk;
        let vz = per * shape.value_dim;
        let group = 2 * dk + 2 * vz;
        let cols = |from: usize, len: usize| -> Vec<i32> {
            (0..nk)
                .flat_map(|h| (h * group + from..h * group + from + len).map(|c| c as i32))
                .collect()
        };
        let mut qkv = cols(0, dk);
        qkv.extend(cols(dk, dk));
        qkv.extend(cols(2 * dk, vz));
        let z = cols(2 * dk + vz, vz);
        let ba_cols = |from: usize| -> Vec<i32> {
            (0..nk)
                .flat_map(|h| (h * 2 * per + from..h * 2 * per + from + per).map(|c| c as i32))
                .collect()
        };
        let array = |v: Vec<i32>| -> Result<Array> {
            let a = Array::from_slice(&v, &[v.len() as i32]);
            a.eval()?;
            Ok(a)
        };
        let rows = |l: &Linear| l.matrix.out_features() as usize;
        if rows(&qkvz) != nk * group || rows(&ba) != 2 * shape.value_heads {
            return Err(EngineError::Config(format!(
                "in_proj_qkvz / in_proj_ba: {} and {} rows, expected {} and {} for {shape:?}",
                rows(&qkvz),
                rows(&ba),
                nk * group,
                2 * shape.value_heads
            )));
        }
        Ok(Self::Fused {
            qkvz,
            ba,
            qkv_columns: array(qkv)?,
            z_columns: array(z)?,
            b_columns: array(ba_cols(0))?,
            a_columns: array(ba_cols(per))?,
        })
    }

    /// `[qkv, z, b, a]` for `x`, in Qwen3.5's layouts.
    fn forward(&self, x: &Array, few: bool) -> Result<[Array; 4]> {
        match self {
            Self::Split { qkv, z, b, a } => {
                let [qkv, z] = Linear::forward_group([qkv, z], x, few)?;
                let [b, a] = Linear::forward_group([b, a], x, few)?;
                Ok([qkv, z, b, a])
            }
            Self::Fused {
                qkvz,
                ba,
                qkv_columns,
                z_columns,
                b_columns,
                a_columns,
            } => {
                let [qkvz, ba] = Linear::forward_group([qkvz, ba], x, few)?;
                // Contiguous: the host recurrence reads them as rows.
                let pick = |p: &Array, columns: &Array| -> Result<Array> {
                    Ok(p.take_axis(columns, -1)?.contiguous()?)
                };
                Ok([
                    pick(&qkvz, qkv_columns)?,
                    pick(&qkvz, z_columns)?,
                    pick(&ba, b_columns)?,
                    pick(&ba, a_columns)?,
                ])
            }
        }
    }

    fn eval(&self) -> Result<()> {
        let all: Vec<&Linear> = match self {
            Self::Split { qkv, z, b, a } => vec![qkv, z, b, a],
            Self::Fused { qkvz, ba, .. } => vec![qkvz, ba],
        };
        for m in all {
            m.eval()?;
        }
        Ok(())
    }
}

fn host_vector(a: &Array) -> Result<Vec<f32>> {
    let a = a.as_dtype(Dtype::Float32)?;
    a.eval()?;
    Ok(a.try_as_slice::<f32>()
        .map_err(|e| EngineError::Mlx(format!("reading a linear-attention weight: {e}")))?
        .to_vec())
}

impl GatedDeltaNet {
    /// Layer `layer`'s `linear_attn` tensors, Hugging Face's layout (convolution
    /// `[channels, 1, kernel]`) or mlx-lm's (`[channels, kernel, 1]`).
    pub(super) fn load(
        store: &TensorStore,
        layer: usize,
        widths: &LinearAttention,
        eps: f32,
        policy: DtypePolicy,
    ) -> Result<Self> {
        let prefix = format!("model.layers.{layer}.linear_attn");
        let name = |part: &str| format!("{prefix}.{part}");
        let shape = widths.shape();
        let conv_weight = store.require(&name("conv1d.weight"))?;
        let channels = shape.channels();
        let kernel = shape.conv_kernel;
        let conv_shape = conv_weight.shape();
        let conv_ok = conv_shape.len() == 3
            && conv_shape[0] as usize == channels
            && (conv_shape[1..] == [1, kernel as i32] || conv_shape[1..] == [kernel as i32, 1]);
        if !conv_ok {
            return Err(EngineError::Config(format!(
                "{}: shape {conv_shape:?}, expected [{channels}, 1, {kernel}] or \
                 [{channels}, {kernel}, 1]",
                name("conv1d.weight")
            )));
        }
        let per_head = |part: &str, n: usize| -> Result<Vec<f32>> {
            let v = host_vector(store.require(&name(part))?)?;
            if v.len() != n {
                return Err(EngineError::Config(format!(
                    "{}: {} values, expected {n}",
                    name(part),
                    v.len()
                )));
            }
            Ok(v)
        };
        let projections = if store.contains(&format!("{}.weight", name("in_proj_qkvz"))) {
            Projections::fused(
                store.linear(&name("in_proj_qkvz"), policy)?,
                store.linear(&name("in_proj_ba"), policy)?,
                shape,
            )?
        } else {
            Projections::Split {
                qkv: store.linear(&name("in_proj_qkv"), policy)?,
                z: store.linear(&name("in_proj_z"), policy)?,
                b: store.linear(&name("in_proj_b"), policy)?,
                a: store.linear(&name("in_proj_a"), policy)?,
            }
        };
        let layer = Self {
            projections,
            out: store.linear(&name("out_proj"), policy)?,
            // Both layouts hold [channels, kernel] in memory order (one axis is 1).
            conv: host_vector(conv_weight)?,
            a_log: per_head("A_log", shape.value_heads)?,
            dt_bias: per_head("dt_bias", shape.value_heads)?,
            norm: per_head("norm.weight", shape.value_dim)?,
            eps,
            shape,
            device: None,
        };
        layer.projections.eval()?;
        layer.out.eval()?;
        Ok(layer)
    }

    /// Runs the recurrence as MLX operations on the default device (`on`) or in the host
    /// kernel. Both give the same arithmetic within f32 rounding.
    pub(super) fn set_on_device(&mut self, on: bool) -> Result<()> {
        self.device = match on {
            false => None,
            true => Some(DeviceWeights::new(
                self.shape,
                &self.conv,
                &self.a_log,
                &self.dt_bias,
                &self.norm,
                self.eps,
            )?),
        };
        Ok(())
    }

    pub(super) fn on_device(&self) -> bool {
        self.device.is_some()
    }

    /// The layer's output (before the residual add) for `x` (`[tokens, hidden]`, normalised),
    /// the tokens of `batch`'s sequences at `ranges` in order; `index` is the layer's place
    /// among the recurrent layers, whose state each sequence's cache holds. States advance
    /// by the chunk; the cache snapshots them where it asks to (`KvCache::snapshot_points`).
    pub(super) fn forward(
        &self,
        x: &Array,
        batch: &mut [SeqChunk<'_>],
        ranges: &[(i32, i32)],
        index: usize,
        few: bool,
    ) -> Result<Array> {
        let [qkv, z, b, a] = self.projections.forward(x, few)?;
        if let Some(weights) = &self.device {
            let mut outs = Vec::with_capacity(batch.len());
            for (seq, &(start, end)) in batch.iter_mut().zip(ranges) {
                let held = seq.cache.len();
                let snapshots_after = seq.cache.snapshot_points((end - start) as usize);
                let state = seq.cache.recurrent_array(index)?;
                let rows = |p: &Array| p.try_index(start..end);
                let inputs = DeviceInputs {
                    qkv: &rows(&qkv)?,
                    z: &rows(&z)?,
                    b: &rows(&b)?,
                    a: &rows(&a)?,
                };
                let done = delta_rule_device::forward(
                    self.shape,
                    weights,
                    &inputs,
                    &state,
                    &snapshots_after,
                )?;
                seq.cache.set_recurrent_array(index, done.state)?;
                for (&i, snapshot) in snapshots_after.iter().zip(done.snapshots) {
                    seq.cache.put_snapshot_array(held + i + 1, index, snapshot);
                }
                outs.push(done.out);
            }
            let mixed = concatenate(&outs, 0)?.as_dtype(x.dtype())?;
            return self.out.forward_on(&mixed, few);
        }
        let parts = [qkv, z, b, a]
            .into_iter()
            .map(|p| p.as_dtype(Dtype::Float32))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        mlx_rs::transforms::eval(&parts)?;
        let read = |p: &Array| -> Result<Vec<f32>> {
            Ok(p.try_as_slice::<f32>()
                .map_err(|e| EngineError::Mlx(format!("reading linear-attention inputs: {e}")))?
                .to_vec())
        };
        let (qkv, z, b, a) = (
            read(&parts[0])?,
            read(&parts[1])?,
            read(&parts[2])?,
            read(&parts[3])?,
        );
        let shape = self.shape;
        let (channels, heads) = (shape.channels(), shape.value_heads);
        let width = heads * shape.value_dim;
        let weights = gated_delta::Weights {
            conv: &self.conv,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
            eps: self.eps,
        };
        let tokens = ranges.last().map_or(0, |&(_, end)| end as usize);
        let mut mixed = Vec::with_capacity(tokens * width);
        for (seq, &(start, end)) in batch.iter_mut().zip(ranges) {
            let (start, end) = (start as usize, end as usize);
            let held = seq.cache.len();
            let snapshots_after = seq.cache.snapshot_points(end - start);
            let (conv, recurrent) = seq.cache.recurrent_state(index)?;
            let inputs = gated_delta::Inputs {
                qkv: &qkv[start * channels..end * channels],
                z: &z[start * width..end * width],
                b: &b[start * heads..end * heads],
                a: &a[start * heads..end * heads],
            };
            let state = gated_delta::State { conv, recurrent };
            let (out, snapshots) =
                gated_delta::forward(shape, &weights, &inputs, state, &snapshots_after);
            for (&i, snapshot) in snapshots_after.iter().zip(snapshots) {
                seq.cache.put_snapshot(held + i + 1, index, snapshot);
            }
            mixed.extend_from_slice(&out);
        }
        let mixed =
            Array::from_slice(&mixed, &[tokens as i32, width as i32]).as_dtype(x.dtype())?;
        self.out.forward_on(&mixed, few)
    }
}
