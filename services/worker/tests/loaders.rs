//! The safetensors loader and the Qwen2 architecture, for real:
//! - SmolLM2 converted from its GGUF (scripts/convert_gguf_to_hf.py, run by setup) into a
//!   Hugging Face f32 folder and an mlx-lm quantised folder gives the same greedy tokens as the
//!   independent numpy reference of the GGUF;
//! - a tiny random-weight Qwen2 GGUF (q/k/v biases, untied head, rotate-half RoPE, theta 1e6)
//!   matches the numpy reference;
//! - bad model files fail with errors that name the problem.

mod common;

use strata_worker::engine::generate::EngineOptions;
use strata_worker::engine::llama::SeqChunk;
use strata_worker::engine::loader::{self, LoadedModel, ModelFormat};
use strata_worker::engine::sample::argmax;
use strata_worker::engine::{DtypePolicy, EngineError};

fn greedy(m: &LoadedModel, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let eos = m.tokenizer.eos_token();
    let mut cache = m.model.new_cache(64);
    let mut logits = m
        .prefill(&mut cache, prompt, &EngineOptions::default(), |_| Ok(()))
        .unwrap();
    let first = logits.clone();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = argmax(&logits) as u32;
        out.push(next);
        if Some(next) == eos {
            break;
        }
        let l = m
            .model
            .forward(&mut [SeqChunk {
                tokens: &[next],
                cache: &mut cache,
            }])
            .unwrap();
        l.eval().unwrap();
        logits = l.as_slice::<f32>().to_vec();
    }
    (out, first)
}

fn smollm2_cases() -> Vec<(Vec<u32>, Vec<u32>)> {
    common::fixture("model/smollm2_greedy.json")["cases"]
        .as_array()
        .unwrap()
        .iter()
        .take(3)
        .map(|c| (common::ids(&c["input_ids"]), common::ids(&c["greedy_ids"])))
        .collect()
}

/// The worker loads on its main thread and computes on its engine thread. A lazy MLX array is
/// bound to the stream of the thread that made it, so the loader must leave none behind
/// (safetensors loads are lazy: this failed with "no Stream(cpu, 0) in current thread").
#[test]
fn a_safetensors_model_loaded_on_one_thread_computes_on_another() {
    let path = common::derived_model("smollm2-135m-instruct-f32");
    let m = loader::open(&path, DtypePolicy::F32, 256).unwrap();
    let (input, want) = smollm2_cases().remove(0);
    let got = std::thread::spawn(move || greedy(&m, &input, want.len()).0)
        .join()
        .expect("the engine thread computes");
    assert_eq!(got, smollm2_cases()[0].1);
}

#[test]
fn hugging_face_f32_folder_gives_the_reference_greedy_tokens() {
    let path = common::derived_model("smollm2-135m-instruct-f32");
    let m = loader::open(&path, DtypePolicy::F32, 256).unwrap();
    assert_eq!(m.format, ModelFormat::Safetensors);
    assert!(
        !m.model.config().rope_traditional,
        "HF checkpoints use rotate-half RoPE"
    );
    assert!(
        !m.template.is_fallback,
        "tokenizer_config.json carries the chat template"
    );
    for (input, want) in smollm2_cases() {
        assert_eq!(greedy(&m, &input, want.len()).0, want);
    }
    // The tokenizer.json path tokenises like the GGUF path.
    let gguf = loader::open(&common::smollm2_gguf(), DtypePolicy::F32, 256).unwrap();
    for text in ["Hello, world! 12345", "<|im_start|>user\nçava?<|im_end|>\n"] {
        assert_eq!(
            m.tokenizer.encode(text).unwrap(),
            gguf.tokenizer.encode(text).unwrap()
        );
    }
    assert_ne!(
        m.fingerprint, gguf.fingerprint,
        "different files, different KV namespaces"
    );
}

#[test]
fn mlx_quantized_folder_gives_the_reference_greedy_tokens() {
    let path = common::derived_model("smollm2-135m-instruct-mlx");
    let m = loader::open(&path, DtypePolicy::F32, 256).unwrap();
    for (input, want) in smollm2_cases() {
        assert_eq!(greedy(&m, &input, want.len()).0, want);
    }
}

#[test]
fn qwen2_architecture_matches_the_numpy_reference() {
    let fixture = common::fixture("qwen2_tiny/qwen2_tiny.json");
    let path = common::derived_model("qwen2-tiny/qwen2_tiny.gguf");
    let m = loader::open(&path, DtypePolicy::F32, 16).unwrap();
    let c = m.model.config();
    assert_eq!(c.arch, strata_worker::engine::Architecture::Qwen2);
    assert!(!c.rope_traditional);
    assert_eq!(c.rope_theta, 1e6);
    for (i, case) in fixture["cases"].as_array().unwrap().iter().enumerate() {
        let input = common::ids(&case["input_ids"]);
        let want = common::ids(&case["greedy_ids"]);
        let margins: Vec<f64> = case["greedy_top1_top2_margin"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_f64().unwrap())
            .collect();
        let (got, logits) = greedy(&m, &input, want.len());
        // Compare up to the first near-tie of the reference (top-1/top-2 gap under 0.02):
        // there, summation order alone may pick the other token.
        let safe = margins.iter().position(|&g| g < 0.02).unwrap_or(want.len());
        assert!(safe >= 5, "case {i}: too few unambiguous steps ({safe})");
        assert_eq!(got[..safe], want[..safe], "case {i}");
        let reference = case["first_logits"].as_array().unwrap();
        for (id, r) in reference.iter().enumerate() {
            let diff = (logits[id] - r.as_f64().unwrap() as f32).abs();
            assert!(diff < 1e-3, "case {i}: logit {id} differs by {diff}");
        }
    }
}

