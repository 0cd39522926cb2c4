//! The `goodput` and `throughput_aware` strategies through the public API: the decide / report
//! contract, and docs/design.md invariant 5 for them: every key a strategy accepts changes its
//! behaviour.

use specdial_core::config::{AdaptiveConfig, ConfigValue};
use specdial_core::sim::curve::CostCurve;
use specdial_core::sim::run::{run_adaptive, Noise, RunOptions, RunResult};
use specdial_core::sim::workload::Regime;
use specdial_core::{AdaptiveSpeculativeParams, Observation, PolicyError};

fn run(config: &str) -> RunResult {
    let w = Regime::named("bursty").unwrap().generate(6000, 3);
    let curve = CostCurve::named("h200-llama8b").unwrap();
    let opts = RunOptions { seed: 3, noise: Noise::default(), skip_zero_step_draft_extend: false, confidence: Default::default() };
    run_adaptive(&w, &curve, "x", &AdaptiveConfig::from_json(config).unwrap(), &opts)
}

fn with(base: &str, key: &str, value: &str) -> String {
    format!("{{{base}, \"{key}\": {value}}}")
}

fn same(a: &RunResult, b: &RunResult) -> bool {
    a.tokens == b.tokens && a.seconds == b.seconds && a.steps_histogram == b.steps_histogram
}

