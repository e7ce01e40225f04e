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

    /// What decoding and resizing `encoded` costs in memory at its peak, from its header
    /// alone (for admission): the decoder's buffer (at most 4 bytes a pixel, as `limits`
    /// bounds it), its RGB copy, and the resized image. Refuses what `pixel_values` would.
    pub fn decode_bytes(&self, encoded: &[u8]) -> Result<u64> {
        let (w, h) = image::ImageReader::new(std::io::Cursor::new(encoded))
            .with_guessed_format()
            .map_err(|e| EngineError::InvalidRequest(format!("cannot read the image: {e}")))?
            .into_dimensions()
            .map_err(|e| EngineError::InvalidRequest(format!("cannot decode the image: {e}")))?;
        check_dimensions(w, h)?;
        let pixels = u64::from(w) * u64::from(h);
        let short = u64::from(self.size.shortest_edge);
        let resized = short * short * u64::from(w.max(h)) / u64::from(w.min(h)) * 3;
        Ok(pixels * 4 + pixels * 3 + resized)
    }

    /// `pixels` as plain values and their shape (for other threads: MLX arrays stay on theirs).
    pub fn pixel_values(&self, encoded: &[u8]) -> Result<(Vec<f32>, [i32; 4])> {
        let bad = |why: String| EngineError::InvalidRequest(why);
        // The size from the header first: a few hundred bytes of PNG can claim gigapixels.
        let reader = image::ImageReader::new(std::io::Cursor::new(encoded))
            .with_guessed_format()
            .map_err(|e| bad(format!("cannot read the image: {e}")))?;
        let (w, h) = reader
            .into_dimensions()
            .map_err(|e| bad(format!("cannot decode the image: {e}")))?;
        check_dimensions(w, h)?;
        let mut reader = image::ImageReader::new(std::io::Cursor::new(encoded))
            .with_guessed_format()
            .map_err(|e| bad(format!("cannot read the image: {e}")))?;
        let mut limits = image::Limits::default();
        limits.max_image_width = Some(w);
        limits.max_image_height = Some(h);
        limits.max_alloc = Some(4 * MAX_PIXELS);
        reader.limits(limits);
        let decoded = reader
            .decode()
            .map_err(|e| bad(format!("cannot decode the image: {e}")))?
            .to_rgb8();
        let (w, h) = decoded.dimensions();
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

/// Largest image decoded, in pixels (8000 x 6250; a 48-megapixel photo fits): what one image
/// may cost in memory before it is resized.
pub const MAX_PIXELS: u64 = 50_000_000;

/// Largest ratio between an image's sides: the resize scales the short side to the model's
/// input size, so a 1 x 20000 image would become 336 x 6.7 million pixels (gigabytes).
pub const MAX_ASPECT_RATIO: u32 = 50;

/// Refuses an image that is empty, over `MAX_PIXELS` or more elongated than
/// `MAX_ASPECT_RATIO`, before anything is decoded or resized.
fn check_dimensions(w: u32, h: u32) -> Result<()> {
    if w == 0 || h == 0 {
        return Err(EngineError::InvalidRequest("the image is empty".into()));
    }
    if u64::from(w) * u64::from(h) > MAX_PIXELS {
        return Err(EngineError::InvalidRequest(format!(
            "the image is {w}x{h}: at most {MAX_PIXELS} pixels are accepted"
        )));
    }
    if w.max(h) / w.min(h) > MAX_ASPECT_RATIO {
        return Err(EngineError::InvalidRequest(format!(
            "the image is {w}x{h}: its sides may differ at most {MAX_ASPECT_RATIO}-fold"
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn clip() -> ClipPreprocess {
        serde_json::from_value(serde_json::json!({
            "size": {"shortest_edge": 336},
            "crop_size": {"height": 336, "width": 336},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        }))
        .unwrap()
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut out = std::io::Cursor::new(Vec::new());
        RgbImage::new(w, h)
            .write_to(&mut out, image::ImageFormat::Png)
            .unwrap();
        out.into_inner()
    }

    /// A PNG's header rewritten to claim `w` x `h` (its CRC recomputed), its data unchanged.
    fn claims(mut png: Vec<u8>, w: u32, h: u32) -> Vec<u8> {
        png[16..20].copy_from_slice(&w.to_be_bytes());
        png[20..24].copy_from_slice(&h.to_be_bytes());
        let crc = png[12..29].iter().fold(0xFFFF_FFFFu32, |mut c, &b| {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0xEDB8_8320
                } else {
                    c >> 1
                };
            }
            c
        }) ^ 0xFFFF_FFFF;
        png[29..33].copy_from_slice(&crc.to_be_bytes());
        png
    }

    fn refusal(encoded: &[u8]) -> String {
        match clip().pixel_values(encoded) {
            Err(EngineError::InvalidRequest(m)) => m,
            other => panic!("expected a refusal, got {:?}", other.map(|(_, s)| s)),
        }
    }

    #[test]
    fn bombs_and_slivers_are_refused_before_decoding_or_resizing() {
        // A few hundred bytes claiming 100000 x 100000 pixels: refused from the header.
        let bomb = claims(png(1, 1), 100_000, 100_000);
        assert!(bomb.len() < 200);
        assert!(refusal(&bomb).contains("at most 50000000 pixels"));
        // 1 x 20000 would be resized to 336 x 6.7M pixels.
        assert!(refusal(&png(1, 20_000)).contains("50-fold"));
        assert!(refusal(&png(20_000, 1)).contains("50-fold"));
        // An ordinary image still goes through.
        let (_, shape) = clip().pixel_values(&png(640, 480)).unwrap();
        assert_eq!(shape, [1, 3, 336, 336]);
    }
}
