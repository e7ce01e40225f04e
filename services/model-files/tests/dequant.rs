//! Every GGUF block type Strata expands, block by block against the PyPI `gguf` package's numpy
//! dequantisers (fixtures from scripts/make_gguf_quant_fixtures.py): random blocks with scales
//! of every magnitude (zeros, negative zero, subnormals), and real blocks from SmolLM2's Q4_1
//! file and Qwen2.5-Coder-0.5B's mixed Q5_0/Q4_K/Q6_K/Q8_0 file.
//!
//! The Rust code performs the same f32 operations in the same order as numpy, so the values
//! must agree bit for bit (NaN never occurs: every scale in the fixtures is finite).

use std::path::PathBuf;

use strata_model_files::{GgmlType, affine_codes, dequantize};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quants")
}

fn type_named(name: &str) -> GgmlType {
    (0..64)
        .filter_map(GgmlType::of)
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("no type {name}"))
}

#[test]
fn every_type_matches_the_gguf_packages_dequantisers_bit_for_bit() {
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("manifest.json")).unwrap()).unwrap();
    let mut types_seen = std::collections::HashSet::new();
    let mut real = 0;
    for pair in manifest["pairs"].as_array().unwrap() {
        let name = pair["name"].as_str().unwrap();
        let ty = type_named(pair["type"].as_str().unwrap());
        let blocks = std::fs::read(fixtures().join(format!("{name}.blocks"))).unwrap();
        let want: Vec<f32> = std::fs::read(fixtures().join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(
            want.len() as u64,
            pair["values"].as_u64().unwrap(),
            "{name}"
        );
        let mut got = vec![f32::NAN; want.len()];
        assert!(dequantize(ty, &blocks, &mut got), "{name}: sizes refused");
        let per_block = ty.block_values();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (*g == 0.0 && *w == 0.0),
                "{name}: value {i} (block {}, index {}) is {g}, gguf gives {w}",
                i / per_block,
                i % per_block
            );
        }
        types_seen.insert(ty);
        real += usize::from(name.contains("real"));
    }
    for ty in [
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q4_0", "Q4_1",
        "Q8_0", "F16", "BF16",
    ] {
        assert!(types_seen.contains(&type_named(ty)), "no fixture for {ty}");
    }
    assert!(real >= 5, "only {real} real-data fixtures");
}

/// The affine types as codes, a scale and a bias per group: `fma(code, scale, bias)` is the
/// f32 expansion bit for bit (the CPU kernel computes the weights that way), on every fixture.
#[test]
fn affine_codes_compute_the_expansion_bit_for_bit() {
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("manifest.json")).unwrap()).unwrap();
    let mut checked = std::collections::HashSet::new();
    for pair in manifest["pairs"].as_array().unwrap() {
        let name = pair["name"].as_str().unwrap();
        let ty = type_named(pair["type"].as_str().unwrap());
        let blocks = std::fs::read(fixtures().join(format!("{name}.blocks"))).unwrap();
        let Some(codes) = affine_codes(ty, &blocks) else {
            assert!(
                matches!(ty.name(), "F16" | "BF16" | "F32" | "IQ4_NL" | "IQ4_XS"),
                "{name}: no codes"
            );
            continue;
        };
        let mut want = vec![0f32; codes.codes.len()];
        assert!(dequantize(ty, &blocks, &mut want));
        assert_eq!(codes.scales.len() * codes.group, want.len(), "{name}");
        for (i, (&q, w)) in codes.codes.iter().zip(&want).enumerate() {
            assert!(usize::from(q) < 1 << codes.bits, "{name}: code {q}");
            let g = i / codes.group;
            let got = f32::from(q).mul_add(codes.scales[g], codes.biases[g]);
            assert!(
                got.to_bits() == w.to_bits() || (got == 0.0 && *w == 0.0),
                "{name}: value {i} is {got} from codes, {w} expanded"
            );
        }
        checked.insert(ty.name());
    }
    for ty in [
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q8_0",
    ] {
        assert!(checked.contains(ty), "no codes checked for {ty}");
    }
    assert!(affine_codes(GgmlType::Q4K, &[0u8; 100]).is_none());
}

#[test]
fn sizes_that_do_not_match_are_refused() {
    let ty = GgmlType::Q4K;
    let block = vec![0u8; ty.block_bytes()];
    let mut out = vec![0f32; 255];
    assert!(!dequantize(ty, &block, &mut out));
    let mut out = vec![0f32; 256];
    assert!(!dequantize(ty, &block[..100], &mut out));
    assert!(dequantize(ty, &block, &mut out));
}
