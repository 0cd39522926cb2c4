//! Issue 28 through the scheduler: the `goodput` strategy's `verify` key, per-request verify
//! lengths in the plan (KV reserved for each request's own length), and `draft_probs` in the
//! report.

use specdial_core::{AdaptiveConfig, AdaptiveSpeculativeParams, PlanKind, ReportExtras, Scheduler, SchedulerConfig, StepsSource};

const PER_REQUEST: &str = r#"{"strategy": "goodput", "verify": "per_request",
  "1": {"candidate_steps": [0, 1, 2, 3, 4]}}"#;

fn scheduler(config: &str, requests: usize) -> Scheduler {
    let config = AdaptiveConfig::from_json(config).unwrap();
    let params = AdaptiveSpeculativeParams::new(4, config);
    let cfg = SchedulerConfig {
        max_running_requests: requests as u32,
        max_prefill_tokens: 4096,
        context_length: 4096,
        num_pages: 4096,
        page_size: 4,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg, StepsSource::Adaptive(params)).unwrap();
    for _ in 0..requests {
        s.add_request(vec![1; 8], 3000, vec![], true).unwrap();
    }
    s
}

/// Offsets of `counts` tokens per request.
fn offsets(counts: &[i64]) -> Vec<i64> {
    let mut o = vec![0i64];
    for n in counts {
        o.push(o.last().unwrap() + n);
    }
    o
}

/// One plan: prefill emits first tokens; decode accepts `accept(i, steps_r)` drafts of request
/// `i` (by position in the plan, ids being admission order) and reports seconds from a device
/// where each verified token costs 4 % of a plain decode and each drafted one 1 %.
fn run(s: &mut Scheduler, accept: impl Fn(usize, i64) -> i64) -> Option<Vec<i64>> {
    let plan = s.schedule().unwrap().expect("work to do");
    s.check_invariants().unwrap();
    if plan.kind == PlanKind::Prefill {
        let o = offsets(&plan.sample_first);
        s.report(&vec![7; *o.last().unwrap() as usize], &o, None).unwrap();
        return None;
    }
    let spr = plan.steps_per_request.clone();
    // KV is reserved for each request's own length only
    let qo: Vec<i64> = spr.iter().map(|&k| k + 1).collect();
    assert_eq!(plan.qo_lens, qo);
    assert_eq!(plan.out_loc.len() as i64, qo.iter().sum::<i64>());
    let acc: Vec<i64> = spr.iter().enumerate().map(|(i, &k)| accept(i, k)).collect();
    let o = offsets(&acc.iter().map(|a| a + 1).collect::<Vec<_>>());
    let verified: i64 = spr.iter().sum();
    let drafted = spr.iter().filter(|&&k| k > 0).count() as i64 * i64::from(plan.steps);
    let seconds = 0.01 * (1.0 + 0.04 * (spr.len() as i64 + verified) as f64 + 0.01 * drafted as f64);
    let probs: Vec<f64> = (0..spr.len()).flat_map(|i| vec![if i % 2 == 0 { 0.9 } else { 0.1 }; spr[i] as usize]).collect();
    let extras = ReportExtras { seconds: Some(seconds), draft_probs: Some(&probs), ..Default::default() };
    s.report_with(&vec![7; *o.last().unwrap() as usize], &o, None, extras).unwrap();
    s.check_invariants().unwrap();
    Some(spr)
}

#[test]
fn the_verify_key_takes_batch_or_per_request_and_names_the_allowed_values() {
    for (v, ok) in [("\"batch\"", true), ("\"per_request\"", true), ("\"tree\"", false), ("1", false)] {
        let r = AdaptiveConfig::from_json(&format!(r#"{{"strategy": "goodput", "verify": {v}, "candidate_steps": [0, 2]}}"#));
        assert_eq!(r.is_ok(), ok, "{v}");
        if let Err(e) = r {
            assert!(e.to_string().contains(r#"verify must be one of "batch", "per_request""#), "{e}");
        }
    }
    let c = AdaptiveConfig::from_json(PER_REQUEST).unwrap();
    assert!(c.to_json().contains(r#""verify":"per_request""#), "{}", c.to_json());
    assert_eq!(AdaptiveConfig::from_json(&c.to_json()).unwrap(), c);
    // another strategy's key
    let e = AdaptiveConfig::from_json(r#"{"strategy": "ema", "verify": "batch"}"#).unwrap_err();
    assert!(e.to_string().contains("verify"), "{e}");
}

#[test]
fn weak_requests_verify_less_than_strong_ones_in_the_same_batch() {
    let mut s = scheduler(PER_REQUEST, 16);
    // even positions always accept everything, odd ones nothing
    let mut last = None;
    for _ in 0..300 {
        if let Some(spr) = run(&mut s, |i, k| if i % 2 == 0 { k } else { 0 }) {
            last = Some(spr);
        }
    }
    let spr = last.unwrap();
    let strong: i64 = spr.iter().step_by(2).sum();
    let weak: i64 = spr.iter().skip(1).step_by(2).sum();
    assert!(strong >= 8 * 2 && weak < strong / 2, "{spr:?}");
    assert!(spr.iter().any(|&k| k != spr[0]), "lengths differ within the batch: {spr:?}");
}

#[test]
fn batch_mode_keeps_every_request_at_the_batch_steps() {
    let cfg = PER_REQUEST.replace("per_request", "batch");
    let mut s = scheduler(&cfg, 16);
    for _ in 0..200 {
        if let Some(spr) = run(&mut s, |i, k| if i % 2 == 0 { k } else { 0 }) {
            assert!(spr.iter().all(|&k| k == spr[0]), "{spr:?}");
        }
    }
}

#[test]
fn draft_probs_are_checked_against_the_plan() {
    let mut s = scheduler(PER_REQUEST, 2);
    run(&mut s, |_, k| k); // prefill
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.kind, PlanKind::Decode);
    let spr = plan.steps_per_request.clone();
    let n: usize = spr.iter().map(|&k| k as usize).sum();
    assert!(n > 0, "{spr:?}");
    let o = offsets(&[1, 1]);
    let tokens = [7i64, 7];
    let report = |s: &mut Scheduler, q: &[f64]| {
        s.report_with(&tokens, &o, None, ReportExtras { draft_probs: Some(q), ..Default::default() })
    };
    let short = vec![0.5; n - 1];
    let e = report(&mut s, &short).unwrap_err().to_string();
    assert!(e.starts_with("draft_probs:") && e.contains(&format!("sum(steps_per_request) = {n}")), "{e}");
    let mut bad = vec![0.5; n];
    bad[0] = 1.5;
    assert!(report(&mut s, &bad).unwrap_err().to_string().starts_with("draft_probs:"));
    bad[0] = f64::NAN;
    assert!(report(&mut s, &bad).unwrap_err().to_string().starts_with("draft_probs:"));
    assert!(s.plan_in_flight(), "a refused report leaves the plan in flight");
    report(&mut s, &vec![0.5; n]).unwrap();
    // prefill plans carry no drafts
    let mut s = scheduler(PER_REQUEST, 2);
    let plan = s.schedule().unwrap().unwrap();
    assert_eq!(plan.kind, PlanKind::Prefill);
    let o = offsets(&plan.sample_first);
    let t = vec![7; *o.last().unwrap() as usize];
    let e = s.report_with(&t, &o, None, ReportExtras { draft_probs: Some(&[]), ..Default::default() }).unwrap_err();
    assert!(e.to_string().starts_with("draft_probs:"), "{e}");
}
