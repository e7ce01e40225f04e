//! Weight tensors as the decoder uses them: linear layers (dense or quantised), embeddings,
//! norms. Built from a `TensorStore` (GGUF or safetensors) under a `DtypePolicy`.

use std::collections::HashMap;
use std::sync::Arc;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{dequantize, quantized_matmul};
use mlx_rs::{Array, Dtype};
use strata_cpu_kernels::packed::PackedMatrix;

use super::policy::DtypePolicy;
use super::{EngineError, Result};

/// MLX's quantisation modes: `affine` (scale and bias per group, 2-8 bits) and the
/// microscaled floats of MLX 0.32 (no biases; e8m0 or e4m3 scales).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMode {
    Affine,
    Mxfp4,
    Nvfp4,
    Mxfp8,
}

impl QuantMode {
    fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "affine" => Self::Affine,
            "mxfp4" => Self::Mxfp4,
            "nvfp4" => Self::Nvfp4,
            "mxfp8" => Self::Mxfp8,
            other => {
                return Err(EngineError::Config(format!(
                    "quantization mode {other:?} is not supported (affine, mxfp4, nvfp4, mxfp8 are)"
                )));
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Affine => "affine",
            Self::Mxfp4 => "mxfp4",
            Self::Nvfp4 => "nvfp4",
            Self::Mxfp8 => "mxfp8",
        }
    }

    /// mlx-lm's defaults for a mode: (group size, bits).
    fn defaults(self) -> (i32, i32) {
        match self {
            Self::Affine => (64, 4),
            Self::Mxfp4 => (32, 4),
            Self::Nvfp4 => (16, 4),
            Self::Mxfp8 => (32, 8),
        }
    }
}

/// How one module's matrix is packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantParams {
    pub group_size: i32,
    /// None: inferred from the packed width (GGUF, where it varies by tensor).
    pub bits: Option<i32>,
    pub mode: QuantMode,
}

/// The packing of a model's quantised matrices: one default, and per-module overrides as
/// mlx-lm writes them in config.json's `quantization` (`{"group_size": 64, "bits": 4,
/// "mode": "affine", "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8}, ...}`).
/// A module without `.scales` is dense whatever this says (mlx-lm decides the same way).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantSpec {
    default: QuantParams,
    per_module: HashMap<String, QuantParams>,
}

impl QuantSpec {
    /// Affine with one group size, the bits read off each tensor (GGUF's Q4_0/Q4_1/Q8_0: 32).
    pub fn affine(group_size: i32) -> Self {
        Self {
            default: QuantParams {
                group_size,
                bits: None,
                mode: QuantMode::Affine,
            },
            per_module: HashMap::new(),
        }
    }

    /// From config.json's `quantization` (or `quantization_config`, its copy for the HF tree).
    pub fn from_mlx_config(value: &serde_json::Value) -> Result<Self> {
        let obj = value.as_object().ok_or_else(|| {
            EngineError::Config(format!("quantization is not an object: {value}"))
        })?;
        let default = Self::params(obj, None)?;
        let mut per_module = HashMap::new();
        for (key, v) in obj {
            match v {
                serde_json::Value::Object(o) => {
                    per_module.insert(key.clone(), Self::params(o, Some(default))?);
                }
                // `false`: left dense (its tensors have no scales); `true`: the default.
                serde_json::Value::Bool(_) => {}
                _ if ["group_size", "bits", "mode", "quant_method"].contains(&key.as_str()) => {}
                _ => {
                    return Err(EngineError::Config(format!(
                        "quantization.{key} = {v} is not understood"
                    )));
                }
            }
        }
        Ok(Self {
            default,
            per_module,
        })
    }

