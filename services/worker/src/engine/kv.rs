//! The per-sequence KV cache: one K and one V buffer per layer, `[1, kv_heads, capacity,
//! head_dim]` in the policy's KV dtype, grown in steps of `step_tokens` (never per token) and
//! written in place with slice updates. Block-aligned ranges export to and import from a flat
//! byte layout without recomputation (what the cache service stores).
//!
//! Sliding-window layers (Gemma 3's local layers) are a layer state kind of their own: their
//! rows are exported into blocks like any layer's (a hit at any later token needs the last
//! window of them, which lie in the blocks before it), but the live cache drops the rows that
//! no query will see again once they are stored (`release_window_rows`), so that such a
//! layer's buffers stay bounded by the window instead of growing with the context.
//!
//! Recurrent layers (Gated DeltaNet in hybrid models) are the third kind: they keep no rows,
//! only a fixed-size state (`RecurrentLayers`) that each token updates and that cannot be cut
//! back to an earlier token. The cache copies it at chosen positions (snapshots: every block
//! end, and the positions a sequence asks for), and a block of a hybrid model carries the
//! snapshot at its end after its attention rows, so a hit resumes every layer exactly there.
//! A block without a snapshot at its end cannot be exported: there is nothing to resume from.

use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::{Array, Dtype};

use super::kv_payload::{EvaluatedRows, KvPayload, TailPart};
use super::policy::dtype_bytes;
use super::{EngineError, Result};

/// Shape facts shared by every layer of a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
    /// Layers whose queries see only their last positions.
    pub window: Option<WindowedLayers>,
    /// Recurrent layers beside the `num_layers` that keep K/V (hybrid models).
    pub recurrent: Option<RecurrentLayers>,
}

/// The recurrent layers of a hybrid model: `layers` of them, each with a state of
/// `conv_floats + state_floats` f32 values (a convolution's last inputs, then the recurrent
/// state), kept and snapshotted in f32 whatever the KV dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecurrentLayers {
    pub layers: usize,
    pub conv_floats: usize,
    pub state_floats: usize,
}

impl RecurrentLayers {
    /// Floats of one layer's state.
    pub fn floats(&self) -> usize {
        self.conv_floats + self.state_floats
    }
    /// Bytes of a snapshot of every layer.
    pub fn snapshot_bytes(&self) -> usize {
        4 * self.layers * self.floats()
    }
}

/// Sliding-window layers: bit i of `layers` is layer i, each query of which sees its last
/// `tokens` positions (its own included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowedLayers {
    pub tokens: usize,
    pub layers: u128,
}

impl WindowedLayers {
    /// At most this many layers can be told apart (`layers` is a bit set).
    pub const MAX_LAYERS: usize = 128;

    pub fn new(tokens: usize, layers: &[usize]) -> Result<Self> {
        let mut bits = 0u128;
        for &layer in layers {
            if layer >= Self::MAX_LAYERS {
                return Err(EngineError::Config(format!(
                    "sliding-window layer {layer}: at most {} layers are supported",
                    Self::MAX_LAYERS
                )));
            }
            bits |= 1 << layer;
        }
        Ok(Self {
            tokens,
            layers: bits,
        })
    }

    pub fn contains(&self, layer: usize) -> bool {
        layer < Self::MAX_LAYERS && self.layers & (1 << layer) != 0
    }
}

impl KvLayout {
    /// Bytes of one token's K and V across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.kv_heads * self.head_dim * dtype_bytes(self.dtype)
    }

    /// A stable description for fingerprints: any change makes old blocks unusable.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "kv-v1 layers={} kv_heads={} head_dim={} dtype={:?} order=layer,kv,head,token,dim",
            self.num_layers, self.kv_heads, self.head_dim, self.dtype
        );
        if let Some(w) = self.window {
            // Windowed layers' rows are stored like the others'; what differs is what a hit
            // reads from them, so their kind is part of the format.
            let layers: Vec<String> = (0..self.num_layers)
                .filter(|&l| w.contains(l))
                .map(|l| l.to_string())
                .collect();
            text.push_str(&format!(
                " state=sliding-window window={} windowed_layers={}",
                w.tokens,
                layers.join(",")
            ));
        }
        if let Some(r) = self.recurrent {
            text.push_str(&format!(
                " state=recurrent layers={} conv_floats={} state_floats={} snapshot=f32,after-kv",
                r.layers, r.conv_floats, r.state_floats
            ));
        }
        text
    }

    /// Bytes of a block of `tokens` rows: their K/V, then (hybrid models) the snapshot of the
    /// recurrent layers at the block's end.
    pub fn block_bytes(&self, tokens: usize) -> usize {
        tokens * self.bytes_per_token() + self.recurrent.map_or(0, |r| r.snapshot_bytes())
    }

    /// The rows a block of `bytes` holds, and its K/V part; None if the size is not a block's.
    fn block_rows<'b>(&self, bytes: &'b [u8]) -> Option<(usize, &'b [u8])> {
        let snapshot = self.recurrent.map_or(0, |r| r.snapshot_bytes());
        let kv = bytes.len().checked_sub(snapshot)?;
        let per_token = self.bytes_per_token();
        (per_token > 0 && kv % per_token == 0).then(|| (kv / per_token, &bytes[..kv]))
    }

    /// The window of `layer`, if it is a sliding-window layer.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        self.window.filter(|w| w.contains(layer)).map(|w| w.tokens)
    }
}

struct LayerKv {
    keys: Array,
    values: Array,
    /// The token held in row 0: rows before it were released (sliding-window layers only).
    first: usize,
}

/// One recurrent layer's state, f32 (convolution inputs, then the recurrent state): in host
/// memory where the host kernel advances it, or an MLX array where the recurrence runs on the
/// device (a GPU), so that a decode step does not copy it both ways. Read back to the host
/// only when a block is exported or the host kernel takes over.
#[derive(Clone)]
enum StateFloats {
    Host(Vec<f32>),
    Device(Array),
}

impl StateFloats {
    fn to_host(&self) -> Result<std::borrow::Cow<'_, [f32]>> {
        match self {
            Self::Host(v) => Ok(std::borrow::Cow::Borrowed(v)),
            Self::Device(a) => {
                let a = a.as_dtype(Dtype::Float32)?;
                a.eval()?;
                let floats = a
                    .try_as_slice::<f32>()
                    .map_err(|e| EngineError::Mlx(format!("reading a recurrent state: {e}")))?;
                Ok(std::borrow::Cow::Owned(crate::device_copy::to_host_f32(
                    floats,
                )))
            }
        }
    }
}

pub struct KvCache {
    layout: KvLayout,
    layers: Vec<Option<LayerKv>>,
    len: usize,
    step_tokens: usize,
    /// Prompt positions skipped (SpecPrefill): the next token's position is `len + skipped`.
    skipped: usize,
    /// Positions skipped inside the next appended chunk: (index of the token in the chunk,
    /// positions skipped right before it), in order. Consumed by `advance`.
    gaps: Vec<(usize, usize)>,
    /// Each recurrent layer's state (convolution inputs, then the recurrent state).
    recurrent: Vec<StateFloats>,
    /// Snapshots of every recurrent layer's state after `position` tokens, filled layer by
    /// layer during a pass.
    snapshots: std::collections::BTreeMap<usize, Vec<StateFloats>>,
    /// Snapshots are taken at multiples of this (0: none) and at `snapshot_at`.
    snapshot_every: usize,
    snapshot_at: Vec<usize>,
    /// Bytes of held rows copied into bigger buffers since `take_grown_bytes` (a growth
    /// copies the whole prefix: the prefill phases line says when a pass paid for one).
    grown_bytes: usize,
    /// Rows the first buffers of a full-attention layer are made with (`plan_capacity`).
    planned: usize,
}

impl KvCache {
    pub fn new(layout: KvLayout, step_tokens: usize) -> Self {
        Self {
            layout,
            layers: (0..layout.num_layers).map(|_| None).collect(),
            len: 0,
            step_tokens: step_tokens.max(1),
            skipped: 0,
            gaps: Vec::new(),
            recurrent: layout
                .recurrent
                .map(|r| vec![StateFloats::Host(vec![0f32; r.floats()]); r.layers])
                .unwrap_or_default(),
            snapshots: Default::default(),
            snapshot_every: 0,
            snapshot_at: Vec::new(),
            grown_bytes: 0,
            planned: 0,
        }
    }

    /// Recurrent layers' states are snapshotted after every multiple of `every` tokens (block
    /// ends) and after each of `at` (message ends): where a later request may resume.
    pub fn set_snapshots(&mut self, every: usize, at: Vec<usize>) {
        self.snapshot_every = every;
        self.snapshot_at = at;
    }

    /// Indices in the next chunk of `t` tokens after which the recurrent layers' states are
    /// snapshotted.
    pub fn snapshot_points(&self, t: usize) -> Vec<usize> {
        if self.layout.recurrent.is_none() {
            return Vec::new();
        }
        let len = self.len;
        (len + 1..=len + t)
            .filter(|&p| {
                (self.snapshot_every > 0 && p % self.snapshot_every == 0)
                    || self.snapshot_at.contains(&p)
            })
            .map(|p| p - len - 1)
            .collect()
    }

    fn recurrent_layer(&mut self, layer: usize) -> Result<&mut StateFloats> {
        self.recurrent
            .get_mut(layer)
            .ok_or_else(|| EngineError::Config(format!("recurrent layer {layer} out of range")))
    }

