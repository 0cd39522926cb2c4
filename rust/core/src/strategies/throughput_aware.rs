//! The `throughput_aware` strategy's [`StepStrategy`] face: [`ThroughputAwarePolicy`] (SGLang's
//! profiled-cost rule, [`crate::throughput`]), one engine-wide steps value for every slot.


use super::{DecideContext, SlotView, StepStrategy, VerifyObservation};
use crate::config::{AdaptiveConfig, ThroughputAwareConfig};
use crate::decision::Decision;
use crate::error::PolicyError;
use crate::throughput::ThroughputAwarePolicy;

/// The strategy's state, started at `initial_steps` if the first slot can choose it.
pub fn new(cfg: ThroughputAwareConfig, initial_steps: u32, config: &AdaptiveConfig) -> ThroughputAwarePolicy {
    ThroughputAwarePolicy::new(cfg, initial_steps, &config.slots[0].1.candidate_steps, &config.candidate_union())
}

impl StepStrategy for ThroughputAwarePolicy {
    fn name(&self) -> &'static str {
        "throughput_aware"
    }

    fn current_steps(&self, _slot: usize) -> u32 {
        ThroughputAwarePolicy::current_steps(self)
    }

    /// Costs are looked up at the graph size where a graph replays.
    fn decide(&mut self, ctx: &DecideContext<'_>) -> Decision {
        Decision::uniform(ThroughputAwarePolicy::decide(self, ctx.graph_bs.unwrap_or(ctx.batch_size), ctx.candidates))
    }

    /// Learns acceptance only (seconds and context are ignored: costs come from the profile).
    fn on_verify_complete(&mut self, obs: &VerifyObservation<'_>) -> Result<Option<u32>, PolicyError> {
        Ok(self.observe(obs.steps, obs.accepted))
    }

    /// The policy-wide state in every slot (`verify count`: the policy's batches).
    fn slot_state(&self, _slot: usize) -> SlotView {
        let k = ThroughputAwarePolicy::current_steps(self);
        (k, self.expected_tokens(k).map_or(0.0, |e| e - 1.0), self.batch_count())
    }

    fn switches(&self) -> u64 {
        ThroughputAwarePolicy::switches(self)
    }

    fn set_profiled_cost(&mut self, batch_size: u32, steps: u32, seconds: f64, _context_tokens: u64) {
        self.set_cost(batch_size, steps, seconds);
    }
}
