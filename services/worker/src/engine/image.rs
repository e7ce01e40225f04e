//! CLIP-style image preprocessing, as a model folder's `preprocessor_config.json` describes
//! it (`CLIPImageProcessor`): RGB, resize so the shortest edge is `size.shortest_edge`
//! (bicubic), center crop to `crop_size`, scale to [0, 1], normalise per channel. Output is
//! `[1, 3, height, width]` f32 (NCHW), what the vision tower takes.

use std::path::Path;

use image::RgbImage;
use mlx_rs::Array;
use serde::Deserialize;

use super::loader::read_json;
use super::{EngineError, Result};

#[derive(Debug, Clone, Deserialize)]
pub struct Edge {
    pub shortest_edge: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CropSize {
    pub height: u32,
    pub width: u32,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize)]
pub struct ClipPreprocess {
    #[serde(default = "yes")]
    pub do_resize: bool,
    pub size: Edge,
    #[serde(default = "yes")]
    pub do_center_crop: bool,
    pub crop_size: CropSize,
    #[serde(default = "yes")]
    pub do_rescale: bool,
    #[serde(default = "default_rescale")]
    pub rescale_factor: f64,
    #[serde(default = "yes")]
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// PIL's resample code; 3 is bicubic, the only one accepted.
    #[serde(default = "default_resample")]
    pub resample: u32,
}

fn default_rescale() -> f64 {
    1.0 / 255.0
}
fn default_resample() -> u32 {
    3
}

impl ClipPreprocess {
    pub fn load(dir: &Path) -> Result<Self> {
        let config: Self = read_json(&dir.join("preprocessor_config.json"))?;
        if config.resample != 3 || !config.do_resize || !config.do_center_crop {
            return Err(EngineError::Config(
                "preprocessor_config.json: only bicubic resize with a center crop is supported"
                    .into(),
            ));
        }
        Ok(config)
    }

    /// Decodes an encoded image (PNG, JPEG) and preprocesses it.
    pub fn pixels(&self, encoded: &[u8]) -> Result<Array> {
        let (values, shape) = self.pixel_values(encoded)?;
        Ok(Array::from_slice(&values, &shape))
    }

    /// `pixels` as plain values and their shape (for other threads: MLX arrays stay on theirs).
    pub fn pixel_values(&self, encoded: &[u8]) -> Result<(Vec<f32>, [i32; 4])> {
        let decoded = image::load_from_memory(encoded)
            .map_err(|e| EngineError::InvalidRequest(format!("cannot decode the image: {e}")))?
            .to_rgb8();
        let (w, h) = decoded.dimensions();
        if w == 0 || h == 0 {
            return Err(EngineError::InvalidRequest("the image is empty".into()));
        }
        // Shortest edge to `shortest_edge`, the other scaled and truncated, as transformers'
        // `get_resize_output_image_size` does.
        let short = self.size.shortest_edge;
        let (nw, nh) = if w <= h {
            (
                short,
                (u64::from(short) * u64::from(h) / u64::from(w)) as u32,
            )
        } else {
            (
                (u64::from(short) * u64::from(w) / u64::from(h)) as u32,
                short,
            )
        };
        let resized = pil_bicubic(&decoded, nw, nh);
        let (cw, ch) = (self.crop_size.width, self.crop_size.height);
        if nw < cw || nh < ch {
            return Err(EngineError::InvalidRequest(format!(
                "the resized image ({nw}x{nh}) is smaller than the crop ({cw}x{ch})"
            )));
        }
        let (left, top) = ((nw - cw) / 2, (nh - ch) / 2);
        let mut out = vec![0f32; 3 * (cw * ch) as usize];
        let plane = (cw * ch) as usize;
        for y in 0..ch {
            for x in 0..cw {
                let p = resized.get_pixel(left + x, top + y);
                for c in 0..3 {
                    let mut v = f32::from(p[c]);
                    if self.do_rescale {
                        v = (f64::from(p[c]) * self.rescale_factor) as f32;
                    }
                    if self.do_normalize {
                        v = (v - self.image_mean[c]) / self.image_std[c];
                    }
                    out[c * plane + (y * cw + x) as usize] = v;
                }
            }
        }
        Ok((out, [1, 3, ch as i32, cw as i32]))
    }
}

/// Bicubic resize as Pillow computes it (`Resample.c`), which transformers' CLIP processor
/// uses: separable passes, horizontal then vertical, each with a kernel widened by the
/// shrink factor (antialiasing), weights in 22-bit fixed point, and a rounding to u8 after
/// each pass. Written by hand because no crate reproduces those roundings; the `image`
/// crate's Catmull-Rom filter, the same kernel in f32, put downscaled pixels up to 5 levels
/// away from the reference.
fn pil_bicubic(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (w, h) = src.dimensions();
    let wide = if width == w {
        src.clone()
    } else {
        pass(
            src,
            width,
            h,
            &pil_coefficients(w as usize, width as usize),
            true,
        )
    };
    if height == h {
        return wide;
    }
    pass(
        &wide,
        width,
        height,
        &pil_coefficients(h as usize, height as usize),
        false,
    )
}

/// One separable pass to `width` x `height`: along rows (`horizontal`) or columns, each
/// output pixel is its coefficients' weighted sum of input pixels, rounded to u8.
fn pass(
    src: &RgbImage,
    width: u32,
    height: u32,
    coeffs: &[(usize, Vec<i64>)],
    horizontal: bool,
) -> RgbImage {
    RgbImage::from_fn(width, height, |x, y| {
        let (start, weights) = &coeffs[if horizontal { x } else { y } as usize];
        let mut px = [0u8; 3];
        for (c, out) in px.iter_mut().enumerate() {
            let sum = weights
                .iter()
                .enumerate()
                .map(|(i, &w)| {
                    let j = (start + i) as u32;
                    let p = if horizontal {
                        src.get_pixel(j, y)
                    } else {
                        src.get_pixel(x, j)
                    };
                    i64::from(p[c]) * w
                })
                .sum();
            *out = round_fixed(sum);
        }
        image::Rgb(px)
    })
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// A fixed-point sum back to u8, with Pillow's rounding (add half, shift, clamp).
fn round_fixed(sum: i64) -> u8 {
    ((sum + (1 << (PRECISION_BITS - 1))) >> PRECISION_BITS).clamp(0, 255) as u8
}

/// For each output index: the first input index and the fixed-point weights from there.
fn pil_coefficients(input: usize, output: usize) -> Vec<(usize, Vec<i64>)> {
    fn bicubic(x: f64) -> f64 {
        const A: f64 = -0.5;
        let x = x.abs();
        if x < 1.0 {
            ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            (((x - 5.0) * x + 8.0) * x - 4.0) * A
        } else {
            0.0
        }
    }
    let scale = input as f64 / output as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    (0..output)
        .map(|i| {
            let center = (i as f64 + 0.5) * scale;
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let last = ((center + support + 0.5) as i64).min(input as i64) as usize;
            let weights: Vec<f64> = (first..last)
                .map(|j| bicubic((j as f64 - center + 0.5) / filter_scale))
                .collect();
            let total: f64 = weights.iter().sum();
            let fixed = weights
                .iter()
                .map(|w| {
                    let w = if total != 0.0 { w / total } else { *w };
                    let scaled = w * f64::from(1u32 << PRECISION_BITS);
                    // Pillow truncates after adding +-0.5: round half away from zero.
                    (if scaled < 0.0 {
                        scaled - 0.5
                    } else {
                        scaled + 0.5
                    }) as i64
                })
                .collect();
            (first, fixed)
        })
        .collect()
}