    fn params(
        obj: &serde_json::Map<String, serde_json::Value>,
        inherit: Option<QuantParams>,
    ) -> Result<QuantParams> {
        let mode = match obj.get("mode").and_then(|m| m.as_str()) {
            Some(m) => QuantMode::parse(m)?,
            None => inherit.map_or(QuantMode::Affine, |p| p.mode),
        };
        let (group_default, bits_default) = match inherit {
            Some(p) if p.mode == mode => (p.group_size, p.bits.unwrap_or(mode.defaults().1)),
            _ => mode.defaults(),
        };
        let int = |key: &str, default: i32| -> Result<i32> {
            match obj.get(key) {
                None => Ok(default),
                Some(v) => v
                    .as_i64()
                    .and_then(|n| i32::try_from(n).ok())
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        EngineError::Config(format!("quantization {key} = {v} is not valid"))
                    }),
            }
        };
        Ok(QuantParams {
            group_size: int("group_size", group_default)?,
            bits: Some(int("bits", bits_default)?),
            mode,
        })
    }

    /// The float modes any module uses (they are expanded at load).
    pub fn float_modes(&self) -> Vec<&'static str> {
        let mut modes: Vec<&'static str> = std::iter::once(self.default)
            .chain(self.per_module.values().copied())
            .filter(|p| p.mode != QuantMode::Affine)
            .map(|p| p.mode.name())
            .collect();
        modes.sort_unstable();
        modes.dedup();
        modes
    }

    /// The packing of module `base` (a tensor name without `.weight`).
    pub fn of(&self, base: &str) -> QuantParams {
        self.per_module.get(base).copied().unwrap_or(self.default)
    }
}

/// Named tensors from a model file, in MLX's quantised layout where quantised: a packed
/// `<base>.weight` (uint32) with `<base>.scales` (and `<base>.biases` in affine mode).
pub struct TensorStore {
    tensors: HashMap<String, Array>,
    pub quant: QuantSpec,
    /// Codes of matrices the loader expanded to f32 itself (GGUF K-quants and kin), by base
    /// name, for the few-rows kernel on a CPU.
    codes: HashMap<String, Arc<PackedMatrix>>,
}

impl TensorStore {
    pub fn new(tensors: HashMap<String, Array>, quant: QuantSpec) -> Self {
        Self {
            tensors,
            quant,
            codes: HashMap::new(),
        }
    }

    pub fn with_codes(mut self, codes: HashMap<String, Arc<PackedMatrix>>) -> Self {
        self.codes = codes;
        self
    }

    pub fn get(&self, name: &str) -> Option<&Array> {
        self.tensors.get(name)
    }

    pub fn require(&self, name: &str) -> Result<&Array> {
        self.get(name)
            .ok_or_else(|| EngineError::MissingTensor(name.to_string()))
    }

