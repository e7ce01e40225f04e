//! The embedding engine on the real all-MiniLM-L6-v2 weights against reference vectors from
//! sentence-transformers (scripts/make_embedding_fixtures.py): each sentence alone, all of
//! them in one padded batch, and through the batching engine thread.

mod common;

use strata_worker::embedder::Embedder;
use strata_worker::engine::bert::{BertEncoder, Pooling};

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

struct Fixture {
    sentences: Vec<String>,
    token_counts: Vec<usize>,
    embeddings: Vec<Vec<f32>>,
}

fn fixture() -> Fixture {
    let f = common::fixture("minilm_embeddings.json");
    let strings = |k: &str| -> Vec<String> {
        f[k].as_array()
            .expect("a list")
            .iter()
            .map(|s| s.as_str().expect("a string").to_string())
            .collect()
    };
    Fixture {
        sentences: strings("sentences"),
        token_counts: common::ids(&f["token_counts"])
            .into_iter()
            .map(|n| n as usize)
            .collect(),
        embeddings: f["embeddings"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|v| {
                v.as_array()
                    .expect("a vector")
                    .iter()
                    .map(|x| x.as_f64().expect("a number") as f32)
                    .collect()
            })
            .collect(),
    }
}

/// The worst cosine similarity of `got` against the reference, with its sentence.
fn worst(got: &[Vec<f32>], want: &Fixture) -> (f64, String) {
    got.iter()
        .zip(&want.embeddings)
        .zip(&want.sentences)
        .map(|((g, w), s)| (cosine(g, w), s.clone()))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .expect("at least one sentence")
}

#[test]
fn minilm_matches_sentence_transformers_alone_and_in_one_padded_batch() {
    let want = fixture();
    assert!(want.sentences.len() >= 50);
    let dir = common::minilm_dir();
    let encoder = BertEncoder::load(&dir).expect("load MiniLM");
    assert_eq!(encoder.pooling, Pooling::Mean);
    assert!(encoder.normalize, "modules.json lists Normalize");
    assert_eq!(
        encoder.max_tokens, 256,
        "sentence_bert_config.json max_seq_length"
    );
    assert_eq!(encoder.dimensions(), 384);
    let embedder = Embedder::start(&dir, 8).expect("start");
    let ids: Vec<Vec<u32>> = want
        .sentences
        .iter()
        .map(|s| embedder.tokenize(s).expect("tokenize"))
        .collect();
    let counts: Vec<usize> = ids.iter().map(Vec::len).collect();
    assert_eq!(
        counts, want.token_counts,
        "token counts differ from the HF tokenizer's"
    );

    let alone: Vec<Vec<f32>> = ids
        .iter()
        .map(|i| {
            encoder
                .embed(std::slice::from_ref(i))
                .expect("embed")
                .remove(0)
        })
        .collect();
    let (cos, sentence) = worst(&alone, &want);
    eprintln!("worst cosine, one sentence at a time: {cos:.7} ({sentence:?})");
    assert!(cos >= 0.9999, "alone: cosine {cos} for {sentence:?}");
    for v in &alone {
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "not normalised: {norm}");
    }

    // All at once: lengths from 3 to 239 tokens padded into one batch.
    let batch = encoder.embed(&ids).expect("embed the batch");
    let (cos, sentence) = worst(&batch, &want);
    eprintln!("worst cosine, all in one padded batch: {cos:.7} ({sentence:?})");
    assert!(cos >= 0.9999, "in one batch: cosine {cos} for {sentence:?}");
    embedder.shutdown();
}

#[test]
fn the_engine_thread_batches_and_keeps_each_requests_order() {
    let want = fixture();
    let embedder = Embedder::start(&common::minilm_dir(), 8).expect("start");
    let ids: Vec<Vec<u32>> = want
        .sentences
        .iter()
        .map(|s| embedder.tokenize(s).expect("tokenize"))
        .collect();
    // Three requests queued together: the engine sorts their inputs by length across them.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let parts: Vec<Vec<Vec<u32>>> = ids.chunks(20).map(<[Vec<u32>]>::to_vec).collect();
    let receivers: Vec<_> = parts
        .into_iter()
        .map(|p| embedder.submit(p).expect("queued"))
        .collect();
    let got: Vec<Vec<f32>> = rt.block_on(async {
        let mut all = Vec::new();
        for r in receivers {
            all.extend(r.await.expect("answered").expect("embedded"));
        }
        all
    });
    assert_eq!(got.len(), want.sentences.len());
    let (cos, sentence) = worst(&got, &want);
    assert!(
        cos >= 0.9999,
        "through the engine: cosine {cos} for {sentence:?}"
    );
    let passes: u64 = embedder
        .counters
        .batches
        .lock()
        .expect("histogram")
        .values()
        .sum();
    assert!(passes >= 2, "55 inputs need at least two passes of 32");
    embedder.shutdown();
}

#[test]
fn over_long_and_out_of_vocabulary_inputs_are_refused() {
    let encoder = BertEncoder::load(&common::minilm_dir()).expect("load");
    let long = vec![1000u32; 257];
    let err = encoder.embed(&[long]).expect_err("too long");
    assert!(err.to_string().contains("at most 256"), "{err}");
    let err = encoder
        .embed(&[vec![101, 999_999, 102]])
        .expect_err("bad id");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    assert!(encoder.embed(&[]).is_err());
}
