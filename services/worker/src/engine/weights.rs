//! Weight tensors as the decoder uses them: linear layers (dense or quantised), embeddings,
//! norms. Built from a `TensorStore` (GGUF or safetensors) under a `DtypePolicy`.

use std::collections::HashMap;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{dequantize, quantized_matmul};
use mlx_rs::{Array, Dtype};

use super::policy::DtypePolicy;
use super::{EngineError, Result};

/// Named tensors from a model file, in MLX's quantised layout where quantised: a packed
/// `<base>.weight` (uint32) with `<base>.scales` and `<base>.biases`.
pub struct TensorStore {
    tensors: HashMap<String, Array>,
    /// Group size of quantised tensors (32 for GGUF's Q4_0/Q4_1/Q8_0).
    pub group_size: i32,
}

impl TensorStore {
    pub fn new(tensors: HashMap<String, Array>, group_size: i32) -> Self {
        Self {
            tensors,
            group_size,
        }
    }

    pub fn get(&self, name: &str) -> Option<&Array> {
        self.tensors.get(name)
    }

    pub fn require(&self, name: &str) -> Result<&Array> {
        self.get(name)
            .ok_or_else(|| EngineError::MissingTensor(name.to_string()))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// A linear layer `<base>.weight` (+ `.scales`/`.biases` when quantised, + `.bias`).
    pub fn linear(&self, base: &str, policy: DtypePolicy) -> Result<Linear> {
        let bias = self
            .get(&format!("{base}.bias"))
            .map(|b| b.as_dtype(policy.compute))
            .transpose()?;
        let matrix = self.matrix(base, policy)?;
        Ok(Linear { matrix, bias })
    }

    /// A linear layer stored fused with others (Phi-3's `qkv_proj`, `gate_up_proj`): its rows
    /// cut into consecutive parts of `sizes` rows each, every part a layer of its own. The
    /// scales, biases and bias of a quantised matrix are per row, so they are cut alike.
    pub fn linear_split(
        &self,
        base: &str,
        sizes: &[usize],
        policy: DtypePolicy,
    ) -> Result<Vec<Linear>> {
        let fused = self.linear(base, policy)?;
        let rows = match &fused.matrix {
            Matrix::Dense(w) => w.shape()[0],
            Matrix::Quantized(q) => q.weight.shape()[0],
        };
        if sizes.iter().sum::<usize>() != rows as usize {
            return Err(EngineError::BadTensor {
                name: format!("{base}.weight"),
                reason: format!("{rows} rows cannot split into {sizes:?}"),
            });
        }
        let mut at = 0i32;
        let mut parts = Vec::with_capacity(sizes.len());
        for &n in sizes {
            let range = at..at + n as i32;
            let cut = |a: &Array| -> Result<Array> { Ok(a.try_index(range.clone())?) };
            let matrix = match &fused.matrix {
                Matrix::Dense(w) => Matrix::Dense(cut(w)?),
                Matrix::Quantized(q) => Matrix::Quantized(QuantizedMatrix {
                    weight: cut(&q.weight)?,
                    scales: cut(&q.scales)?,
                    biases: cut(&q.biases)?,
                    group_size: q.group_size,
                    bits: q.bits,
                }),
            };
            let bias = fused.bias.as_ref().map(cut).transpose()?;
            parts.push(Linear { matrix, bias });
            at += n as i32;
        }
        Ok(parts)
    }

    /// `<base>.weight` as a dense or quantised [out, in] matrix, per the policy.
    pub fn matrix(&self, base: &str, policy: DtypePolicy) -> Result<Matrix> {
        let weight_name = format!("{base}.weight");
        let weight = self.require(&weight_name)?;
        let Some(scales) = self.get(&format!("{base}.scales")) else {
            return Ok(Matrix::Dense(weight.as_dtype(policy.compute)?));
        };
        let biases = self.require(&format!("{base}.biases"))?;
        let bad = |reason: String| EngineError::BadTensor {
            name: weight_name.clone(),
            reason,
        };
        let (&[out, packed], &[s_out, groups]) = (weight.shape(), scales.shape()) else {
            return Err(bad(format!(
                "quantised weight and scales must be 2-D, got {:?} and {:?}",
                weight.shape(),
                scales.shape()
            )));
        };
        if out != s_out || groups == 0 {
            return Err(bad(format!(
                "scales {:?} do not match {:?}",
                scales.shape(),
                weight.shape()
            )));
        }
        let in_features = groups * self.group_size;
        // Each uint32 packs 32 / bits values: packed = in * bits / 32.
        let bits = packed * 32 / in_features;
        if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) || packed * 32 != bits * in_features {
            return Err(bad(format!(
                "cannot infer bits from packed width {packed} and {in_features} inputs"
            )));
        }
        let q = QuantizedMatrix {
            weight: weight.clone(),
            scales: scales.as_dtype(policy.compute)?,
            biases: biases.as_dtype(policy.compute)?,
            group_size: self.group_size,
            bits,
        };
        if policy.quantized_weights {
            Ok(Matrix::Quantized(q))
        } else {
            Ok(Matrix::Dense(q.dequantize()?.as_dtype(policy.compute)?))
        }
    }

