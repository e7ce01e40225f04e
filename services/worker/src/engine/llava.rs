//! LLaVA-1.5-family vision-language models (`model_type: "llava"`): a CLIP vision tower, a
//! two-layer projector, and the Llama/Qwen2 decoder of `llama.rs`, from a safetensors folder in
//! the published llava-hf layout. An image becomes `image_tokens` feature rows that replace
//! the embeddings of as many `<image>` tokens in the prompt, in order.
//!
//! Checked against mlx-vlm on a tiny random-weight model (tests/vlm_parity.rs). No real VLM
//! weights are reachable from this machine, so none has been run.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, sigmoid};
use mlx_rs::{Array, fast};
use serde::Deserialize;

use super::config::HfConfig;
use super::llama::{Model, SeqChunk, TensorNaming};
use super::loader::{load_safetensors, read_json, safetensors_files};
use super::policy::DtypePolicy;
use super::weights::{Linear, QuantSpec, TensorStore};
use super::{EngineError, Result};

#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub image_size: usize,
    pub patch_size: usize,
    #[serde(default = "default_channels")]
    pub num_channels: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
    #[serde(default = "default_vision_act")]
    pub hidden_act: String,
}

fn default_channels() -> usize {
    3
}
fn default_eps() -> f32 {
    1e-5
}
fn default_vision_act() -> String {
    "quick_gelu".into()
}
fn default_feature_layer() -> i32 {
    -2
}
fn default_strategy() -> String {
    "default".into()
}
fn default_projector_act() -> String {
    "gelu".into()
}

#[derive(Debug, Clone, Deserialize)]
struct LlavaConfig {
    image_token_index: u32,
    #[serde(default = "default_feature_layer")]
    vision_feature_layer: i32,
    #[serde(default = "default_strategy")]
    vision_feature_select_strategy: String,
    #[serde(default = "default_projector_act")]
    projector_hidden_act: String,
    vision_config: VisionConfig,
    text_config: serde_json::Value,
}

struct ClipLayer {
    norm1: (Array, Array),
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    norm2: (Array, Array),
    fc1: Linear,
    fc2: Linear,
}

/// A LLaVA model: the text decoder, and everything that turns an image into decoder input.
pub struct Llava {
    pub text: Model,
    pub vision: VisionTower,
}

/// The CLIP vision tower and the projector, with the image token they fill.
pub struct VisionTower {
    pub vision_config: VisionConfig,
    /// The token id whose positions image features fill.
    pub image_token: u32,
    /// Feature rows (prompt positions) per image.
    pub image_tokens: usize,
    /// Patch embedding as a matrix `[hidden, channels * patch * patch]` (the conv's OIHW
    /// weight flattened): a stride-`patch` convolution is a matmul over flattened patches.
    patch: Array,
    class: Array,
    position: Array,
    pre_norm: (Array, Array),
    layers: Vec<ClipLayer>,
    feature_layer: i32,
    projector: (Linear, Linear),
}