    /// Whether the tensor is held, as an array or (a matrix's `.weight`) only as codes.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
            || name
                .strip_suffix(".weight")
                .is_some_and(|base| self.codes.contains_key(base))
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
        let rows = fused.matrix.out_features();
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
            let cut_codes = |packed: &PackedMatrix| -> Result<Arc<PackedMatrix>> {
                let part = packed
                    .rows(at as usize, n)
                    .ok_or_else(|| EngineError::BadTensor {
                        name: format!("{base}.weight"),
                        reason: format!("rows {at}..{} past its codes", at as usize + n),
                    })?;
                Ok(Arc::new(part))
            };
            let matrix = match &fused.matrix {
                Matrix::Dense(w) => Matrix::Dense(cut(w)?),
                Matrix::WithCodes { dense, packed } => Matrix::WithCodes {
                    dense: cut(dense)?,
                    packed: cut_codes(packed)?,
                },
                Matrix::Codes(packed) => Matrix::Codes(cut_codes(packed)?),
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
        let codes_alone =
            policy.compute == Dtype::Float32 && codes_enabled() && codes_replace_expansion();
        if codes_alone && let Some(packed) = self.codes.get(base) {
            return Ok(Matrix::Codes(packed.clone()));
        }
        let weight = self.require(&weight_name)?;
        let Some(scales) = self.get(&format!("{base}.scales")) else {
            let dense = weight.as_dtype(policy.compute)?;
            return Ok(match self.codes.get(base) {
                Some(packed) if policy.compute == Dtype::Float32 && codes_enabled() => {
                    Matrix::WithCodes {
                        dense,
                        packed: packed.clone(),
                    }
                }
                _ => Matrix::Dense(dense),
            });
        };
        let params = self.quant.of(base);
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
        let in_features = groups * params.group_size;
        // Each uint32 packs 32 / bits values: packed = in * bits / 32.
        let bits = params.bits.unwrap_or(packed * 32 / in_features);
        if !matches!(bits, 2..=6 | 8) || packed * 32 != bits * in_features {
            return Err(bad(format!(
                "a packed width of {packed} does not hold {in_features} inputs of {bits} bits \
                 in groups of {} ({} mode)",
                params.group_size,
                params.mode.name()
            )));
        }
        if params.mode != QuantMode::Affine {
            // The float modes are expanded at load on every device: mlx-rs's products take
            // only affine packing (logged by the loader).
            let dense = dequantize_mode(weight, scales, params.group_size, bits, params.mode)?;
            return Ok(Matrix::Dense(dense.as_dtype(policy.compute)?));
        }
        let biases = self.require(&format!("{base}.biases"))?;
        let q = QuantizedMatrix {
            weight: weight.clone(),
            scales: scales.as_dtype(policy.compute)?,
            biases: biases.as_dtype(policy.compute)?,
            group_size: params.group_size,
            bits,
        };
        if policy.quantized_weights {
            return Ok(Matrix::Quantized(q));
        }
        if codes_alone {
            match packed_codes(&q, out as usize, in_features as usize) {
                Ok(packed) => return Ok(Matrix::Codes(Arc::new(packed))),
                Err(reason) => tracing::debug!(matrix = %weight_name, %reason, "kept as f32 only"),
            }
        }
        let dense = q.dequantize()?.as_dtype(policy.compute)?;
        if policy.compute != Dtype::Float32 || !codes_enabled() {
            return Ok(Matrix::Dense(dense));
        }
        // f32 on a CPU: the file's codes are kept too, for products of a few rows (decode
        // steps, short chunks), where reading 1-byte codes instead of 4-byte floats is what
        // makes them faster; longer products stay with MLX on the expansion.
        match packed_codes(&q, out as usize, in_features as usize) {
            Ok(packed) => Ok(Matrix::WithCodes {
                dense,
                packed: Arc::new(packed),
            }),
            Err(reason) => {
                tracing::debug!(matrix = %weight_name, %reason, "kept as f32 only");
                Ok(Matrix::Dense(dense))
            }
        }
    }

    /// A norm weight, in the compute dtype.
    pub fn vector(&self, name: &str, policy: DtypePolicy) -> Result<Array> {
        Ok(self.require(name)?.as_dtype(policy.compute)?)
    }
}

/// Whether matrices with codes drop their f32 expansion (a CPU computing in f32): when the
/// process holds a BLAS `sgemm` for long products on panels dequantised as they go
/// (`strata_cpu_kernels::blas`). Without one they keep the expansion for MLX's products,
/// and the loader says so. `STRATA_WEIGHT_EXPANSION=1` keeps both anyway, for measuring: long
/// products on the expansion, at 4 bytes per weight more (as fast as the panels, measured on
/// Qwen2.5-1.5B's prefill).
pub fn codes_replace_expansion() -> bool {
    strata_cpu_kernels::blas::sgemm().is_some()
        && std::env::var("STRATA_WEIGHT_EXPANSION").map_or(true, |v| v != "1")
}

/// Whether quantised weights also keep their codes on a CPU (`STRATA_WEIGHT_CODES=0` turns it
/// off, for measuring the kernel against the f32 expansion: both compute the same weights).
fn codes_enabled() -> bool {
    std::env::var("STRATA_WEIGHT_CODES").map_or(true, |v| v != "0")
}

/// An affine quantised matrix's codes, scales and biases, unpacked for `PackedMatrix`.
fn packed_codes(
    q: &QuantizedMatrix,
    n: usize,
    k: usize,
) -> std::result::Result<PackedMatrix, String> {
    let f32s = |a: &Array| -> std::result::Result<Vec<f32>, String> {
        let a = a.as_dtype(Dtype::Float32).map_err(|e| e.to_string())?;
        a.eval().map_err(|e| e.to_string())?;
        a.try_as_slice::<f32>()
            .map(<[f32]>::to_vec)
            .map_err(|e| e.to_string())
    };
    let (scales, biases) = (f32s(&q.scales)?, f32s(&q.biases)?);
    if q.weight.dtype() != Dtype::Uint32 {
        return Err(format!("packed as {:?}, not uint32", q.weight.dtype()));
    }
    q.weight.eval().map_err(|e| e.to_string())?;
    let words = q.weight.try_as_slice::<u32>().map_err(|e| e.to_string())?;
    PackedMatrix::from_mlx_words(
        words,
        q.bits as usize,
        &scales,
        &biases,
        n,
        k,
        q.group_size as usize,
    )
}