    /// A norm weight, in the compute dtype.
    pub fn vector(&self, name: &str, policy: DtypePolicy) -> Result<Array> {
        Ok(self.require(name)?.as_dtype(policy.compute)?)
    }
}

#[derive(Clone)]
pub struct QuantizedMatrix {
    pub weight: Array,
    pub scales: Array,
    pub biases: Array,
    pub group_size: i32,
    pub bits: i32,
}

impl QuantizedMatrix {
    pub fn dequantize(&self) -> Result<Array> {
        Ok(dequantize(
            &self.weight,
            &self.scales,
            &self.biases,
            self.group_size,
            self.bits,
        )?)
    }
}

/// An [out, in] weight matrix.
#[derive(Clone)]
pub enum Matrix {
    Dense(Array),
    Quantized(QuantizedMatrix),
}

impl Matrix {
    pub fn eval(&self) -> Result<()> {
        match self {
            Matrix::Dense(w) => w.eval()?,
            Matrix::Quantized(q) => {
                q.weight.eval()?;
                q.scales.eval()?;
                q.biases.eval()?;
            }
        }
        Ok(())
    }

    /// `x @ W.T`.
    pub fn apply(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Matrix::Dense(w) => x.matmul(w.t())?,
            Matrix::Quantized(q) => quantized_matmul(
                x,
                &q.weight,
                &q.scales,
                &q.biases,
                true,
                q.group_size,
                q.bits,
            )?,
        })
    }

    /// `x @ W.T` by the few-rows CPU kernel (`strata_cpu_kernels::matmul`), when it applies: dense f32
    /// weights, an evaluated f32 `x` of `[rows, k]` with at most `strata_cpu_kernels::matmul::MAX_ROWS` rows.
    /// `x` is evaluated here (the kernel reads its memory). None: use `apply`.
    pub fn apply_few_rows(&self, x: &Array) -> Result<Option<Array>> {
        let Matrix::Dense(w) = self else {
            return Ok(None);
        };
        let (xs, ws) = (x.shape(), w.shape());
        if xs.len() != 2
            || ws.len() != 2
            || xs[0] as usize > strata_cpu_kernels::matmul::MAX_ROWS
            || xs[1] != ws[1]
            || x.dtype() != Dtype::Float32
            || w.dtype() != Dtype::Float32
        {
            return Ok(None);
        }
        x.eval()?;
        // Either may be a strided view (then MLX's product takes it).
        let (Ok(xv), Ok(wv)) = (x.try_as_slice::<f32>(), w.try_as_slice::<f32>()) else {
            return Ok(None);
        };
        let (rows, n, k) = (xs[0] as usize, ws[0] as usize, ws[1] as usize);
        let out = strata_cpu_kernels::matmul::x_wt(xv, rows, wv, n, k);
        Ok(Some(Array::from_slice(&out, &[xs[0], ws[0]])))
    }

    /// Rows `ids` of the matrix (an embedding lookup), dense, in `dtype`.
    pub fn rows(&self, ids: &Array, dtype: Dtype) -> Result<Array> {
        Ok(match self {
            Matrix::Dense(w) => w.take_axis(ids, 0)?,
            Matrix::Quantized(q) => dequantize(
                q.weight.take_axis(ids, 0)?,
                q.scales.take_axis(ids, 0)?,
                &q.biases.take_axis(ids, 0)?,
                q.group_size,
                q.bits,
            )?
            .as_dtype(dtype)?,
        })
    }
}

pub struct Linear {
    pub matrix: Matrix,
    pub bias: Option<Array>,
}

impl Linear {
    /// Materialises the weights (safetensors loads are lazy, bound to the loading thread's
    /// stream, and the engine computes on another thread).
    pub fn eval(&self) -> Result<()> {
        self.matrix.eval()?;
        if let Some(b) = &self.bias {
            b.eval()?;
        }
        Ok(())
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.forward_on(x, false)
    }

    /// `forward`, by the few-rows CPU kernel where it applies when `few_rows_kernel`.
    pub fn forward_on(&self, x: &Array, few_rows_kernel: bool) -> Result<Array> {
        let few = if few_rows_kernel {
            self.matrix.apply_few_rows(x)?
        } else {
            None
        };
        let y = match few {
            Some(y) => y,
            None => self.matrix.apply(x)?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}
