//! `x · Wᵀ` for a few rows of `x` against a weight matrix kept as 8-bit codes with an affine
//! scale and bias per group: `w = scale · q + bias`. This is how GGUF's Q8_0/Q4_0/Q4_1 and
//! mlx-community's affine 2-8 bit weights are defined, so the products are those of the file's
//! own weights (each element dequantised by one fused multiply-add in f32, then the same f32
//! products and sums as the dense kernel), not of re-quantised ones; `x` stays f32.
//!
//! Why: on a CPU a decode step or a short chunk reads every weight once per product, so its
//! time is the bytes of the weights. Expanded to f32 those are 4 bytes per weight; as codes a
//! byte, or half of one for codes of up to 4 bits (two to a byte), plus a scale and a bias per
//! group of 16-128: half precision where f16 holds them exactly (GGUF's Q4_0/Q4_1/Q8_0 and
//! mlx-community files store f16 scales), f32 otherwise (a K-quant's scale is an f16 times a
//! small integer). The codes are widened to f32 in registers, a few
//! instructions that the memory traffic they save pays for. MLX's CPU
//! `quantized_matmul` computes the same thing without vectorising the weights' expansion, and
//! no BLAS we link has such a product.

use rayon::prelude::*;

/// A `[n, k]` weight matrix as codes and, per group of `group` consecutive weights of a row, a
/// scale and a bias. Codes of up to 4 bits in groups of a multiple of 32 go two to
/// a byte: in each run of 32 codes, byte `i` holds code `i` in its low nibble and code `i + 16`
/// in its high one, so that one load yields two vectors of consecutive weights with a mask and
/// a shift (llama.cpp lays out its Q4_0 blocks the same way). Other codes take a byte each.
#[derive(Clone)]
pub struct PackedMatrix {
    codes: Vec<u8>,
    nibbles: bool,
    params: Params,
    n: usize,
    k: usize,
    group: usize,
}

/// Each group's scale and bias.
#[derive(Clone)]
enum Params {
    /// f16 bits.
    Half {
        scales: Vec<u16>,
        biases: Vec<u16>,
    },
    Single {
        scales: Vec<f32>,
        biases: Vec<f32>,
    },
}

impl Params {
    /// Groups `from..to` (rows' worth), borrowed for a kernel.
    fn slice(&self, from: usize, to: usize) -> ParamsRef<'_> {
        match self {
            Params::Half { scales, biases } => ParamsRef {
                s16: &scales[from..to],
                b16: &biases[from..to],
                s32: &[],
                b32: &[],
            },
            Params::Single { scales, biases } => ParamsRef {
                s16: &[],
                b16: &[],
                s32: &scales[from..to],
                b32: &biases[from..to],
            },
        }
    }

    fn len(&self) -> usize {
        match self {
            Params::Half { scales, .. } => scales.len(),
            Params::Single { scales, .. } => scales.len(),
        }
    }

    fn get(&self, g: usize) -> (f32, f32) {
        self.slice(g, g + 1).get(0)
    }
}

/// Scales and biases of some groups: the f16 pair or the f32 pair is empty.
#[derive(Clone, Copy)]
struct ParamsRef<'a> {
    s16: &'a [u16],
    b16: &'a [u16],
    s32: &'a [f32],
    b32: &'a [f32],
}

impl ParamsRef<'_> {
    fn half(&self) -> bool {
        self.s32.is_empty()
    }

    fn len(&self) -> usize {
        self.s16.len().max(self.s32.len())
    }

    #[inline]
    fn get(&self, g: usize) -> (f32, f32) {
        if self.half() {
            (
                half::f16::from_bits(self.s16[g]).to_f32(),
                half::f16::from_bits(self.b16[g]).to_f32(),
            )
        } else {
            (self.s32[g], self.b32[g])
        }
    }
}

/// Weight rows per parallel task, as in the dense kernel.
const COLS_PER_TASK: usize = 32;

/// f16 bits of `v`, when f16 holds it exactly.
fn exact_f16(v: f32) -> Option<u16> {
    let h = half::f16::from_f32(v);
    (h.to_f32() == v || v.is_nan() && h.is_nan()).then(|| h.to_bits())
}

impl PackedMatrix {
    /// The codes of MLX's affine packing (`bits` per value, a little-endian bit stream of u32
    /// words, `[n, k · bits / 32]`) with `[n, k / group]` scales and biases.
    pub fn from_mlx_words(
        words: &[u32],
        bits: usize,
        scales: &[f32],
        biases: &[f32],
        n: usize,
        k: usize,
        group: usize,
    ) -> Result<Self, String> {
        if !matches!(bits, 2..=6 | 8) {
            return Err(format!("{bits}-bit codes are not supported"));
        }
        if words.len() * 32 != n * k * bits {
            return Err(format!(
                "{} words do not hold a {n} x {k} matrix of {bits} bits",
                words.len()
            ));
        }
        // Values may straddle two words at 3, 5 and 6 bits: read them as one bit stream.
        let mask = (1u64 << bits) - 1;
        let mut codes = Vec::with_capacity(n * k);
        for row in words.chunks_exact(k * bits / 32) {
            let mut buffer = 0u64;
            let mut held = 0usize;
            let mut next = row.iter();
            for _ in 0..k {
                if held < bits {
                    let word = next.next().copied().unwrap_or(0);
                    buffer |= u64::from(word) << held;
                    held += 32;
                }
                codes.push((buffer & mask) as u8);
                buffer >>= bits;
                held -= bits;
            }
        }
        Self::from_codes(&codes, bits, scales, biases, n, k, group)
    }

    /// A matrix from one code per weight (`[n, k]`, each below `1 << bits`) and `[n, k / group]`
    /// scales and biases. The group must be a multiple of 16 (the vector width): GGUF uses 16
    /// and 32, MLX 32 to 128.
    pub fn from_codes(
        codes: &[u8],
        bits: usize,
        scales: &[f32],
        biases: &[f32],
        n: usize,
        k: usize,
        group: usize,
    ) -> Result<Self, String> {
        if !(1..=8).contains(&bits) {
            return Err(format!("{bits}-bit codes are not supported"));
        }
        if group == 0 || !group.is_multiple_of(16) || !k.is_multiple_of(group) {
            return Err(format!(
                "a group of {group} does not divide {k} in steps of 16"
            ));
        }
        let groups = k / group;
        if codes.len() != n * k || scales.len() != n * groups || biases.len() != n * groups {
            return Err(format!(
                "{} codes, {} scales and {} biases do not make a {n} x {k} matrix in groups \
                 of {group}",
                codes.len(),
                scales.len(),
                biases.len()
            ));
        }
        if let Some(q) = codes.iter().find(|&&q| usize::from(q) >> bits != 0) {
            return Err(format!("code {q} has more than {bits} bits"));
        }
        let halves =
            |values: &[f32]| -> Option<Vec<u16>> { values.iter().map(|&v| exact_f16(v)).collect() };
        let params = match (halves(scales), halves(biases)) {
            (Some(scales), Some(biases)) => Params::Half { scales, biases },
            _ => Params::Single {
                scales: scales.to_vec(),
                biases: biases.to_vec(),
            },
        };
        let nibbles = bits <= 4 && group.is_multiple_of(32);
        let packed = if nibbles {
            codes
                .chunks_exact(32)
                .flat_map(|run| {
                    let (low, high) = run.split_at(16);
                    low.iter().zip(high).map(|(l, h)| l | h << 4)
                })
                .collect()
        } else {
            codes.to_vec()
        };
        Ok(Self {
            codes: packed,
            nibbles,
            params,
            n,
            k,
            group,
        })
    }

    /// Bytes of codes per row.
    fn row_bytes(&self) -> usize {
        if self.nibbles { self.k / 2 } else { self.k }
    }

