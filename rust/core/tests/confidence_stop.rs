//! Issue 28, the core's side of the worker's confidence stop and of budget-0 requests skipping
//! the draft extend: the decision's `ConfidenceStop` reaches the plan as `min_survival`, the
//! plan marks the budget-0 requests that skip their extend (`skip_extend`) and counts the
//! catch-up only where it runs, `report(verified=)` is validated, frees the cut positions' KV and
//! counts only verified drafts, and the trace records the cut.

use specdial_core::strategies::{DecideContext, SlotView, StepStrategy, VerifyObservation};
use specdial_core::{
    AdaptiveConfig, AdaptiveSpeculativeParams, ConfidenceStop, Decision, PlanKind,
    PolicyError, ReportExtras, Scheduler, SchedulerConfig, StepsSource, VerifyShape,
};

/// Decides `steps` with `lengths[i]` for request `i` and the confidence stop `stop`; records the
/// catch-up tokens it is told at each verify.
#[derive(Debug, Clone, Default)]
struct Fixed {
    steps: u32,
    lengths: Vec<u32>,
    stop: Option<f32>,
    observed: Vec<(u32, Option<u64>)>,
}

impl StepStrategy for Fixed {
    fn name(&self) -> &'static str {
        "confidence_stop_test"
    }
    fn current_steps(&self, _slot: usize) -> u32 {
        self.steps
    }
    fn decide(&mut self, ctx: &DecideContext<'_>) -> Decision {
        let lengths = (0..ctx.batch_size as usize)
            .map(|i| self.lengths[i % self.lengths.len()])
            .collect();
        let confidence_stop = self
            .stop
            .map(|min_survival| ConfidenceStop { min_survival });
        Decision {
            steps: self.steps,
            verify: VerifyShape::PerRequest(lengths),
            tree: None,
            confidence_stop,
        }
    }
    fn on_verify_complete(
        &mut self,
        obs: &VerifyObservation<'_>,
    ) -> Result<Option<u32>, PolicyError> {
        self.observed.push((obs.steps, obs.catch_up_tokens));
        Ok(None)
    }
    fn slot_state(&self, _slot: usize) -> SlotView {
        (self.steps, 0.0, self.observed.len() as u64)
    }
}