#[test]
fn every_goodput_key_changes_behaviour() {
    let base = r#""strategy": "goodput", "1": {"candidate_steps": [0, 1, 2, 3, 4, 5, 6, 7]}, "128": {"candidate_steps": [0, 1, 2, 3]}"#;
    let reference = run(&format!("{{{base}}}"));
    let changes = [
        ("switch_margin", "0.2"),
        ("min_dwell", "40"),
        ("acceptance_window", "200"),
        ("cost_window", "4"),
        ("probe_budget", "0.0"),
        ("profile_run_batch_sizes", "[1, 16, 64, 160]"),
        ("verify", "\"per_request\""),
        ("tree", r#"{"max_topk": 4, "max_num_draft_tokens": 16}"#),
    ];
    for (key, value) in changes {
        assert!(!same(&run(&with(base, key, value)), &reference), "{key} = {value} changed nothing");
    }
    // The sweep's own settings change what the sweep measures, so what is decided.
    let swept = &with(base, "profile_run_batch_sizes", "[1, 16, 64, 160]");
    let swept = &swept[1..swept.len() - 1];
    let sweep = run(&format!("{{{swept}}}"));
    for (key, value) in [
        ("max_profile_run_batch_size", "16"),
        ("profile_run_n_warmup", "0"),
        ("profile_run_n_measure", "1"),
        ("profile_run_seq_len", "32768"),
    ] {
        assert!(!same(&run(&with(swept, key, value)), &sweep), "{key} = {value} changed nothing");
    }
    // min_survival (the confidence stop) needs per-request verify: it changes what that decides.
    let per_request = with(base, "verify", "\"per_request\"");
    let per_request = &per_request[1..per_request.len() - 1];
    let without = run(&format!("{{{per_request}}}"));
    for value in ["0.3", "\"auto\""] {
        let r = run(&with(per_request, "min_survival", value));
        assert!(!same(&r, &without) || r.verify_histogram != without.verify_histogram, "min_survival = {value} changed nothing");
    }
    // The list above covers every key the strategy takes.
    let mut covered: Vec<&str> = changes.iter().map(|c| c.0).collect();
    covered.extend(["max_profile_run_batch_size", "profile_run_n_warmup", "profile_run_n_measure", "profile_run_seq_len"]);
    covered.push("min_survival");
    covered.sort_unstable();
    assert_eq!(covered, specdial_core::config::GOODPUT_KEYS.to_vec());
}

#[test]
fn every_throughput_aware_key_changes_behaviour() {
    let base = r#""strategy": "throughput_aware", "1": {"candidate_steps": [1, 3, 5, 7]}, "8": {"candidate_steps": [1, 3, 5]}, "32": {"candidate_steps": [1, 3]}, "128": {"candidate_steps": [1]}"#;
    let reference = run(&format!("{{{base}}}"));
    let changes = [
        ("window_size", "3"),
        ("update_interval", "2"),
        ("switch_hysteresis", "0.5"),
        ("profile_run_batch_sizes", "[1, 64]"),
        ("max_profile_run_batch_size", "16"),
        ("profile_run_n_warmup", "0"),
        ("profile_run_n_measure", "1"),
        ("profile_run_seq_len", "32768"),
    ];
    for (key, value) in changes {
        assert!(!same(&run(&with(base, key, value)), &reference), "{key} = {value} changed nothing");
    }
    let mut covered: Vec<&str> = changes.iter().map(|c| c.0).collect();
    covered.sort_unstable();
    assert_eq!(covered, specdial_core::config::THROUGHPUT_AWARE_KEYS.to_vec());
}

fn goodput() -> AdaptiveSpeculativeParams {
    let cfg = AdaptiveConfig::from_value(&ConfigValue::Map(vec![
        ("strategy".into(), ConfigValue::Str("goodput".into())),
        ("1".into(), ConfigValue::Map(vec![("candidate_steps".into(), ConfigValue::List((0..8).map(ConfigValue::Int).collect()))])),
    ]))
    .unwrap();
    AdaptiveSpeculativeParams::new(4, cfg)
}

#[test]
fn reports_are_checked_against_the_pending_decision() {
    let mut p = goodput();
    let d = p.decide(2, Some(100)).unwrap();
    assert_eq!(d.steps, 4);
    // The pending decision (4) bounds the accepted drafts; a steps override replaces it.
    assert_eq!(
        p.on_verify_complete_with([5i64, 0], 2, Observation::default()),
        Err(PolicyError::Accepted { index: 0, value: 5, steps: 4 })
    );
    assert!(p.on_verify_complete_with([2i64, 0], 2, Observation { steps: Some(2), ..Default::default() }).is_ok());
    assert_eq!(
        p.on_verify_complete_with([0i64], 1, Observation { seconds: Some(0.0), ..Default::default() }),
        Err(PolicyError::Seconds(0.0))
    );
    assert!(p.on_verify_complete_with([0i64], 1, Observation { seconds: Some(f64::NAN), ..Default::default() }).is_err());
    // get_steps_for_batch is a pure read; a repeated decide replaces the pending one.
    let before = format!("{:?}", p.slot_states());
    for _ in 0..3 {
        p.get_steps_for_batch(2).unwrap();
    }
    assert_eq!(format!("{:?}", p.slot_states()), before);
}

#[test]
fn goodput_learns_a_device_where_drafting_is_expensive_and_turns_it_off() {
    // Every draft step costs as much as the verify, acceptance is 30 %: plain decoding wins.
    let mut p = goodput();
    let mut steps = Vec::new();
    for i in 0..400 {
        let d = p.decide(8, Some(8000)).unwrap();
        let accepted: Vec<i64> = (0..8).map(|r| i64::from((i * 7 + r * 3) % 10 < 3 && d.steps > 0)).collect();
        let seconds = 0.010 * (1.0 + f64::from(d.steps));
        p.on_verify_complete_with(accepted, 8, Observation { seconds: Some(seconds), context_tokens: Some(8000), steps: None, catch_up_tokens: None }).unwrap();
        steps.push(d.steps);
    }
    let late = &steps[300..];
    let zeros = late.iter().filter(|&&k| k == 0).count();
    assert!(zeros >= 90, "late steps {late:?}");
    // At steps 0 it still probes acceptance, within its budget.
    let probes = late.iter().filter(|&&k| k > 0).count();
    assert!((1..=10).contains(&probes), "late steps {late:?}");
    let g = p.goodput().unwrap();
    assert!(g.probes() > 0);
}

#[test]
fn goodput_finds_the_best_steps_soon_after_the_batch_jumps() {
    // This CPU's shape (BENCHMARKS.md, issue 11): 5 ms + 0.8 ms per draft step + 0.85 ms per
    // request + 0.4 ms per request and draft step; each draft accepted with probability 0.78
    // given the one before. Learned at batch 2 (where steps 7 pays), then batch 64 arrives, where
    // steps 2 is best and steps 5 gives 0.87 of it. A policy that trusts an extrapolated cost
    // stays high; it must measure the lower steps at the new batch size and move within a few
    // dozen iterations.
    let t = |b: u32, k: u32| {
        let (b, k) = (f64::from(b), f64::from(k));
        0.005 + 0.0008 * k + 0.00085 * b + 0.0004 * b * k
    };
    let e = |k: u32| (0..=k).map(|j| 0.78f64.powi(j as i32)).sum::<f64>();
    let best = (0..8).map(|k| e(k) / t(64, k)).fold(0.0, f64::max);
    let mut p = goodput();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut after = Vec::new();
    for i in 0..87 {
        let b = if i < 15 { 2 } else { 53 + (uniform() * 12.0) as u32 };
        let d = p.decide(i64::from(b), Some(u64::from(b) * 300)).unwrap();
        let accepted: Vec<i64> = (0..b)
            .map(|_| (0..d.steps).take_while(|_| uniform() < 0.78).count() as i64)
            .collect();
        let noise = 1.0 + 0.2 * (uniform() - 0.5);
        let obs = Observation { seconds: Some(t(b, d.steps) * noise), context_tokens: Some(u64::from(b) * 300), steps: None, catch_up_tokens: None };
        p.on_verify_complete_with(accepted, i64::from(b), obs).unwrap();
        if i >= 27 {
            after.push(d.steps);
        }
    }
    let share = after.iter().map(|&k| e(k) / t(64, k) / best).sum::<f64>() / after.len() as f64;
    assert!(share >= 0.95, "goodput {share:.3} of the best; steps after the jump {after:?}");
}