    /// Code `t` of row `j`.
    fn code(&self, j: usize, t: usize) -> u8 {
        code_in(
            &self.codes[j * self.row_bytes()..(j + 1) * self.row_bytes()],
            self.nibbles,
            t,
        )
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes held (codes, scales and biases).
    pub fn bytes(&self) -> usize {
        let per_group = match self.params {
            Params::Half { .. } => 4,
            Params::Single { .. } => 8,
        };
        self.codes.len() + per_group * self.params.len()
    }

    /// Weight rows `start..start + len` as a matrix of their own (a fused projection's parts).
    pub fn rows(&self, start: usize, len: usize) -> Option<Self> {
        if start + len > self.n {
            return None;
        }
        let (bytes, groups) = (self.row_bytes(), self.k / self.group);
        let (from, to) = (start * groups, (start + len) * groups);
        let params = match &self.params {
            Params::Half { scales, biases } => Params::Half {
                scales: scales[from..to].to_vec(),
                biases: biases[from..to].to_vec(),
            },
            Params::Single { scales, biases } => Params::Single {
                scales: scales[from..to].to_vec(),
                biases: biases[from..to].to_vec(),
            },
        };
        Some(Self {
            codes: self.codes[start * bytes..(start + len) * bytes].to_vec(),
            nibbles: self.nibbles,
            params,
            n: len,
            k: self.k,
            group: self.group,
        })
    }

    /// The matrix in f32, each weight as the kernel computes it.
    pub fn dequantize(&self) -> Vec<f32> {
        let groups = self.k / self.group;
        let mut out = Vec::with_capacity(self.n * self.k);
        for j in 0..self.n {
            for t in 0..self.k {
                let (scale, bias) = self.params.get(j * groups + t / self.group);
                out.push(f32::from(self.code(j, t)).mul_add(scale, bias));
            }
        }
        out
    }

    /// Weight rows `j0..j0 + out.len() / k`, dequantised into `out` (row-major), as the kernel
    /// computes each weight.
    pub fn dequantize_rows_into(&self, j0: usize, out: &mut [f32]) {
        assert!(out.len().is_multiple_of(self.k), "out is not whole rows");
        let rows = out.len() / self.k;
        assert!(j0 + rows <= self.n, "rows past the matrix");
        let (bytes, groups) = (self.row_bytes(), self.k / self.group);
        let part = Part {
            codes: &self.codes[j0 * bytes..(j0 + rows) * bytes],
            nibbles: self.nibbles,
            params: self.params.slice(j0 * groups, (j0 + rows) * groups),
            k: self.k,
            group: self.group,
        };
        dequantize_part(&part, out);
    }

    /// Rows `ids` of the matrix in f32 (`[ids.len(), k]`): an embedding lookup.
    pub fn gather_rows(&self, ids: &[usize]) -> Option<Vec<f32>> {
        if ids.iter().any(|&j| j >= self.n) {
            return None;
        }
        let mut out = vec![0f32; ids.len() * self.k];
        for (&j, row) in ids.iter().zip(out.chunks_exact_mut(self.k)) {
            self.dequantize_rows_into(j, row);
        }
        Some(out)
    }

    /// `x · Wᵀ` for `x` of `[rows, k]` of any length, by `sgemm` on panels of weight rows
    /// dequantised one at a time into a buffer: the products of a
    /// prefill chunk at the speed of the BLAS, without keeping the f32 expansion. Dequantising
    /// costs one pass over the codes per call, small beside the product's `2 · rows · n · k`
    /// operations once `rows` is past the few-rows kernel's range. Returns `[rows, n]`.
    pub fn x_wt_long(&self, x: &[f32], rows: usize, sgemm: crate::blas::Sgemm) -> Vec<f32> {
        let mut out = vec![0f32; rows * self.n];
        self.x_wt_long_into(x, rows, sgemm, &mut out);
        out
    }

    /// `x_wt_long` into `out` (`[rows, n]`, overwritten). The panel buffer is kept by the
    /// calling thread between calls: allocating megabytes per product made page faults and
    /// zeroing a measurable part of a prefill chunk.
    pub fn x_wt_long_into(
        &self,
        x: &[f32],
        rows: usize,
        sgemm: crate::blas::Sgemm,
        out: &mut [f32],
    ) {
        thread_local! {
            static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        assert_eq!(x.len(), rows * self.k, "x is not [rows, k]");
        assert_eq!(out.len(), rows * self.n, "out is not [rows, n]");
        if rows == 0 || self.n == 0 {
            return;
        }
        // At least 1024 weight rows per panel (2 MB of f32 where rows are short): each `sgemm`
        // call packs all of `x` again, so fewer, larger panels cost less than panels that fit
        // the L2 cache. The panel is dequantised on this thread (0.1-0.2 ns a weight): handing
        // it to the pool between two BLAS calls cost more in thread hand-offs than it saved.
        // Measured on Qwen2.5-1.5B's prefill: 512-row panels dequantised by the pool made a
        // cold 1K prompt 13% slower than the f32 expansion, these as fast.
        let panel_rows = (PANEL_FLOATS / self.k).max(PANEL_MIN_ROWS);
        PANEL.with_borrow_mut(|panel| {
            let size = panel_rows.min(self.n) * self.k;
            if panel.len() < size {
                panel.resize(size, 0.0);
            }
            let mut j0 = 0;
            while j0 < self.n {
                let len = panel_rows.min(self.n - j0);
                let buffer = &mut panel[..len * self.k];
                self.dequantize_rows_into(j0, buffer);
                // SAFETY: `x` is `[rows, k]`, the panel `[len, k]` and `out` `[rows, n]` with
                // columns `j0..j0 + len` inside it, all row-major, as the strides passed say; the
                // sizes fit i32 (a weight matrix and a chunk).
                unsafe {
                    sgemm(
                        crate::blas::ROW_MAJOR,
                        crate::blas::NO_TRANS,
                        crate::blas::TRANS,
                        rows as i32,
                        len as i32,
                        self.k as i32,
                        1.0,
                        x.as_ptr(),
                        self.k as i32,
                        buffer.as_ptr(),
                        self.k as i32,
                        0.0,
                        out.as_mut_ptr().add(j0),
                        self.n as i32,
                    )
                };
                j0 += len;
            }
        });
    }

    /// Whether a product of `rows` rows runs in bf16 (`set_bf16_products`, 8+ rows): then at
    /// any length faster than BLAS panels of f32 (Qwen2.5-1.5B's matrices at 256 rows: dot
    /// tiles 243-362, packed panels 362-583 GFLOP/s, OpenBLAS 216).
    pub fn runs_in_bf16(&self, rows: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            bf16::applies(rows, self.k)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = rows;
            false
        }
    }

    /// Whether a product of `rows` rows runs on bf16 panels: in bf16, long enough, and a
    /// shape they take.
    #[cfg(target_arch = "x86_64")]
    fn bf16_panels(&self, rows: usize) -> bool {
        rows >= PANELS_FROM_ROWS
            && bf16::applies(rows, self.k)
            && self.n.is_multiple_of(16)
            && bf16::panels_apply(self.k, self.group)
    }

    /// `x · Wᵀ` for `x` of `[rows, k]`, row-major; returns `[rows, n]`.
    pub fn x_wt(&self, x: &[f32], rows: usize) -> Vec<f32> {
        x_wt_many(&[self], x, rows).pop().unwrap_or_default()
    }

    /// The weight rows from `j0` on that `out` (`[cols, rows]`) has room for.
    fn part(&self, j0: usize, cols: usize) -> Part<'_> {
        let (bytes, groups) = (self.row_bytes(), self.k / self.group);
        Part {
            codes: &self.codes[j0 * bytes..(j0 + cols) * bytes],
            nibbles: self.nibbles,
            params: self.params.slice(j0 * groups, (j0 + cols) * groups),
            k: self.k,
            group: self.group,
        }
    }
}

/// `x · Wᵀ` for several matrices of the same `k` (a layer's q, k and v projections, or its
/// gate and up ones) in one parallel pass: a decode step makes hundreds of these products, and
/// waking the pool once per group instead of once per matrix is measurably cheaper on 2 cores.
/// Returns one `[rows, n]` per matrix. Panics when a matrix's `k` is not `x`'s row length.
pub fn x_wt_many(matrices: &[&PackedMatrix], x: &[f32], rows: usize) -> Vec<Vec<f32>> {
    for m in matrices {
        assert_eq!(x.len(), rows * m.k, "x is not [rows, k]");
    }
    // Computed column-major (`[n, rows]`) so that each task writes one contiguous piece.
    let mut by_col: Vec<Vec<f32>> = matrices.iter().map(|m| vec![0f32; m.n * rows]).collect();
    let mut tasks: Vec<(&PackedMatrix, usize, &mut [f32])> = Vec::new();
    for (m, out) in matrices.iter().zip(by_col.iter_mut()) {
        for (t, chunk) in out.chunks_mut(COLS_PER_TASK * rows).enumerate() {
            tasks.push((m, t * COLS_PER_TASK, chunk));
        }
    }
    #[cfg(target_arch = "x86_64")]
    if matrices.iter().all(|m| m.bf16_panels(rows)) {
        return panels(matrices, x, rows);
    }
    #[cfg(target_arch = "x86_64")]
    if matrices.first().is_some_and(|m| bf16::applies(rows, m.k)) {
        let xb = bf16::round_rows(x);
        tasks.into_par_iter().for_each(|(m, j0, out)| {
            bf16::columns(&xb, rows, &m.part(j0, out.len() / rows), out);
        });
        return transposed(by_col, matrices, rows);
    }
    tasks.into_par_iter().for_each(|(m, j0, out)| {
        let part = m.part(j0, out.len() / rows);
        columns(x, rows, &part, out);
    });
    transposed(by_col, matrices, rows)
}