fn scheduler(skip: bool, stop: Option<f32>) -> Scheduler {
    let config = AdaptiveConfig::from_json(r#"{"1": {"candidate_steps": [0, 1, 2, 3]}}"#).unwrap();
    let strategy = Fixed {
        steps: 3,
        lengths: vec![3, 0],
        stop,
        observed: Vec::new(),
    };
    let params = AdaptiveSpeculativeParams::with_strategy(config, Box::new(strategy));
    let cfg = SchedulerConfig {
        max_running_requests: 4,
        max_prefill_tokens: 64,
        context_length: 128,
        num_pages: 64,
        page_size: 4,
        record_trace: true,
        skip_zero_step_draft_extend: skip,
        enable_prefix_caching: false,
        ..SchedulerConfig::default()
    };
    Scheduler::new(cfg, StepsSource::Adaptive(params)).unwrap()
}

fn strategy(s: &mut Scheduler) -> &mut Fixed {
    s.policy_mut()
        .unwrap()
        .strategy_mut()
        .as_any_mut()
        .downcast_mut::<Fixed>()
        .unwrap()
}

/// Two requests prefilled (one token each); returns the next (decode) plan.
fn two_decoding(s: &mut Scheduler) -> specdial_core::Plan {
    s.add_request(vec![1; 6], 60, vec![], true).unwrap();
    s.add_request(vec![1; 6], 60, vec![], true).unwrap();
    let p = s.schedule().unwrap().unwrap();
    assert_eq!(p.kind, PlanKind::Prefill);
    s.report(&[5, 5], &[0, 1, 2], None).unwrap();
    s.schedule().unwrap().unwrap()
}

/// Reports `emitted[b]` tokens per request (tokens 7) and `verified`.
fn report(s: &mut Scheduler, emitted: &[i64], verified: Option<&[i64]>) -> Result<(), String> {
    let mut offsets = vec![0i64];
    for n in emitted {
        offsets.push(offsets.last().unwrap() + n);
    }
    let tokens = vec![7i64; *offsets.last().unwrap() as usize];
    s.report_with(
        &tokens,
        &offsets,
        None,
        ReportExtras {
            verified,
            ..Default::default()
        },
    )
    .map(|_| ())
    .map_err(|e| e.to_string())
}

#[test]
fn the_plan_carries_the_stop_and_the_budget_zero_requests_that_skip_their_extend() {
    for (skip, want) in [(true, vec![0i64, 1]), (false, vec![0, 0])] {
        let mut s = scheduler(skip, Some(0.25));
        let plan = two_decoding(&mut s);
        assert_eq!(
            (plan.kind, plan.steps, plan.steps_per_request.clone()),
            (PlanKind::Decode, 3, vec![3, 0])
        );
        assert_eq!(plan.skip_extend, want);
        assert_eq!(plan.min_survival, 0.25);
        report(&mut s, &[2, 1], Some(&[2, 0])).unwrap();
    }
    let mut s = scheduler(true, None);
    assert_eq!(two_decoding(&mut s).min_survival, 0.0, "no rule: 0.0");
}

#[test]
fn skipped_extends_are_caught_up_when_the_request_drafts_again() {
    let mut s = scheduler(true, None);
    two_decoding(&mut s);
    report(&mut s, &[4, 1], None).unwrap(); // request 1 at budget 0 lags by 1
    for _ in 0..2 {
        s.schedule().unwrap().unwrap();
        report(&mut s, &[4, 1], None).unwrap(); // lags by 3
    }
    strategy(&mut s).lengths = vec![3, 3];
    let p = s.schedule().unwrap().unwrap();
    assert_eq!(p.skip_extend, vec![0, 0]);
    report(&mut s, &[4, 4], None).unwrap();
    s.schedule().unwrap().unwrap();
    report(&mut s, &[4, 4], None).unwrap();
    let seen: Vec<Option<u64>> = strategy(&mut s).observed.iter().map(|o| o.1).collect();
    // the skipping iterations catch nothing up; the one where request 1 drafts again all 3
    assert_eq!(seen, vec![Some(0), Some(0), Some(0), Some(3), Some(0)]);
    // without the skip, every extend runs: nothing is ever behind
    let mut s = scheduler(false, None);
    two_decoding(&mut s);
    for _ in 0..3 {
        report(&mut s, &[4, 1], None).unwrap();
        s.schedule().unwrap().unwrap();
    }
    report(&mut s, &[4, 1], None).unwrap();
    assert!(strategy(&mut s).observed.iter().all(|o| o.1 == Some(0)));
}

#[test]
fn verified_lengths_are_checked_against_the_plan() {
    let mut s = scheduler(true, Some(0.5));
    two_decoding(&mut s);
    let cases: [(&[i64], &[i64], &str); 4] = [
        (&[1, 1], &[0], "verified: expected 2 entries"),
        (
            &[1, 1],
            &[4, 0],
            "verified: verified[0] = 4 must be in 0..=3",
        ),
        (
            &[1, 1],
            &[0, 1],
            "verified: verified[1] = 1 must be in 0..=0",
        ),
        (
            &[3, 1],
            &[1, 0],
            "verified: verified[0] = 1 is below the 2 drafts",
        ),
    ];
    for (emitted, verified, msg) in cases {
        let err = report(&mut s, emitted, Some(verified)).unwrap_err();
        assert!(err.starts_with(msg), "{err}");
        assert!(s.plan_in_flight(), "a refused report changes nothing");
    }
    report(&mut s, &[2, 1], Some(&[1, 0])).unwrap();
}

#[test]
fn a_cut_frees_its_slots_and_only_verified_drafts_are_counted_and_traced() {
    let mut s = scheduler(true, Some(0.5));
    let id = two_decoding(&mut s).request_ids[0] as u64;
    assert_eq!(
        s.pool().pages(id).unwrap().len(),
        3,
        "L = 6 plus 4 reserved slots"
    );
    // request 0 reserved L ..= L + 3; its verify was cut to 1 draft, accepted 1
    report(&mut s, &[2, 1], Some(&[1, 0])).unwrap();
    let st = s.stats();
    assert_eq!(
        (
            st.spec_num_drafts,
            st.spec_num_draft_tokens,
            st.spec_num_accepted_tokens
        ),
        (1, 1, 1)
    );
    assert_eq!(
        s.pool().pages(id).unwrap().len(),
        2,
        "positions past L + 1 were freed"
    );
    let trace = s.drain_trace();
    let json = trace.last().unwrap().to_json();
    assert!(
        json.contains(r#""min_survival":0.5"#) && json.contains(r#""verified":[1,0]"#),
        "{json}"
    );
    assert!(json.contains(r#""steps_per_request":[3,0]"#), "{json}");
}

#[test]
fn the_goodput_min_survival_reaches_the_plan() {
    let json = r#"{"strategy": "goodput", "verify": "per_request", "min_survival": 0.4,
                   "1": {"candidate_steps": [2]}}"#;
    let params = AdaptiveSpeculativeParams::new(2, AdaptiveConfig::from_json(json).unwrap());
    let cfg = SchedulerConfig {
        num_pages: 64,
        page_size: 4,
        context_length: 128,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg, StepsSource::Adaptive(params)).unwrap();
    let plan = two_decoding(&mut s);
    assert_eq!(plan.steps, 2);
    assert_eq!(plan.min_survival, 0.4);
}
