//! One request as a state machine the scheduler can step: prefill one chunk at a time, then
//! take the logits of its last position (from the prefill, or from a row of a batched decode
//! step), sample, stream, and say which token to feed next. `LoadedModel::generate` drives a
//! single sequence through the same steps, so batched and single runs share every line of it.

use std::time::{Duration, Instant};

use super::generate::StopMatcher;
use super::generate::{
    EngineOptions, FinishReason, GenerateRequest, Generation, Notice, PrefillPhases, Timings,
    TokenEvent,
};
use super::kv::KvCache;
use super::kv_payload::KvPayload;
use super::llama::SeqChunk;
use super::loader::LoadedModel;
use super::multimodal;
use super::sample::{Sampled, Sampler};
use super::spec_prefill;
use super::speculative::{self, Plan, Speculation};
use super::{EngineError, Result};
use crate::tokenizer::StreamDecoder;
use mlx_rs::Array;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;

/// A block of KV a sequence finished computing, for the cache: its index in the sequence, its
/// token ids (fewer than a block for the prompt's partial tail) and its bytes.
pub struct FinishedBlock {
    pub index: usize,
    pub tokens: Vec<u32>,
    /// On CUDA still on the device until taken (see `KvPayload`).
    pub bytes: KvPayload,
}

/// Where finished blocks go.
pub type BlockSink<'a> = Option<&'a mut (dyn FnMut(FinishedBlock) + Send)>;

/// KV brought from the cache for the start of a prompt, in order: whole blocks, then at most
/// one partial block.
#[derive(Clone, Copy)]
pub struct CachedKv<'a> {
    pub bytes: &'a [u8],
    pub tokens: usize,
}

/// A finished sequence's live KV cache, kept where it was computed (device memory on a GPU)
/// so that the next prompt sharing its start resumes from it without a copy: `tokens` are
/// the ids whose KV it holds (prompt, then generated tokens fed back), `stored_blocks` the
/// whole blocks of them already handed to the prefix cache.
pub struct ParkedKv {
    pub tokens: Vec<u32>,
    pub cache: KvCache,
    pub stored_blocks: usize,
}

/// A parked cache taken by a new sequence: its first `tokens` rows (the common prefix with
/// the new prompt, short of the prompt's last token) are kept, the rest forgotten.
pub struct Resume {
    pub parked: ParkedKv,
    pub tokens: usize,
}

impl ParkedKv {
    /// Bytes the cache's buffers hold (what parking it keeps from the memory budget).
    pub fn bytes(&self) -> u64 {
        // Rows are counted per layer; a token's bytes cover K and V of every layer.
        let l = self.cache.layout();
        let per_layer_row = l.bytes_per_token() / l.num_layers.max(1);
        (self.cache.rows_allocated() * per_layer_row) as u64
    }
}

pub struct Sequence {
    req: GenerateRequest,
    /// The ids the KV cache knows the prompt by (image positions carry the image's hash).
    cache_tokens: Vec<u32>,
    /// The images' features in the decoder's space, computed when a chunk first needs them
    /// (never, when the cache held every image position).
    image_features: Option<Array>,
    chunk: usize,
    block: usize,
    /// See `EngineOptions::last_token_alone`.
    last_token_alone: bool,
    pub cache: KvCache,
    /// Hybrid models: message ends inside blocks, where partial blocks are stored.
    message_ends: Vec<usize>,
    prefilled: usize,
    /// Where passes are counted from (`prefill_step`): 0, or in the default reuse mode where
    /// prefill started after a cache hit or the last `prefill_breaks` position.
    pass_origin: usize,
    cached_tokens: usize,
    /// Whole blocks imported or handed to the sink.
    stored_blocks: usize,
    /// Whether blocks of generated tokens are handed to the sink too (opt-in: decode KV is
    /// not bit-identical to prefill KV).
    store_decode: bool,
    sampler: Sampler,
    stops: StopMatcher,
    decoder: StreamDecoder,
    tokens: Vec<u32>,
    logprobs: Vec<Sampled>,
    text: String,
    /// Logits of the last prefilled position, until they are sampled.
    prefill_logits: Option<Vec<f32>>,
    /// The token to run through the model next (decode phase).
    pub pending: [u32; 1],
    has_pending: bool,
    started: Instant,
    prefill_time: Option<Duration>,
    phases: PrefillPhases,
    ttft: Option<Duration>,
    finish: Option<FinishReason>,
    /// The draft's state, when this sequence decodes speculatively.
    spec: Option<Speculation>,
    /// Features asked for that did not (fully) apply.
    notices: Vec<Notice>,
    /// SpecPrefill: the draft's reading of the prompt until it has chosen, then the prompt
    /// ranges the target prefills.
    prune: Option<spec_prefill::Scoring>,
    kept: Option<Vec<std::ops::Range<usize>>>,
}