/// Calls an MLX C operation in a quantisation mode that mlx-rs does not bind: `call` gets
/// the result slot, an empty array for each absent input, the mode's name, the int options'
/// form and the stream, and returns MLX's status; `what` names it in the error.
fn mlx_mode_op(
    mode: QuantMode,
    what: &str,
    call: impl FnOnce(
        *mut mlx_sys::mlx_array,
        mlx_sys::mlx_array,
        *const std::ffi::c_char,
        mlx_sys::mlx_stream,
    ) -> i32,
) -> Result<Array> {
    let name = std::ffi::CString::new(mode.name())
        .map_err(|e| EngineError::Mlx(format!("quantization mode: {e}")))?;
    let stream = mlx_rs::Stream::thread_local_or_default();
    // SAFETY: `res` and `empty` are made here and live through the call (the borrowed
    // arrays `call` captures live longer); `res` then holds a new array that `from_ptr` owns
    // and frees on success as on failure; `empty` is freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let empty = mlx_sys::mlx_array_new();
        let status = call(&mut res, empty, name.as_ptr(), stream.as_ptr());
        mlx_sys::mlx_array_free(empty);
        let out = Array::from_ptr(res);
        if status != 0 {
            return Err(EngineError::Mlx(format!(
                "MLX's {what} failed on {} codes",
                mode.name()
            )));
        }
        Ok(out)
    }
}

fn some_int(value: i32) -> mlx_sys::mlx_optional_int_ {
    mlx_sys::mlx_optional_int_ {
        value,
        has_value: true,
    }
}

/// MLX's `gather_qmm` in any mode (mlx-rs binds it for affine codes only): `x` through each
/// row's `rhs_indices` matrices of packed `weight` (`[experts, out, in packed]`, transposed as
/// mlx-lm's `QuantizedSwitchLinear` multiplies), `biases` for affine codes only.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather_qmm_mode(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    rhs_indices: &Array,
    group_size: i32,
    bits: i32,
    mode: QuantMode,
    sorted: bool,
) -> Result<Array> {
    mlx_mode_op(mode, "gather_qmm", |res, empty, mode, stream| {
        // SAFETY: every handle is alive for the call (see `mlx_mode_op`).
        unsafe {
            mlx_sys::mlx_gather_qmm(
                res,
                x.as_ptr(),
                weight.as_ptr(),
                scales.as_ptr(),
                biases.map_or(empty, |b| b.as_ptr()),
                empty,
                rhs_indices.as_ptr(),
                true,
                some_int(group_size),
                some_int(bits),
                mode,
                sorted,
                stream,
            )
        }
    })
}

/// MLX's `dequantize` in a float mode (mlx-rs binds only affine): scales without biases.
pub(crate) fn dequantize_mode(
    weight: &Array,
    scales: &Array,
    group_size: i32,
    bits: i32,
    mode: QuantMode,
) -> Result<Array> {
    mlx_mode_op(mode, "dequantize", |res, empty, mode, stream| {
        // SAFETY: every handle is alive for the call (see `mlx_mode_op`).
        unsafe {
            mlx_sys::mlx_dequantize(
                res,
                weight.as_ptr(),
                scales.as_ptr(),
                empty,
                some_int(group_size),
                some_int(bits),
                mode,
                empty,
                mlx_sys::mlx_optional_dtype_ {
                    value: mlx_sys::mlx_dtype__MLX_FLOAT32,
                    has_value: false,
                },
                stream,
            )
        }
    })
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
    /// f32 (a CPU) from a quantised file: the expansion for MLX's products and the file's codes
    /// for the few-rows kernel (`strata_cpu_kernels::packed`).
    WithCodes {
        dense: Array,
        packed: Arc<PackedMatrix>,
    },
    /// f32 (a CPU) from a quantised file, kept only as the file's codes: a few rows by the
    /// packed kernel, longer products by the BLAS on panels dequantised as they go
    /// (`PackedMatrix::x_wt_long`), so the f32 weights are never held whole.
    Codes(Arc<PackedMatrix>),
}