impl Llava {
    pub fn load(dir: &Path) -> Result<Self> {
        let config: LlavaConfig = read_json(&dir.join("config.json"))?;
        let v = config.vision_config.clone();
        if config.vision_feature_select_strategy != "default" {
            return Err(EngineError::Config(format!(
                "vision_feature_select_strategy {:?} is not supported (only default)",
                config.vision_feature_select_strategy
            )));
        }
        if v.hidden_act != "quick_gelu" || config.projector_hidden_act != "gelu" {
            return Err(EngineError::Config(format!(
                "activations {:?} / {:?} are not supported (quick_gelu / gelu)",
                v.hidden_act, config.projector_hidden_act
            )));
        }
        if v.patch_size == 0
            || !v.image_size.is_multiple_of(v.patch_size)
            || v.num_attention_heads == 0
            || !v.hidden_size.is_multiple_of(v.num_attention_heads)
        {
            return Err(EngineError::Config(format!(
                "vision_config: image_size {} / patch_size {} / heads {} do not divide",
                v.image_size, v.patch_size, v.num_attention_heads
            )));
        }
        let text_config: HfConfig = serde_json::from_value(config.text_config.clone())
            .map_err(|e| EngineError::Config(format!("text_config: {e}")))?;

        let mut text = HashMap::new();
        let mut other = HashMap::new();
        for file in safetensors_files(dir)? {
            let loaded = load_safetensors(&file)?;
            for (name, array) in loaded {
                match name.strip_prefix("language_model.") {
                    Some(rest) => text.insert(rest.to_string(), array),
                    None => other.insert(name, array),
                };
            }
        }
        let p = DtypePolicy::F32;
        let text = Model::load(
            text_config.to_model_config()?,
            &TensorStore::new(text, QuantSpec::affine(64)),
            TensorNaming::HuggingFace,
            p,
        )?;
        let store = TensorStore::new(other, QuantSpec::affine(64));
        let vt = |name: &str| format!("vision_tower.vision_model.{name}");
        let norm = |base: &str| -> Result<(Array, Array)> {
            Ok((
                store.vector(&format!("{base}.weight"), p)?,
                store.vector(&format!("{base}.bias"), p)?,
            ))
        };
        let layers = (0..v.num_hidden_layers)
            .map(|i| {
                let at = |part: &str| vt(&format!("encoder.layers.{i}.{part}"));
                Ok(ClipLayer {
                    norm1: norm(&at("layer_norm1"))?,
                    q: store.linear(&at("self_attn.q_proj"), p)?,
                    k: store.linear(&at("self_attn.k_proj"), p)?,
                    v: store.linear(&at("self_attn.v_proj"), p)?,
                    out: store.linear(&at("self_attn.out_proj"), p)?,
                    norm2: norm(&at("layer_norm2"))?,
                    fc1: store.linear(&at("mlp.fc1"), p)?,
                    fc2: store.linear(&at("mlp.fc2"), p)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let patch_name = vt("embeddings.patch_embedding.weight");
        let patch = store.vector(&patch_name, p)?;
        let want = [
            v.hidden_size as i32,
            v.num_channels as i32,
            v.patch_size as i32,
            v.patch_size as i32,
        ];
        if patch.shape() != want {
            return Err(EngineError::BadTensor {
                name: patch_name,
                reason: format!("shape {:?}, expected {want:?} (OIHW)", patch.shape()),
            });
        }
        let patch = patch.reshape(&[v.hidden_size as i32, -1])?;
        let side = v.image_size / v.patch_size;
        let vision = VisionTower {
            image_token: config.image_token_index,
            image_tokens: side * side,
            patch,
            class: store.vector(&vt("embeddings.class_embedding"), p)?,
            position: store.vector(&vt("embeddings.position_embedding.weight"), p)?,
            pre_norm: norm(&vt("pre_layrnorm"))?,
            layers,
            feature_layer: config.vision_feature_layer,
            projector: (
                store.linear("multi_modal_projector.linear_1", p)?,
                store.linear("multi_modal_projector.linear_2", p)?,
            ),
            vision_config: v,
        };
        vision.eval_weights()?;
        Ok(Self { text, vision })
    }

    /// Logits `[1, vocab]` at the last position of `ids` (a fresh sequence, or one continuing
    /// `cache`), with image features placed at the `<image>` positions.
    pub fn forward(
        &self,
        ids: &[u32],
        features: Option<&Array>,
        cache: &mut super::KvCache,
    ) -> Result<Array> {
        if let Some(&bad) = ids
            .iter()
            .find(|&&t| t as usize >= self.text.config().vocab_size)
        {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} outside the vocabulary"
            )));
        }
        let x = self.vision.embed_with_images(&self.text, ids, features)?;
        self.text
            .forward_embedded(x, &mut [SeqChunk { tokens: ids, cache }])
    }
}

impl VisionTower {
    /// Safetensors loads are lazy and bound to this thread's stream: materialise everything.
    fn eval_weights(&self) -> Result<()> {
        let mut arrays = vec![
            &self.patch,
            &self.class,
            &self.position,
            &self.pre_norm.0,
            &self.pre_norm.1,
        ];
        let mut linears = vec![&self.projector.0, &self.projector.1];
        for l in &self.layers {
            arrays.extend([&l.norm1.0, &l.norm1.1, &l.norm2.0, &l.norm2.1]);
            linears.extend([&l.q, &l.k, &l.v, &l.out, &l.fc1, &l.fc2]);
        }
        for l in linears {
            l.eval()?;
        }
        for a in arrays {
            a.eval()?;
        }
        Ok(())
    }