    /// Recurrent layer `layer`'s state: (convolution inputs, recurrent state).
    pub fn recurrent_state(&mut self, layer: usize) -> Result<(&mut [f32], &mut [f32])> {
        let r = self
            .layout
            .recurrent
            .ok_or_else(|| EngineError::Config("no recurrent layers in this cache".into()))?;
        let state = self.recurrent_layer(layer)?;
        if let StateFloats::Device(_) = state {
            *state = StateFloats::Host(state.to_host()?.into_owned());
        }
        match state {
            StateFloats::Host(floats) => Ok(floats.split_at_mut(r.conv_floats)),
            StateFloats::Device(_) => Err(EngineError::Mlx(
                "a recurrent state left on the device".into(),
            )),
        }
    }

    /// Recurrent layer `layer`'s state as one f32 array (`[conv_floats + state_floats]`), for
    /// the recurrence on the device; a host state is copied up once and stays there.
    pub fn recurrent_array(&mut self, layer: usize) -> Result<Array> {
        let state = self.recurrent_layer(layer)?;
        if let StateFloats::Host(floats) = state {
            *state = StateFloats::Device(Array::from_slice(floats, &[floats.len() as i32]));
        }
        match state {
            StateFloats::Device(array) => Ok(array.clone()),
            StateFloats::Host(_) => Err(EngineError::Mlx(
                "a recurrent state left on the host".into(),
            )),
        }
    }

    /// Replaces recurrent layer `layer`'s state by `array` (as `recurrent_array` gave it).
    pub fn set_recurrent_array(&mut self, layer: usize, array: Array) -> Result<()> {
        let state = self.recurrent_layer(layer)?;
        *state = StateFloats::Device(array);
        Ok(())
    }

    /// Records recurrent layer `layer`'s state after `position` tokens (layers in order).
    pub fn put_snapshot(&mut self, position: usize, layer: usize, floats: Vec<f32>) {
        self.put_snapshot_state(position, layer, StateFloats::Host(floats));
    }

    /// As `put_snapshot`, a state on the device (read back only if its block is exported).
    pub fn put_snapshot_array(&mut self, position: usize, layer: usize, array: Array) {
        self.put_snapshot_state(position, layer, StateFloats::Device(array));
    }

    fn put_snapshot_state(&mut self, position: usize, layer: usize, state: StateFloats) {
        let layers = self.snapshots.entry(position).or_default();
        if layers.len() == layer {
            layers.push(state);
        }
    }

    /// Whether every recurrent layer's state after `position` tokens is known (always, for
    /// a model without recurrent layers).
    pub fn has_snapshot(&self, position: usize) -> bool {
        match self.layout.recurrent {
            None => true,
            Some(r) => self
                .snapshots
                .get(&position)
                .is_some_and(|s| s.len() == r.layers),
        }
    }

    /// Forgets snapshots before `position` (already stored, or never to be).
    pub fn drop_snapshots_before(&mut self, position: usize) {
        self.snapshots = self.snapshots.split_off(&position);
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The position (for RoPE) of the next token: tokens held plus positions skipped.
    pub fn position(&self) -> usize {
        self.len + self.skipped
    }

    /// The next chunk's tokens skip positions: `gaps` lists (index of a token in the chunk,
    /// positions skipped before it). Pruned prompt tokens keep the positions of the full
    /// prompt this way, several kept runs sharing one forward pass.
    pub fn set_gaps(&mut self, gaps: Vec<(usize, usize)>) {
        self.gaps = gaps;
    }

    /// The RoPE positions of the next chunk of `t` tokens, as runs: (first token index in the
    /// chunk, tokens in the run, position of the first).
    pub fn position_runs(&self, t: usize) -> Vec<(usize, usize, usize)> {
        let mut runs = Vec::with_capacity(self.gaps.len() + 1);
        let mut start = 0;
        let mut position = self.position();
        for &(at, gap) in &self.gaps {
            let at = at.min(t);
            if at > start {
                runs.push((start, at - start, position));
                position += at - start;
                start = at;
            }
            position += gap;
        }
        if t > start {
            runs.push((start, t - start, position));
        }
        runs
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first token whose rows `layer` still holds (0 but in sliding-window layers).
    pub fn first_held(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .and_then(|kv| kv.as_ref())
            .map_or(0, |kv| kv.first)
    }

    /// Rows allocated across all layers' K and V buffers (memory held, in token rows).
    pub fn rows_allocated(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|kv| kv.keys.shape()[2] as usize)
            .sum()
    }

    /// Writes `keys`/`values` (`[1, kv_heads, t, head_dim]`) of `layer` after the tokens held,
    /// and returns views of everything held for that layer, new tokens included (from
    /// `first_held(layer)` on). Call for every layer, then `advance(t)` once.
    pub fn append(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let t = keys.shape()[2] as usize;
        let planned = self.planned;
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| EngineError::Config(format!("layer {layer} out of range")))?;
        let first = slot.as_ref().map_or(0, |kv| kv.first);
        // Rows of the buffer, which starts at token `first`.
        let needed = self.len - first + t;
        let start = (self.len - first) as i32;
        let end = needed as i32;
        let step = self.step_tokens;
        let layout = self.layout;
        let rows = first_rows(layout, planned, needed, slot.is_some());
        let grow_to = grown_capacity(rows, step, slot.is_some());
        match slot {
            Some(kv) if (kv.keys.shape()[2] as usize) >= needed => {}
            _ => {
                if slot.is_some() {
                    self.grown_bytes += 2
                        * start as usize
                        * layout.kv_heads
                        * layout.head_dim
                        * dtype_bytes(layout.dtype);
                }
                let fresh = |old: Option<&Array>| -> Result<Array> {
                    let shape = [
                        1,
                        layout.kv_heads as i32,
                        grow_to as i32,
                        layout.head_dim as i32,
                    ];
                    let zeros = zeros_dtype(&shape, layout.dtype)?;
                    Ok(match old {
                        Some(old) if start > 0 => {
                            let held = old.try_index((.., .., 0..start, ..))?;
                            let extra = [
                                1,
                                layout.kv_heads as i32,
                                grow_to as i32 - start,
                                layout.head_dim as i32,
                            ];
                            concatenate(&[held, zeros_dtype(&extra, layout.dtype)?], 2)?
                        }
                        _ => zeros,
                    })
                };
                let keys = fresh(slot.as_ref().map(|kv| &kv.keys))?;
                let values = fresh(slot.as_ref().map(|kv| &kv.values))?;
                *slot = Some(LayerKv {
                    keys,
                    values,
                    first,
                });
            }
        }
        let kv = slot
            .as_mut()
            .ok_or_else(|| EngineError::Mlx("kv slot".into()))?;
        kv.keys
            .try_index_mut((.., .., start..end, ..), keys.as_dtype(layout.dtype)?)?;
        kv.values
            .try_index_mut((.., .., start..end, ..), values.as_dtype(layout.dtype)?)?;
        Ok((
            kv.keys.try_index((.., .., 0..end, ..))?,
            kv.values.try_index((.., .., 0..end, ..))?,
        ))
    }

    /// Makes the first buffers of each full-attention layer hold `tokens` rows, however few
    /// the first chunk has: a prompt's chunks, its answer and the next turn of its
    /// conversation then fill them without growing. A growth copies every row held: the next
    /// turn of a 4K-token SmolLM2 conversation copied its 188 MB prefix in a 19-token pass
    /// that took 300-790 ms instead of ~100 (`grown_mb` in the prefill phases line).
    /// Windowed layers keep sizing themselves by what they hold.
    pub fn plan_capacity(&mut self, tokens: usize) {
        self.planned = tokens;
    }

    /// Bytes of held rows copied into bigger buffers since the last call.
    pub fn take_grown_bytes(&mut self) -> usize {
        std::mem::take(&mut self.grown_bytes)
    }

    /// Grows every layer's buffers to hold `t` more tokens and materialises them. Buffers
    /// that already have room are left as they are.
    fn reserve(&mut self, t: usize) -> Result<()> {
        let layout = self.layout;
        let (len, step) = (self.len, self.step_tokens);
        for slot in &mut self.layers {
            let first = slot.as_ref().map_or(0, |kv| kv.first);
            let needed = len - first + t;
            let rows = first_rows(layout, self.planned, needed, slot.is_some());
            let grow_to = grown_capacity(rows, step, slot.is_some());
            let held = (len - first) as i32;
            if matches!(slot, Some(kv) if kv.keys.shape()[2] as usize >= needed) {
                continue;
            }
            if slot.is_some() {
                self.grown_bytes += 2
                    * held as usize
                    * layout.kv_heads
                    * layout.head_dim
                    * dtype_bytes(layout.dtype);
            }
            let fresh = |old: Option<&Array>| -> Result<Array> {
                let shape = |tokens: usize| {
                    [
                        1,
                        layout.kv_heads as i32,
                        tokens as i32,
                        layout.head_dim as i32,
                    ]
                };
                Ok(match old {
                    Some(old) if held > 0 => {
                        let kept = old.try_index((.., .., 0..held, ..))?;
                        let extra = zeros_dtype(&shape(grow_to - held as usize), layout.dtype)?;
                        concatenate(&[kept, extra], 2)?
                    }
                    _ => zeros_dtype(&shape(grow_to), layout.dtype)?,
                })
            };
            let keys = fresh(slot.as_ref().map(|kv| &kv.keys))?;
            let values = fresh(slot.as_ref().map(|kv| &kv.values))?;
            *slot = Some(LayerKv {
                keys,
                values,
                first,
            });
        }
        self.eval()
    }

