//! What the engine loop asks of a model, apart from MLX: start a request's sequence, run one
//! prefill chunk of it, one decode step for a batch, and end it. The engine implements it for
//! `LoadedModel`; the loop's unit tests implement it for a fake that scripts tokens, failures
//! and pauses, so that the loop's rules (who runs when, what a failure or a departed client
//! ends) are tested without weights.

use crate::engine::EngineError;
use crate::engine::generate::{EngineOptions, GenerateRequest, Generation, TokenEvent};
use crate::engine::loader::LoadedModel;
use crate::engine::sequence::{
    BlockSink, CachedKv, ParkedKv, Resume, Sequence, Stepped, decode_step,
};

/// A request's state as the loop sees it.
pub trait BatchSeq {
    /// Prompt tokens still to prefill.
    fn prefill_left(&self) -> usize;
    fn needs_prefill(&self) -> bool {
        self.prefill_left() > 0
    }
    /// Ready for a batched decode step (it has a token to feed).
    fn wants_decode(&self) -> bool;
    fn is_finished(&self) -> bool;
    /// Ends the sequence where it is: its client has gone.
    fn cancel(&mut self);
}

pub trait BatchModel: Send + 'static {
    type Seq: BatchSeq;

    /// Validates the request and imports the cached KV for the start of its prompt, or
    /// resumes it from a parked cache.
    fn start(
        &self,
        request: GenerateRequest,
        options: &EngineOptions,
        cached: &[CachedKv<'_>],
        resume: Option<Resume>,
    ) -> Result<Self::Seq, EngineError>;

    /// Runs the next prefill chunk, handing finished blocks to `sink`. Once the prompt is
    /// done, samples the first token and streams it through `emit` (false: the client is
    /// gone); returns whether that happened.
    fn prefill_chunk(
        &self,
        seq: &mut Self::Seq,
        sink: BlockSink<'_>,
        emit: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<bool, EngineError>;

    /// One decode step for every sequence in `batch` that wants one, in one forward pass. A
    /// failed pass is an error for all of them; a sequence whose own part failed is listed
    /// in `Stepped::failed` alone.
    fn decode(
        &self,
        batch: &mut [&mut Self::Seq],
        emit: &mut dyn FnMut(usize, &TokenEvent) -> bool,
    ) -> Result<Stepped, EngineError>;

    /// Hands the blocks of generated tokens to `sink` (where the request stores them) and
    /// gives the finished generation, with the sequence's KV cache if it can be parked.
    fn finish(
        &self,
        seq: Self::Seq,
        sink: BlockSink<'_>,
    ) -> Result<(Generation, Option<ParkedKv>), EngineError>;
}

impl BatchSeq for Sequence {
    fn prefill_left(&self) -> usize {
        Sequence::prefill_left(self)
    }
    fn needs_prefill(&self) -> bool {
        Sequence::needs_prefill(self)
    }
    fn wants_decode(&self) -> bool {
        Sequence::wants_decode(self)
    }
    fn is_finished(&self) -> bool {
        Sequence::is_finished(self)
    }
    fn cancel(&mut self) {
        Sequence::cancel(self)
    }
}

impl BatchModel for LoadedModel {
    type Seq = Sequence;

    fn start(
        &self,
        request: GenerateRequest,
        options: &EngineOptions,
        cached: &[CachedKv<'_>],
        resume: Option<Resume>,
    ) -> Result<Sequence, EngineError> {
        Sequence::new(self, request, options, cached, resume)
    }

    fn prefill_chunk(
        &self,
        seq: &mut Sequence,
        sink: BlockSink<'_>,
        emit: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<bool, EngineError> {
        seq.prefill_step(self, sink)?;
        match seq.take_prefill_logits() {
            Some(logits) => seq.advance(self, &logits, emit).map(|()| true),
            None => Ok(false),
        }
    }

    fn decode(
        &self,
        batch: &mut [&mut Sequence],
        emit: &mut dyn FnMut(usize, &TokenEvent) -> bool,
    ) -> Result<Stepped, EngineError> {
        decode_step(self, batch, emit)
    }

    fn finish(
        &self,
        mut seq: Sequence,
        sink: BlockSink<'_>,
    ) -> Result<(Generation, Option<ParkedKv>), EngineError> {
        // Storing is a favour to later requests: its failure does not fail this one.
        if let Err(e) = seq.finish_blocks(sink) {
            tracing::warn!(error = %e, "storing generated blocks failed");
        }
        seq.into_parts()
    }
}