impl Sequence {
    /// Validates the request and imports cached KV for the start of the prompt: whole blocks,
    /// then maybe a partial one. KV that does not fit is dropped and the prompt computed. The
    /// last prompt token is never imported: it is computed, for the first token's
    /// logits, in cold and warm runs alike (see `prefill_step`).
    pub fn new(
        model: &LoadedModel,
        req: GenerateRequest,
        options: &EngineOptions,
        cached: &[CachedKv<'_>],
        resume: Option<Resume>,
    ) -> Result<Self> {
        model.validate(&req)?;
        let cache_tokens = match &model.vision {
            Some(v) => multimodal::cache_tokens(
                &req.prompt,
                v.input.image_token,
                v.input.image_tokens,
                &req.images,
            )?,
            None if req.images.is_empty() => req.prompt.clone(),
            None => {
                return Err(EngineError::InvalidRequest(
                    "this model reads text only; it cannot take images".into(),
                ));
            }
        };
        let mut notices = Vec::new();
        let prune = match (spec_prefill::plan(model, &req), &model.draft) {
            (spec_prefill::Plan::Keep(ratio), Some(draft)) => Some(spec_prefill::Scoring::new(
                draft,
                ratio,
                options.kv_step_tokens,
            )),
            (spec_prefill::Plan::NotApplied(why), _) => {
                tracing::info!(feature = spec_prefill::FEATURE, "not applied: {why}");
                notices.push(Notice {
                    feature: spec_prefill::FEATURE.into(),
                    message: format!("not applied: {why}"),
                });
                None
            }
            _ => None,
        };
        // A pruned prompt's KV is not the prompt's: nothing cached is used for it.
        let cached = if prune.is_some() { &[][..] } else { cached };
        let block = model.block_tokens;
        let body = req.prompt.len() - 1;
        // A hybrid model's recurrent states are snapshotted where a block may end: every
        // block end, the end of the prompt's body (its partial tail) and its message ends.
        let message_ends: Vec<usize> = if model.model.is_hybrid() {
            req.message_ends
                .iter()
                .copied()
                .filter(|&m| m > 0 && m < body && m % block != 0)
                .collect()
        } else {
            Vec::new()
        };
        // Rows for the prompt, a short answer and the conversation's next turn, so that none
        // of them grows (copies) the buffers (`KvCache::plan_capacity`).
        let planned = planned_rows(req.prompt.len(), req.max_tokens);
        let fresh_cache = || {
            let mut cache = model.model.new_cache(options.kv_step_tokens);
            cache.plan_capacity(planned);
            if model.model.is_hybrid() {
                let mut at = message_ends.clone();
                at.push(body);
                cache.set_snapshots(block, at);
            }
            cache
        };
        let mut cache = fresh_cache();
        // Whole blocks, then at most one partial one, never reaching the last token.
        let mut usable = Vec::new();
        let mut covered = 0;
        for kv in cached {
            let fits = kv.tokens > 0
                && covered % block == 0
                && kv.tokens <= block
                && covered + kv.tokens <= body;
            if !fits {
                break;
            }
            usable.push((kv.bytes, kv.tokens));
            covered += kv.tokens;
        }
        let mut imported = covered;
        let mut stored_blocks = covered / block;
        let import_started = Instant::now();
        let resume = resume.filter(|r| {
            prune.is_none()
                && r.tokens > 0
                && r.tokens <= body
                && parkable(&r.parked.cache)
                && r.parked.tokens.get(..r.tokens) == cache_tokens.get(..r.tokens)
        });
        let mut resumed = false;
        if let Some(r) = resume {
            // The parked cache's first rows are this prompt's KV (same model, same token
            // ids at the same positions): keep them, forget the rest. Its whole blocks not yet
            // stored (those of its answer) go to the cache with this prompt's first pass.
            // Where cached blocks give more, their further rows are appended to it (they are
            // all in the cache already).
            let mut parked = r.parked.cache;
            match parked.truncate(r.tokens) {
                Ok(()) if covered > r.tokens => match parked.append_from_parts(&usable) {
                    Ok(()) => {
                        cache = parked;
                        stored_blocks = covered / block;
                        resumed = true;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cached rows could not be appended to a parked KV cache; importing them");
                        notices.push(Notice {
                            feature: "parked_kv".into(),
                            message: format!(
                                "the cached rows could not be appended to the parked KV cache ({e}): the blocks were imported instead"
                            ),
                        });
                    }
                },
                Ok(()) => {
                    cache = parked;
                    imported = r.tokens;
                    stored_blocks = r.parked.stored_blocks.min(r.tokens / block);
                    resumed = true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a parked KV cache could not be cut back; computing the prompt");
                }
            }
        }
        // Room for the rest of the prompt, the answer and the next turn, as planned.
        let room = planned.saturating_sub(covered).max(1);
        if !resumed && let Err(e) = cache.import_all(&usable, room) {
            tracing::warn!(error = %e, "cached KV does not fit this model; computing the prompt");
            notices.push(Notice {
                feature: "prefix_cache".into(),
                message: format!(
                    "the cached KV did not fit this model ({e}): the prompt was computed"
                ),
            });
            cache = fresh_cache();
            imported = 0;
            stored_blocks = 0;
        }
        let spec = match (speculative::plan(model, &req), &model.draft) {
            (Plan::On, Some(draft)) => Some(Speculation::new(draft, options.kv_step_tokens)),
            (Plan::NotApplied(why), _) => {
                tracing::info!(feature = speculative::FEATURE, "not applied: {why}");
                notices.push(Notice {
                    feature: speculative::FEATURE.into(),
                    message: format!("not applied: {why}"),
                });
                None
            }
            _ => None,
        };
        Ok(Self {
            sampler: Sampler::new(req.sampling.clone(), &req.prompt),
            stops: StopMatcher::new(&req.stop),
            decoder: StreamDecoder::new(true),
            chunk: model.prefill_chunk_for(options, req.prompt.len()),
            block,
            last_token_alone: options.last_token_alone,
            cache,
            message_ends,
            prefilled: imported,
            pass_origin: if options.last_token_alone {
                0
            } else {
                imported
            },
            cached_tokens: imported,
            stored_blocks,
            store_decode: options.store_decode_kv,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            text: String::new(),
            prefill_logits: None,
            pending: [0],
            has_pending: false,
            started: Instant::now(),
            prefill_time: None,
            phases: PrefillPhases {
                import: import_started.elapsed(),
                ..PrefillPhases::default()
            },
            ttft: None,
            finish: None,
            cache_tokens,
            image_features: None,
            spec,
            notices,
            prune,
            kept: None,
            req,
        })
    }

    /// Prompt tokens still to prefill.
    pub fn prefill_left(&self) -> usize {
        self.req.prompt.len() - self.prefilled
    }

    pub fn needs_prefill(&self) -> bool {
        self.prefilled < self.req.prompt.len()
    }

    /// Ready for a batched decode step (it has a token to feed).
    pub fn wants_decode(&self) -> bool {
        self.finish.is_none() && self.has_pending
    }

    pub fn is_finished(&self) -> bool {
        self.finish.is_some()
    }

    /// Ends the sequence where it is: its client has gone.
    pub fn cancel(&mut self) {
        self.finish.get_or_insert(FinishReason::Cancelled);
        self.has_pending = false;
    }

    /// Runs the next prefill chunk and hands finished prompt blocks to `on_block`.
    ///
    /// Chunk ends: the multiples of the chunk size counted from the pass origin, the
    /// request's `prefill_breaks`, the end of the prompt's body (all but the last token) and
    /// the end. With `last_token_alone` (`cache.exact`) the origin is always 0, so chunk ends
    /// depend only on absolute positions, never on what was cached: MLX's results for a row
    /// depend on the shape of the matmul it is part of, so this is what makes an exact hit
    /// (at a block end) repeat a cold run's arithmetic bit for bit; and the last token runs
    /// alone, so that a prompt whose body is fully cached, partial tail included, still
    /// repeats the cold run. In the default mode a hit equals a cold run within rounding
    /// anyway, so passes count from where prefill started (and from each prefill break): a
    /// warm prompt's new tokens run in one pass wherever they sit (a 19-token tail that
    /// crossed position 4096 took two passes), and a cold run with a break at the hit's
    /// length still repeats the warm run exactly. The last token joins the body's last chunk
    /// (one pass over the weights fewer for every prompt).
    pub fn prefill_step(&mut self, model: &LoadedModel, on_block: BlockSink<'_>) -> Result<()> {
        if self.prune.is_some() || self.kept.is_some() {
            return self.pruned_prefill_step(model);
        }
        let at = self.prefilled;
        let len = self.req.prompt.len();
        let body = len - 1;
        let end = if at < body {
            let origin = self.pass_origin;
            let next_chunk = origin + ((at - origin) / self.chunk + 1) * self.chunk;
            let next_break = self
                .req
                .prefill_breaks
                .iter()
                .copied()
                .filter(|&b| b > at)
                .min()
                .unwrap_or(usize::MAX);
            let end = next_chunk.min(next_break).min(body);
            if end == body && !self.last_token_alone {
                len
            } else {
                end
            }
        } else {
            len
        };
        let compute = tracing::info_span!("prefill.compute", tokens = end - at).entered();
        let started = Instant::now();
        let out = match self.image_rows(model, at, end)? {
            None => model.model.forward(&mut [SeqChunk {
                tokens: &self.req.prompt[at..end],
                cache: &mut self.cache,
            }])?,
            Some(rows) => {
                let ids = &self.req.prompt[at..end];
                let tower = model.vision.as_ref().map(|v| &v.tower).ok_or_else(|| {
                    EngineError::Config("image rows for a model without vision".into())
                })?;
                let x = tower.embed_with_images(&model.model, ids, Some(&rows))?;
                model.model.forward_embedded(
                    x,
                    &mut [SeqChunk {
                        tokens: ids,
                        cache: &mut self.cache,
                    }],
                )?
            }
        };
        out.eval()?;
        self.phases.passes += 1;
        self.phases.compute += started.elapsed();
        self.phases.grown_bytes += self.cache.take_grown_bytes();
        drop(compute);
        self.prefilled = end;
        if !self.last_token_alone && self.req.prefill_breaks.contains(&end) {
            self.pass_origin = end;
        }
        let storing = on_block.is_some();
        if let Some(sink) = on_block {
            let finished = self.blocks_finished(at, end);
            if !finished.is_empty() {
                // All of this pass's blocks come back from the device in one evaluation.
                let export =
                    tracing::info_span!("prefill.export", blocks = finished.len()).entered();
                let started = Instant::now();
                let ranges: Vec<_> = finished.iter().map(|(_, r)| r.clone()).collect();
                let bytes = self.cache.export_ranges(&ranges)?;
                self.phases.export += started.elapsed();
                drop(export);
                let _store =
                    tracing::info_span!("prefill.store", blocks = finished.len()).entered();
                let started = Instant::now();
                for ((index, range), bytes) in finished.into_iter().zip(bytes) {
                    if range.len() == self.block {
                        self.stored_blocks = self.stored_blocks.max(index + 1);
                    }
                    self.phases.blocks += 1;
                    sink(FinishedBlock {
                        index,
                        tokens: self.cache_tokens[range].to_vec(),
                        bytes,
                    });
                }
                self.phases.store += started.elapsed();
            }
        }
        if !self.needs_prefill() {
            self.prefill_logits = Some(crate::device_copy::to_host_f32(out.as_slice::<f32>()));
            self.prefill_time = Some(self.started.elapsed());
        }
        self.release_window_rows(storing)
    }

    /// The blocks a pass over `at..end` finished, as (index in the prompt, token range):
    /// whole blocks not yet stored, then (hybrid models) a partial block at each message end
    /// the pass went by, then the body's partial tail unless it came from the cache whole.
    fn blocks_finished(&self, at: usize, end: usize) -> Vec<(usize, std::ops::Range<usize>)> {
        let b = self.block;
        let len = self.req.prompt.len();
        let body = len - 1;
        let done = (self.cache.len() / b).min(len / b);
        let mut out: Vec<_> = (self.stored_blocks..done)
            .map(|i| (i, i * b..(i + 1) * b))
            .collect();
        // A prompt sharing the conversation up to a message end resumes exactly there.
        for &m in &self.message_ends {
            if m > at && m <= end {
                out.push((m / b, m / b * b..m));
            }
        }
        let tail_start = body / b * b;
        if end >= body && at < body && body > tail_start && self.cached_tokens < body {
            out.push((body / b, tail_start..body));
        }
        out
    }

    /// Lets sliding-window layers drop the rows no query sees again, keeping those a block
    /// still to be stored will export (`storing`: blocks of this sequence go to the cache).
    fn release_window_rows(&mut self, storing: bool) -> Result<()> {
        let exported_later = storing && (self.needs_prefill() || self.store_decode);
        let keep_from = if exported_later {
            self.stored_blocks * self.block
        } else {
            usize::MAX
        };
        self.cache.release_window_rows(keep_from)
    }

    /// SpecPrefill: the first steps let the draft read the prompt (a chunk per step) and
    /// choose the chunks to keep; each step then prefills the next kept tokens at their own
    /// positions, skipping the positions between. Nothing goes to the prefix cache.
    fn pruned_prefill_step(&mut self, model: &LoadedModel) -> Result<()> {
        let len = self.req.prompt.len();
        if let Some(scoring) = self.prune.take() {
            let draft = model
                .draft
                .as_ref()
                .ok_or_else(|| EngineError::Config("pruning without a draft".into()))?;
            match scoring.step(draft, &self.req.prompt, self.chunk)? {
                spec_prefill::Scored::Reading(more) => self.prune = Some(more),
                spec_prefill::Scored::Chosen(kept, draft_cache) => {
                    // The draft now holds the whole prompt: speculative decoding goes on
                    // from there.
                    if let Some(spec) = self.spec.as_mut() {
                        spec.adopt_cache(draft_cache);
                    }
                    self.kept = Some(kept);
                }
            }
            return Ok(());
        }
        // The next kept tokens, as many as a full prefill's chunk would hold (chunks end at
        // multiples of the chunk size in kept tokens), the last token alone: with nothing
        // skipped this is a full prefill's arithmetic. Runs of kept tokens share the pass,
        // each at its own positions.
        let body = len - 1;
        let limit = self.chunk - self.cache.len() % self.chunk;
        let mut ids = Vec::with_capacity(limit);
        let mut gaps = Vec::new();
        let mut at = self.prefilled;
        for run in self.kept.iter().flatten() {
            if run.end <= at {
                continue;
            }
            let start = run.start.max(at);
            // The last token runs alone.
            let stop = if start < body {
                run.end.min(body)
            } else {
                run.end
            };
            let end = stop.min(start + (limit - ids.len()));
            if start > at {
                gaps.push((ids.len(), start - at));
            }
            ids.extend_from_slice(&self.req.prompt[start..end]);
            at = end;
            if ids.len() == limit || at == body {
                break;
            }
        }
        if ids.is_empty() {
            return Err(EngineError::Config(
                "pruned prefill past its last chunk".into(),
            ));
        }
        self.cache.set_gaps(gaps);
        let out = model.model.forward(&mut [SeqChunk {
            tokens: &ids,
            cache: &mut self.cache,
        }])?;
        out.eval()?;
        self.prefilled = at;
        if at == len {
            self.prefill_logits = Some(crate::device_copy::to_host_f32(out.as_slice::<f32>()));
            self.prefill_time = Some(self.started.elapsed());
        }
        Ok(())
    }

    /// The image feature rows of prompt positions `at..end`, or None when they hold no image
    /// position. Features of all the prompt's images are computed the first time.
    fn image_rows(&mut self, model: &LoadedModel, at: usize, end: usize) -> Result<Option<Array>> {
        let Some(vision) = &model.vision else {
            return Ok(None);
        };
        let image_token = vision.input.image_token;
        let count = |ids: &[u32]| ids.iter().filter(|&&t| t == image_token).count();
        let n = count(&self.req.prompt[at..end]);
        if n == 0 || self.req.images.is_empty() {
            return Ok(None);
        }
        if self.image_features.is_none() {
            let per_image = self
                .req
                .images
                .iter()
                .map(|i| vision.tower.image_features(&i.array()))
                .collect::<Result<Vec<_>>>()?;
            let all = concatenate(&per_image, 0)?;
            all.eval()?;
            self.image_features = Some(all);
        }
        let offset = count(&self.req.prompt[..at]) as i32;
        let features = self
            .image_features
            .as_ref()
            .ok_or_else(|| EngineError::Config("image features missing".into()))?;
        Ok(Some(features.try_index(offset..offset + n as i32)?))
    }

    /// At the end of a generation, in the opt-in mode: hands the whole blocks that hold
    /// generated tokens to `on_block` (their KV came from decode steps, which round
    /// differently from a prefill, so a later hit on them is not bit-identical to computing
    /// them).
    pub fn finish_blocks(&mut self, on_block: BlockSink<'_>) -> Result<()> {
        let Some(sink) = on_block else {
            return Ok(());
        };
        if !self.store_decode || self.needs_prefill() || self.kept.is_some() {
            return Ok(());
        }
        let b = self.block;
        let held = self.cache.len();
        let done = held / b;
        // Nothing was generated into the KV beyond the prompt: the prefill stored it all.
        if held <= self.cache_tokens.len() {
            return Ok(());
        }
        let all = self.first_tokens(held);
        while self.stored_blocks < done {
            let i = self.stored_blocks;
            sink(FinishedBlock {
                index: i,
                tokens: all[i * b..(i + 1) * b].to_vec(),
                bytes: self.cache.export(i * b, (i + 1) * b)?.into(),
            });
            self.stored_blocks += 1;
        }
        // The partial tail with the answer in it: a chat's next turn resends the answer, and
        // resumes after it (at token granularity) instead of recomputing it.
        let tail_start = done * b;
        if held > tail_start {
            sink(FinishedBlock {
                index: done,
                tokens: all[tail_start..held].to_vec(),
                bytes: self.cache.export(tail_start, held)?.into(),
            });
        }
        Ok(())
    }

    /// After the prefill: samples the first token from the prefill's logits.
    pub fn take_prefill_logits(&mut self) -> Option<Vec<f32>> {
        self.prefill_logits.take()
    }

    /// Samples from `logits` (this sequence's last position), streams the text through
    /// `emit` (false: the client is gone), and decides whether to go on. Afterwards either
    /// the sequence is finished or `pending` holds the token to feed next.
    pub fn advance(
        &mut self,
        model: &LoadedModel,
        logits: &[f32],
        emit: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<()> {
        self.has_pending = false;
        let sampled = match self.req.grammar.as_mut() {
            None => self.sampler.sample(logits),
            Some(guide) => {
                let mask = guide.allowed().map_err(grammar_failed)?;
                if mask.num_set() == 0 {
                    return Err(EngineError::InvalidRequest(
                        "the answer cannot go on under its constraint: the grammar allows no token here"
                            .into(),
                    ));
                }
                self.sampler
                    .sample_allowed(logits, Some(&|i: usize| mask.is_allowed(i as u32)))
            }
        };
        // Decode blocks are stored at the end (`finish_blocks`) in the default mode.
        self.release_window_rows(true)?;
        self.take(model, sampled, emit)
    }

    /// Takes a chosen token: ends the answer on a stop token, stop string, a complete grammar
    /// or the length limit, streams its text, and otherwise makes it the token to feed next.
    pub(super) fn take(
        &mut self,
        model: &LoadedModel,
        sampled: Sampled,
        emit: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<()> {
        self.has_pending = false;
        let token = sampled.token;
        self.ttft.get_or_insert_with(|| self.started.elapsed());
        // A grammar allows the end token only where it is complete; then it ends the answer
        // even when the request ignores EOS.
        let grammar_complete = self.req.grammar.is_some() && model.stop_tokens.contains(&token);
        let is_stop_token = (!self.req.ignore_eos && model.stop_tokens.contains(&token))
            || self.req.stop_token_ids.contains(&token)
            || grammar_complete;
        if is_stop_token {
            let tail = self
                .stops
                .finish(self.decoder.flush(&model.tokenizer)?.unwrap_or_default());
            self.text.push_str(&tail);
            // The stop token itself is not output text.
            if !tail.is_empty() {
                emit(&TokenEvent {
                    token,
                    text: tail,
                    sampled,
                });
            }
            self.finish = Some(FinishReason::Stop);
            return Ok(());
        }
        if let Some(guide) = self.req.grammar.as_mut() {
            guide.accept(token).map_err(grammar_failed)?;
        }
        let grammar_done = self.req.grammar.as_ref().is_some_and(|g| g.is_done());
        self.tokens.push(token);
        if self.req.sampling.logprobs.is_some() {
            self.logprobs.push(sampled.clone());
        }
        let delta = self
            .decoder
            .push(&model.tokenizer, token)?
            .unwrap_or_default();
        let (mut out, hit_stop) = self.stops.push(&delta);
        let at_limit = !hit_stop && self.tokens.len() >= self.req.max_tokens;
        // A complete grammar ends the answer (its text whole, unlike a stop string's).
        let complete = !hit_stop && grammar_done;
        if at_limit || complete {
            // The last token's event also carries whatever was held back, so every token
            // is streamed exactly once.
            let tail = self.decoder.flush(&model.tokenizer)?.unwrap_or_default();
            out.push_str(&self.stops.finish(tail));
        }
        self.text.push_str(&out);
        let go_on = emit(&TokenEvent {
            token,
            text: out,
            sampled,
        });
        if hit_stop || complete {
            self.finish = Some(FinishReason::Stop);
        } else if at_limit {
            self.finish = Some(FinishReason::Length);
        } else if !go_on {
            self.finish = Some(FinishReason::Cancelled);
        } else {
            self.pending = [token];
            self.has_pending = true;
        }
        Ok(())
    }

    /// Whether this sequence's next decode step can be a speculative one.
    pub fn speculates(&self) -> bool {
        self.spec.is_some() && self.wants_decode()
    }

    /// One speculative step: the draft proposes, the target verifies in one pass, and the
    /// kept tokens (at least one) are taken in order. Both KV caches are rolled back to what
    /// was kept.
    fn speculate(
        &mut self,
        model: &LoadedModel,
        emit: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<()> {
        let (Some(draft), Some(spec)) = (&model.draft, self.spec.as_mut()) else {
            return Err(EngineError::Config("speculation without a draft".into()));
        };
        let held = self.cache.len();
        let context = model.model.config().context_length;
        // Room for the drafted tokens and the one the target adds, within max_tokens and the
        // context (`tokens` already counts the pending token).
        let room = (self.req.max_tokens - self.tokens.len())
            .min(context.saturating_sub(self.cache.position() + 1));
        let k = draft.tokens.min(room.saturating_sub(1));
        let mut history = Vec::with_capacity(held + 1);
        history.extend_from_slice(&self.req.prompt);
        history.extend_from_slice(&self.tokens);
        let (drafted, dists) = if k == 0 {
            (Vec::new(), Vec::new())
        } else {
            speculative::propose(
                draft,
                spec,
                &history,
                k,
                model.model.config().vocab_size,
                self.chunk,
                &mut self.sampler,
            )?
        };
        let mut input = Vec::with_capacity(drafted.len() + 1);
        input.push(self.pending[0]);
        input.extend_from_slice(&drafted);
        let out = model.model.forward_all_positions(SeqChunk {
            tokens: &input,
            cache: &mut self.cache,
        })?;
        out.eval()?;
        let rows = out.as_slice::<f32>();
        let vocab = rows.len() / input.len();
        let verdict = speculative::verify(&mut self.sampler, &drafted, &dists, rows, vocab);
        spec.stats.steps += 1;
        spec.stats.drafted += drafted.len();
        spec.stats.accepted += verdict.accepted;
        // The target keeps the fed token and the accepted drafts; the draft never holds more.
        self.cache.truncate(held + 1 + verdict.accepted)?;
        spec.cache_truncate(held + 1 + verdict.accepted)?;
        let before = self.tokens.len();
        for token in verdict.tokens {
            self.take(model, speculative::plain(token), emit)?;
            if self.finish.is_some() {
                break;
            }
        }
        // A finish part-way leaves KV of tokens that were never output: keep the fed token
        // and the taken ones but the last (the next to feed).
        self.cache
            .truncate(held + (self.tokens.len() - before).max(1))?;
        Ok(())
    }

    /// The finished generation.
    pub fn into_generation(self) -> Result<Generation> {
        self.into_parts().map(|(g, _)| g)
    }

    /// The first `n` ids of the prompt (as the cache knows it) and then the answer.
    fn first_tokens(&self, n: usize) -> Vec<u32> {
        self.cache_tokens
            .iter()
            .chain(self.tokens.iter())
            .copied()
            .take(n)
            .collect()
    }

    /// The finished generation, and the sequence's KV cache to park for the next prompt
    /// that shares its start, where it can be resumed (see `parkable`).
    pub fn into_parts(mut self) -> Result<(Generation, Option<ParkedKv>)> {
        let parked = (self.kept.is_none() && parkable(&self.cache) && !self.cache.is_empty())
            .then(|| {
                // Answer rows are resumed only where blocks of generated tokens are cached
                // too (`store_decode_kv`): turned off, a later prompt computes them.
                let held = if self.store_decode {
                    self.cache.len()
                } else {
                    self.cache.len().min(self.cache_tokens.len())
                };
                let tokens = self.first_tokens(held);
                let layout = self.cache.layout();
                let cache = std::mem::replace(&mut self.cache, KvCache::new(layout, 1));
                (tokens.len() == held).then_some(ParkedKv {
                    tokens,
                    cache,
                    stored_blocks: self.stored_blocks,
                })
            })
            .flatten();
        self.into_generation_only().map(|g| (g, parked))
    }

    fn into_generation_only(self) -> Result<Generation> {
        let finish = self
            .finish
            .ok_or_else(|| EngineError::Config("generation taken before it finished".into()))?;
        let total = self.started.elapsed();
        let prefill = self.prefill_time.unwrap_or(total);
        let mut notices = self.notices;
        let speculation = self.spec.map(|s| s.stats);
        if let Some(s) = speculation.filter(|s| s.batched_steps > 0) {
            let message = format!(
                "off for {} of {} decode steps: other requests were decoding in the same batch, and batched steps run without the draft",
                s.batched_steps,
                s.batched_steps + s.steps
            );
            tracing::info!(feature = speculative::FEATURE, "{message}");
            notices.push(Notice {
                feature: speculative::FEATURE.into(),
                message,
            });
        }
        let pruned_tokens = self.kept.as_ref().map_or(0, |kept| {
            self.req.prompt.len() - kept.iter().map(|r| r.len()).sum::<usize>()
        });
        Ok(Generation {
            notices,
            speculation,
            pruned_tokens,
            prompt_tokens: self.req.prompt.len(),
            tokens: self.tokens,
            text: self.text,
            finish,
            timings: Timings {
                prefill,
                decode: total.saturating_sub(prefill),
                time_to_first_token: self.ttft.unwrap_or(total),
                phases: self.phases,
            },
            logprobs: self.logprobs,
            cached_tokens: self.cached_tokens,
        })
    }
}

/// Whether a cache can be parked and later cut back to any shorter prefix: not a hybrid
/// model's (a recurrent state resumes only at its snapshots), not one whose sliding-window
/// layers may have dropped rows, not one holding pruned positions.
fn parkable(cache: &KvCache) -> bool {
    let l = cache.layout();
    l.recurrent.is_none() && l.window.is_none() && cache.position() == cache.len()
}

/// The grammar engine failing mid-answer is the constraint's fault (a request's), not the
/// worker's: a 400 for the request.
fn grammar_failed(e: crate::grammar::GrammarError) -> EngineError {
    EngineError::InvalidRequest(e.to_string())
}

/// What a decode step did: how many sequences ran together in it, and the errors of those
/// whose own part failed (their index in the batch), the others having gone on.
#[derive(Debug, Default)]
pub struct Stepped {
    pub ran: usize,
    pub failed: Vec<(usize, EngineError)>,
}

/// One decode step for every sequence in `batch` that has a token to feed, in one forward
/// pass; each then samples from its own row. A failed pass is an error (for every sequence
/// in it); a sequence whose sampling fails is listed in `Stepped::failed` alone.
pub fn decode_step(
    model: &LoadedModel,
    batch: &mut [&mut Sequence],
    emit: &mut dyn FnMut(usize, &TokenEvent) -> bool,
) -> Result<Stepped> {
    let ready: Vec<usize> = (0..batch.len())
        .filter(|&i| batch[i].wants_decode())
        .collect();
    if ready.is_empty() {
        return Ok(Stepped::default());
    }
    if let [only] = ready[..]
        && batch[only].speculates()
    {
        batch[only].speculate(model, &mut |e| emit(only, e))?;
        return Ok(Stepped {
            ran: 1,
            failed: Vec::new(),
        });
    }
    for &i in &ready {
        if let Some(spec) = batch[i].spec.as_mut() {
            spec.stats.batched_steps += 1;
        }
    }
    let logits = {
        let mut chunks: Vec<SeqChunk<'_>> = Vec::with_capacity(ready.len());
        for (i, s) in batch.iter_mut().enumerate() {
            if ready.contains(&i) {
                let s = &mut **s;
                chunks.push(SeqChunk {
                    tokens: &s.pending,
                    cache: &mut s.cache,
                });
            }
        }
        let out = model.model.forward(&mut chunks)?;
        out.eval()?;
        crate::device_copy::to_host_f32(out.as_slice::<f32>())
    };
    let vocab = logits.len() / ready.len();
    let mut failed = Vec::new();
    for (row, &i) in ready.iter().enumerate() {
        let seq = &mut *batch[i];
        let row = &logits[row * vocab..(row + 1) * vocab];
        if let Err(e) = seq.advance(model, row, &mut |e| emit(i, e)) {
            failed.push((i, e));
        }
    }
    Ok(Stepped {
        ran: ready.len(),
        failed,
    })
}

/// Rows a sequence's KV buffers are made with: its prompt, up to 64 generated tokens (a
/// longer answer grows them as decode goes, an eighth at a time), and a next turn of an
/// eighth of the prompt. A resumed conversation's next turn then fits in the buffers it
/// parked. Short prompts gain little (a growth copies little), and eight short streams
/// given 512 rows each held ~190 MB more at their peak.
fn planned_rows(prompt: usize, max_tokens: usize) -> usize {
    prompt + max_tokens.min(64) + prompt / 8
}