    /// Drops the rows of sliding-window layers that no query will see again and that are
    /// not needed for export any more: rows of tokens before `keep_from` (the first token
    /// not yet stored in a block) and more than a window (plus a step of slack, so that a
    /// speculative rollback still finds its window) behind the end. Copies the kept rows into
    /// a fresh buffer only once a whole step can be dropped, so a decode step rarely pays it.
    pub fn release_window_rows(&mut self, keep_from: usize) -> Result<()> {
        // Recurrent snapshots before `keep_from` will not be exported either.
        self.drop_snapshots_before(keep_from.min(self.len));
        let Some(window) = self.layout.window else {
            return Ok(());
        };
        let (len, step, layout) = (self.len, self.step_tokens, self.layout);
        let drop_to = keep_from.min(len.saturating_sub(window.tokens + step));
        for (layer, slot) in self.layers.iter_mut().enumerate() {
            let Some(kv) = slot.as_mut().filter(|_| window.contains(layer)) else {
                continue;
            };
            if drop_to < kv.first + step {
                continue;
            }
            let (from, to) = ((drop_to - kv.first) as i32, (len - kv.first) as i32);
            let rows = (len - drop_to + 1).div_ceil(step) * step;
            let extra = [
                1,
                layout.kv_heads as i32,
                (rows - (len - drop_to)) as i32,
                layout.head_dim as i32,
            ];
            for buffer in [&mut kv.keys, &mut kv.values] {
                let kept = buffer.try_index((.., .., from..to, ..))?;
                *buffer = concatenate(&[kept, zeros_dtype(&extra, layout.dtype)?], 2)?;
                buffer.eval()?;
            }
            kv.first = drop_to;
        }
        Ok(())
    }