#[test]
fn bad_model_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = |path: &std::path::Path| match loader::open(path, DtypePolicy::F32, 16) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e,
    };

    // A path that is not there.
    assert!(matches!(
        err(&dir.path().join("nope.gguf")),
        EngineError::ModelNotFound(_)
    ));

    // A truncated GGUF.
    let bytes = std::fs::read(common::smollm2_gguf()).unwrap();
    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    let e = err(&truncated);
    assert!(matches!(e, EngineError::Load(_)), "{e}");

    // A folder of an unknown architecture.
    let folder = dir.path().join("mamba");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(
        folder.join("config.json"),
        r#"{"model_type": "mamba", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}"#,
    )
    .unwrap();
    let e = err(&folder);
    assert!(e.to_string().contains("mamba"), "{e}");

    // A folder with a tensor missing: the error names it.
    let src = common::derived_model("smollm2-135m-instruct-f32");
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), broken.join(f)).unwrap();
    }
    let mut tensors = mlx_rs::Array::load_safetensors(src.join("model.safetensors")).unwrap();
    tensors.remove("model.layers.7.mlp.up_proj.weight");
    mlx_rs::Array::save_safetensors(tensors, None, broken.join("model.safetensors")).unwrap();
    let e = err(&broken);
    assert!(
        e.to_string().contains("model.layers.7.mlp.up_proj.weight"),
        "{e}"
    );

    // A tokenizer.json that is not valid UTF-8.
    std::fs::write(broken.join("tokenizer.json"), b"{\"model\": \"\xff\xfe\"}").unwrap();
    let e = err(&broken);
    assert!(matches!(e, EngineError::Tokenizer(_)), "{e}");
}

/// Every weight file scripts/setup provides passes the structural checks that now run before
/// MLX's readers, so they refuse nothing real.
#[test]
fn every_real_model_file_passes_the_structural_checks() {
    for gguf in [
        common::smollm2_gguf(),
        common::derived_model("qwen2-tiny/qwen2_tiny.gguf"),
    ] {
        let s = strata_model_files::check_gguf(&gguf).unwrap();
        assert!(s.tensors.len() >= 27, "{}: {s:?}", gguf.display());
    }
    let vlm = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vlm/tiny-llava/model.safetensors");
    for file in [
        common::derived_model("smollm2-135m-instruct-f32/model.safetensors"),
        common::derived_model("smollm2-135m-instruct-mlx/model.safetensors"),
        common::minilm_dir().join("model.safetensors"),
        vlm,
    ] {
        let s = strata_model_files::check_safetensors(&file).unwrap();
        assert!(!s.tensors.is_empty(), "{}", file.display());
    }
}

/// A fuzz probe of MLX's own GGUF reader (mx.load on mutated copies of the qwen2-tiny fixture)
/// crashed it with SIGSEGV when a tensor's dimension count was corrupted to 0 or to 2^24. The
/// worker now refuses such a file with a load error and keeps running.
#[test]
fn gguf_damage_that_crashes_mlx_is_a_load_error() {
    let bytes = std::fs::read(common::derived_model("qwen2-tiny/qwen2_tiny.gguf")).unwrap();
    let name = b"blk.1.attn_q.weight";
    let n_dims_at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let dir = tempfile::tempdir().unwrap();
    for n_dims in [0u32, 1 << 24] {
        let mut broken = bytes.clone();
        broken[n_dims_at..n_dims_at + 4].copy_from_slice(&n_dims.to_le_bytes());
        let path = dir.path().join(format!("dims-{n_dims}.gguf"));
        std::fs::write(&path, &broken).unwrap();
        match loader::open(&path, DtypePolicy::F32, 16) {
            Ok(_) => panic!("n_dims {n_dims} loaded"),
            Err(EngineError::Load(why)) => assert!(
                why.contains("tensor 'blk.1.attn_q.weight' has") && why.contains("dimensions"),
                "{why}"
            ),
            Err(e) => panic!("n_dims {n_dims}: {e}"),
        }
    }
    // A safetensors header whose shape overflows is refused too (MLX loads it).
    let folder = dir.path().join("overflow");
    std::fs::create_dir(&folder).unwrap();
    let src = common::derived_model("smollm2-135m-instruct-f32");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), folder.join(f)).unwrap();
    }
    let header =
        br#"{"a":{"data_offsets":[0,0],"dtype":"F32","shape":[1073741824,1073741824,16]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    std::fs::write(folder.join("model.safetensors"), file).unwrap();
    match loader::open(&folder, DtypePolicy::F32, 16) {
        Err(EngineError::Load(why)) => assert!(why.contains("invalid header"), "{why}"),
        Ok(_) => panic!("overflowing shape loaded"),
        Err(e) => panic!("{e}"),
    }
}
