//! Softmax rows with a vectorised, branch-free `exp`.
//!
//! Why by hand: MLX's CPU backend computes `exp` one element at a time on one thread (about
//! 17 ns per element on this machine), so a softmax over a prefill chunk's scores cost several
//! times both of attention's matrix products together. No crate offers a vectorised masked
//! softmax over a borrowed buffer; this is a few lines of arithmetic the compiler vectorises.

/// `out = softmax(row)`, vectorised where the CPU allows.
pub fn softmax_row(row: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above); the function is otherwise safe.
            unsafe { softmax_row_avx2(row, out) };
            return;
        }
    }
    softmax_row_portable(row, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_row_avx2(row: &[f32], out: &mut [f32]) {
    softmax_row_portable(row, out)
}

/// Lanes of the hand-split reductions: the compiler keeps a float sum or max in order (it may
/// not reassociate), so the lanes are written out for it to vectorise.
const LANES: usize = 8;

#[inline(always)]
fn softmax_row_portable(row: &[f32], out: &mut [f32]) {
    let (head, tail) = row.split_at(row.len() / LANES * LANES);
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in head.chunks_exact(LANES) {
        for j in 0..LANES {
            lanes[j] = if chunk[j] > lanes[j] {
                chunk[j]
            } else {
                lanes[j]
            };
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    let mut sums = [0f32; LANES];
    let (out_head, out_tail) = out.split_at_mut(head.len());
    for (o, x) in out_head
        .chunks_exact_mut(LANES)
        .zip(head.chunks_exact(LANES))
    {
        for j in 0..LANES {
            let e = exp_nonpositive(x[j] - max);
            o[j] = e;
            sums[j] += e;
        }
    }
    let mut sum: f32 = sums.iter().sum();
    for (o, &x) in out_tail.iter_mut().zip(tail) {
        let e = exp_nonpositive(x - max);
        *o = e;
        sum += e;
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// e^x for x <= 0 (a softmax's shifted scores) to within 2 ulp, branch-free so that it
/// vectorises: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 minimax polynomial
/// (Cephes' expf coefficients), times 2^n built in the exponent bits. Inputs below the
/// smallest normal's logarithm give that normal (weights under 1e-38 of the largest).
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer, which then sits in the low bits of
    // the sum's mantissa; subtracting it again gives that integer as a float. Neither needs a
    // float->int instruction, and taking the integer from the bits avoids Rust's saturating
    // `as i32`, which the compiler does not vectorise (it made this loop scalar: a quarter of
    // the attention time of a 255-token chunk at 4K context).
    const ROUND: f32 = 12_582_912.0;
    let x = if x < -87.336_55 { -87.336_55 } else { x };
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = p * r2 + r + 1.0;
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    e_r * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_library_exp_on_nonpositive_inputs() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (ours, libm) = (exp_nonpositive(x), x.exp());
            let ulp = (libm.to_bits() as i64 - ours.to_bits() as i64).unsigned_abs() as f32;
            worst = worst.max(ulp);
            x += 0.0173;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-200.0) < 1.2e-38);
    }

    #[test]
    fn softmax_rows_sum_to_one_and_ignore_masked_positions() {
        let row: Vec<f32> = (0..37)
            .map(|i| ((i * 7919) % 13) as f32 * 0.37 - 2.0)
            .collect();
        let mut out = vec![0f32; row.len()];
        softmax_row(&row, &mut out);
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let denom: f32 = row.iter().map(|x| (x - max).exp()).sum();
        for (o, x) in out.iter().zip(&row) {
            assert!((o - (x - max).exp() / denom).abs() < 1e-6);
        }
        assert!((out.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    }
}