    /// The buffers of every layer, grown to hold `t` more tokens, as memory the host kernels
    /// write new K/V rows into and read attention from (`llama::host_step`). Needs f32
    /// buffers. While the handle lives the cache is borrowed; `advance(t)` after it.
    ///
    /// Why in place: a decode step computed outside MLX would otherwise pay an MLX slice
    /// update, a graph and a synchronisation per layer for a few hundred bytes, which was most
    /// of a step's time on a CPU.
    pub fn host_rows(&mut self, t: usize) -> Result<HostKv<'_>> {
        let l = self.layout;
        if l.dtype != Dtype::Float32 {
            return Err(EngineError::Config(format!(
                "host kernels need f32 KV buffers, not {:?}",
                l.dtype
            )));
        }
        self.reserve(t)?;
        let mut layers = Vec::with_capacity(l.num_layers);
        for (layer, kv) in self.layers.iter().enumerate() {
            let kv = kv
                .as_ref()
                .ok_or_else(|| EngineError::Mlx(format!("layer {layer} has no KV buffers")))?;
            let capacity = kv.keys.shape()[2] as usize;
            let mut pair = [std::ptr::null_mut(); 2];
            for (ptr, buffer) in pair.iter_mut().zip([&kv.keys, &kv.values]) {
                // Materialised, row-major and of the full size (`reserve` made it so): the
                // data pointer then addresses every float of the buffer.
                let full = buffer
                    .try_as_slice::<f32>()
                    .map_err(|e| EngineError::Mlx(format!("KV buffer of layer {layer}: {e}")))?;
                if buffer.shape()[2] as usize != capacity
                    || full.len() != l.kv_heads * capacity * l.head_dim
                {
                    return Err(EngineError::Mlx(format!(
                        "KV buffer of layer {layer} is not [{}, {capacity}, {}]",
                        l.kv_heads, l.head_dim
                    )));
                }
                // SAFETY: an evaluated array's data pointer, valid while the array lives
                // (the cache holds it, and it is borrowed by the handle).
                *ptr = unsafe { mlx_sys::mlx_array_data_float32(buffer.as_ptr()) } as *mut f32;
            }
            layers.push(HostLayerKv {
                buffers: pair,
                capacity,
                held: self.len - kv.first,
                window: l.window_of(layer),
            });
        }
        Ok(HostKv {
            layers,
            kv_heads: l.kv_heads,
            dim: l.head_dim,
            t,
            _cache: std::marker::PhantomData,
        })
    }

    /// The whole key and value buffers of `layer` (`[1, kv_heads, capacity, dim]`, pending
    /// writes included), for kernels that read the cache in place.
    pub fn layer_buffers(&self, layer: usize) -> Option<(&Array, &Array)> {
        let kv = self.layers.get(layer)?.as_ref()?;
        Some((&kv.keys, &kv.values))
    }

    /// Marks `t` appended tokens as held (after every layer got them).
    pub fn advance(&mut self, t: usize) {
        self.len += t;
        self.skipped += self.gaps.drain(..).map(|(_, gap)| gap).sum::<usize>();
    }

    /// Forgets tokens after `len` (their slots are overwritten later). Sliding-window layers
    /// keep a step of rows beyond their window (`release_window_rows`), so a rollback of up
    /// to a step still finds every row its next query sees.
    ///
    /// Recurrent states cannot be cut back: a hybrid model's cache goes back only to a
    /// position it holds a snapshot of, and refuses any other.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len < self.len && self.layout.recurrent.is_some() {
            let snapshot = self
                .snapshots
                .get(&len)
                .filter(|_| self.has_snapshot(len))
                .ok_or_else(|| {
                    EngineError::Config(format!(
                        "cannot roll a recurrent state back from {} to {len} tokens",
                        self.len
                    ))
                })?;
            self.recurrent = snapshot.clone();
        }
        // Snapshots past the new end are of tokens that are gone.
        drop(self.snapshots.split_off(&len.saturating_add(1)));
        self.len = self.len.min(len);
        Ok(())
    }

    /// Forces pending writes, so that later reads see materialised buffers.
    pub fn eval(&self) -> Result<()> {
        for kv in self.layers.iter().flatten() {
            kv.keys.eval()?;
            kv.values.eval()?;
        }
        Ok(())
    }

    /// Tokens `[start, end)` of every layer as one contiguous byte buffer in the live dtype,
    /// ordered layer, K then V, head, token, dim.
    pub fn export(&self, start: usize, end: usize) -> Result<Vec<u8>> {
        let mut all = self.export_ranges_with(std::slice::from_ref(&(start..end)), false)?;
        all.pop()
            .ok_or_else(|| EngineError::Config("export of no range".into()))?
            .into_vec()
    }

    /// `export` of several token ranges with one evaluation: on a GPU each evaluation is a
    /// synchronisation with the device, and a prefill pass of many blocks exports them all
    /// at once.
    pub fn export_ranges(&self, ranges: &[std::ops::Range<usize>]) -> Result<Vec<KvPayload>> {
        self.export_ranges_with(ranges, crate::device_copy::uses_driver())
    }

    /// `export_ranges`, with each block's payload gathered on the device where `gathered`
    /// (CUDA) and left there for whoever takes the block (see `KvPayload`); a block's
    /// read-back is then one driver copy instead of one per layer and K/V (1,792 copies of
    /// 131 KB for an 8K-token Qwen2.5-1.5B prompt ran at 1.1 GB/s on an H100, 200 ms of a
    /// 300 ms cold request). On the CPU the gather would be one more copy of every byte, so
    /// the slices are read at once as they are.
    fn export_ranges_with(
        &self,
        ranges: &[std::ops::Range<usize>],
        gathered: bool,
    ) -> Result<Vec<KvPayload>> {
        for range in ranges {
            let (start, end) = (range.start, range.end);
            if start > end || end > self.len {
                return Err(EngineError::Config(format!(
                    "export of tokens {start}..{end} from a cache holding {}",
                    self.len
                )));
            }
            for (layer, kv) in self.layers.iter().enumerate() {
                let kv = kv
                    .as_ref()
                    .ok_or_else(|| EngineError::Config("export from an empty cache".into()))?;
                if start < kv.first {
                    return Err(EngineError::Config(format!(
                        "export of tokens {start}..{end}: sliding-window layer {layer} released \
                         the rows before {}",
                        kv.first
                    )));
                }
            }
        }
        if gathered {
            return self.export_gathered(ranges);
        }
        let mut slices = Vec::with_capacity(2 * self.layers.len() * ranges.len());
        for range in ranges {
            for kv in self.layers.iter().flatten() {
                let (from, to) = (
                    (range.start - kv.first) as i32,
                    (range.end - kv.first) as i32,
                );
                for buf in [&kv.keys, &kv.values] {
                    slices.push(
                        buf.try_index((.., .., from..to, ..))?
                            .flatten(None, None)?
                            .view::<u8>()?,
                    );
                }
            }
        }
        // One evaluation for all ranges, layers, K and V: one per layer and K/V made a
        // block's export cost more than its prefill on a GPU.
        mlx_rs::transforms::eval(&slices)?;
        let per_range = 2 * self.layers.len();
        let mut out = Vec::with_capacity(ranges.len());
        for (i, range) in ranges.iter().enumerate() {
            let slices = &slices[i * per_range..(i + 1) * per_range];
            out.push(self.block_bytes(range.start, range.end, slices)?.into());
        }
        Ok(out)
    }

    /// The ranges (checked by the caller) with each run of consecutive ranges of one length
    /// gathered into one device array, a row per range in `export`'s order (layer, K then V,
    /// head, token, dim), so that a block comes back in one copy.
    fn export_gathered(&self, ranges: &[std::ops::Range<usize>]) -> Result<Vec<KvPayload>> {
        // (first range's start, tokens per range, ranges) for each run.
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for range in ranges {
            match runs.last_mut() {
                Some((start, len, count))
                    if *len == range.len() && *len > 0 && *start + *len * *count == range.start =>
                {
                    *count += 1
                }
                _ => runs.push((range.start, range.len(), 1)),
            }
        }
        let mut rows = Vec::with_capacity(runs.len());
        for &(start, len, count) in &runs {
            if len == 0 {
                rows.push(None);
                continue;
            }
            let mut parts = Vec::with_capacity(2 * self.layers.len());
            for kv in self.layers.iter().flatten() {
                let from = (start - kv.first) as i32;
                let to = from + (len * count) as i32;
                for buf in [&kv.keys, &kv.values] {
                    let rows = buf.try_index((.., .., from..to, ..))?;
                    let (heads, dim) = (rows.dim(1), rows.dim(3));
                    parts.push(
                        rows.reshape(&[heads, count as i32, len as i32, dim])?
                            .transpose_axes(&[1, 0, 2, 3])?
                            .reshape(&[count as i32, -1])?,
                    );
                }
            }
            rows.push(Some(concatenate(&parts, 1)?.view::<u8>()?));
        }
        // Each block's recurrent states (hybrid models) as byte views, evaluated with the
        // K/V and read back with them by whoever takes the block.
        let mut tails = Vec::with_capacity(ranges.len());
        for (&(start, len, count), row) in runs.iter().zip(&rows) {
            if row.is_some() {
                for i in 0..count {
                    tails.push(self.snapshot_views(start + (i + 1) * len)?);
                }
            }
        }
        let mut evaluated: Vec<&Array> = rows.iter().flatten().collect();
        evaluated.extend(tails.iter().flatten().filter_map(|v| v.as_ref().err()));
        mlx_rs::transforms::eval(evaluated)?;
        let mut tails = tails.into_iter();
        let mut out = Vec::with_capacity(ranges.len());
        for (&(start, len, count), row) in runs.iter().zip(rows) {
            let per = len * self.layout.bytes_per_token();
            let Some(row) = row else {
                let mut block = Vec::new();
                self.append_snapshot(start, &mut block)?;
                out.push(block.into());
                continue;
            };
            let shared = EvaluatedRows::new(row);
            if shared.len() != per * count {
                return Err(EngineError::Config(format!(
                    "gathered KV of {} bytes for {count} blocks of {per}",
                    shared.len()
                )));
            }
            for i in 0..count {
                let tail = tails
                    .next()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|v| match v {
                        Ok(bytes) => TailPart::Host(bytes),
                        Err(view) => TailPart::Device(EvaluatedRows::new(view)),
                    })
                    .collect();
                out.push(KvPayload::on_device(
                    shared.clone(),
                    i * per..(i + 1) * per,
                    tail,
                ));
            }
        }
        Ok(out)
    }

    /// A block's payload: its evaluated K/V slices, then (hybrid models) the recurrent states
    /// at its last token.
    fn block_bytes(&self, start: usize, end: usize, slices: &[Array]) -> Result<Vec<u8>> {
        let per_token = self.layout.bytes_per_token();
        let mut out = Vec::with_capacity(self.layout.block_bytes(end - start));
        // An empty slice has no data pointer to read.
        for slice in slices.iter().filter(|s| s.size() > 0) {
            let bytes = slice
                .try_as_slice::<u8>()
                .map_err(|e| EngineError::Mlx(format!("reading KV bytes: {e}")))?;
            crate::device_copy::append(&mut out, bytes);
        }
        debug_assert_eq!(out.len(), (end - start) * per_token);
        self.append_snapshot(end, &mut out)?;
        Ok(out)
    }

    /// The recurrent states at token `end`: a snapshot, or the live states for a block that
    /// ends where the sequence is.
    fn snapshot_at(&self, end: usize) -> Result<&[StateFloats]> {
        let live = (end == self.len).then_some(&self.recurrent);
        self.snapshots
            .get(&end)
            .filter(|_| self.has_snapshot(end))
            .or(live)
            .map(Vec::as_slice)
            .ok_or_else(|| {
                EngineError::Config(format!(
                    "no snapshot of the recurrent layers at token {end}: a block cannot end \
                     there"
                ))
            })
    }

    /// (Hybrid models) each recurrent layer's state at token `end` in a block payload's
    /// layout: host bytes (f32 LE), or a lazy `u8` view of a device state (f32, whose bytes
    /// are LE on every host MLX runs on) for the caller to evaluate.
    fn snapshot_views(&self, end: usize) -> Result<Vec<std::result::Result<Vec<u8>, Array>>> {
        if self.layout.recurrent.is_none() {
            return Ok(Vec::new());
        }
        self.snapshot_at(end)?
            .iter()
            .map(|layer| match layer {
                StateFloats::Host(v) => Ok(Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect())),
                StateFloats::Device(a) => Ok(Err(a.as_dtype(Dtype::Float32)?.view::<u8>()?)),
            })
            .collect()
    }

    /// Appends (hybrid models) the recurrent states at token `end` to a block's payload.
    fn append_snapshot(&self, end: usize, out: &mut Vec<u8>) -> Result<()> {
        if self.layout.recurrent.is_none() {
            return Ok(());
        }
        let snapshot = self.snapshot_at(end)?;
        // Device states are computed together first: one synchronisation, not one a layer.
        let on_device: Vec<&Array> = snapshot
            .iter()
            .filter_map(|layer| match layer {
                StateFloats::Device(a) => Some(a),
                StateFloats::Host(_) => None,
            })
            .collect();
        if !on_device.is_empty() {
            mlx_rs::transforms::eval(on_device)?;
        }
        for layer in snapshot {
            out.extend(layer.to_host()?.iter().flat_map(|x| x.to_le_bytes()));
        }
        Ok(())
    }

    /// Restores every recurrent layer's state from a snapshot in `export`'s layout.
    fn restore_snapshot(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(r) = self.layout.recurrent else {
            return Ok(());
        };
        if bytes.len() != r.snapshot_bytes() {
            return Err(EngineError::Config(format!(
                "a recurrent snapshot of {} bytes, expected {}",
                bytes.len(),
                r.snapshot_bytes()
            )));
        }
        let floats: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if floats.iter().any(|x| !x.is_finite()) {
            return Err(EngineError::Config(
                "a recurrent snapshot holds a value that is not finite".into(),
            ));
        }
        self.recurrent = floats
            .chunks(r.floats())
            .map(|layer| StateFloats::Host(layer.to_vec()))
            .collect();
        Ok(())
    }

    /// Appends `tokens` tokens given as bytes in `export`'s layout after the tokens held.
    pub fn import(&mut self, bytes: &[u8], tokens: usize) -> Result<()> {
        let l = self.layout;
        if bytes.len() != l.block_bytes(tokens) {
            return Err(EngineError::Config(format!(
                "KV import of {tokens} tokens needs {} bytes, got {}",
                l.block_bytes(tokens),
                bytes.len()
            )));
        }
        let (snapshot, bytes) = (
            &bytes[tokens * l.bytes_per_token()..],
            &bytes[..tokens * l.bytes_per_token()],
        );
        let expected = bytes.len();
        let per_buf = expected / (2 * l.num_layers);
        let shape = [1, l.kv_heads as i32, tokens as i32, l.head_dim as i32];
        for layer in 0..l.num_layers {
            let at = |i: usize| -> Result<Array> {
                let chunk = &bytes[(2 * layer + i) * per_buf..(2 * layer + i + 1) * per_buf];
                let raw = Array::from_slice(chunk, &[chunk.len() as i32]);
                Ok(view_as(&raw, l.dtype)?.reshape(&shape)?)
            };
            let (k, v) = (at(0)?, at(1)?);
            self.append(layer, &k, &v)?;
        }
        self.restore_snapshot(snapshot)?;
        self.advance(tokens);
        Ok(())
    }
}

/// One sequence's KV buffers open to the host kernels for a pass of `t` new tokens
/// (`KvCache::host_rows`): rows `len..len + t` of each layer are written, then attention
/// reads rows `0..len + t`.
pub struct HostKv<'a> {
    layers: Vec<HostLayerKv>,
    kv_heads: usize,
    dim: usize,
    t: usize,
    _cache: std::marker::PhantomData<&'a mut KvCache>,
}

/// One layer's buffers in a `HostKv`.
struct HostLayerKv {
    /// Key and value buffers, `[kv_heads, capacity, dim]` f32.
    buffers: [*mut f32; 2],
    capacity: usize,
    /// Rows held before this pass (tokens held less those a sliding window released).
    held: usize,
    window: Option<usize>,
}

// SAFETY: the handle owns exclusive access to the buffers (it borrows the cache mutably), and
// MLX does not touch evaluated buffers on its own: moving it to another thread moves that
// access with it.
unsafe impl Send for HostKv<'_> {}

