//! Products of many rows (a chunk of a prompt) in bfloat16 on CPUs with AVX-512 BF16: the
//! weights are dequantised from their codes in f32 as everywhere else, then rounded to bf16,
//! `x` is rounded to bf16 once per product, and `vdpbf16ps` multiplies pairs of them into f32
//! sums. That instruction does 32 multiply-adds where an f32 FMA does 16, at the same rate
//! (measured on the AMD EPYC of docs/BENCHMARKS.md: 419 against 225 GFLOP/s a core), and the
//! dequantised weights take half the room in L1.
//!
//! The numbers: rounding `x` and a weight to bf16 keeps 8 significant bits of each (a relative
//! error of at most 2^-9), against the 4-6 bits a K-quant file's weights carry in the first
//! place; llama.cpp rounds `x` to 8-bit integers per block of 32 for the same products. Sums
//! stay f32. So a product here differs from the f32 one by up to about 2^-8 of its terms' size, and
//! a chunk computed here differs from the same rows computed one at a time (which stay f32).
//! Which is why it is a choice (`set_bf16_products`), not what the kernels do by default.

use std::arch::x86_64::*;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{Part, Tile, group_params_f16c};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Products of `DEQUANTISE_FROM_ROWS` rows or more in bf16 from now on, where the CPU has
/// AVX-512 BF16 (see the module's text). Returns whether they will be.
pub fn set_bf16_products(on: bool) -> bool {
    ENABLED.store(on, Ordering::Relaxed);
    bf16_products()
}

/// Whether products of many rows run in bf16: asked for and the CPU has the instructions.
pub fn bf16_products() -> bool {
    ENABLED.load(Ordering::Relaxed) && available()
}

/// The CPU has what this module uses.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("f16c")
}

/// Whether a product of `rows` rows of length `k` runs here.
pub(super) fn applies(rows: usize, k: usize) -> bool {
    rows >= super::DEQUANTISE_FROM_ROWS && k.is_multiple_of(STEP) && bf16_products()
}

/// Values of `k` per step: one vector of bf16.
const STEP: usize = 32;

/// Values of `k` per span: a 6 x 4 tile's weights and rows of `x` (20 KiB in bf16) stay in L1.
const SPAN: usize = 1024;

/// Weight rows dequantised at a time.
const DEQUANTISED_ROWS: usize = 4;

/// Rows of `x` and weight rows per tile: 24 accumulators, 4 weight vectors and one of `x` in
/// AVX-512's 32 registers.
const ROWS: usize = 6;
const COLS: usize = 4;

/// `x` (`[rows, k]`) in bf16, rounded to nearest even.
pub(super) fn round_rows(x: &[f32]) -> Vec<u16> {
    assert!(available(), "bf16 products on a CPU without AVX-512 BF16");
    let mut out = vec![0u16; x.len()];
    // SAFETY: the CPU has AVX-512 BF16 (asserted above).
    unsafe { round_into(x, &mut out) };
    out
}

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn round_into(x: &[f32], out: &mut [u16]) {
    let whole = x.len() / 16 * 16;
    for at in (0..whole).step_by(16) {
        // SAFETY: at + 16 <= whole <= both lengths.
        unsafe {
            let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(x.as_ptr().add(at)));
            _mm256_storeu_si256(
                out.as_mut_ptr().add(at).cast(),
                std::mem::transmute::<__m256bh, __m256i>(v),
            );
        }
    }
    for (o, &v) in out[whole..].iter_mut().zip(&x[whole..]) {
        *o = round_one(v);
    }
}

/// One f32 to bf16 as `vcvtneps2bf16` converts: nearest even, NaN kept a NaN, subnormals
/// flushed to a zero of their sign.
fn round_one(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    if v.is_subnormal() {
        return ((bits >> 16) & 0x8000) as u16;
    }
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    (rounded >> 16) as u16
}