/// Rows up to which products against a matrix's codes use the packed kernel: measured beside
/// MLX's OpenBLAS product on the f32 expansion (`cargo bench -p strata-worker --bench few_rows`).
pub const PACKED_MAX_ROWS: usize = 16;

/// Rows up to which a matrix kept only as codes uses the packed kernel rather than BLAS panels.
const CODES_KERNEL_MAX_ROWS: usize = 48;

impl Matrix {
    pub fn eval(&self) -> Result<()> {
        match self {
            Matrix::Dense(w) | Matrix::WithCodes { dense: w, .. } => w.eval()?,
            Matrix::Codes(_) => {}
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
            Matrix::Dense(w) | Matrix::WithCodes { dense: w, .. } => x.matmul(w.t())?,
            Matrix::Codes(packed) => codes_product(packed, x)?,
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
        let w = match self {
            Matrix::Dense(w) => w,
            Matrix::WithCodes { packed, .. } | Matrix::Codes(packed) => {
                return apply_codes(packed, x);
            }
            Matrix::Quantized(_) => return Ok(None),
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

    /// Bytes of codes held (`Codes`, or `WithCodes` beside the expansion), else 0.
    pub fn code_bytes(&self) -> usize {
        match self {
            Matrix::WithCodes { packed, .. } | Matrix::Codes(packed) => packed.bytes(),
            _ => 0,
        }
    }

    /// The number of output rows.
    pub fn out_features(&self) -> i32 {
        match self {
            Matrix::Dense(w) | Matrix::WithCodes { dense: w, .. } => w.shape()[0],
            Matrix::Codes(packed) => packed.n() as i32,
            Matrix::Quantized(q) => q.weight.shape()[0],
        }
    }

    /// Rows `ids` of the matrix (an embedding lookup), dense, in `dtype`.
    pub fn rows(&self, ids: &Array, dtype: Dtype) -> Result<Array> {
        Ok(match self {
            Matrix::Dense(w) | Matrix::WithCodes { dense: w, .. } => w.take_axis(ids, 0)?,
            Matrix::Codes(packed) => codes_rows(packed, ids)?.as_dtype(dtype)?,
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

/// `x @ W.T` for `x` of `[.., k]` against a matrix kept only as codes: the packed kernel for a
/// few rows, panels through the BLAS for more. Computed now (`x` is evaluated here).
fn codes_product(packed: &PackedMatrix, x: &Array) -> Result<Array> {
    let shape = x.shape().to_vec();
    let (k, n) = (packed.k() as i32, packed.n() as i32);
    let Some((&last, lead)) = shape.split_last() else {
        return Err(EngineError::Mlx(
            "a product of a scalar against a matrix".into(),
        ));
    };
    if last != k {
        return Err(EngineError::Mlx(format!(
            "a product of {shape:?} against a [{n}, {k}] matrix"
        )));
    }
    let rows: i32 = lead.iter().product();
    let x2 = x.as_dtype(Dtype::Float32)?.reshape(&[rows, k])?;
    x2.eval()?;
    let x2 = if x2.try_as_slice::<f32>().is_ok() {
        x2
    } else {
        let c = x2.contiguous()?;
        c.eval()?;
        c
    };
    let xv = x2
        .try_as_slice::<f32>()
        .map_err(|e| EngineError::Mlx(format!("the input of a product: {e}")))?;
    let rows = rows as usize;
    // Past `PACKED_MAX_ROWS` the kernel still beats dequantised panels for a few rows more
    // (measured: `cargo bench -p strata-worker --bench few_rows`).
    let mut out_shape = lead.to_vec();
    out_shape.push(n);
    if rows <= CODES_KERNEL_MAX_ROWS || packed.runs_in_bf16(rows) {
        return Ok(Array::from_slice(&packed.x_wt(xv, rows), &out_shape));
    }
    let sgemm = strata_cpu_kernels::blas::sgemm()
        .ok_or_else(|| EngineError::Mlx("no BLAS sgemm in the process".into()))?;
    // The product's buffer is kept by the engine thread between calls (MLX copies it out):
    // a fresh one of megabytes per product costs page faults and zeroing every time.
    thread_local! {
        static OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    Ok(OUT.with_borrow_mut(|out| {
        if out.len() < rows * packed.n() {
            out.resize(rows * packed.n(), 0.0);
        }
        let out = &mut out[..rows * packed.n()];
        packed.x_wt_long_into(xv, rows, sgemm, out);
        Array::from_slice(out, &out_shape)
    }))
}

/// Rows `ids` of a matrix kept only as codes (an embedding lookup), f32, `[ids.., k]`.
fn codes_rows(packed: &PackedMatrix, ids: &Array) -> Result<Array> {
    let flat = ids.as_dtype(Dtype::Int32)?.flatten(None, None)?;
    flat.eval()?;
    let values = flat
        .try_as_slice::<i32>()
        .map_err(|e| EngineError::Mlx(format!("token ids: {e}")))?;
    // A negative id becomes a row past the matrix, refused below.
    let rows: Vec<usize> = values
        .iter()
        .map(|&i| usize::try_from(i).unwrap_or(usize::MAX))
        .collect();
    let out = packed.gather_rows(&rows).ok_or_else(|| {
        EngineError::Mlx(format!(
            "a token id past the {} rows of the embedding",
            packed.n()
        ))
    })?;
    let mut shape = ids.shape().to_vec();
    shape.push(packed.k() as i32);
    Ok(Array::from_slice(&out, &shape))
}

/// `x @ W.T` by the packed kernel: an evaluated f32 `x` of `[rows, k]`, at most
/// `PACKED_MAX_ROWS` rows. None: use `apply`.
fn apply_codes(packed: &PackedMatrix, x: &Array) -> Result<Option<Array>> {
    let xs = x.shape();
    if xs.len() != 2
        || xs[0] as usize > PACKED_MAX_ROWS
        || xs[1] as usize != packed.k()
        || x.dtype() != Dtype::Float32
    {
        return Ok(None);
    }
    x.eval()?;
    let Ok(xv) = x.try_as_slice::<f32>() else {
        return Ok(None);
    };
    let out = packed.x_wt(xv, xs[0] as usize);
    Ok(Some(Array::from_slice(&out, &[xs[0], packed.n() as i32])))
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

    /// `forward_on` for several layers that read the same `x` (q, k and v; gate and up): by
    /// one pass of the packed kernel when every one has codes and it applies, else one by one.
    pub fn forward_group<const N: usize>(
        layers: [&Linear; N],
        x: &Array,
        few_rows_kernel: bool,
    ) -> Result<[Array; N]> {
        let packed: Vec<&PackedMatrix> = layers
            .iter()
            .filter_map(|l| match &l.matrix {
                Matrix::WithCodes { packed, .. } | Matrix::Codes(packed) => Some(&**packed),
                _ => None,
            })
            .collect();
        let xs = x.shape();
        let grouped = few_rows_kernel
            && packed.len() == N
            && xs.len() == 2
            && xs[0] as usize <= PACKED_MAX_ROWS
            && packed.iter().all(|m| m.k() == xs[1] as usize)
            && x.dtype() == Dtype::Float32;
        if grouped {
            x.eval()?;
            if let Ok(xv) = x.try_as_slice::<f32>() {
                let outs = strata_cpu_kernels::packed::x_wt_many(&packed, xv, xs[0] as usize);
                let mut arrays = Vec::with_capacity(N);
                for ((out, m), layer) in outs.iter().zip(&packed).zip(layers) {
                    let y = Array::from_slice(out, &[xs[0], m.n() as i32]);
                    arrays.push(match &layer.bias {
                        Some(b) => y.add(b)?,
                        None => y,
                    });
                }
                if let Ok(arrays) = arrays.try_into() {
                    return Ok(arrays);
                }
            }
        }
        let mut arrays = Vec::with_capacity(N);
        for layer in layers {
            arrays.push(layer.forward_on(x, few_rows_kernel)?);
        }
        arrays
            .try_into()
            .map_err(|_| EngineError::Mlx("a layer group lost an output".into()))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `x @ W.T` as MLX computes it on the expansion, with the matrix's rows `ids` beside.
    fn expanded(store: &TensorStore, group: i32, bits: i32) -> Array {
        let q = QuantizedMatrix {
            weight: store.require("m.weight").unwrap().clone(),
            scales: store
                .require("m.scales")
                .unwrap()
                .as_dtype(Dtype::Float32)
                .unwrap(),
            biases: store
                .require("m.biases")
                .unwrap()
                .as_dtype(Dtype::Float32)
                .unwrap(),
            group_size: group,
            bits,
        };
        q.dequantize().unwrap()
    }

    fn quantised_store(w: &Array, group: i32, bits: i32) -> TensorStore {
        let (wq, scales, biases) = mlx_rs::ops::quantize(w, group, bits).unwrap();
        TensorStore::new(
            HashMap::from([
                ("m.weight".to_string(), wq),
                ("m.scales".to_string(), scales),
                ("m.biases".to_string(), biases),
            ]),
            QuantSpec::affine(group),
        )
    }

    /// Checks `ours` against `mlx` within f32 rounding of sums in another order: far below
    /// 1e-5 of the largest output for sums of 256 products.
    fn assert_close(ours: &Array, mlx: &Array, what: &str) {
        assert_eq!(ours.shape(), mlx.shape(), "{what}");
        let (ours, mlx) = (ours.as_slice::<f32>(), mlx.as_slice::<f32>());
        let largest = mlx.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in ours.iter().zip(mlx) {
            assert!(
                (a - b).abs() <= 1e-5 * largest.max(1e-3),
                "{what}: {a} vs {b}"
            );
        }
    }

    /// On a CPU a quantised matrix is kept only as its codes (the process holds a BLAS), which
    /// are MLX's own quantisation at every width MLX packs: products of every length (the
    /// packed kernel up to `PACKED_MAX_ROWS` rows, BLAS panels past it), embedding rows and a
    /// fused matrix's parts equal MLX's on the expansion within f32 rounding.
    #[test]
    fn a_quantised_matrix_is_kept_as_codes_that_compute_as_its_expansion_on_a_cpu() {
        let (n, k) = (48, 256);
        let values: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.2)
            .collect();
        // f16 weights quantise to f16 scales and biases, as the files hold them.
        let w = Array::from_slice(&values, &[n as i32, k as i32])
            .as_dtype(Dtype::Float16)
            .unwrap();
        assert!(
            codes_replace_expansion(),
            "the test process holds MLX's BLAS"
        );
        for (bits, group) in [
            (4, 32),
            (8, 32),
            (4, 64),
            (3, 64),
            (6, 128),
            (2, 32),
            (5, 32),
        ] {
            let store = quantised_store(&w, group, bits);
            let dense = expanded(&store, group, bits);
            let matrix = store.matrix("m", DtypePolicy::F32).unwrap();
            let what = format!("{bits} bits in groups of {group}");
            assert!(
                matches!(matrix, Matrix::Codes(_)),
                "{what}: not kept as codes"
            );
            for rows in [1, 5, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 64] {
                let x: Vec<f32> = (0..rows * k)
                    .map(|i| (i % 13) as f32 / 13.0 - 0.4)
                    .collect();
                let x = Array::from_slice(&x, &[rows as i32, k as i32]);
                let mlx = x.matmul(dense.t()).unwrap();
                assert_close(
                    &matrix.apply(&x).unwrap(),
                    &mlx,
                    &format!("{what}, {rows} rows"),
                );
                if rows <= PACKED_MAX_ROWS {
                    let few = matrix.apply_few_rows(&x).unwrap().unwrap();
                    assert_close(&few, &mlx, &format!("{what}, {rows} rows, few"));
                }
            }
            // A batch of sequences, and a strided (transposed) input.
            let x = Array::from_slice(&vec![0.1f32; 2 * 20 * k], &[2, 20, k as i32]);
            assert_close(
                &matrix.apply(&x).unwrap(),
                &x.matmul(dense.t()).unwrap(),
                &what,
            );
            let xt = Array::from_slice(&values[..k * 24], &[k as i32, 24]).t();
            assert_close(
                &matrix.apply(&xt).unwrap(),
                &xt.matmul(dense.t()).unwrap(),
                &what,
            );
            let ids = Array::from_slice(&[3i32, 0, 47, 3], &[2, 2]);
            let rows = matrix.rows(&ids, Dtype::Float32).unwrap();
            assert_close(
                &rows,
                &dense.take_axis(&ids, 0).unwrap(),
                &format!("{what}, rows"),
            );
            let past = Array::from_slice(&[48i32], &[1]);
            assert!(
                matrix.rows(&past, Dtype::Float32).is_err(),
                "a row past the matrix"
            );

            let parts = store
                .linear_split("m", &[16, 32], DtypePolicy::F32)
                .unwrap();
            assert!(parts.iter().all(|p| p.matrix.code_bytes() > 0));
            let x = Array::from_slice(&vec![0.3f32; 40 * k], &[40, k as i32]);
            let second = dense.try_index(16..48).unwrap();
            assert_close(
                &parts[1].forward(&x).unwrap(),
                &x.matmul(second.t()).unwrap(),
                &format!("{what}, a fused matrix's part"),
            );
        }
        // Scales that f16 cannot hold exactly (an f32 model quantised in MLX) stay f32.
        let w32 = Array::from_slice(&values, &[n as i32, k as i32]);
        let store = quantised_store(&w32, 32, 4);
        let dense = expanded(&store, 32, 4);
        let matrix = store.matrix("m", DtypePolicy::F32).unwrap();
        for rows in [3, 40] {
            let x = Array::from_slice(&vec![0.25f32; rows * k], &[rows as i32, k as i32]);
            assert_close(
                &matrix.apply(&x).unwrap(),
                &x.matmul(dense.t()).unwrap(),
                "f32 scales",
            );
        }
        // Past the row limit the few-rows kernel does not apply.
        let x = Array::zeros::<f32>(&[PACKED_MAX_ROWS as i32 + 1, k as i32]).unwrap();
        assert!(matrix.apply_few_rows(&x).unwrap().is_none());
    }

    #[test]
    fn mlx_lm_quantization_configs_are_read_per_module() {
        let spec = QuantSpec::from_mlx_config(&serde_json::json!({
            "group_size": 64, "bits": 4, "mode": "affine",
            "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
            "model.layers.1.mlp.down_proj": false,
            "model.embed_tokens": {"bits": 6},
            "lm_head": {"mode": "mxfp4"},
        }))
        .unwrap();
        let p = |group_size, bits, mode| QuantParams {
            group_size,
            bits: Some(bits),
            mode,
        };
        assert_eq!(
            spec.of("model.layers.3.self_attn.q_proj"),
            p(64, 4, QuantMode::Affine)
        );
        assert_eq!(
            spec.of("model.layers.0.mlp.down_proj"),
            p(32, 8, QuantMode::Affine)
        );
        // Unspecified fields inherit the default of the same mode, else the mode's own.
        assert_eq!(spec.of("model.embed_tokens"), p(64, 6, QuantMode::Affine));
        assert_eq!(spec.of("lm_head"), p(32, 4, QuantMode::Mxfp4));
        assert_eq!(spec.float_modes(), vec!["mxfp4"]);
        // Older uploads: no mode at all.
        let old = QuantSpec::from_mlx_config(&serde_json::json!({"group_size": 32, "bits": 8}));
        assert_eq!(old.unwrap().of("x"), p(32, 8, QuantMode::Affine));

        for bad in [
            serde_json::json!({"group_size": 64, "bits": 4, "mode": "int3"}),
            serde_json::json!({"group_size": -1, "bits": 4}),
            serde_json::json!({"group_size": 64, "bits": 4, "x": 3}),
            serde_json::json!([1, 2]),
        ] {
            assert!(QuantSpec::from_mlx_config(&bad).is_err(), "{bad}");
        }
    }
}