impl HostKv<'_> {
    /// New tokens of this pass.
    pub fn new_tokens(&self) -> usize {
        self.t
    }

    /// Writes the K and V rows of this pass's new tokens for `layer`, `[t, kv_heads * dim]`
    /// each (the projections' layout).
    pub fn write(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let width = self.kv_heads * self.dim;
        let Some(&HostLayerKv {
            buffers: [k_buf, v_buf],
            capacity,
            held,
            ..
        }) = self.layers.get(layer)
        else {
            return Err(EngineError::Config(format!("layer {layer} out of range")));
        };
        if keys.len() != self.t * width || values.len() != keys.len() {
            return Err(EngineError::Config(format!(
                "KV rows of {} and {} values for {} tokens of width {width}",
                keys.len(),
                values.len(),
                self.t
            )));
        }
        for (buffer, rows) in [(k_buf, keys), (v_buf, values)] {
            for i in 0..self.t {
                for h in 0..self.kv_heads {
                    let src = &rows[i * width + h * self.dim..][..self.dim];
                    let at = (h * capacity + held + i) * self.dim;
                    // SAFETY: `held + t <= capacity` (`reserve`) and `h < kv_heads`, so the row
                    // lies inside the buffer; `&mut self` excludes any slice of it from
                    // `buffers` being alive.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), buffer.add(at), self.dim)
                    };
                }
            }
        }
        Ok(())
    }

    /// `layer`'s buffers for the attention kernel, every row held visible (and its window,
    /// for a sliding-window layer).
    pub fn buffers(&self, layer: usize) -> Option<strata_cpu_kernels::attention::CacheBuffers<'_>> {
        let &HostLayerKv {
            buffers: [k_buf, v_buf],
            capacity,
            held,
            window,
        } = self.layers.get(layer)?;
        let size = self.kv_heads * capacity * self.dim;
        // SAFETY: each buffer holds `size` floats (checked in `host_rows`), and no write
        // happens while these shared slices live (`write` takes `&mut self`).
        let (keys, values) = unsafe {
            (
                std::slice::from_raw_parts(k_buf as *const f32, size),
                std::slice::from_raw_parts(v_buf as *const f32, size),
            )
        };
        Some(strata_cpu_kernels::attention::CacheBuffers {
            keys,
            values,
            kv_heads: self.kv_heads,
            capacity,
            dim: self.dim,
            visible: held + self.t,
            window,
        })
    }
}

impl KvCache {
    /// Fills an empty cache from consecutive parts in `export`'s layout, each (bytes, tokens),
    /// with one buffer per layer and K/V sized for all of them at once. Importing part by part
    /// would grow (and copy) every buffer once per part: quadratic in the prefix, which at 4K
    /// tokens cost more than the fetch itself. `room`: tokens the caller will add next.
    pub fn import_all(&mut self, parts: &[(&[u8], usize)], room: usize) -> Result<()> {
        if self.len != 0 || self.layers.iter().any(Option::is_some) {
            return Err(EngineError::Config(
                "import_all needs an empty cache".into(),
            ));
        }
        let l = self.layout;
        let total: usize = parts.iter().map(|(_, t)| t).sum();
        if total == 0 {
            return Ok(());
        }
        let mut kv_parts = Vec::with_capacity(parts.len());
        for (i, &(bytes, tokens)) in parts.iter().enumerate() {
            // A part may hold more rows than are used: its leading `tokens` rows are imported
            // (token-granular reuse takes the start of a block whose later tokens differ).
            // Not in a hybrid model: its recurrent state is known at the block's end only,
            // and only the last part's is restored, so the others may come without theirs.
            let per_token = l.bytes_per_token();
            let kv_only =
                l.recurrent.is_some() && i + 1 < parts.len() && bytes.len() == tokens * per_token;
            let rows = if kv_only {
                Some((tokens, bytes))
            } else {
                l.block_rows(bytes)
            };
            let fits = match rows {
                Some((rows, _)) if l.recurrent.is_some() => rows == tokens,
                Some((rows, _)) => rows >= tokens,
                None => false,
            };
            if !fits {
                return Err(EngineError::Config(format!(
                    "KV import of {tokens} tokens needs {} of {per_token} bytes a row{}, got {} bytes",
                    if l.recurrent.is_some() {
                        "a block"
                    } else {
                        "at least as many rows"
                    },
                    if l.recurrent.is_some() {
                        " and its snapshot"
                    } else {
                        ""
                    },
                    bytes.len()
                )));
            }
            if let Some((_, kv)) = rows {
                kv_parts.push((kv, tokens));
            }
        }
        if let Some((last, _)) = parts.last() {
            let kv = last.len() - l.recurrent.map_or(0, |r| r.snapshot_bytes());
            self.restore_snapshot(&last[kv..])?;
        }
        let parts = &kv_parts[..];
        // Room for the `room` tokens the caller computes next (at least one), so that they do
        // not grow (copy) buffers that hold the whole prefix: a warm prompt's tail that
        // crossed a step boundary copied a 4K-token prefix's 189 MB again in its second pass.
        let capacity = (total + room.max(1)).div_ceil(self.step_tokens) * self.step_tokens;
        // Layers are independent: each core stages and builds a share of them. The copy is
        // bound by memory bandwidth, but page faults of fresh buffers parallelise: for a
        // 4K-token prefix (~190 MB of f32 KV) on 2 cores, 43 -> 38 ms warm and 111 -> 74 ms for
        // a process's first import (`cargo bench --bench kv_import`).
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(l.num_layers);
        if crate::device_copy::uses_driver() && device_import_enabled() {
            // One thread a buffer (K or V of a layer), up to one a core.
            let threads = std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(2 * l.num_layers);
            self.layers = import_on_device(l, parts, capacity, threads)?
                .into_iter()
                .map(Some)
                .collect();
            self.len = total;
            return Ok(());
        }
        let per_thread = l.num_layers.div_ceil(threads);
        let built: Vec<Result<Vec<LayerKv>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..l.num_layers)
                .step_by(per_thread)
                .map(|first| {
                    let layers = first..(first + per_thread).min(l.num_layers);
                    scope.spawn(move || import_layers(l, parts, capacity, layers))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(EngineError::Mlx("KV import thread panicked".into()))
                    })
                })
                .collect()
        });
        let mut layers = Vec::with_capacity(l.num_layers);
        for share in built {
            layers.extend(share?);
        }
        // On a GPU the new buffers' pages move to the device in one go (`device_copy`).
        let mut spans = Vec::with_capacity(2 * layers.len());
        for kv in &layers {
            for a in [&kv.keys, &kv.values] {
                spans.push(array_bytes(a)?);
            }
        }
        crate::device_copy::prefetch_to_device(&spans);
        self.layers = layers.into_iter().map(Some).collect();
        self.len = total;
        Ok(())
    }

    /// Appends the rows of `parts` (consecutive from token 0, in `export`'s layout, each with
    /// the number of its leading rows to use) that this cache does not hold yet: a parked
    /// cache that holds the first tokens of a prompt takes the rest from cached blocks in its
    /// own buffers, instead of a fresh import of the whole prefix. Attention-only caches.
    pub fn append_from_parts(&mut self, parts: &[(&[u8], usize)]) -> Result<()> {
        let l = self.layout;
        if l.recurrent.is_some() || l.window.is_some() || self.skipped > 0 {
            return Err(EngineError::Config(
                "rows from blocks are appended to plain attention caches only".into(),
            ));
        }
        let total: usize = parts.iter().map(|(_, t)| t).sum();
        let from = self.len;
        if total <= from {
            return Ok(());
        }
        let n = total - from;
        let row = l.head_dim * dtype_bytes(l.dtype);
        // (KV bytes of a part, rows it holds, its first row to take, rows to take)
        let mut pieces = Vec::new();
        let mut start = 0;
        for &(bytes, tokens) in parts {
            let (held, kv) = l
                .block_rows(bytes)
                .filter(|(held, _)| *held >= tokens)
                .ok_or_else(|| {
                    EngineError::Config(format!(
                        "a cached part of {} bytes does not hold {tokens} rows",
                        bytes.len()
                    ))
                })?;
            let end = start + tokens;
            if end > from {
                let skip = from.saturating_sub(start);
                pieces.push((kv, held, skip, tokens - skip));
            }
            start = end;
        }
        if l.dtype == Dtype::Float32 && crate::mlx_device::default_device_kind() == "cpu" {
            // Written in place, as host passes write their rows: MLX's slice update would copy
            // the whole buffer into fresh memory unless it could donate it.
            let (heads, dim) = (l.kv_heads, l.head_dim);
            let width = heads * dim;
            let mut host = self.host_rows(n)?;
            let (mut keys, mut values) = (vec![0f32; n * width], vec![0f32; n * width]);
            for layer in 0..l.num_layers {
                for (kv, out) in [(0, &mut keys), (1, &mut values)] {
                    let mut at = 0;
                    for &(bytes, held, skip, take) in &pieces {
                        let per_buf = held * heads * row;
                        let src =
                            &bytes[(2 * layer + kv) * per_buf..(2 * layer + kv + 1) * per_buf];
                        for h in 0..heads {
                            for r in 0..take {
                                let from = (h * held + skip + r) * row;
                                let to = (at + r) * width + h * dim;
                                for (x, b) in out[to..to + dim]
                                    .iter_mut()
                                    .zip(src[from..from + row].chunks_exact(4))
                                {
                                    *x = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                                }
                            }
                        }
                        at += take;
                    }
                }
                host.write(layer, &keys, &values)?;
            }
            drop(host);
            self.advance(n);
            return Ok(());
        }
        let shape = [1, l.kv_heads as i32, n as i32, l.head_dim as i32];
        let mut buf = vec![0u8; l.kv_heads * n * row];
        for layer in 0..l.num_layers {
            let mut pair = Vec::with_capacity(2);
            for kv in 0..2 {
                let mut at = 0;
                for &(bytes, held, skip, take) in &pieces {
                    let per_buf = held * l.kv_heads * row;
                    let src = &bytes[(2 * layer + kv) * per_buf..(2 * layer + kv + 1) * per_buf];
                    for h in 0..l.kv_heads {
                        let to = (h * n + at) * row;
                        let first = (h * held + skip) * row;
                        buf[to..to + take * row].copy_from_slice(&src[first..first + take * row]);
                    }
                    at += take;
                }
                pair.push(array_from_bytes(&buf, &shape, l.dtype)?);
            }
            self.append(layer, &pair[0], &pair[1])?;
        }
        self.advance(n);
        Ok(())
    }
}