    /// The vision tower's selected hidden state without the CLS row, `[patches, vision
    /// hidden]`, for pixels `[1, channels, size, size]` (NCHW, normalised).
    pub fn vision_features(&self, pixels: &Array) -> Result<Array> {
        let v = &self.vision_config;
        let (c, s, p) = (
            v.num_channels as i32,
            v.image_size as i32,
            v.patch_size as i32,
        );
        if pixels.shape() != [1, c, s, s] {
            return Err(EngineError::InvalidRequest(format!(
                "pixels of shape {:?}, expected [1, {c}, {s}, {s}]",
                pixels.shape()
            )));
        }
        let side = s / p;
        // [C, side, p, side, p] -> [side, side, C, p, p] -> one row per patch, row-major.
        let patches = pixels
            .reshape(&[c, side, p, side, p])?
            .transpose_axes(&[1, 3, 0, 2, 4])?
            .reshape(&[side * side, c * p * p])?;
        let x = patches.matmul(self.patch.t())?;
        let d = v.hidden_size as i32;
        let x = concatenate(&[self.class.reshape(&[1, d])?, x], 0)?.add(&self.position)?;
        let mut x = fast::layer_norm(&x, &self.pre_norm.0, &self.pre_norm.1, v.layer_norm_eps)?;
        // hidden_states[0] is the embeddings' output, [i + 1] that of layer i.
        let count = self.layers.len() as i32 + 1;
        let wanted = if self.feature_layer < 0 {
            count + self.feature_layer
        } else {
            self.feature_layer
        };
        if !(0..count).contains(&wanted) {
            return Err(EngineError::Config(format!(
                "vision_feature_layer {} is outside the tower's {count} hidden states",
                self.feature_layer
            )));
        }
        for layer in self.layers.iter().take(wanted as usize) {
            x = self.clip_layer(layer, &x)?;
        }
        // Drop CLS ("default" strategy).
        Ok(x.try_index(1..)?)
    }

    fn clip_layer(&self, l: &ClipLayer, x: &Array) -> Result<Array> {
        let v = &self.vision_config;
        let eps = v.layer_norm_eps;
        let (n, heads) = (x.shape()[0], v.num_attention_heads as i32);
        let hd = v.hidden_size as i32 / heads;
        let h = fast::layer_norm(x, &l.norm1.0, &l.norm1.1, eps)?;
        let split = |a: Array| -> Result<Array> {
            Ok(a.reshape(&[1, n, heads, hd])?
                .transpose_axes(&[0, 2, 1, 3])?)
        };
        let (q, k, val) = (
            split(l.q.forward(&h)?)?,
            split(l.k.forward(&h)?)?,
            split(l.v.forward(&h)?)?,
        );
        let scale = 1.0 / (hd as f32).sqrt();
        let attn = fast::scaled_dot_product_attention(&q, &k, &val, scale, None, None)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[n, heads * hd])?;
        let x = x.add(l.out.forward(&attn)?)?;
        let h = fast::layer_norm(&x, &l.norm2.0, &l.norm2.1, eps)?;
        let h = l.fc1.forward(&h)?;
        // quick_gelu: x * sigmoid(1.702 x).
        let h = h.multiply(sigmoid(&h.multiply(Array::from_f32(1.702))?)?)?;
        Ok(x.add(l.fc2.forward(&h)?)?)
    }

    /// Image features in the decoder's embedding space, `[image_tokens, text hidden]`.
    pub fn image_features(&self, pixels: &Array) -> Result<Array> {
        let f = self.vision_features(pixels)?;
        let h = self.projector.0.forward(&f)?;
        let h = h.multiply(Array::from_f32(0.5))?.multiply(
            mlx_rs::ops::erf(&h.multiply(Array::from_f32(std::f32::consts::FRAC_1_SQRT_2))?)?
                .add(Array::from_f32(1.0))?,
        )?;
        self.projector.1.forward(&h)
    }

    /// The decoder's input embeddings for `ids`, with the rows of `<image>` tokens replaced by
    /// `features` (`[k * image_tokens, hidden]` for k images), in order.
    pub fn embed_with_images(
        &self,
        text: &Model,
        ids: &[u32],
        features: Option<&Array>,
    ) -> Result<Array> {
        let slots = ids.iter().filter(|&&t| t == self.image_token).count();
        let rows = features.map_or(0, |f| f.shape()[0] as usize);
        if slots != rows {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {slots} image token positions but the images give {rows} feature rows"
            )));
        }
        let x = text.embed_tokens(ids)?;
        let Some(features) = features else {
            return Ok(x);
        };
        // One gather from [embeddings; features]: position i takes its own row, or the next
        // feature row where an image token is.
        let mut next = ids.len();
        let index: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                if t == self.image_token {
                    next += 1;
                    (next - 1) as u32
                } else {
                    i as u32
                }
            })
            .collect();
        let all = concatenate(&[x, features.clone()], 0)?;
        Ok(all.take_axis(Array::from_slice(&index, &[index.len() as i32]), 0)?)
    }
}
