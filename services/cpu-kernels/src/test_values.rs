//! Inputs for the kernels' tests: the same pseudo-random values in every module.

/// `len` values in [-0.5, 0.5) from a linear congruential generator seeded with `seed`.
pub fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}
