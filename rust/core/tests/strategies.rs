//! The `goodput` and `throughput_aware` strategies through the public API: the decide / report
//! contract, and DESIGN.md invariant 5 for them: every key a strategy accepts changes its
//! behaviour.

use specdial_core::config::{AdaptiveConfig, ConfigValue};
use specdial_core::sim::curve::CostCurve;
use specdial_core::sim::run::{run_adaptive, Noise, RunOptions, RunResult};
use specdial_core::sim::workload::Regime;
use specdial_core::{AdaptiveSpeculativeParams, Observation, PolicyError};

fn run(config: &str) -> RunResult {
    let w = Regime::named("bursty").unwrap().generate(6000, 3);
    let curve = CostCurve::named("h200-llama8b").unwrap();
    let opts = RunOptions { seed: 3, noise: Noise::default(), skip_zero_step_draft_extend: false };
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
    // The list above covers every key the strategy takes.
    let mut covered: Vec<&str> = changes.iter().map(|c| c.0).collect();
    covered.extend(["max_profile_run_batch_size", "profile_run_n_warmup", "profile_run_n_measure", "profile_run_seq_len"]);
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
        p.on_verify_complete_with(accepted, 8, Observation { seconds: Some(seconds), context_tokens: Some(8000), steps: None }).unwrap();
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
