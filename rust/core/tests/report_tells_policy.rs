//! What a report tells the policy about the iteration it answers (issue 27, item 1): the drafter
//! catch-up tokens the iteration really ran (deferred drafter prefills and skipped zero-step
//! extends, 0 when the extend is not skipped), the pending catch-up when the policy decides, and
//! stop-string finishes decided in `report` itself: the tokens after the one that completed the
//! stop string are dropped, while the policy still sees every draft the verify accepted.

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
    /// Accepted drafts per request of every observation.
    accepted: Vec<Vec<i64>>,
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
        self.accepted.push(obs.accepted.to_vec());
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
fn a_stop_string_finishes_in_the_report_with_the_tokens_up_to_the_completing_one() {
    let mut s = scheduler(true);
    let a = s.add_request(vec![1; 5], 40, vec![], true).unwrap();
    let b = s.add_request(vec![1; 5], 40, vec![], true).unwrap();
    let c = s.add_request(vec![1; 5], 40, vec![], true).unwrap();
    run(&mut s, 0);
    let pages_before = s.stats().kv_pages_used;
    let generated_before = s.stats().tokens_generated;
    recorder(&mut s).next = 2;
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.request_ids, vec![a as i64, b as i64, c as i64]);
    let (tokens, offsets) = ([7i64, 8, 9, 7, 8, 9, 4, 5, 6], [0i64, 3, 6, 9]);
    // an id outside the plan, a keep outside 1..=emitted or an id twice is refused, unchanged
    for (stops, message) in [
        (vec![(99, 1)], "stop_strings: request 99 is not in the plan"),
        (vec![(b, 0)], "stop_strings: request 1 keeps 0 tokens; must be 1..=3"),
        (vec![(b, 4)], "stop_strings: request 1 keeps 4 tokens; must be 1..=3"),
        (vec![(b, 1), (b, 2)], "stop_strings: request 1 is listed twice"),
    ] {
        let bad = s.report_with(&tokens, &offsets, None, ReportExtras { stop_strings: &stops, ..Default::default() });
        let err = bad.unwrap_err().to_string();
        assert!(err.starts_with(message), "{err}");
        assert!(s.plan_in_flight());
    }
    let observed_before = recorder(&mut s).accepted.len();
    let stops = [(b, 1), (c, 3)];
    let out = s.report_with(&tokens, &offsets, None, ReportExtras { stop_strings: &stops, ..Default::default() }).unwrap();
    // b keeps the token that completed its stop string and drops the two after it; c keeps all
    assert_eq!(out.new_tokens, vec![7, 8, 9, 7, 4, 5, 6]);
    assert_eq!(out.new_offsets, vec![0, 3, 4, 7]);
    let ends: Vec<_> = out.finished.iter().map(|f| (f.request_id, f.reason.as_str(), f.reason.stop_token_id(), f.output_len)).collect();
    assert_eq!(ends, vec![(b, "stop", None, 2), (c, "stop", None, 4)]);
    assert_eq!((s.output_ids(b), s.output_ids(c)), (None, None));
    assert_eq!(s.output_ids(a).unwrap(), &[7, 7, 8, 9]);
    let st = out.stats;
    assert_eq!((st.requests_finished, st.tokens_generated - generated_before), (2, 7));
    // the finished requests' pages are all back: only a's remain (fewer than before)
    assert!(st.kv_pages_used < pages_before, "{} !< {pages_before}", st.kv_pages_used);
    // the policy saw what the verify accepted: 2 drafts each, b's truncation is no rejection
    let rec = recorder(&mut s);
    assert_eq!(rec.accepted.len(), observed_before + 1);
    assert_eq!(rec.accepted.last().unwrap(), &vec![2, 2, 2]);
    // a drains: every page is returned
    s.abort(a).unwrap();
    assert_eq!(s.stats().kv_pages_used, 0);
}

#[test]
fn the_core_rules_run_on_the_kept_tokens_only() {
    // EOS (token 0) after the completing token is not output: the stop string finishes first,
    // as it would one token per iteration; an EOS at or before it finishes by its own rule
    let config = AdaptiveConfig::from_json(r#"{"1": {"candidate_steps": [0, 3]}}"#).unwrap();
    let params = AdaptiveSpeculativeParams::with_strategy(config, Box::new(Recorder::default()));
    let cfg = SchedulerConfig {
        max_running_requests: 4, max_prefill_tokens: 64, context_length: 64, num_pages: 64,
        page_size: 4, eos_token_ids: vec![0], ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg, StepsSource::Adaptive(params)).unwrap();
    let a = s.add_request(vec![1; 5], 40, vec![], false).unwrap();
    let b = s.add_request(vec![1; 5], 40, vec![], false).unwrap();
    let c = s.add_request(vec![1; 5], 3, vec![], false).unwrap();
    run(&mut s, 0);
    recorder(&mut s).next = 3;
    s.schedule().unwrap().unwrap();
    // c may produce 2 more tokens (max_new_tokens 3, 1 from the prefill): its plan runs 1 step
    let (tokens, offsets) = ([5i64, 6, 0, 8, 5, 0, 6, 8, 5, 6], [0i64, 4, 8, 10]);
    let stops = [(a, 2), (b, 3), (c, 2)];
    let out = s.report_with(&tokens, &offsets, None, ReportExtras { stop_strings: &stops, ..Default::default() }).unwrap();
    assert_eq!(out.new_tokens, vec![5, 6, 5, 0, 5, 6]);
    let ends: Vec<_> = out.finished.iter().map(|f| (f.request_id, f.reason.as_str(), f.reason.stop_token_id(), f.output_len)).collect();
    // c: its length rule finishes it at the token that also completed its stop string
    assert_eq!(ends, vec![(a, "stop", None, 3), (b, "stop", Some(0), 3), (c, "length", None, 3)]);
    assert_eq!(s.stats().kv_pages_used, 0);
}
