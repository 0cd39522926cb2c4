//! The `goodput` strategy's [`StepStrategy`] face: [`GoodputPolicy`] (see [`crate::goodput`])
//! fed with the cost model's batch-size bucket.


use super::{DecideContext, SlotView, StepStrategy, VerifyObservation};
use crate::config::{AdaptiveConfig, GoodputConfig, VerifyMode};
use crate::decision::Decision;
use crate::error::PolicyError;
use crate::goodput::{cost::bucket_of, GoodputPolicy};

/// The strategy's state, one slot per config slot.
pub fn new(cfg: GoodputConfig, initial_steps: u32, config: &AdaptiveConfig) -> GoodputPolicy {
    let candidates = config.slots.iter().map(|(_, c)| c.candidate_steps.clone()).collect();
    GoodputPolicy::new(cfg, initial_steps, candidates)
}

/// The bucket and the batch size the cost model sees: the graph size where a graph replays.
fn cost_batch(batch_size: u32, graph: Option<u32>) -> (u32, u32) {
    match graph {
        Some(g) => (g, g),
        None => (bucket_of(batch_size), batch_size),
    }
}

impl StepStrategy for GoodputPolicy {
    fn name(&self) -> &'static str {
        "goodput"
    }

    fn current_steps(&self, slot: usize) -> u32 {
        GoodputPolicy::current_steps(self, slot)
    }

    fn decide(&mut self, ctx: &DecideContext<'_>) -> Decision {
        let (bucket, b_cost) = cost_batch(ctx.batch_size, ctx.graph_bs);
        let context = ctx.context_tokens.unwrap_or(0);
        self.decide_requests(ctx.slot, bucket, ctx.batch_size, b_cost, context, ctx.catch_up_tokens, ctx.request_ids)
    }

    fn on_verify_complete(&mut self, obs: &VerifyObservation<'_>) -> Result<Option<u32>, PolicyError> {
        let (bucket, b_cost) = cost_batch(obs.batch_size, obs.graph_bs);
        let context = obs.context_tokens.unwrap_or(0);
        let (b, steps) = (obs.batch_size, obs.steps);
        if let Some(requests) = obs.requests.filter(|_| self.verify_mode() == VerifyMode::PerRequest) {
            return Ok(self.observe_requests(obs.slot, bucket, b_cost, steps, requests, obs.seconds, context, obs.catch_up_tokens));
        }
        Ok(self.observe_with(obs.slot, bucket, b, b_cost, steps, obs.accepted, obs.seconds, context, obs.catch_up_tokens))
    }

    fn slot_state(&self, slot: usize) -> SlotView {
        let k = GoodputPolicy::current_steps(self, slot);
        (k, self.expected_accepted(k), self.verify_count(slot))
    }

    fn switches(&self) -> u64 {
        GoodputPolicy::switches(self)
    }

    /// Feeds the measurement to the cost model (the optional startup sweep).
    fn set_profiled_cost(&mut self, batch_size: u32, steps: u32, seconds: f64, context_tokens: u64) {
        self.seed_cost(bucket_of(batch_size), batch_size, steps, seconds, context_tokens);
    }
}
