//! What a report tells the policy about the iteration it answers (issue 27, item 1): the drafter
//! catch-up tokens the iteration really ran (deferred drafter prefills and skipped zero-step
//! extends, 0 when the extend is not skipped), the pending catch-up when the policy decides, and
//! stop-string finishes decided in `report` itself.

use specdial_core::strategies::{DecideContext, SlotView, StepStrategy, VerifyObservation};
use specdial_core::{
    AdaptiveConfig, AdaptiveSpeculativeParams, Decision, PlanKind, PolicyError, ReportExtras, Scheduler,
    SchedulerConfig, StepsSource,
};

/// Runs the steps it is told (`next`) and records what it saw.
#[derive(Debug, Clone, Default)]
struct Recorder {
    next: u32,
    /// `catch_up_tokens` of every decide.
    decided: Vec<Option<u64>>,
    /// `(steps, catch_up_tokens)` of every observation.
    observed: Vec<(u32, Option<u64>)>,
}

impl StepStrategy for Recorder {
    fn name(&self) -> &'static str {
        "recorder_test"
    }
    fn current_steps(&self, _slot: usize) -> u32 {
        self.next
    }
    fn decide(&mut self, ctx: &DecideContext<'_>) -> Decision {
        self.decided.push(ctx.catch_up_tokens);
        Decision::uniform(self.next)
    }
    fn on_verify_complete(&mut self, obs: &VerifyObservation<'_>) -> Result<Option<u32>, PolicyError> {
        self.observed.push((obs.steps, obs.catch_up_tokens));
        Ok(None)
    }
    fn slot_state(&self, _slot: usize) -> SlotView {
        (self.next, 0.0, self.observed.len() as u64)
    }
}

fn scheduler(skip: bool) -> Scheduler {
    let config = AdaptiveConfig::from_json(r#"{"1": {"candidate_steps": [0, 2]}}"#).unwrap();
    let params = AdaptiveSpeculativeParams::with_strategy(config, Box::new(Recorder::default()));
    let cfg = SchedulerConfig {
        max_running_requests: 4,
        max_prefill_tokens: 64,
        context_length: 64,
        num_pages: 64,
        page_size: 4,
        skip_zero_step_draft_extend: skip,
        ..SchedulerConfig::default()
    };
    Scheduler::new(cfg, StepsSource::Adaptive(params)).unwrap()
}

fn recorder(s: &mut Scheduler) -> &mut Recorder {
    s.policy_mut().unwrap().strategy_mut().as_any_mut().downcast_mut::<Recorder>().unwrap()
}

/// Runs one plan, every request emitting its first token (prefill) or all its drafts accepted
/// plus the bonus (decode), tokens 7. Returns the plan's `draft_prefill` and kind.
fn run(s: &mut Scheduler, steps: u32) -> (PlanKind, bool) {
    recorder(s).next = steps;
    let plan = s.schedule().unwrap().expect("work to do");
    let counts: Vec<i64> = match plan.kind {
        PlanKind::Prefill => plan.sample_first.clone(),
        PlanKind::Decode => plan.steps_per_request.iter().map(|&k| k + 1).collect(),
    };
    let mut offsets = vec![0i64];
    for n in &counts {
        offsets.push(offsets.last().unwrap() + n);
    }
    let tokens = vec![7i64; *offsets.last().unwrap() as usize];
    s.report(&tokens, &offsets, None).unwrap();
    (plan.kind, plan.draft_prefill)
}

/// Two requests (prompt 5) decode at steps 0 twice; a third (prompt 4) arrives and is prefilled
/// while steps are 0; one more steps-0 iteration; then two drafting iterations.
fn scenario(skip: bool) -> (Vec<(PlanKind, bool)>, Recorder) {
    let mut s = scheduler(skip);
    s.add_request(vec![1; 5], 40, vec![], true).unwrap();
    s.add_request(vec![1; 5], 40, vec![], true).unwrap();
    let mut kinds = vec![run(&mut s, 0), run(&mut s, 0), run(&mut s, 0)];
    s.add_request(vec![1; 4], 40, vec![], true).unwrap();
    for steps in [0, 0, 2, 2] {
        kinds.push(run(&mut s, steps));
    }
    (kinds, recorder(&mut s).clone())
}

#[test]
fn skipped_zero_step_extends_and_deferred_prefills_are_the_catch_up_reported() {
    let (kinds, rec) = scenario(true);
    // the first prefill drafts; the one planned while decoding runs steps 0 is deferred
    assert_eq!(
        kinds,
        vec![
            (PlanKind::Prefill, true),
            (PlanKind::Decode, true),
            (PlanKind::Decode, true),
            (PlanKind::Prefill, false),
            (PlanKind::Decode, true),
            (PlanKind::Decode, true),
            (PlanKind::Decode, true),
        ]
    );
    // lags before each decide: 0; 1 + 1; then the third request's 4 prompt tokens; then 3 + 3 + 5
    assert_eq!(rec.decided, vec![Some(0), Some(2), Some(4 + 4), Some(3 + 3 + 5), Some(0)]);
    // steps-0 iterations catch nothing up; the first drafting one all 11 tokens, the next none
    assert_eq!(rec.observed, vec![(0, Some(0)), (0, Some(0)), (0, Some(0)), (2, Some(11)), (2, Some(0))]);
}

#[test]
fn without_skipped_extends_nothing_is_deferred_or_caught_up() {
    let (kinds, rec) = scenario(false);
    assert!(kinds.iter().all(|&(_, draft)| draft), "{kinds:?}");
    assert!(rec.decided.iter().all(|&c| c == Some(0)), "{:?}", rec.decided);
    assert!(rec.observed.iter().all(|&(_, c)| c == Some(0)), "{:?}", rec.observed);
}

#[test]
fn a_stop_string_finishes_in_the_report_with_the_tokens_kept() {
    let mut s = scheduler(true);
    let a = s.add_request(vec![1; 5], 40, vec![], true).unwrap();
    let b = s.add_request(vec![1; 5], 40, vec![], true).unwrap();
    run(&mut s, 0);
    recorder(&mut s).next = 2;
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.request_ids, vec![a as i64, b as i64]);
    let (tokens, offsets) = ([7i64, 8, 9, 7, 8, 9], [0i64, 3, 6]);
    // an id outside the plan, or one without tokens, is refused and nothing changes
    let bad = s.report_with(&tokens, &offsets, None, ReportExtras { stop_strings: &[99], ..Default::default() });
    assert!(bad.unwrap_err().to_string().starts_with("stop_strings: request 99"));
    assert!(s.plan_in_flight());
    let out = s.report_with(&tokens, &offsets, None, ReportExtras { stop_strings: &[b], ..Default::default() }).unwrap();
    assert_eq!(out.new_tokens, tokens.to_vec(), "every emitted token is kept");
    assert_eq!(out.finished.len(), 1);
    let f = out.finished[0];
    assert_eq!((f.request_id, f.reason.as_str(), f.reason.stop_token_id(), f.output_len), (b, "stop", None, 4));
    assert_eq!(s.output_ids(b), None);
    assert_eq!(s.output_ids(a).unwrap(), &[7, 7, 8, 9]);
    assert_eq!(out.stats.requests_finished, 1);
}