/// `x_wt_many` by `bf16::panel_product`: each task a panel, its `[rows, cols]` outputs then
/// copied into place row by row.
#[cfg(target_arch = "x86_64")]
fn panels(matrices: &[&PackedMatrix], x: &[f32], rows: usize) -> Vec<Vec<f32>> {
    let xb = bf16::round_rows(x);
    let tasks: Vec<(usize, usize)> = matrices
        .iter()
        .enumerate()
        .flat_map(|(i, m)| (0..m.n).step_by(bf16::PANEL).map(move |j0| (i, j0)))
        .collect();
    let products: Vec<(usize, usize, Vec<f32>)> = tasks
        .into_par_iter()
        .map(|(i, j0)| {
            let m = matrices[i];
            let part = m.part(j0, bf16::PANEL.min(m.n - j0));
            (i, j0, bf16::panel_product(&xb, rows, &part))
        })
        .collect();
    matrices
        .par_iter()
        .enumerate()
        .map(|(i, m)| {
            let mut out = vec![0f32; rows * m.n];
            let mine: Vec<&(usize, usize, Vec<f32>)> =
                products.iter().filter(|p| p.0 == i).collect();
            for (r, row) in out.chunks_exact_mut(m.n).enumerate() {
                for (_, j0, c) in &mine {
                    let cols = c.len() / rows;
                    row[*j0..j0 + cols].copy_from_slice(&c[r * cols..(r + 1) * cols]);
                }
            }
            out
        })
        .collect()
}

/// Rows from which bf16 products run on packed panels rather than dot-product tiles: 64+
/// (Qwen2.5-1.5B's 8960 x 1536 at 96 rows 376-409 against 304-320 GFLOP/s, at 48 rows
/// 233-297 against 399-490; even at 64).
#[cfg(target_arch = "x86_64")]
const PANELS_FROM_ROWS: usize = 64;

/// Each `[n, rows]` product of `x_wt_many` as `[rows, n]`.
fn transposed(by_col: Vec<Vec<f32>>, matrices: &[&PackedMatrix], rows: usize) -> Vec<Vec<f32>> {
    if rows == 1 {
        return by_col;
    }
    by_col
        .iter()
        .zip(matrices)
        .map(|(cols, m)| {
            let mut out = vec![0f32; rows * m.n];
            for (j, col) in cols.chunks_exact(rows).enumerate() {
                for (r, &v) in col.iter().enumerate() {
                    out[r * m.n + j] = v;
                }
            }
            out
        })
        .collect()
}

/// f32 values per dequantised panel of `x_wt_long`, and its least number of weight rows.
const PANEL_FLOATS: usize = 512 * 1024;
const PANEL_MIN_ROWS: usize = 1024;

/// The weights of `part` in f32 into `out` (`[rows, k]`), vectorised where the CPU allows.
fn dequantize_part(part: &Part<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has AVX-512F and F16C (checked above).
            unsafe { dequantize_part_avx512(part, out) };
            return;
        }
        if std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            unsafe { dequantize_part_fma(part, out) };
            return;
        }
    }
    dequantize_part_any(part, out);
}

/// The groups of `part` beside their floats of `out` (`[rows, k]`): each group's codes (bytes,
/// or `group / 2` bytes of nibbles), its `group` floats and its index among the parameters.
/// The frame of the vectorised dequantisations.
fn groups_of<'a>(
    part: &'a Part<'_>,
    out: &'a mut [f32],
) -> impl Iterator<Item = (&'a [u8], &'a mut [f32], usize)> {
    let (k, group, bytes) = (part.k, part.group, part.row_bytes());
    assert!(
        out.len() >= part.codes.len() / bytes * k,
        "out is not [rows, k]"
    );
    let group_bytes = if part.nibbles { group / 2 } else { group };
    part.codes
        .chunks_exact(group_bytes)
        .zip(out.chunks_exact_mut(group))
        .enumerate()
        .map(|(at, (codes, dst))| (codes, dst, at))
}

/// Group `at`'s scale and bias; f16 pairs through F16C, in place of `half`'s conversion, which
/// checks the CPU on every call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
#[inline]
fn group_params_f16c(params: &ParamsRef<'_>, at: usize) -> (f32, f32) {
    use std::arch::x86_64::*;
    if !params.half() {
        return (params.s32[at], params.b32[at]);
    }
    let (s, b) = (params.s16[at] as i16, params.b16[at] as i16);
    let pair = _mm_cvtph_ps(_mm_setr_epi16(s, b, 0, 0, 0, 0, 0, 0));
    (_mm_cvtss_f32(pair), _mm_cvtss_f32(_mm_movehdup_ps(pair)))
}

/// `dequantize_part_any` in AVX2 and FMA: eight codes widened to f32 and scaled per
/// instruction (left to the compiler, the loops went through a libm `fmaf` call per weight).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_part_fma(part: &Part<'_>, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let low_nibbles = _mm_set1_epi8(15);
    for (codes, dst, at) in groups_of(part, out) {
        let (scale, bias) = group_params_f16c(&part.params, at);
        let (scale, bias) = (_mm256_set1_ps(scale), _mm256_set1_ps(bias));
        let (q, d) = (codes.as_ptr(), dst.as_mut_ptr());
        // SAFETY: `codes` are the group's (`dst.len()` codes, half as many bytes as nibbles),
        // and groups are multiples of 16 (32 as nibbles): every load and store below stays
        // inside them.
        unsafe {
            let widen = |eight: __m128i, at: usize| {
                let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
                _mm256_storeu_ps(d.add(at), _mm256_fmadd_ps(q, scale, bias));
            };
            if part.nibbles {
                for run in 0..dst.len() / 32 {
                    let v = _mm_loadu_si128(q.add(run * 16).cast());
                    let low = _mm_and_si128(v, low_nibbles);
                    let high = _mm_and_si128(_mm_srli_epi16(v, 4), low_nibbles);
                    let at = run * 32;
                    widen(low, at);
                    widen(_mm_srli_si128(low, 8), at + 8);
                    widen(high, at + 16);
                    widen(_mm_srli_si128(high, 8), at + 24);
                }
            } else {
                for at in (0..dst.len()).step_by(8) {
                    widen(_mm_loadl_epi64(q.add(at).cast()), at);
                }
            }
        }
    }
}

/// `dequantize_part_fma` 16 weights at a time: a chunk of a few rows after a cache hit
/// dequantises every weight of the model once, and at 8 a time that was a fifth of the
/// products' time on Qwen2.5-1.5B (perf, 25-token chunks). The same fused multiply-add per
/// weight, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn dequantize_part_avx512(part: &Part<'_>, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let low_nibbles = _mm512_set1_epi32(15);
    for (codes, dst, at) in groups_of(part, out) {
        let (scale, bias) = group_params_f16c(&part.params, at);
        let (scale, bias) = (_mm512_set1_ps(scale), _mm512_set1_ps(bias));
        let (q, d) = (codes.as_ptr(), dst.as_mut_ptr());
        // SAFETY: as in `dequantize_part_fma`.
        unsafe {
            let store = |lanes: __m512i, at: usize| {
                let w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), scale, bias);
                _mm512_storeu_ps(d.add(at), w);
            };
            if part.nibbles {
                for run in 0..dst.len() / 32 {
                    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(run * 16).cast()));
                    store(_mm512_and_si512(v, low_nibbles), run * 32);
                    store(_mm512_srli_epi32(v, 4), run * 32 + 16);
                }
            } else {
                for at in (0..dst.len()).step_by(16) {
                    store(_mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(at).cast())), at);
                }
            }
        }
    }
}