/// Rows to make a layer's buffers with for `needed`: the plan (`KvCache::plan_capacity`)
/// where they are first made in a cache without windowed layers.
fn first_rows(layout: KvLayout, planned: usize, needed: usize, growing: bool) -> usize {
    if growing || layout.window.is_some() {
        needed
    } else {
        needed.max(planned)
    }
}

/// Rows a layer's buffers are given when `needed` rows do not fit: whole steps, plus an
/// eighth of what they hold when they grow (not when first made), so that a cache that grows
/// by a few tokens at a time (decode, a conversation's next turns resuming a parked cache)
/// copies itself into fresh memory once per eighth of its length, not once per step.
fn grown_capacity(needed: usize, step: usize, growing: bool) -> usize {
    let headroom = if growing { needed / 8 } else { 0 };
    (needed + headroom).div_ceil(step) * step
}

/// The bytes of an evaluated array in its own dtype.
fn array_bytes(a: &Array) -> Result<&[u8]> {
    let (ptr, len) = match a.dtype() {
        Dtype::Float32 => {
            let s = a.try_as_slice::<f32>();
            s.map(|s| (s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)))
        }
        Dtype::Float16 => {
            let s = a.try_as_slice::<half::f16>();
            s.map(|s| (s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)))
        }
        Dtype::Bfloat16 => {
            let s = a.try_as_slice::<half::bf16>();
            s.map(|s| (s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)))
        }
        other => {
            return Err(EngineError::Config(format!("KV of dtype {other:?}")));
        }
    }
    .map_err(|e| EngineError::Mlx(format!("reading KV bytes: {e}")))?;
    // SAFETY: the slice above spans exactly these bytes of the array's buffer, which lives as
    // long as the borrow of `a`.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Builds the K and V arrays `[1, heads, capacity, dim]` of `layers` from `parts` (blocks in
/// `export`'s layout, in token order, each with the number of its leading rows to use); slots
/// after the prefix are zero.
fn import_layers(
    l: KvLayout,
    parts: &[(&[u8], usize)],
    capacity: usize,
    layers: std::ops::Range<usize>,
) -> Result<Vec<LayerKv>> {
    let row = l.head_dim * dtype_bytes(l.dtype);
    let shape = [1, l.kv_heads as i32, capacity as i32, l.head_dim as i32];
    // One staging buffer, reused: a fresh one each time would page-fault it in again.
    let mut buf = vec![0u8; l.kv_heads * capacity * row];
    let mut out = Vec::with_capacity(layers.len());
    for layer in layers {
        let mut pair = [None, None];
        for (kv, slot) in pair.iter_mut().enumerate() {
            for (to, src) in part_runs(l, parts, capacity, layer, kv) {
                buf[to..to + src.len()].copy_from_slice(src);
            }
            *slot = Some(array_from_bytes(&buf, &shape, l.dtype)?);
        }
        if let [Some(keys), Some(values)] = pair {
            out.push(LayerKv {
                keys,
                values,
                first: 0,
            });
        }
    }
    Ok(out)
}

/// Where each part's rows of layer `layer`'s keys (`kv` 0) or values (1) go in a buffer of
/// `[heads, capacity, dim]`: (byte offset, bytes), one run per part and head. A part's
/// `[heads, tokens, dim]` goes at its token offset; it holds `held` rows of which the leading
/// `tokens` are used (a whole number of rows, at least `tokens`: checked by `import_all`).
fn part_runs<'a>(
    l: KvLayout,
    parts: &[(&'a [u8], usize)],
    capacity: usize,
    layer: usize,
    kv: usize,
) -> Vec<(usize, &'a [u8])> {
    let row = l.head_dim * dtype_bytes(l.dtype);
    let mut runs = Vec::with_capacity(parts.len() * l.kv_heads);
    let mut at = 0;
    for &(bytes, tokens) in parts {
        let held = bytes.len() / (2 * l.num_layers * l.kv_heads * row);
        let per_buf = held * l.kv_heads * row;
        let src = &bytes[(2 * layer + kv) * per_buf..(2 * layer + kv + 1) * per_buf];
        for h in 0..l.kv_heads {
            let from = h * held * row;
            runs.push(((h * capacity + at) * row, &src[from..from + tokens * row]));
        }
        at += tokens;
    }
    runs
}

/// Whether an import on CUDA writes the rows straight into device buffers
/// (`import_on_device`); `STRATA_KV_DEVICE_IMPORT=0` keeps the host import, to measure one
/// against the other.
fn device_import_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_KV_DEVICE_IMPORT").map_or(true, |v| v != "0"))
}

/// `import_layers` on CUDA: every layer's K and V made as device buffers first (one
/// evaluation), then each part's rows written into them by the driver, `threads` buffers at
/// a time. The host import stages every byte twice (a staging buffer, then MLX's copy into
/// fresh managed memory, whose pages fault in one at a time on the host) and then migrates
/// the pages to the device: 0.31-0.33 s of a 64K-token hit at the seed's shape on an H100.
fn import_on_device(
    l: KvLayout,
    parts: &[(&[u8], usize)],
    capacity: usize,
    threads: usize,
) -> Result<Vec<LayerKv>> {
    let row = l.head_dim * dtype_bytes(l.dtype);
    let shape = [1, l.kv_heads as i32, capacity as i32, l.head_dim as i32];
    let buffers = (0..2 * l.num_layers)
        .map(|_| zeros_dtype(&shape, l.dtype))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    mlx_rs::transforms::eval(buffers.iter())?;
    let len = l.kv_heads * capacity * row;
    let mut targets = Vec::with_capacity(buffers.len());
    for b in &buffers {
        let bytes = array_bytes(b)?;
        if bytes.len() != len {
            return Err(EngineError::Mlx(format!(
                "a fresh KV buffer holds {} bytes, not {len}",
                bytes.len()
            )));
        }
        // An address, so that the scoped threads below may share it.
        targets.push(bytes.as_ptr() as usize);
    }
    // Buffer i is layer i / 2's keys (even) or values (odd).
    let write = |i: usize, dst: usize| {
        let runs = part_runs(l, parts, capacity, i / 2, i % 2);
        // SAFETY: `dst` is buffer i's `len` bytes, evaluated above and not read or written by
        // anyone else until this function returns it; every run lies inside it (offsets
        // below `kv_heads * capacity` rows, `at + tokens <= capacity`).
        unsafe { crate::device_copy::write_runs(dst as *mut u8, len, &runs) };
    };
    let per_thread = targets.len().div_ceil(threads.max(1));
    std::thread::scope(|scope| {
        for (chunk, share) in targets.chunks(per_thread).enumerate() {
            let write = &write;
            scope.spawn(move || {
                for (j, &dst) in share.iter().enumerate() {
                    write(chunk * per_thread + j, dst);
                }
            });
        }
    });
    let mut buffers = buffers.into_iter();
    let mut layers = Vec::with_capacity(l.num_layers);
    while let (Some(keys), Some(values)) = (buffers.next(), buffers.next()) {
        layers.push(LayerKv {
            keys,
            values,
            first: 0,
        });
    }
    Ok(layers)
}

/// An MLX array (a copy) of `bytes` read as `dtype` elements of `shape`.
fn array_from_bytes(bytes: &[u8], shape: &[i32; 4], dtype: Dtype) -> Result<Array> {
    let elements: usize = shape.iter().map(|&d| d as usize).product();
    if !matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
        || bytes.len() != elements * dtype_bytes(dtype)
    {
        return Err(EngineError::Config(format!(
            "{} bytes are not a {dtype:?} array of shape {shape:?}",
            bytes.len()
        )));
    }
    // SAFETY: `bytes` holds exactly `elements` values of `dtype` (checked above), and MLX
    // copies them before this returns. Unlike `from_slice` + `view`, this builds the array in
    // its own dtype, so nothing is converted or copied again at evaluation.
    Ok(unsafe { Array::from_raw_data(bytes.as_ptr().cast(), shape, dtype) })
}