/// `out[j * rows + r] = x[r] · w[j]` for the weight rows of `part`, with `x` in bf16.
pub(super) fn columns(xb: &[u16], rows: usize, part: &Part<'_>, out: &mut [f32]) {
    assert!(available(), "bf16 products on a CPU without AVX-512 BF16");
    // SAFETY: the CPU has AVX-512 BF16 and F16C (asserted above).
    unsafe { columns_avx512(xb, rows, part, out) }
}

#[target_feature(enable = "avx512f,avx512bf16,f16c")]
unsafe fn columns_avx512(xb: &[u16], rows: usize, part: &Part<'_>, out: &mut [f32]) {
    let k = part.k;
    let cols = part.codes.len() / part.row_bytes();
    assert!(xb.len() >= rows * k && out.len() >= cols * rows && k.is_multiple_of(STEP));
    let mut buffer = vec![0u16; DEQUANTISED_ROWS * k];
    let mut sums = vec![_mm512_setzero_ps(); rows * DEQUANTISED_ROWS];
    let mut j0 = 0;
    while j0 < cols {
        let n = DEQUANTISED_ROWS.min(cols - j0);
        // SAFETY: the caller's features.
        unsafe { dequantize_bf16(&part.sub(j0, n), &mut buffer[..n * k]) };
        let mut from = 0;
        while from < k {
            let to = (from + SPAN).min(k);
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
                    // SAFETY: `tile` asserts that its rows, columns, sums and outputs exist.
                    unsafe { by_shape!(t, c, tile_bf16(xb, w, &tile, &mut sums, o)) };
                    r += t;
                }
                j += c;
            }
            from = to;
        }
        j0 += n;
    }
}

/// Rows `r0..r0 + R` of `x` by weight rows `j..j + C` of the buffer `w` (`[C, k]` from `j`)
/// over `from..to`; accumulators carried between spans in `sums` (`[rows, DEQUANTISED_ROWS]`)
/// and summed into `out` after the last.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_bf16<const R: usize, const C: usize>(
    xb: &[u16],
    w: &[u16],
    tile: &Tile,
    sums: &mut [__m512],
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
    let width = DEQUANTISED_ROWS;
    assert!((r0 + R) * k <= xb.len() && C * k <= w.len() && to <= k);
    assert!((C - 1) * rows + r0 + R <= out.len());
    assert!((r0 + R - 1) * width + j + C <= sums.len() && j + C <= width);
    assert!((to - from).is_multiple_of(STEP));
    let (xp, wp) = (xb.as_ptr(), w.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    if from > 0 {
        for (i, row) in acc.iter_mut().enumerate() {
            row.copy_from_slice(&sums[(r0 + i) * width + j..][..C]);
        }
    }
    let mut at = from;
    while at < to {
        // SAFETY: at + STEP <= to <= k inside every row (asserted above); bf16 vectors are
        // 32 u16 of the same 64 bytes.
        unsafe {
            let mut wv = [_mm512_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(wp.add(c * k + at).cast());
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv: __m512bh =
                    std::mem::transmute(_mm512_loadu_ps(xp.add((r0 + i) * k + at).cast()));
                for (a, wc) in row.iter_mut().zip(&wv) {
                    *a = _mm512_dpbf16_ps(*a, xv, std::mem::transmute::<__m512, __m512bh>(*wc));
                }
            }
        }
        at += STEP;
    }
    for (i, row) in acc.iter().enumerate() {
        if to < k {
            sums[(r0 + i) * width + j..][..C].copy_from_slice(row);
            continue;
        }
        for (c, a) in row.iter().enumerate() {
            out[c * rows + r0 + i] = _mm512_reduce_add_ps(*a);
        }
    }
}

