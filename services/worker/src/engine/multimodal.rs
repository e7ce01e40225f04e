//! Images in a prompt. The worker expands each image's one `<image>` token into the tower's
//! `image_tokens` copies; the engine fills those positions with the image's features.
//!
//! The KV cache keys blocks by token ids, and every image position holds the same `<image>`
//! id, so two different images would share keys. The cache therefore sees other ids at image
//! positions: ids derived from a BLAKE3 hash of the image's preprocessed pixels (what the
//! model actually reads), with the top bit set so that they never equal a vocabulary id. Two
//! images that preprocess to the same pixels give the same features, and may share blocks.

use std::sync::Arc;

use mlx_rs::Array;

use super::image::ClipPreprocess;
use super::llava::VisionTower;
use super::{EngineError, Result};

/// Set on every cache-key id that stands for an image position (vocabularies are far smaller).
pub const IMAGE_KEY_BIT: u32 = 0x8000_0000;

/// One preprocessed image of a prompt.
#[derive(Clone)]
pub struct PromptImage {
    /// `[1, channels, height, width]`, normalised, row-major.
    pixels: Arc<[f32]>,
    shape: [i32; 4],
    hash: blake3::Hash,
}

impl std::fmt::Debug for PromptImage {
    // The pixels are thousands of floats; the hash names them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PromptImage({:?}, {})", self.shape, self.hash.to_hex())
    }
}

impl PromptImage {
    pub fn new(pixels: Vec<f32>, shape: [i32; 4]) -> Result<Self> {
        let want: i64 = shape.iter().map(|&d| i64::from(d)).product();
        if want != pixels.len() as i64 {
            return Err(EngineError::InvalidRequest(format!(
                "{} pixel values for shape {shape:?}",
                pixels.len()
            )));
        }
        let mut hasher = blake3::Hasher::new();
        for d in shape {
            hasher.update(&d.to_le_bytes());
        }
        for v in &pixels {
            hasher.update(&v.to_le_bytes());
        }
        Ok(Self {
            pixels: pixels.into(),
            shape,
            hash: hasher.finalize(),
        })
    }

    pub fn hash(&self) -> &blake3::Hash {
        &self.hash
    }

    pub fn array(&self) -> Array {
        Array::from_slice(&self.pixels, &self.shape)
    }

    /// The cache-key ids of this image's `count` positions.
    fn key_ids(&self, count: usize) -> Vec<u32> {
        let mut bytes = vec![0u8; count * 4];
        let mut hasher = blake3::Hasher::new_derive_key("strata image positions v1");
        hasher.update(self.hash.as_bytes());
        hasher.finalize_xof().fill(&mut bytes);
        bytes
            .chunks_exact(4)
            .map(|c| IMAGE_KEY_BIT | u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// A VLM's vision tower, and how images enter its prompts.
pub struct Vision {
    pub tower: VisionTower,
    pub input: ImageInput,
}

/// What a worker needs to put images into prompts: the preprocessing, and the image token
/// with its number of positions per image.
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub preprocess: ClipPreprocess,
    pub image_token: u32,
    pub image_tokens: usize,
}

impl ImageInput {
    pub fn of(tower: &VisionTower, preprocess: ClipPreprocess) -> Self {
        Self {
            preprocess,
            image_token: tower.image_token,
            image_tokens: tower.image_tokens,
        }
    }

    /// The peak memory of decoding `encoded`, from its header.
    pub fn decode_bytes(&self, encoded: &[u8]) -> Result<u64> {
        self.preprocess.decode_bytes(encoded)
    }

    /// Decodes and preprocesses an encoded image (PNG, JPEG).
    pub fn image(&self, encoded: &[u8]) -> Result<PromptImage> {
        let (pixels, shape) = self.preprocess.pixel_values(encoded)?;
        PromptImage::new(pixels, shape)
    }

    /// Token ids of a rendered prompt with each `<image>` expanded to the image's positions;
    /// the prompt must hold exactly one `<image>` per image.
    pub fn expand(&self, ids: &[u32], images: usize) -> Result<Vec<u32>> {
        let found = ids.iter().filter(|&&t| t == self.image_token).count();
        if found != images {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {found} image placeholders but the request carries {images} images \
                 (the chat template places one per image part)"
            )));
        }
        let mut out = Vec::with_capacity(ids.len() + images * self.image_tokens);
        for &t in ids {
            if t == self.image_token {
                out.extend(std::iter::repeat_n(t, self.image_tokens));
            } else {
                out.push(t);
            }
        }
        Ok(out)
    }
}

/// Checks that `prompt` has exactly `image_tokens` image positions per image.
pub fn check_image_positions(
    prompt: &[u32],
    image_token: u32,
    image_tokens: usize,
    images: &[PromptImage],
) -> Result<()> {
    let slots = prompt.iter().filter(|&&t| t == image_token).count();
    if slots != images.len() * image_tokens {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt has {slots} image token positions; {} images need {}",
            images.len(),
            images.len() * image_tokens
        )));
    }
    Ok(())
}

/// The ids the KV cache keys `prompt` by: the prompt itself, with the image positions (in
/// order, `image_tokens` per image) replaced by ids derived from each image's hash.
pub fn cache_tokens(
    prompt: &[u32],
    image_token: u32,
    image_tokens: usize,
    images: &[PromptImage],
) -> Result<Vec<u32>> {
    if images.is_empty() {
        return Ok(prompt.to_vec());
    }
    check_image_positions(prompt, image_token, image_tokens, images)?;
    let mut keys = images.iter().flat_map(|i| i.key_ids(image_tokens));
    Ok(prompt
        .iter()
        .map(|&t| {
            if t == image_token {
                keys.next().unwrap_or(t)
            } else {
                t
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(value: f32) -> PromptImage {
        PromptImage::new(vec![value; 12], [1, 3, 2, 2]).expect("shape fits")
    }

    #[test]
    fn different_images_give_different_keys_and_the_same_image_the_same() {
        let prompt = [1, 7, 9, 9, 9, 5, 9, 9, 9, 6];
        let a = cache_tokens(&prompt, 9, 3, &[image(0.1), image(0.2)]).expect("a");
        let b = cache_tokens(&prompt, 9, 3, &[image(0.1), image(0.3)]).expect("b");
        let again = cache_tokens(&prompt, 9, 3, &[image(0.1), image(0.2)]).expect("again");
        assert_eq!(a, again);
        // Text positions and the first image's span agree; the second image's span differs.
        assert_eq!(a[..6], b[..6]);
        assert_eq!(a[9], b[9]);
        assert!(a[6..9].iter().zip(&b[6..9]).all(|(x, y)| x != y));
        // Image positions never look like vocabulary ids, and text positions are unchanged.
        assert!(a[2..5].iter().all(|&t| t & IMAGE_KEY_BIT != 0));
        assert_eq!([a[0], a[1], a[5], a[9]], [1, 7, 5, 6]);
        // Swapping the images swaps the spans' keys: order is part of the key.
        let swapped = cache_tokens(&prompt, 9, 3, &[image(0.2), image(0.1)]).expect("swap");
        assert_ne!(a[2..5], swapped[2..5]);
    }

    #[test]
    fn image_positions_must_match_the_images() {
        let prompt = [1, 9, 9, 2];
        assert!(cache_tokens(&prompt, 9, 3, &[image(0.1)]).is_err());
        assert_eq!(
            cache_tokens(&prompt, 9, 3, &[]).expect("no images"),
            prompt.to_vec()
        );
        assert!(PromptImage::new(vec![0.0; 5], [1, 3, 2, 2]).is_err());
    }
}
