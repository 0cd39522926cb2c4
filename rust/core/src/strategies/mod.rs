//! The step strategies behind [`crate::AdaptiveSpeculativeParams`], one file each, behind one
//! trait: [`StepStrategy`].
//!
//! The policy routes the batch size to its slot and validates every report; a strategy only
//! decides ([`StepStrategy::decide`]) and learns ([`StepStrategy::on_verify_complete`]). A new
//! strategy is a new file here implementing the trait, plus its config (in [`crate::config`]) and
//! one arm in [`build`].
//!
//! - [`ema`]: SGLang's per-slot EMA + hysteresis rules ([`crate::slot`]).
//! - [`goodput`]: expected tokens per second from learned costs ([`crate::goodput`]).
//! - [`throughput_aware`]: SGLang's profiled-cost rule ([`crate::throughput`]).

pub mod ema;
pub mod goodput;
pub mod throughput_aware;

use std::any::Any;
use std::fmt::Debug;

use crate::config::{AdaptiveConfig, Strategy};
use crate::decision::Decision;
use crate::error::PolicyError;
pub use crate::goodput::per_request::RequestVerify;

/// What a strategy sees when it decides one decode iteration (the policy has routed it).
#[derive(Debug, Clone, Copy)]
pub struct DecideContext<'a> {
    /// Index of the routed slot (into the config's slots, ascending by lower bound).
    pub slot: usize,
    /// Requests in the batch (>= 1).
    pub batch_size: u32,
    /// The padded CUDA-graph batch size that replays, or `None` (eager).
    pub graph_bs: Option<u32>,
    /// Sum of the batch's KV lengths before the iteration, tokens (`None`: unknown).
    pub context_tokens: Option<u64>,
    /// Drafter catch-up tokens pending in the batch: what a drafting iteration would run over
    /// before its drafts (`None`: unknown).
    pub catch_up_tokens: Option<u64>,
    /// The routed slot's candidate steps, ascending.
    pub candidates: &'a [u32],
    /// The batch's request ids in batch order (`None`: unknown; a per-request decision needs
    /// them to find each request's history).
    pub request_ids: Option<&'a [u64]>,
}

/// One reported verify, already validated by the policy (every `accepted[i]` is in
/// `0..=steps`, `seconds` is finite and > 0 when given).
#[derive(Debug, Clone, Copy)]
pub struct VerifyObservation<'a> {
    /// Index of the routed slot.
    pub slot: usize,
    /// Requests in the batch (>= 1).
    pub batch_size: u32,
    /// The padded CUDA-graph batch size that replayed, or `None` (eager).
    pub graph_bs: Option<u32>,
    /// The steps the iteration ran.
    pub steps: u32,
    /// Accepted drafts per request (bonus excluded).
    pub accepted: &'a [i64],
    /// Wall time of the iteration, seconds.
    pub seconds: Option<f64>,
    /// Sum of the batch's KV lengths before the iteration, tokens.
    pub context_tokens: Option<u64>,
    /// Drafter catch-up tokens the iteration ran (`None`: unknown; see
    /// [`crate::Observation::catch_up_tokens`]).
    pub catch_up_tokens: Option<u64>,
    /// Every request of the batch with its own verify length, accepted drafts and draft
    /// probabilities (`None`: not reported; `accepted` above then holds the requests that ran
    /// the full `steps`).
    pub requests: Option<&'a [RequestVerify<'a>]>,
}

/// One slot's state as a strategy reports it: `(current steps, accepted drafts estimate at them,
/// verifies counted)`; see [`crate::SlotState`] for each strategy's meaning.
pub type SlotView = (u32, f64, u64);

/// A step strategy: per-slot state that decides each decode iteration's [`Decision`] and learns
/// from the reports.
pub trait StepStrategy: StrategyObject + Debug + Send + Sync {
    /// The config name (`"ema"`, `"goodput"`, `"throughput_aware"`).
    fn name(&self) -> &'static str;

    /// Steps the slot runs now (a pure read).
    fn current_steps(&self, slot: usize) -> u32;

    /// The decision for one decode iteration.
    fn decide(&mut self, ctx: &DecideContext<'_>) -> Decision;

    /// Learns from one verify. Returns the slot's new steps if they changed.
    fn on_verify_complete(&mut self, obs: &VerifyObservation<'_>) -> Result<Option<u32>, PolicyError>;

    /// The slot's state for metrics (`/server_info`, `slot_states()`).
    fn slot_state(&self, slot: usize) -> SlotView;

    /// Switches of the steps so far (0 where the strategy does not count them).
    fn switches(&self) -> u64 {
        0
    }

    /// A startup measurement of one iteration: `batch_size` requests (>= 1) at `steps`, `seconds`
    /// (finite, > 0) with `context_tokens` of context. Ignored by default.
    fn set_profiled_cost(&mut self, _batch_size: u32, _steps: u32, _seconds: f64, _context_tokens: u64) {}
}

/// What the policy needs of any boxed strategy besides its rules: implemented once, for every
/// `Clone + 'static` strategy, so a strategy file holds its rules only.
pub trait StrategyObject {
    /// A boxed copy (for `Clone` of the policy).
    fn clone_box(&self) -> Box<dyn StepStrategy>;

    /// For the policy's typed accessors (`goodput()` and the like).
    fn as_any(&self) -> &dyn Any;

    /// Mutable counterpart of [`Self::as_any`].
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: StepStrategy + Clone + 'static> StrategyObject for T {
    fn clone_box(&self) -> Box<dyn StepStrategy> {
        Box::new(self.clone())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Clone for Box<dyn StepStrategy> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// The strategy the config names, every slot started at `initial_steps` (or the slot's middle
/// candidate when that is not one of its candidates; `throughput_aware`: one engine-wide value).
pub fn build(initial_steps: u32, config: &AdaptiveConfig) -> Box<dyn StepStrategy> {
    match &config.strategy {
        Strategy::Ema => Box::new(ema::EmaStrategy::new(initial_steps, config)),
        Strategy::Goodput(g) => Box::new(goodput::new(g.clone(), initial_steps, config)),
        Strategy::ThroughputAware(t) => Box::new(throughput_aware::new(t.clone(), initial_steps, config)),
    }
}