fn dequantize_part_any(part: &Part<'_>, out: &mut [f32]) {
    let (k, group, bytes) = (part.k, part.group, part.row_bytes());
    let groups = k / group;
    for (j, (row, dst)) in part
        .codes
        .chunks_exact(bytes)
        .zip(out.chunks_exact_mut(k))
        .enumerate()
    {
        for (g, dst) in dst.chunks_exact_mut(group).enumerate() {
            let (scale, bias) = part.params.get(j * groups + g);
            if part.nibbles {
                let codes = &row[g * group / 2..(g + 1) * group / 2];
                for (run, dst) in codes.chunks_exact(16).zip(dst.chunks_exact_mut(32)) {
                    // Unpacked to bytes first: two loops that the compiler vectorises.
                    let mut unpacked = [0u8; 32];
                    let (low, high) = unpacked.split_at_mut(16);
                    for ((l, h), &q) in low.iter_mut().zip(high).zip(run) {
                        (*l, *h) = (q & 15, q >> 4);
                    }
                    for (d, &q) in dst.iter_mut().zip(&unpacked) {
                        *d = f32::from(q).mul_add(scale, bias);
                    }
                }
            } else {
                let codes = &row[g * group..(g + 1) * group];
                for (d, &q) in dst.iter_mut().zip(codes) {
                    *d = f32::from(q).mul_add(scale, bias);
                }
            }
        }
    }
}

/// Code `t` of a row of codes laid out as `PackedMatrix` says.
fn code_in(row: &[u8], nibbles: bool, t: usize) -> u8 {
    if nibbles {
        let (run, i) = (t / 32, t % 32);
        row[run * 16 + i % 16] >> (4 * (i / 16)) & 15
    } else {
        row[t]
    }
}

/// The weight rows of one task.
struct Part<'a> {
    codes: &'a [u8],
    nibbles: bool,
    params: ParamsRef<'a>,
    k: usize,
    group: usize,
}

impl Part<'_> {
    fn row_bytes(&self) -> usize {
        if self.nibbles { self.k / 2 } else { self.k }
    }

    /// Weight row `j`'s codes `from..to` (whole groups, and whole runs of 32 as nibbles) as
    /// a part of one row `to - from` long.
    #[cfg(target_arch = "x86_64")]
    fn row_span(&self, j: usize, from: usize, to: usize) -> Part<'_> {
        let (bytes, groups) = (self.row_bytes(), self.k / self.group);
        let (b0, b1) = if self.nibbles {
            (from / 2, to / 2)
        } else {
            (from, to)
        };
        let (g0, g1) = (j * groups + from / self.group, j * groups + to / self.group);
        let params = &self.params;
        Part {
            codes: &self.codes[j * bytes + b0..j * bytes + b1],
            nibbles: self.nibbles,
            params: ParamsRef {
                s16: params.s16.get(g0..g1).unwrap_or(&[]),
                b16: params.b16.get(g0..g1).unwrap_or(&[]),
                s32: params.s32.get(g0..g1).unwrap_or(&[]),
                b32: params.b32.get(g0..g1).unwrap_or(&[]),
            },
            k: to - from,
            group: self.group,
        }
    }

    /// Weight rows `j..j + c` of this part.
    fn sub(&self, j: usize, c: usize) -> Part<'_> {
        let (bytes, groups) = (self.row_bytes(), self.k / self.group);
        let params = &self.params;
        Part {
            codes: &self.codes[j * bytes..(j + c) * bytes],
            nibbles: self.nibbles,
            params: ParamsRef {
                s16: params.s16.get(j * groups..(j + c) * groups).unwrap_or(&[]),
                b16: params.b16.get(j * groups..(j + c) * groups).unwrap_or(&[]),
                s32: params.s32.get(j * groups..(j + c) * groups).unwrap_or(&[]),
                b32: params.b32.get(j * groups..(j + c) * groups).unwrap_or(&[]),
            },
            k: self.k,
            group: self.group,
        }
    }
}

/// Rows of `x` from which a task's weight rows are dequantised once, a few at a time into a
/// buffer that stays in L1, and the tiles multiply that: below, each tile of 4 rows widens
/// and scales the codes itself, which for 13-48 rows (a short chunk after a cache hit) meant
/// dequantising every weight 4-12 times.
const DEQUANTISE_FROM_ROWS: usize = 8;

/// Weight rows dequantised at a time (4 rows of up to 8960 floats: 140 KiB at most, in L2;
/// 24 KiB for a 1536-wide matrix).
const DEQUANTISED_ROWS: usize = 4;

/// Bytes ahead of each weight row's codes that a tile on codes asks the CPU to fetch, one
/// line per group. A decode step streams every weight from memory once, and the hardware
/// prefetcher alone kept too few lines in flight for 4 rows' streams: Qwen2.5-1.5B's decode
/// went from 9-10 to 12-15 tokens/s with 512 bytes, SmolLM2's from 89-99 to 126-163 (2 cores,
/// one run each of 0 and 256-2048; 512-2048 alike within the machine's noise).
/// `STRATA_PREFETCH_BYTES` overrides it (0: none), to measure.
fn prefetch_distance() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var("STRATA_PREFETCH_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(512)
    })
}

/// Where a tile on dequantised weights lies (`tile_f32` here, `tile_bf16` in `bf16`): its
/// first row of `x` and weight row in the buffer, its span of `k`, the row length and the
/// number of rows of `x`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Tile {
    r0: usize,
    j: usize,
    from: usize,
    to: usize,
    k: usize,
    rows: usize,
}

/// Floats of `k` per span of `dequantised_columns` (rounded up to whole steps): a 4 x 6 tile's
/// span of weights and of `x` (40 KiB) stays in a 48 KiB L1.
const SPAN: usize = 1024;

/// `out[j * rows + r] = x[r] · w[j]` for the weight rows of `part`.
fn columns(x: &[f32], rows: usize, part: &Part<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f16c = std::arch::is_x86_feature_detected!("f16c");
        if f16c && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F and F16C (checked above).
            unsafe { avx512::columns(x, rows, part, out) };
            return;
        }
        if f16c
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            unsafe { avx2::columns(x, rows, part, out) };
            return;
        }
    }
    columns_scalar(x, rows, part, out);
}

fn columns_scalar(x: &[f32], rows: usize, part: &Part<'_>, out: &mut [f32]) {
    let (k, groups, bytes) = (part.k, part.k / part.group, part.row_bytes());
    for j in 0..part.codes.len() / bytes {
        let row = &part.codes[j * bytes..(j + 1) * bytes];
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            let mut sum = 0f32;
            for (t, &xv) in xr.iter().enumerate() {
                let q = code_in(row, part.nibbles, t);
                let (scale, bias) = part.params.get(j * groups + t / part.group);
                let w = f32::from(q).mul_add(scale, bias);
                sum = xv.mul_add(w, sum);
            }
            out[j * rows + r] = sum;
        }
    }
}