/// The weights of `part` as `dequantize_part` computes them (one fused multiply-add per
/// weight in f32), rounded to bf16 into `out` (`[rows, k]`).
#[target_feature(enable = "avx512f,avx512bf16,f16c")]
unsafe fn dequantize_bf16(part: &Part<'_>, out: &mut [u16]) {
    let (k, group) = (part.k, part.group);
    let group_bytes = if part.nibbles { group / 2 } else { group };
    assert!(out.len() >= part.codes.len() / part.row_bytes() * k);
    assert!(group.is_multiple_of(16) && (!part.nibbles || group.is_multiple_of(32)));
    let low_nibbles = _mm512_set1_epi32(15);
    for (at, (codes, dst)) in part
        .codes
        .chunks_exact(group_bytes)
        .zip(out.chunks_exact_mut(group))
        .enumerate()
    {
        let (scale, bias) = group_params_f16c(&part.params, at);
        let (scale, bias) = (_mm512_set1_ps(scale), _mm512_set1_ps(bias));
        let (q, d) = (codes.as_ptr(), dst.as_mut_ptr());
        let weights = |lanes: __m512i| _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), scale, bias);
        // SAFETY: `codes` are the group's (`dst.len()` codes, half as many bytes as nibbles)
        // and groups are multiples of 16 (32 as nibbles; asserted above).
        unsafe {
            if part.nibbles {
                for run in 0..dst.len() / 32 {
                    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(run * 16).cast()));
                    let low = weights(_mm512_and_si512(v, low_nibbles));
                    let high = weights(_mm512_srli_epi32(v, 4));
                    // The low half of the result from the second operand: codes at..at + 16.
                    let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(high, low));
                    _mm512_storeu_si512(d.add(run * 32).cast(), both);
                }
            } else {
                for at in (0..dst.len()).step_by(16) {
                    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(at).cast()));
                    let half: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(weights(v)));
                    _mm256_storeu_si256(d.add(at).cast(), half);
                }
            }
        }
    }
}

/// Weight rows per panel of `panel_product`: four vectors of 16 lanes.
pub(super) const PANEL: usize = 64;

/// Values of `k` per packed span of a panel: 64 rows of it take 32 KiB.
const PANEL_SPAN: usize = 256;

/// Rows of `x` per step of `panel_tile`: 6 x 4 accumulators, 4 weight vectors and the
/// broadcast pair of `x`.
const PANEL_ROWS: usize = 6;

/// Whether `panel_product` can take a product of weight rows of length `k` in groups of
/// `group`: whole pairs, and spans that end on whole groups.
pub(super) fn panels_apply(k: usize, group: usize) -> bool {
    k.is_multiple_of(32) && PANEL_SPAN.is_multiple_of(group)
}

/// `x · Wᵀ` (`[rows, cols]`) for a panel of weight rows (a multiple of 16, at most `PANEL`),
/// as a GEMM kernel computes it: for each span of `k`, the panel's weights are
/// dequantised to bf16 and packed pair by pair across the rows (`packed[p][j]` holds row `j`'s
/// values `2p` and `2p + 1`), so that one `vdpbf16ps` multiplies 16 weight rows by the same
/// broadcast pair of `x`. The accumulators hold outputs, not partial dot products: no
/// horizontal sums, and `x` is read as pairs from L1/L2 while the packed span stays in L1.
/// For chunks of hundreds of rows, where the dot-product tiles above re-read all of `x` for
/// every four weight rows.
pub(super) fn panel_product(xb: &[u16], rows: usize, part: &Part<'_>) -> Vec<f32> {
    assert!(available(), "bf16 products on a CPU without AVX-512 BF16");
    // SAFETY: the CPU has AVX-512 BF16 and F16C (asserted above); the shape is checked inside.
    unsafe { panel_product_avx512(xb, rows, part) }
}

