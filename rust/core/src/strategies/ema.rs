//! The `ema` strategy: SGLang's per-slot EMA of accepted drafts with hysteresis
//! ([`AdaptiveStepSlot`]), one state machine per batch-size slot.


use super::{DecideContext, SlotView, StepStrategy, VerifyObservation};
use crate::config::AdaptiveConfig;
use crate::decision::Decision;
use crate::error::PolicyError;
use crate::slot::AdaptiveStepSlot;

/// One [`AdaptiveStepSlot`] per config slot.
#[derive(Debug, Clone)]
pub struct EmaStrategy {
    slots: Vec<AdaptiveStepSlot>,
}

impl EmaStrategy {
    /// One slot per config slot, each started at `initial_steps` (or its middle candidate).
    pub fn new(initial_steps: u32, config: &AdaptiveConfig) -> Self {
        let slots = config.slots.iter().map(|(_, c)| AdaptiveStepSlot::new(initial_steps, c.clone())).collect();
        EmaStrategy { slots }
    }

    /// The slots, ascending by lower bound.
    pub fn slots(&self) -> &[AdaptiveStepSlot] {
        &self.slots
    }
}

impl StepStrategy for EmaStrategy {
    fn name(&self) -> &'static str {
        "ema"
    }

    fn current_steps(&self, slot: usize) -> u32 {
        self.slots[slot].current_steps()
    }

    fn decide(&mut self, ctx: &DecideContext<'_>) -> Decision {
        Decision::uniform(self.slots[ctx.slot].current_steps())
    }

    /// Feeds the EMA only with verifies at the slot's current steps (an EMA of another depth
    /// means something else); seconds and context are ignored.
    fn on_verify_complete(&mut self, obs: &VerifyObservation<'_>) -> Result<Option<u32>, PolicyError> {
        let slot = &mut self.slots[obs.slot];
        if obs.steps != slot.current_steps() {
            return Ok(None);
        }
        slot.update(obs.accepted.iter().copied())
    }

    fn slot_state(&self, slot: usize) -> SlotView {
        let s = &self.slots[slot];
        (s.current_steps(), s.ema_accept_len(), s.verify_count())
    }
}