/// Reinterprets raw bytes as `dtype` (no conversion).
fn view_as(raw: &Array, dtype: Dtype) -> Result<Array> {
    Ok(match dtype {
        Dtype::Float32 => raw.view::<f32>()?,
        Dtype::Float16 => raw.view::<half::f16>()?,
        Dtype::Bfloat16 => raw.view::<half::bf16>()?,
        other => {
            return Err(EngineError::Config(format!(
                "unsupported KV dtype {other:?}"
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two layers of two KV heads of four dims: big enough to tell heads, layers and K from V.
    fn small_layout(dtype: Dtype) -> KvLayout {
        KvLayout {
            num_layers: 2,
            kv_heads: 2,
            head_dim: 4,
            dtype,
            window: None,
            recurrent: None,
        }
    }

    /// A cache holding a prompt's first rows (a parked cache cut back) takes the rest from the
    /// blocks, in its own buffers: the same KV as importing the blocks whole, across a growth
    /// of its buffers, and starting inside a block.
    #[test]
    fn rows_appended_from_blocks_equal_the_blocks_imported_whole() {
        // f32 is written in place on the CPU; f16 goes through MLX's slice update.
        for dtype in [Dtype::Float32, Dtype::Float16] {
            rows_appended_from_blocks_in(dtype);
        }
    }

    fn rows_appended_from_blocks_in(dtype: Dtype) {
        let layout = small_layout(dtype);
        let values = |n: usize, seed: f32| -> Vec<u8> {
            let count = n * layout.bytes_per_token() / dtype_bytes(dtype);
            (0..count)
                .flat_map(|i| {
                    let x = i as f32 * 0.25 + seed;
                    if dtype == Dtype::Float32 {
                        x.to_le_bytes().to_vec()
                    } else {
                        half::f16::from_f32(x).to_le_bytes().to_vec()
                    }
                })
                .collect()
        };
        let (a, b, c) = (values(4, 0.0), values(4, 100.0), values(6, 200.0));
        let parts = [(&a[..], 4), (&b[..], 4), (&c[..], 5)];
        let mut whole = KvCache::new(layout, 4);
        whole.import_all(&parts, 1).unwrap();
        for held in [0, 3, 4, 6] {
            let mut cache = KvCache::new(layout, 4);
            cache.import_all(&[(&a[..], 4), (&b[..], 4)], 1).unwrap();
            cache.truncate(held).unwrap();
            cache.append_from_parts(&parts).unwrap();
            assert_eq!(cache.len(), 13, "from {held}");
            assert_eq!(
                cache.export(0, 13).unwrap(),
                whole.export(0, 13).unwrap(),
                "from {held}"
            );
        }
        // A part that does not hold the rows asked for is refused.
        let mut cache = KvCache::new(layout, 4);
        assert!(cache.append_from_parts(&[(&a[..], 5)]).is_err());
    }

    /// The leading rows of a longer block are the KV of those tokens: importing 3 of a 5-row
    /// block gives what exporting the first 3 rows gave.
    #[test]
    fn the_leading_rows_of_a_longer_block_import_as_those_tokens() {
        let layout = small_layout(Dtype::Float32);
        let values = |n: usize, seed: f32| -> Vec<u8> {
            (0..n * layout.bytes_per_token() / 4)
                .flat_map(|i| (i as f32 * 0.5 + seed).to_le_bytes())
                .collect()
        };
        let (first, second) = (values(4, 0.0), values(5, 1000.0));
        let mut full = KvCache::new(layout, 16);
        full.import_all(&[(&first, 4), (&second, 5)], 1).unwrap();
        let mut lead = KvCache::new(layout, 16);
        lead.import_all(&[(&first, 4), (&second, 3)], 1).unwrap();
        assert_eq!(lead.len(), 7);
        assert_eq!(lead.export(0, 7).unwrap(), full.export(0, 7).unwrap());
        // More rows than the part holds, or a ragged part, is refused.
        let mut bad = KvCache::new(layout, 16);
        assert!(bad.import_all(&[(&first, 5)], 1).is_err());
        assert!(
            bad.import_all(&[(&first[..first.len() - 4], 3)], 1)
                .is_err()
        );
    }

    /// The import that writes rows into device buffers (on a CPU, through host pointers, as
    /// on CUDA when the driver fails) builds what the host import builds: parts of several
    /// lengths, the leading rows of a longer one, room past the end, 1 and 3 threads.
    #[test]
    fn rows_written_into_device_buffers_equal_the_host_import() {
        for dtype in [Dtype::Float32, Dtype::Float16] {
            let layout = small_layout(dtype);
            let values = |n: usize, seed: f32| -> Vec<u8> {
                (0..n * layout.bytes_per_token() / dtype_bytes(dtype))
                    .flat_map(|i| {
                        let x = i as f32 * 0.25 + seed;
                        match dtype {
                            Dtype::Float16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
                            _ => x.to_le_bytes().to_vec(),
                        }
                    })
                    .collect()
            };
            let (a, b, c) = (values(4, 0.0), values(4, 100.0), values(6, 200.0));
            let parts = [(&a[..], 4), (&b[..], 4), (&c[..], 5)];
            let host = import_layers(layout, &parts, 16, 0..layout.num_layers).unwrap();
            for threads in [1, 3] {
                let device = import_on_device(layout, &parts, 16, threads).unwrap();
                assert_eq!(device.len(), host.len());
                for (d, h) in device.iter().zip(&host) {
                    for (x, y) in [(&d.keys, &h.keys), (&d.values, &h.values)] {
                        assert_eq!(x.shape(), y.shape());
                        // The rows past the parts are room: only the 13 imported are compared.
                        let rows = |a: &Array| a.try_index((.., .., ..13, ..)).unwrap();
                        let (x, y) = (rows(x), rows(y));
                        assert!(x.eq_values(&y).unwrap(), "{dtype:?}, {threads} threads");
                    }
                }
            }
        }
    }

    /// A growth of the buffers is counted in bytes of the rows it copied, once, and only
    /// when rows were held (the first buffers are not a growth).
    #[test]
    fn a_growth_counts_the_rows_it_copies() {
        let layout = small_layout(Dtype::Float32);
        let mut cache = KvCache::new(layout, 4);
        let rows = |t: i32| Array::zeros::<f32>(&[1, 2, t, 4]).unwrap();
        let append = |cache: &mut KvCache, t: i32| {
            for layer in 0..layout.num_layers {
                cache.append(layer, &rows(t), &rows(t)).unwrap();
            }
            cache.advance(t as usize);
        };
        append(&mut cache, 4);
        assert_eq!(cache.take_grown_bytes(), 0, "first buffers");
        append(&mut cache, 1);
        // 4 rows of 2 heads of 4 f32, keys and values, 2 layers.
        assert_eq!(cache.take_grown_bytes(), 4 * 2 * 4 * 4 * 2 * 2);
        assert_eq!(cache.take_grown_bytes(), 0, "taken");
        append(&mut cache, 1);
        assert_eq!(cache.take_grown_bytes(), 0, "room left after the growth");

        // Planned rows: the chunks, the answer and a next turn fill them without a growth.
        let mut planned = KvCache::new(layout, 4);
        planned.plan_capacity(12);
        for t in [4, 4, 2, 1, 1] {
            append(&mut planned, t);
        }
        assert_eq!(planned.len(), 12);
        assert_eq!(planned.take_grown_bytes(), 0, "planned");
        append(&mut planned, 1);
        assert!(planned.take_grown_bytes() > 0, "past the plan it grows");
    }

    fn host(payloads: Vec<KvPayload>) -> Vec<Vec<u8>> {
        payloads
            .into_iter()
            .map(|p| p.into_vec().unwrap())
            .collect()
    }

    /// Several ranges exported in one evaluation are each what exporting it alone gives, in
    /// the order asked, partial and overlapping ranges included; a range past the end fails.
    #[test]
    fn ranges_exported_together_equal_each_exported_alone() {
        for dtype in [Dtype::Float32, Dtype::Float16] {
            ranges_exported_together_in(dtype);
        }
    }

    fn ranges_exported_together_in(dtype: Dtype) {
        let layout = small_layout(dtype);
        let bytes: Vec<u8> = (0..9 * layout.bytes_per_token() / dtype_bytes(dtype))
            .flat_map(|i| {
                let x = i as f32 * 0.25 - 3.0;
                match dtype {
                    Dtype::Float16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
                    _ => x.to_le_bytes().to_vec(),
                }
            })
            .collect();
        let mut cache = KvCache::new(layout, 16);
        cache.import_all(&[(&bytes, 9)], 1).unwrap();
        let ranges = [0..4, 4..8, 8..9, 2..7, 0..9];
        let together = cache.export_ranges(&ranges).unwrap();
        assert_eq!(together.len(), ranges.len());
        for (range, got) in ranges.iter().zip(&together) {
            assert_eq!(**got, cache.export(range.start, range.end).unwrap());
            assert_eq!(got.len(), range.len() * layout.bytes_per_token());
        }
        // A range over all that was imported gives the imported bytes back.
        assert_eq!(*together[4], bytes);
        assert!(cache.export_ranges(&[0..4, 8..10]).is_err());
        // Gathered on the device first (as on CUDA), runs of blocks included, the bytes are
        // the same.
        for ranges in [
            &ranges[..],
            &[0..2, 2..4, 4..6, 6..8, 8..9, 9..9, 3..5, 5..7],
        ] {
            let gathered = host(cache.export_ranges_with(ranges, true).unwrap());
            assert_eq!(
                gathered,
                host(cache.export_ranges_with(ranges, false).unwrap())
            );
            // Read in place first, then taken: the same bytes.
            for (payload, bytes) in cache
                .export_ranges_with(ranges, true)
                .unwrap()
                .into_iter()
                .zip(&gathered)
            {
                assert_eq!(&*payload, bytes.as_slice());
                assert_eq!(&payload.into_vec().unwrap(), bytes);
            }
        }
        assert!(cache.export_ranges_with(&[0..4, 8..10], true).is_err());
    }

    /// A hybrid model's block carries the recurrent states at its end: importing blocks
    /// restores the last one's states, a block may end only where a snapshot (or the live
    /// state) is, and a rollback goes only to a snapshot.
    #[test]
    fn hybrid_blocks_carry_and_restore_the_recurrent_states_at_their_end() {
        let recurrent = RecurrentLayers {
            layers: 2,
            conv_floats: 3,
            state_floats: 5,
        };
        let layout = KvLayout {
            num_layers: 1,
            kv_heads: 1,
            head_dim: 4,
            dtype: Dtype::Float32,
            window: None,
            recurrent: Some(recurrent),
        };
        let state = |seed: f32| -> Vec<f32> { (0..8).map(|i| seed + i as f32).collect() };
        let mut cache = KvCache::new(layout, 16);
        cache.set_snapshots(4, vec![6]);
        // Snapshot points of a 7-token chunk from 0: after positions 4 and 6.
        assert_eq!(cache.snapshot_points(7), vec![3, 5]);
        let rows = Array::from_slice(
            &(0..28).map(|i| i as f32).collect::<Vec<_>>(),
            &[1, 1, 7, 4],
        );
        let negated = rows.multiply(Array::from_f32(-1.0)).unwrap();
        cache.append(0, &rows, &negated).unwrap();
        for (position, seed) in [(4, 10.0), (6, 20.0)] {
            for layer in 0..2 {
                cache.put_snapshot(position, layer, state(seed + layer as f32 * 100.0));
            }
        }
        for layer in 0..2 {
            let (conv, rec) = cache.recurrent_state(layer).unwrap();
            conv.fill(7.0 + layer as f32);
            rec.fill(-7.0);
        }
        cache.advance(7);
        let whole = cache.export(0, 4).unwrap();
        let tail = cache.export(4, 6).unwrap();
        let live = cache.export(4, 7).unwrap();
        assert_eq!(whole.len(), layout.block_bytes(4));
        assert_eq!(tail.len(), 2 * 4 * 4 * 2 + recurrent.snapshot_bytes());
        // No snapshot after 5 tokens: no block ends there.
        assert!(cache.export(0, 5).is_err());
        // Gathered on the device, each block still ends with its own states.
        assert_eq!(
            host(cache.export_ranges_with(&[0..4, 4..6, 4..7], true).unwrap()),
            vec![whole.clone(), tail.clone(), live.clone()]
        );
        assert!(
            cache
                .export_ranges_with(std::slice::from_ref(&(0..5)), true)
                .is_err()
        );
        // States kept on the device (the recurrence on a GPU) stay there in the gathered
        // blocks and read back as the host's states do.
        let mut on_device = KvCache::new(layout, 16);
        on_device.set_snapshots(4, vec![6]);
        on_device.append(0, &rows, &negated).unwrap();
        for (position, seed) in [(4, 10.0), (6, 20.0)] {
            for layer in 0..2 {
                let floats = state(seed + layer as f32 * 100.0);
                on_device.put_snapshot_array(position, layer, Array::from_slice(&floats, &[8]));
            }
        }
        for layer in 0..2 {
            let mut live = vec![7.0 + layer as f32; 3];
            live.extend([-7.0; 5]);
            on_device
                .set_recurrent_array(layer, Array::from_slice(&live, &[8]))
                .unwrap();
        }
        on_device.advance(7);
        let gathered = on_device
            .export_ranges_with(&[0..4, 4..6, 4..7], true)
            .unwrap();
        assert!(format!("{:?}", gathered[0]).contains("2 parts"));
        assert_eq!(
            host(gathered),
            vec![whole.clone(), tail.clone(), live.clone()]
        );

        let mut resumed = KvCache::new(layout, 16);
        resumed.import_all(&[(&whole, 4), (&tail, 2)], 1).unwrap();
        assert_eq!(resumed.len(), 6);
        assert_eq!(
            resumed.export(0, 6).unwrap()[..6 * 32],
            cache.export(0, 6).unwrap()[..6 * 32]
        );
        let (conv, rec) = resumed.recurrent_state(1).unwrap();
        assert_eq!(
            (conv.to_vec(), rec.to_vec()),
            (state(120.0)[..3].to_vec(), state(120.0)[3..].to_vec())
        );
        // Blocks before the last may come with their K/V alone (a fetch reads only the
        // snapshot it resumes from); the same rows and states result. The last may not.
        let kv_of_whole = &whole[..4 * layout.bytes_per_token()];
        let mut from_parts = KvCache::new(layout, 16);
        from_parts
            .import_all(&[(kv_of_whole, 4), (&tail, 2)], 1)
            .unwrap();
        assert_eq!(
            from_parts.export(0, 6).unwrap(),
            resumed.export(0, 6).unwrap()
        );
        assert!(
            KvCache::new(layout, 16)
                .import_all(
                    &[(&whole, 4), (&tail[..2 * layout.bytes_per_token()], 2)],
                    1
                )
                .is_err()
        );
        // The live states end the block that ends where the sequence is.
        let mut at_end = KvCache::new(layout, 16);
        at_end.import_all(&[(&whole, 4), (&live, 3)], 1).unwrap();
        assert_eq!(at_end.recurrent_state(0).unwrap().1.to_vec(), vec![-7.0; 5]);
        // The leading rows of a block cannot be taken: the states are known at its end only.
        assert!(
            KvCache::new(layout, 16)
                .import_all(&[(&whole, 3)], 1)
                .is_err()
        );

        // Back to a snapshot, not to anywhere else.
        assert!(cache.truncate(5).is_err());
        cache.truncate(4).unwrap();
        assert_eq!(
            cache.recurrent_state(0).unwrap().0.to_vec(),
            state(10.0)[..3].to_vec()
        );
    }

    /// Rows written in place land where MLX's appends put them, across a growth of the
    /// buffers, and rows that do not fit or have the wrong width are refused.
    #[test]
    fn rows_written_in_place_equal_rows_appended() {
        let layout = small_layout(Dtype::Float32);
        let width = layout.kv_heads * layout.head_dim;
        // Token i's K row: head-major values [t, kv_heads * dim], V rows negated.
        let rows = |from: usize, t: usize, layer: usize| -> Vec<f32> {
            (0..t * width)
                .map(|j| (100 * layer + from * width + j) as f32)
                .collect()
        };
        let as_mlx = |r: &[f32], t: usize| {
            // [t, kv_heads, dim] -> [1, kv_heads, t, dim]
            Array::from_slice(r, &[1, t as i32, 2, 4])
                .transpose_axes(&[0, 2, 1, 3])
                .unwrap()
        };
        let (mut written, mut appended) = (KvCache::new(layout, 4), KvCache::new(layout, 4));
        let mut held = 0;
        for t in [3, 1, 1, 4] {
            let mut host = written.host_rows(t).unwrap();
            for layer in 0..2 {
                let k = rows(held, t, layer);
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                host.write(layer, &k, &v).unwrap();
                appended
                    .append(layer, &as_mlx(&k, t), &as_mlx(&v, t))
                    .unwrap();
            }
            written.advance(t);
            appended.advance(t);
            held += t;
        }
        assert_eq!(written.len(), 9);
        assert_eq!(
            written.export(0, 9).unwrap(),
            appended.export(0, 9).unwrap()
        );
        // More rows than the pass has, rows of the wrong width, a layer past the model:
        // refused, nothing written.
        let mut host = written.host_rows(1).unwrap();
        assert!(host.write(0, &[0.0; 16], &[0.0; 16]).is_err());
        assert!(host.write(0, &[1.0; 3], &[1.0; 3]).is_err());
        assert!(host.write(5, &[0.0; 8], &[0.0; 8]).is_err());
        assert_eq!(host.buffers(1).map(|b| b.visible), Some(10));
        assert_eq!(
            written.export(0, 9).unwrap(),
            appended.export(0, 9).unwrap()
        );
    }

    #[test]
    fn skipped_positions_shift_the_runs_of_a_chunk_and_everything_after() {
        let layout = KvLayout {
            num_layers: 1,
            kv_heads: 1,
            head_dim: 4,
            dtype: Dtype::Float32,
            window: None,
            recurrent: None,
        };
        let mut cache = KvCache::new(layout, 16);
        assert_eq!(cache.position_runs(5), vec![(0, 5, 0)]);
        // Positions 0..3 skipped, then 4 tokens, 10 skipped, 2 tokens.
        cache.set_gaps(vec![(0, 3), (4, 10)]);
        assert_eq!(cache.position_runs(6), vec![(0, 4, 3), (4, 2, 17)]);
        cache.advance(6);
        assert_eq!((cache.len(), cache.position()), (6, 19));
        // The next chunk carries on after them, and gaps are used once.
        assert_eq!(cache.position_runs(1), vec![(0, 1, 19)]);
        cache.advance(1);
        assert_eq!(cache.position(), 20);
    }
}