#[target_feature(enable = "avx512f,avx512bf16,f16c")]
unsafe fn panel_product_avx512(xb: &[u16], rows: usize, part: &Part<'_>) -> Vec<f32> {
    let k = part.k;
    let cols = part.codes.len() / part.row_bytes();
    assert!(cols.is_multiple_of(16) && cols <= PANEL && panels_apply(k, part.group));
    assert!(xb.len() >= rows * k);
    let mut rowwise = vec![0u16; cols * PANEL_SPAN];
    let mut packed = vec![0u32; PANEL_SPAN / 2 * cols];
    // The panel's outputs, `[rows, cols]`, carried between spans.
    let mut c = vec![0f32; rows * cols];
    let mut from = 0;
    while from < k {
        let to = (from + PANEL_SPAN).min(k);
        let len = to - from;
        for j in 0..cols {
            let dst = &mut rowwise[j * len..(j + 1) * len];
            // SAFETY: the caller's features.
            unsafe { dequantize_bf16(&part.row_span(j, from, to), dst) };
        }
        let pairs = len / 2;
        for j in 0..cols {
            for (p, pair) in rowwise[j * len..(j + 1) * len].chunks_exact(2).enumerate() {
                packed[p * cols + j] = u32::from(pair[0]) | u32::from(pair[1]) << 16;
            }
        }
        let span = Span {
            k,
            from,
            pairs,
            cols,
            first: from == 0,
        };
        let mut r = 0;
        while r < rows {
            let t = (rows - r).min(PANEL_ROWS);
            // SAFETY: `panel_tile` asserts that its rows, pairs and outputs exist.
            unsafe {
                match cols / 16 {
                    1 => by_rows!(t, panel_tile::<1>(xb, r, &packed, &span, &mut c)),
                    2 => by_rows!(t, panel_tile::<2>(xb, r, &packed, &span, &mut c)),
                    3 => by_rows!(t, panel_tile::<3>(xb, r, &packed, &span, &mut c)),
                    _ => by_rows!(t, panel_tile::<4>(xb, r, &packed, &span, &mut c)),
                }
            }
            r += t;
        }
        from = to;
    }
    c
}

/// `$kernel::<R, ...>(...)` for `R` rows (1-6) known only at run time.
macro_rules! by_rows {
    ($t:expr, $kernel:ident::<$v:literal>($($a:expr),*)) => {
        match $t {
            1 => $kernel::<1, $v>($($a),*),
            2 => $kernel::<2, $v>($($a),*),
            3 => $kernel::<3, $v>($($a),*),
            4 => $kernel::<4, $v>($($a),*),
            5 => $kernel::<5, $v>($($a),*),
            6 => $kernel::<6, $v>($($a),*),
            t => unreachable!("no tile of {t} rows"),
        }
    };
}
use by_rows;

/// A packed span of a panel: the row length of `x`, where the span starts, its pairs, the
/// panel's weight rows, and whether it is the first (the outputs start from zero).
struct Span {
    k: usize,
    from: usize,
    pairs: usize,
    cols: usize,
    first: bool,
}

/// Rows `r0..r0 + R` of `x` by the panel's `16 V` weight rows over one packed span, added
/// to `c` (`[rows, cols]`).
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn panel_tile<const R: usize, const V: usize>(
    xb: &[u16],
    r0: usize,
    packed: &[u32],
    span: &Span,
    c: &mut [f32],
) {
    let Span {
        k,
        from,
        pairs,
        cols,
        first,
    } = *span;
    assert!(V * 16 == cols && pairs * cols <= packed.len());
    assert!((r0 + R) * k <= xb.len() && from + 2 * pairs <= k);
    assert!((r0 + R) * cols <= c.len());
    let (xp, wp, cp) = (xb.as_ptr(), packed.as_ptr(), c.as_mut_ptr());
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    // SAFETY (of every access below): inside the lengths asserted above.
    unsafe {
        if !first {
            for (i, row) in acc.iter_mut().enumerate() {
                for (v, a) in row.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(cp.add((r0 + i) * cols + v * 16));
                }
            }
        }
        for p in 0..pairs {
            let mut w = [_mm512_setzero_ps(); V];
            for (v, wv) in w.iter_mut().enumerate() {
                *wv = _mm512_loadu_ps(wp.add(p * cols + v * 16).cast());
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let pair = xp
                    .add((r0 + i) * k + from + 2 * p)
                    .cast::<i32>()
                    .read_unaligned();
                let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                for (a, wv) in row.iter_mut().zip(&w) {
                    *a = _mm512_dpbf16_ps(*a, xv, std::mem::transmute::<__m512, __m512bh>(*wv));
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (v, a) in row.iter().enumerate() {
                _mm512_storeu_ps(cp.add((r0 + i) * cols + v * 16), *a);
            }
        }
    }
}
