//! The decision type's room to grow (issue 27, item 6): a strategy outside the crate plugs in
//! through `StepStrategy`, and a per-request verify shape reaches the plan's `steps_per_request`
//! through the scheduler's caps (the cut at a fallback to fewer steps is
//! `VerifyShape::steps_for`'s unit test).


use specdial_core::strategies::{DecideContext, SlotView, StepStrategy, VerifyObservation};
use specdial_core::{
    AdaptiveConfig, AdaptiveSpeculativeParams, Decision, PlanKind, PolicyError, Scheduler, SchedulerConfig,
    StepsSource, VerifyShape,
};

/// Decides `steps` for the batch and `lengths[i]` for request `i` (cycled to the batch size).
#[derive(Debug, Clone)]
struct PerRequest {
    steps: u32,
    lengths: Vec<u32>,
    verifies: u64,
}

impl StepStrategy for PerRequest {
    fn name(&self) -> &'static str {
        "per_request_test"
    }
    fn current_steps(&self, _slot: usize) -> u32 {
        self.steps
    }
    fn decide(&mut self, ctx: &DecideContext<'_>) -> Decision {
        let lengths = (0..ctx.batch_size as usize).map(|i| self.lengths[i % self.lengths.len()]).collect();
        Decision { steps: self.steps, verify: VerifyShape::PerRequest(lengths), tree: None, confidence_stop: None }
    }
    fn on_verify_complete(&mut self, _obs: &VerifyObservation<'_>) -> Result<Option<u32>, PolicyError> {
        self.verifies += 1;
        Ok(None)
    }
    fn slot_state(&self, _slot: usize) -> SlotView {
        (self.steps, 0.0, self.verifies)
    }
}

fn one_slot() -> AdaptiveConfig {
    AdaptiveConfig::from_json(r#"{"1": {"candidate_steps": [1, 2, 4]}}"#).unwrap()
}

fn policy(steps: u32, lengths: Vec<u32>) -> AdaptiveSpeculativeParams {
    AdaptiveSpeculativeParams::with_strategy(one_slot(), Box::new(PerRequest { steps, lengths, verifies: 0 }))
}

fn scheduler(params: AdaptiveSpeculativeParams, num_pages: u32) -> Scheduler {
    let config = SchedulerConfig {
        max_running_requests: 8,
        max_queued_requests: 16,
        max_prefill_tokens: 64,
        context_length: 64,
        num_pages,
        page_size: 4,
        eos_token_ids: vec![],
        record_trace: false,
        chunked_prefill_size: None,
        skip_zero_step_draft_extend: true,
        enable_prefix_caching: false,
    };
    Scheduler::new(config, StepsSource::Adaptive(params)).unwrap()
}

/// Prefills every waiting request (one token sampled each) and returns the first decode plan.
fn first_decode(s: &mut Scheduler) -> specdial_core::Plan {
    loop {
        let plan = s.schedule().unwrap().expect("work to do");
        if plan.kind == PlanKind::Decode {
            return plan;
        }
        let sampled: Vec<i64> = plan.sample_first.iter().filter(|&&f| f == 1).map(|_| 5).collect();
        let mut offsets = vec![0i64];
        for &f in &plan.sample_first {
            offsets.push(offsets.last().unwrap() + f);
        }
        s.report(&sampled, &offsets, None).unwrap();
    }
}

#[test]
fn the_policy_passes_the_strategy_decision_through() {
    let mut p = policy(4, vec![4, 1, 0]);
    let d = p.decide(3, Some(30)).unwrap();
    assert_eq!((d.steps, d.num_draft_tokens, d.slot, d.tree), (4, 5, 0, None));
    assert_eq!(d.verify, VerifyShape::PerRequest(vec![4, 1, 0]));
    assert_eq!(p.strategy().name(), "per_request_test");
    assert!(p.goodput().is_none() && p.ema_slots().is_none());
    // Built-in strategies decide uniform chains.
    let mut ema = AdaptiveSpeculativeParams::new(2, one_slot());
    let d = ema.decide(3, None).unwrap();
    assert_eq!((d.steps, d.verify, d.tree), (2, VerifyShape::Uniform, None));
    assert_eq!(ema.strategy().name(), "ema");
}

#[test]
#[should_panic(expected = "per-request verify lengths [3] for a batch of 1 at steps 1")]
fn a_per_request_length_above_the_steps_is_a_strategy_bug() {
    let _ = policy(1, vec![3]).decide(1, None);
}

#[test]
fn per_request_lengths_become_the_plan_and_are_capped_near_the_end() {
    let mut s = scheduler(policy(4, vec![4, 1, 0]), 64);
    s.add_request(vec![1; 3], 40, vec![], false).unwrap();
    s.add_request(vec![1; 3], 40, vec![], false).unwrap();
    s.add_request(vec![1; 3], 40, vec![], false).unwrap();
    // max_new_tokens 3: one token sampled at prefill leaves room for 2, so steps_r <= 1.
    s.add_request(vec![1; 3], 3, vec![], false).unwrap();
    let plan = first_decode(&mut s);
    assert_eq!(plan.steps, 4);
    assert_eq!(plan.steps_per_request, vec![4, 1, 0, 1]);
    assert_eq!(plan.qo_lens, vec![5, 2, 1, 2]);
}