/// `$tile::<R, C, ...>(...)` for a tile of `R` rows of `x` by `C` weight rows known only at
/// run time (1-6 by 1-4): the kernels are generic over both so that their accumulators live
/// in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! by_shape {
    // A kernel generic over the shape alone.
    ($t:expr, $c:expr, $tile:ident($($a:expr),*)) => {
        by_shape!($t, $c, $tile::<>($($a),*))
    };
    ($t:expr, $c:expr, $tile:ident::<$($g:ident),*>($($a:expr),*)) => {
        match ($t, $c) {
            (1, 1) => $tile::<1, 1, $($g),*>($($a),*),
            (1, 2) => $tile::<1, 2, $($g),*>($($a),*),
            (1, 3) => $tile::<1, 3, $($g),*>($($a),*),
            (1, 4) => $tile::<1, 4, $($g),*>($($a),*),
            (2, 1) => $tile::<2, 1, $($g),*>($($a),*),
            (2, 2) => $tile::<2, 2, $($g),*>($($a),*),
            (2, 3) => $tile::<2, 3, $($g),*>($($a),*),
            (2, 4) => $tile::<2, 4, $($g),*>($($a),*),
            (3, 1) => $tile::<3, 1, $($g),*>($($a),*),
            (3, 2) => $tile::<3, 2, $($g),*>($($a),*),
            (3, 3) => $tile::<3, 3, $($g),*>($($a),*),
            (3, 4) => $tile::<3, 4, $($g),*>($($a),*),
            (4, 1) => $tile::<4, 1, $($g),*>($($a),*),
            (4, 2) => $tile::<4, 2, $($g),*>($($a),*),
            (4, 3) => $tile::<4, 3, $($g),*>($($a),*),
            (4, 4) => $tile::<4, 4, $($g),*>($($a),*),
            (5, 1) => $tile::<5, 1, $($g),*>($($a),*),
            (5, 2) => $tile::<5, 2, $($g),*>($($a),*),
            (5, 3) => $tile::<5, 3, $($g),*>($($a),*),
            (5, 4) => $tile::<5, 4, $($g),*>($($a),*),
            (6, 1) => $tile::<6, 1, $($g),*>($($a),*),
            (6, 2) => $tile::<6, 2, $($g),*>($($a),*),
            (6, 3) => $tile::<6, 3, $($g),*>($($a),*),
            (6, 4) => $tile::<6, 4, $($g),*>($($a),*),
            (t, c) => unreachable!("no {t} x {c} tile"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod bf16;
#[cfg(target_arch = "x86_64")]
pub use bf16::{bf16_products, set_bf16_products};

/// Products in bf16 need AVX-512 BF16 (`bf16`): elsewhere they stay f32.
#[cfg(not(target_arch = "x86_64"))]
pub fn set_bf16_products(_on: bool) -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub fn bf16_products() -> bool {
    false
}

/// One module per instruction set, as in `matmul`: tiles of up to 4 rows of `x` by
/// `$code_cols` weight rows; each chunk of codes is widened and dequantised once in registers
/// and then serves the tile's rows. Past a few rows, tiles of up to `$rows` by `$cols` multiply
/// weights dequantised into a buffer. `$bytes` and `$nibbles` load `$lanes` codes as f32 from
/// bytes or nibbles. The tile sizes are what the registers hold (16 in AVX2, 32 in AVX-512):
/// a tile's accumulators are independent chains of multiply-adds, and with 8 of them (4 x 2)
/// a core waited on their latency and on L2 for weights and `x` it could have reused. With
/// 6 x 4 tiles and spans of `k`, products of 16-48 rows by Qwen2.5-1.5B's matrices took
/// 25-40% less time (`benches/packed.rs`, medians of three alternating runs), a 25-token
/// chunk after a cache hit 22% less. Every output is one chain over `k` in the same order
/// whatever the tile, so the tile sizes do not change a bit of it.
#[cfg(target_arch = "x86_64")]
macro_rules! packed_kernel {
    ($module:ident, $feature:literal, $vector:ty, $lanes:expr, $code_cols:expr, $rows:expr,
     $cols:expr,
     $zero:ident, $load:ident, $set1:ident, $half_set1:expr, $fma:ident, $bytes:expr,
     $nibbles:expr, $sum:expr) => {
        mod $module {
            use super::{Part, Tile};
            use std::arch::x86_64::*;

            const LANES: usize = $lanes;
            /// Weight rows per tile on codes; rows of `x` and weight rows per tile on
            /// dequantised weights.
            const CODE_COLS: usize = $code_cols;
            const ROWS: usize = $rows;
            const COLS: usize = $cols;

            #[target_feature(enable = $feature)]
            pub unsafe fn columns(x: &[f32], rows: usize, part: &Part<'_>, out: &mut [f32]) {
                // SAFETY (of each call): the caller's features.
                unsafe {
                    match (part.nibbles, part.params.half()) {
                        (true, true) => columns_of::<true, true>(x, rows, part, out),
                        (true, false) => columns_of::<true, false>(x, rows, part, out),
                        (false, true) => columns_of::<false, true>(x, rows, part, out),
                        (false, false) => columns_of::<false, false>(x, rows, part, out),
                    }
                }
            }

            #[target_feature(enable = $feature)]
            unsafe fn columns_of<const NIB: bool, const HALF: bool>(
                x: &[f32],
                rows: usize,
                part: &Part<'_>,
                out: &mut [f32],
            ) {
                let cols = part.codes.len() / part.row_bytes();
                if rows >= super::DEQUANTISE_FROM_ROWS {
                    // SAFETY: the caller's features.
                    unsafe { dequantised_columns::<NIB>(x, rows, part, out) };
                    return;
                }
                // Wider tiles for one or two rows only: at 4 x 4 the dequantised weights and
                // their scales no longer fit the registers beside 16 accumulators.
                let widest = if rows <= 2 { CODE_COLS } else { 2 };
                let mut j = 0;
                while j < cols {
                    let c = (cols - j).min(widest);
                    let mut r = 0;
                    while r < rows {
                        let t = (rows - r).min(4);
                        // SAFETY: `tile` asserts that its rows, columns and outputs exist.
                        unsafe { by_shape!(t, c, tile::<NIB, HALF>(x, r, part, j, rows, out)) };
                        r += t;
                    }
                    j += c;
                }
            }

            /// `columns` for many rows of `x`: a few weight rows at a time dequantised into
            /// a buffer (as `tile` computes each weight), then tiles over every row of `x`
            /// reading the buffer, with `tile`'s order of multiply-adds: each output is bit
            /// for bit what `tile` gives.
            #[target_feature(enable = $feature)]
            unsafe fn dequantised_columns<const NIB: bool>(
                x: &[f32],
                rows: usize,
                part: &Part<'_>,
                out: &mut [f32],
            ) {
                let k = part.k;
                let cols = part.codes.len() / part.row_bytes();
                let mut buffer = vec![0f32; super::DEQUANTISED_ROWS * k];
                // Each tile's accumulators between spans of `k`, `[rows, DEQUANTISED_ROWS]`.
                let mut sums = vec![$zero(); rows * super::DEQUANTISED_ROWS];
                let step = if NIB { 32 } else { LANES };
                let span = super::SPAN.div_ceil(step) * step;
                let mut j0 = 0;
                while j0 < cols {
                    let n = super::DEQUANTISED_ROWS.min(cols - j0);
                    super::dequantize_part(&part.sub(j0, n), &mut buffer[..n * k]);
                    let mut from = 0;
                    while from < k {
                        let to = (from + span).min(k);
                        let mut j = 0;
                        while j < n {
                            let c = (n - j).min(COLS);
                            let w = &buffer[j * k..(j + c) * k];
                            let o = &mut out[(j0 + j) * rows..(j0 + j + c) * rows];
                            let mut r = 0;
                            while r < rows {
                                let t = (rows - r).min(ROWS);
                                let tile = Tile {
                                    r0: r,
                                    j,
                                    from,
                                    to,
                                    k,
                                    rows,
                                };
                                // SAFETY: `tile_f32` asserts that its rows, columns, sums and
                                // outputs exist.
                                unsafe {
                                    by_shape!(t, c, tile_f32::<NIB>(x, w, &tile, &mut sums, o))
                                };
                                r += t;
                            }
                            j += c;
                        }
                        from = to;
                    }
                    j0 += n;
                }
            }

            /// `tile` on dequantised weights `w` (`[C, k]`) over the span `from..to` of `k`:
            /// the same loads of `x` and the same multiply-adds in the same order. The
            /// accumulators start from `sums` (`[rows, DEQUANTISED_ROWS]`, zero before the
            /// first span) and go back there; after the last span each is summed into `out`,
            /// as `tile` sums them, so splitting `k` changes no bit. Spans keep a tile's weights
            /// in L1 while every row of `x` passes over them: over the whole of a long row
            /// (Qwen2.5-1.5B's 8960) the tile's weights and rows of `x` left L1 and L2's
            /// bandwidth set the pace.
            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn tile_f32<const R: usize, const C: usize, const NIB: bool>(
                x: &[f32],
                w: &[f32],
                tile: &Tile,
                sums: &mut [$vector],
                out: &mut [f32],
            ) {
                let Tile {
                    r0,
                    j,
                    from,
                    to,
                    k,
                    rows,
                } = *tile;
                let width = super::DEQUANTISED_ROWS;
                assert!((r0 + R) * k <= x.len() && C * k <= w.len() && to <= k);
                assert!((C - 1) * rows + r0 + R <= out.len());
                assert!((r0 + R - 1) * width + j + C <= sums.len() && j + C <= width);
                assert!((to - from).is_multiple_of(if NIB { 32 } else { LANES }));
                let (xp, wp) = (x.as_ptr(), w.as_ptr());
                let mut acc: [[$vector; C]; R] = [[$zero(); C]; R];
                if from > 0 {
                    for (i, row) in acc.iter_mut().enumerate() {
                        row.copy_from_slice(&sums[(r0 + i) * width + j..][..C]);
                    }
                }
                let mut at = from;
                while NIB && at < to {
                    for u in (0..16).step_by(LANES) {
                        // The low weights into every accumulator, then the high ones: each
                        // accumulator's order is `tile`'s, and only `C` weight vectors are
                        // live at a time (a 6 x 4 tile's 24 accumulators leave room for 4).
                        for half in [u, 16 + u] {
                            // SAFETY: at + 32 <= to <= k inside every row (asserted above).
                            unsafe {
                                let mut wv: [$vector; C] = [$zero(); C];
                                for c in 0..C {
                                    wv[c] = $load(wp.add(c * k + at + half));
                                }
                                for (i, row) in acc.iter_mut().enumerate() {
                                    let xv = $load(xp.add((r0 + i) * k + at + half));
                                    for c in 0..C {
                                        row[c] = $fma(xv, wv[c], row[c]);
                                    }
                                }
                            }
                        }
                    }
                    at += 32;
                }
                while !NIB && at < to {
                    // SAFETY: at + LANES <= to <= k inside every row (asserted above).
                    unsafe {
                        let mut wv: [$vector; C] = [$zero(); C];
                        for c in 0..C {
                            wv[c] = $load(wp.add(c * k + at));
                        }
                        for (i, row) in acc.iter_mut().enumerate() {
                            let xv = $load(xp.add((r0 + i) * k + at));
                            for (a, wc) in row.iter_mut().zip(&wv) {
                                *a = $fma(xv, *wc, *a);
                            }
                        }
                    }
                    at += LANES;
                }
                for (i, row) in acc.iter().enumerate() {
                    if to < k {
                        sums[(r0 + i) * width + j..][..C].copy_from_slice(row);
                        continue;
                    }
                    for (c, a) in row.iter().enumerate() {
                        out[c * rows + r0 + i] = $sum(*a);
                    }
                }
            }

            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn tile<const R: usize, const C: usize, const NIB: bool, const HALF: bool>(
                x: &[f32],
                r0: usize,
                part: &Part<'_>,
                j0: usize,
                rows: usize,
                out: &mut [f32],
            ) {
                let (k, group, bytes) = (part.k, part.group, part.row_bytes());
                let groups = k / group;
                assert!((r0 + R) * k <= x.len() && (j0 + C) * bytes <= part.codes.len());
                let p = part.params;
                assert!((j0 + C) * groups <= p.len());
                assert!(p.s16.len() == p.b16.len() && p.s32.len() == p.b32.len());
                assert!((j0 + C - 1) * rows + r0 + R <= out.len());
                assert!(group.is_multiple_of(LANES) && k.is_multiple_of(group));
                let (xp, cp) = (x.as_ptr(), part.codes.as_ptr());
                let mut acc: [[$vector; C]; R] = [[$zero(); C]; R];
                let ahead = super::prefetch_distance();
                let group_bytes = if NIB { group / 2 } else { group };
                for g in 0..groups {
                    if ahead > 0 {
                        // A hint only: it never faults, and a line past the codes is harmless.
                        for c in 0..C {
                            let line = cp.wrapping_add((j0 + c) * bytes + g * group_bytes + ahead);
                            _mm_prefetch::<_MM_HINT_T0>(line.cast());
                        }
                    }
                    let mut scale: [$vector; C] = [$zero(); C];
                    let mut bias: [$vector; C] = [$zero(); C];
                    for c in 0..C {
                        let at = (j0 + c) * groups + g;
                        if HALF {
                            scale[c] = $half_set1(p.s16[at]);
                            bias[c] = $half_set1(p.b16[at]);
                        } else {
                            scale[c] = $set1(p.s32[at]);
                            bias[c] = $set1(p.b32[at]);
                        }
                    }
                    let mut at = g * group;
                    let end = at + group;
                    while NIB && at < end {
                        // A run of 32 codes in 16 bytes: each load of LANES bytes gives the
                        // weights at `at + u` (low nibbles) and `at + 16 + u` (high ones).
                        for u in (0..16).step_by(LANES) {
                            // SAFETY: the run lies inside each row (k is a multiple of the
                            // group, itself of 32), and its bytes at at / 2 + u.. inside the
                            // row's k / 2.
                            unsafe {
                                let mut low: [$vector; C] = [$zero(); C];
                                let mut high: [$vector; C] = [$zero(); C];
                                for c in 0..C {
                                    let (l, h) = $nibbles(cp.add((j0 + c) * bytes + at / 2 + u));
                                    low[c] = $fma(l, scale[c], bias[c]);
                                    high[c] = $fma(h, scale[c], bias[c]);
                                }
                                for (i, row) in acc.iter_mut().enumerate() {
                                    let xl = $load(xp.add((r0 + i) * k + at + u));
                                    let xh = $load(xp.add((r0 + i) * k + at + 16 + u));
                                    for c in 0..C {
                                        row[c] = $fma(xl, low[c], row[c]);
                                        row[c] = $fma(xh, high[c], row[c]);
                                    }
                                }
                            }
                        }
                        at += 32;
                    }
                    while !NIB && at < end {
                        // SAFETY: at + LANES <= k inside each row (asserted above).
                        unsafe {
                            let mut w: [$vector; C] = [$zero(); C];
                            for c in 0..C {
                                let q = $bytes(cp.add((j0 + c) * bytes + at));
                                w[c] = $fma(q, scale[c], bias[c]);
                            }
                            for (i, row) in acc.iter_mut().enumerate() {
                                let xv = $load(xp.add((r0 + i) * k + at));
                                for (a, wc) in row.iter_mut().zip(&w) {
                                    *a = $fma(xv, *wc, *a);
                                }
                            }
                        }
                        at += LANES;
                    }
                }
                for (i, row) in acc.iter().enumerate() {
                    for (c, a) in row.iter().enumerate() {
                        out[(j0 + c) * rows + r0 + i] = $sum(*a);
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
packed_kernel!(
    avx2,
    "avx2,fma,f16c",
    __m256,
    8,
    2,
    4,
    2,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_set1_ps,
    // f16 bits broadcast and widened to f32 (F16C).
    |h: u16| _mm256_cvtph_ps(_mm_set1_epi16(h as i16)),
    _mm256_fmadd_ps,
    // Called inside `tile`'s unsafe block, on 8 readable bytes (`_mm_loadl_epi64` reads 8).
    |p: *const u8| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))),
    // 8 bytes widened to 8 lanes: their low nibbles, then their high ones.
    |p: *const u8| {
        let lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        (
            _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(15))),
            _mm256_cvtepi32_ps(_mm256_srli_epi32(lanes, 4)),
        )
    },
    |v: __m256| {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        lanes.iter().sum::<f32>()
    }
);

#[cfg(target_arch = "x86_64")]
packed_kernel!(
    avx512,
    "avx512f,f16c",
    __m512,
    16,
    4,
    6,
    4,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_set1_ps,
    // f16 bits broadcast and widened to f32.
    |h: u16| _mm512_cvtph_ps(_mm256_set1_epi16(h as i16)),
    _mm512_fmadd_ps,
    // Called inside `tile`'s unsafe block, on 16 readable bytes.
    |p: *const u8| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))),
    // 16 bytes widened to 16 lanes: their low nibbles, then their high ones.
    |p: *const u8| {
        let lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        (
            _mm512_cvtepi32_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(15))),
            _mm512_cvtepi32_ps(_mm512_srli_epi32(lanes, 4)),
        )
    },
    |v: __m512| _mm512_reduce_add_ps(v)
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values::values;

    /// MLX's packing of `codes` (`bits` each, low bits first, values straddling words).
    fn pack(codes: &[u8], bits: usize) -> Vec<u32> {
        let mut words = vec![0u32; codes.len() * bits / 32];
        for (i, &q) in codes.iter().enumerate() {
            for b in 0..bits {
                if q >> b & 1 == 1 {
                    let bit = i * bits + b;
                    words[bit / 32] |= 1 << (bit % 32);
                }
            }
        }
        words
    }

    fn matrix(n: usize, k: usize, bits: usize, group: usize) -> (PackedMatrix, Vec<u8>) {
        let codes: Vec<u8> = values(n * k, 3)
            .iter()
            .map(|v| ((v + 0.5) * (1 << bits) as f32) as u8 & ((1 << bits) - 1) as u8)
            .collect();
        let groups = n * k / group;
        // Scales and biases as the files have them: f16 values.
        let f16 = |v: f32| half::f16::from_f32(v).to_f32();
        let scales: Vec<f32> = values(groups, 4).iter().map(|v| f16(v * 0.1)).collect();
        let biases: Vec<f32> = values(groups, 5).iter().map(|v| f16(v * 0.3)).collect();
        let m =
            PackedMatrix::from_mlx_words(&pack(&codes, bits), bits, &scales, &biases, n, k, group)
                .unwrap();
        (m, codes)
    }

    /// Many rows go through weights dequantised into a buffer, a few through tiles that
    /// dequantise in registers: each row's output is the same bits either way (so a sequence
    /// gets the same logits whatever it is batched with).
    #[test]
    fn many_rows_give_each_row_the_bits_it_gets_alone() {
        for &(n, k, bits, group) in &[
            (37, 576, 4, 32),
            (19, 128, 8, 64),
            (9, 96, 6, 32),
            (11, 64, 4, 16),
            // Rows longer than a span of `dequantised_columns`.
            (7, 2080, 4, 32),
            (5, 1040, 8, 16),
        ] {
            let (m, _) = matrix(n, k, bits, group);
            let rows = 13;
            let x = values(rows * k, 7);
            let together = m.x_wt(&x, rows);
            for r in 0..rows {
                let alone = m.x_wt(&x[r * k..(r + 1) * k], 1);
                assert_eq!(
                    together[r * n..(r + 1) * n]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{bits} bits, groups of {group}, row {r}"
                );
            }
        }
    }

    /// bf16 products (called directly: the process-wide switch stays off for the other
    /// tests) stay within their rounding of the exact product of the dequantised weights:
    /// each of `x` and `w` is off by at most 2^-9 of itself, so each term by about 2^-8.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn bf16_products_stay_within_their_rounding() {
        if !bf16::available() {
            eprintln!("no AVX-512 BF16 on this CPU: nothing to check");
            return;
        }
        for &(rows, n, k, bits, group) in &[
            (8, 37, 576, 4, 32),
            // Panels of every width (16-64 weight rows, and a second panel), spans of `k`.
            (50, 150, 608, 4, 32),
            (7, 48, 96, 8, 16),
            (13, 19, 128, 8, 64),
            (25, 11, 64, 4, 16),
            (9, 9, 96, 6, 32),
            // Longer than a span, and a tile's every shape.
            (31, 7, 2080, 4, 32),
            (14, 5, 1056, 8, 16),
        ] {
            let (half, codes) = matrix(n, k, bits, group);
            // The same codes with scales and biases that f16 cannot hold (a K-quant's).
            let groups = n * k / group;
            let scales: Vec<f32> = values(groups, 4).iter().map(|v| v * 0.1 + 1e-6).collect();
            let biases: Vec<f32> = values(groups, 5).iter().map(|v| v * 0.3 + 1e-6).collect();
            let single =
                PackedMatrix::from_codes(&codes, bits, &scales, &biases, n, k, group).unwrap();
            assert!(matches!(single.params, Params::Single { .. }));
            for m in [half, single] {
                let w = m.dequantize();
                let x = values(rows * k, 11);
                let mut by_col = vec![0f32; n * rows];
                bf16::columns(&bf16::round_rows(&x), rows, &m.part(0, n), &mut by_col);
                // And as panels, where the shape allows (weight rows in sixteens).
                let mut panels = vec![0f32; n / 16 * 16 * rows];
                if n >= 16 && bf16::panels_apply(k, group) {
                    for (t, out) in panels.chunks_mut(bf16::PANEL * rows).enumerate() {
                        let part = m.part(t * bf16::PANEL, out.len() / rows);
                        let c = bf16::panel_product(&bf16::round_rows(&x), rows, &part);
                        let cols = c.len() / rows;
                        for (j, col) in out.chunks_exact_mut(rows).enumerate() {
                            for (r, v) in col.iter_mut().enumerate() {
                                *v = c[r * cols + j];
                            }
                        }
                    }
                }
                for r in 0..rows {
                    for j in 0..n {
                        let terms = (0..k).map(|t| x[r * k + t] as f64 * w[j * k + t] as f64);
                        let want: f64 = terms.clone().sum();
                        let size: f64 = terms.map(f64::abs).sum();
                        let bound = size * (2f64.powi(-8) + k as f64 * 2f64.powi(-24));
                        let got = by_col[j * rows + r] as f64;
                        assert!(
                            (got - want).abs() <= bound,
                            "{rows}x{n}x{k} {bits} bits, groups of {group}: {got} vs {want}"
                        );
                        if n >= 16 && j < n / 16 * 16 && bf16::panels_apply(k, group) {
                            let got = panels[j * rows + r] as f64;
                            assert!(
                                (got - want).abs() <= bound,
                                "panels {rows}x{n}x{k} {bits} bits: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The scalar rounding of a row's tail is the instruction's: nearest, ties to even.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn bf16_rounding_of_tails_is_the_instructions() {
        if !bf16::available() {
            return;
        }
        let specials = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -1.0 - 2f32.powi(-8),
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            -0.0,
            1e-40,
        ];
        let mut x: Vec<f32> = specials.to_vec();
        x.extend(values(40, 12).iter().map(|v| v * 1e3));
        for &v in &x {
            // 17 values: the first 16 through the instruction, the last through the tail.
            let row = [v; 17];
            let rounded = bf16::round_rows(&row);
            assert_eq!(rounded[0], rounded[16], "{v:e}");
        }
    }

    #[test]
    fn mlx_words_unpack_to_their_codes_at_every_width() {
        for bits in [2, 3, 4, 5, 6, 8] {
            let (m, codes) = matrix(3, 64, bits, 32);
            let held: Vec<u8> = (0..3 * 64).map(|i| m.code(i / 64, i % 64)).collect();
            assert_eq!(held, codes, "{bits} bits");
            assert_eq!(m.codes.len(), if bits <= 4 { 96 } else { 192 });
            // Groups of 16 keep 4-bit codes a byte each.
            let (m, codes) = matrix(2, 64, bits, 16);
            let held: Vec<u8> = (0..2 * 64).map(|i| m.code(i / 64, i % 64)).collect();
            assert_eq!(
                (held, m.codes.len()),
                (codes, 128),
                "{bits} bits, groups of 16"
            );
        }
    }

    #[test]
    fn matches_a_double_precision_product_of_the_dequantised_weights() {
        for &(rows, n, k, bits, group) in &[
            (1, 1, 32, 8, 32),
            (3, 5, 64, 4, 32),
            (4, 64, 576, 8, 64),
            (7, 33, 128, 4, 128),
            (16, 70, 1536, 8, 32),
            (13, 97, 96, 6, 32),
            (5, 9, 64, 4, 16),
            (2, 9, 96, 3, 32),
        ] {
            let (m, _) = matrix(n, k, bits, group);
            let w = m.dequantize();
            let x = values(rows * k, 1);
            let got = m.x_wt(&x, rows);
            for r in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| x[r * k + t] as f64 * w[j * k + t] as f64)
                        .sum();
                    let g = got[r * n + j];
                    // Weights reach |0.05 · 255 + 0.15|: rounding grows like sqrt(k) times that.
                    assert!(
                        (g as f64 - want).abs() <= 1e-5 * (k as f64).sqrt() * 14.0,
                        "{rows}x{n}x{k} {bits} bits: {g} vs {want}"
                    );
                }
            }
        }
    }

    /// A row-major `C = A · Bᵀ` in plain Rust with CBLAS's signature: the BLAS that the
    /// worker finds in its process, stood in for in this crate's tests.
    unsafe extern "C" fn reference_sgemm(
        layout: i32,
        trans_a: i32,
        trans_b: i32,
        m: i32,
        n: i32,
        k: i32,
        alpha: f32,
        a: *const f32,
        lda: i32,
        b: *const f32,
        ldb: i32,
        beta: f32,
        c: *mut f32,
        ldc: i32,
    ) {
        use crate::blas::{NO_TRANS, ROW_MAJOR, TRANS};
        assert_eq!((layout, trans_a, trans_b), (ROW_MAJOR, NO_TRANS, TRANS));
        assert_eq!(beta, 0.0);
        for i in 0..m as usize {
            for j in 0..n as usize {
                let mut sum = 0f64;
                for t in 0..k as usize {
                    // SAFETY: the caller passes matrices of the sizes and strides given.
                    unsafe {
                        sum += *a.add(i * lda as usize + t) as f64
                            * *b.add(j * ldb as usize + t) as f64;
                    }
                }
                // SAFETY: as above.
                unsafe { *c.add(i * ldc as usize + j) = alpha * sum as f32 };
            }
        }
    }

    #[test]
    fn rows_dequantise_as_the_whole_matrix_does() {
        for (n, k, bits, group) in [
            (37, 64, 4, 32),
            (5, 96, 6, 16),
            (9, 256, 8, 128),
            (6, 64, 3, 32),
        ] {
            let (m, _) = matrix(n, k, bits, group);
            let whole = m.dequantize();
            let mut rows = vec![0f32; 3 * k];
            m.dequantize_rows_into(2, &mut rows);
            assert_eq!(rows, whole[2 * k..5 * k], "{bits} bits, groups of {group}");
            let gathered = m.gather_rows(&[4, 0, 4]).unwrap();
            assert_eq!(gathered[..k], whole[4 * k..5 * k]);
            assert_eq!(gathered[k..2 * k], whole[..k]);
            assert!(m.gather_rows(&[n]).is_none(), "a row past the matrix");
            // Each instruction set's dequantisation, whichever `dequantize_part` picks here.
            #[cfg(target_arch = "x86_64")]
            {
                let part = m.part(0, n);
                let mut out = vec![0f32; n * k];
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
                {
                    // SAFETY: the CPU has the features (checked above).
                    unsafe { dequantize_part_fma(&part, &mut out) };
                    assert_eq!(out, whole, "AVX2, {bits} bits");
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("f16c")
                {
                    // SAFETY: the CPU has the features (checked above).
                    unsafe { dequantize_part_avx512(&part, &mut out) };
                    assert_eq!(out, whole, "AVX-512, {bits} bits");
                }
            }
        }
        // f32 scales and biases (a K-quant's): the other parameter path.
        let (n, k, group) = (6, 96, 16);
        let codes: Vec<u8> = (0..n * k).map(|i| (i * 7 % 64) as u8).collect();
        let groups = n * k / group;
        let scales: Vec<f32> = (0..groups).map(|g| 0.01 + g as f32 * 1e-7).collect();
        let biases: Vec<f32> = (0..groups).map(|g| -0.3 + g as f32 * 3e-7).collect();
        let m = PackedMatrix::from_codes(&codes, 6, &scales, &biases, n, k, group).unwrap();
        assert!(matches!(m.params, Params::Single { .. }));
        let mut rows = vec![0f32; n * k];
        m.dequantize_rows_into(0, &mut rows);
        assert_eq!(rows, m.dequantize());
    }

    /// Panels cover every weight row once, in place, whatever their size against the matrix's.
    #[test]
    fn long_products_by_panels_equal_the_product_of_the_dequantised_weights() {
        // k = 4096 makes panels of 1024 rows: 1100 rows take two, the second one short.
        for (rows, n, k, bits, group) in [
            (3, 1100, 4096, 4, 32),
            (40, 70, 96, 8, 32),
            (1, 3, 64, 6, 16),
        ] {
            let (m, _) = matrix(n, k, bits, group);
            let w = m.dequantize();
            let x = values(rows * k, 9);
            let got = m.x_wt_long(&x, rows, reference_sgemm);
            assert_eq!(got.len(), rows * n);
            for r in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| x[r * k + t] as f64 * w[j * k + t] as f64)
                        .sum();
                    assert!(
                        (got[r * n + j] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                        "{rows}x{n}x{k}: row {r} column {j}"
                    );
                }
            }
        }
    }

    /// Every code path this CPU can run computes the same products as the scalar one.
    #[test]
    fn the_vector_paths_equal_the_scalar_one() {
        for (bits, group, f32_scales) in
            [(4, 32, false), (8, 32, false), (4, 32, true), (6, 16, true)]
        {
            let (m, codes) = matrix(5, 128, bits, group);
            let m = if f32_scales {
                // Scales f16 cannot hold: the f32 path.
                let (scale, bias) = m.params.get(0);
                let groups = 5 * 128 / group;
                let scales: Vec<f32> = (0..groups).map(|g| scale + g as f32 * 1e-7).collect();
                let m = PackedMatrix::from_codes(
                    &codes,
                    bits,
                    &scales,
                    &vec![bias; groups],
                    5,
                    128,
                    group,
                )
                .unwrap();
                assert!(matches!(m.params, Params::Single { .. }));
                m
            } else {
                m
            };
            let rows = 6;
            let x = values(rows * 128, 7);
            let part = m.part(0, m.n);
            let mut want = vec![0f32; m.n * rows];
            columns_scalar(&x, rows, &part, &mut want);
            let close = |got: &[f32], path: &str| {
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                        "{path}, {bits} bits"
                    );
                }
            };
            #[cfg(target_arch = "x86_64")]
            {
                let f16c = std::arch::is_x86_feature_detected!("f16c");
                if f16c && std::arch::is_x86_feature_detected!("avx512f") {
                    let mut got = vec![0f32; m.n * rows];
                    // SAFETY: checked above.
                    unsafe { avx512::columns(&x, rows, &part, &mut got) };
                    close(&got, "avx512");
                }
                if f16c
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    let mut got = vec![0f32; m.n * rows];
                    // SAFETY: checked above.
                    unsafe { avx2::columns(&x, rows, &part, &mut got) };
                    close(&got, "avx2");
                }
            }
        }
    }

    #[test]
    fn several_matrices_in_one_pass_compute_as_each_alone() {
        let (a, _) = matrix(40, 64, 4, 32);
        let (b, _) = matrix(7, 64, 8, 64);
        for rows in [1, 3] {
            let x = values(rows * 64, 11);
            let both = x_wt_many(&[&a, &b], &x, rows);
            assert_eq!(both, vec![a.x_wt(&x, rows), b.x_wt(&x, rows)]);
        }
    }

    #[test]
    fn rows_cut_a_fused_matrix_into_parts_that_compute_alike() {
        let (m, _) = matrix(12, 64, 4, 32);
        let x = values(64, 9);
        let whole = m.x_wt(&x, 1);
        let (a, b) = (m.rows(0, 5).unwrap(), m.rows(5, 7).unwrap());
        let mut parts = a.x_wt(&x, 1);
        parts.extend(b.x_wt(&x, 1));
        assert_eq!(parts, whole);
        assert!(m.rows(6, 7).is_none());
    }

    #[test]
    fn scales_that_f16_cannot_hold_exactly_stay_f32() {
        let words = [0x0403_0201u32; 8];
        let half = |s: f32, b: f32| {
            let m = PackedMatrix::from_mlx_words(&words, 8, &[s], &[b], 1, 32, 32).unwrap();
            (matches!(m.params, Params::Half { .. }), m.dequantize()[2])
        };
        assert_eq!(half(0.125, -2.5), (true, 3.0f32.mul_add(0.125, -2.5)));
        assert_eq!(half(0.1, 0.0), (false, 3.0f32 * 0.1));
        assert_eq!(half(0.125, 1e-9), (false, 3.0f32.mul_add(0.125, 1e-9)));
    }

    #[test]
    fn shapes_that_do_not_add_up_are_refused() {
        assert!(PackedMatrix::from_codes(&[16; 32], 4, &[1.0], &[0.0], 1, 32, 32).is_err());
        assert!(PackedMatrix::from_mlx_words(&[0; 8], 8, &[0.0; 1], &[0.0; 1], 1, 32, 24).is_err());
        assert!(PackedMatrix::from_mlx_words(&[0; 7], 8, &[0.0; 1], &[0.0; 1], 1, 32, 32).is_err());
        assert!(PackedMatrix::from_mlx_words(&[0; 8], 7, &[0.0; 1], &[0.0; 1], 1, 32, 32).is_err());
    }
}
