//! Tests of the config parser: every strategy's keys, defaults and errors.

use super::*;

fn err(text: &str) -> String {
    AdaptiveConfig::from_json(text).unwrap_err().0
}

#[test]
fn slot_keys_merge_globals_and_normalise() {
    let c = AdaptiveConfig::from_json(
        r#"{"ema_alpha": 0.5, "08": {"candidate_steps": [3, 0, 3]}, "1": {"candidate_steps": [1], "ema_alpha": 0.1}}"#,
    )
    .unwrap();
    assert_eq!(c.slots.len(), 2);
    assert_eq!(c.slots[0].0, 1);
    assert_eq!(c.slots[0].1.ema_alpha, 0.1);
    assert_eq!(c.slots[1].0, 8);
    assert_eq!(c.slots[1].1.candidate_steps, vec![0, 3]);
    assert_eq!(c.slots[1].1.ema_alpha, 0.5);
    assert_eq!(c.slots[1].1.update_interval, 5);
    assert_eq!(c.slots[1].1.warmup_batches, 10);
    assert_eq!(c.slots[1].1.down_hysteresis, -0.25);
}

#[test]
fn flat_object_is_slot_one() {
    let c = AdaptiveConfig::from_json(r#"{"candidate_steps": [2, 4], "warmup_batches": 0}"#).unwrap();
    assert_eq!(c.slots.len(), 1);
    assert_eq!(c.slots[0].0, 1);
    assert_eq!(c.slots[0].1.candidate_steps, vec![2, 4]);
    assert_eq!(c.slots[0].1.warmup_batches, 0);
}

#[test]
fn ema_default_is_sglangs_default() {
    let c = AdaptiveConfig::ema_default();
    let bounds: Vec<u32> = c.slots.iter().map(|s| s.0).collect();
    assert_eq!(bounds, vec![1, 8, 32, 64]);
    assert_eq!(c.slots[0].1.candidate_steps, vec![1, 3, 5, 7]);
    assert_eq!(c.slots[0].1.down_hysteresis, -0.25);
    assert_eq!(c.slots[1].1.candidate_steps, vec![0, 1, 3]);
    assert_eq!(c.slots[3].1.candidate_steps, vec![0]);
    assert!(c.slots[1..].iter().all(|s| s.1.down_hysteresis == 0.0));
    assert_eq!(c.candidate_union(), vec![0, 1, 3, 5, 7]);
    // The canonical JSON round-trips.
    assert_eq!(AdaptiveConfig::from_json(&c.to_json()).unwrap(), c);
}

#[test]
fn errors_name_key_and_value() {
    assert!(err("[1]").contains("must be a JSON object"));
    assert!(err("{").contains("not valid JSON"));
    assert!(err("{}").contains("no slot"));
    assert!(err(r#"{"0": {"candidate_steps": [1]}}"#).contains("slot key \"0\""));
    assert!(err(r#"{"8": {"candidate_steps": [1]}, "08": {"candidate_steps": [1]}}"#).contains("both mean batch size 8"));
    assert!(err(r#"{"1": {}}"#).contains("candidate_steps is missing"));
    assert!(err(r#"{"1": {"candidate_steps": []}}"#).contains("non-empty"));
    assert!(err(r#"{"1": {"candidate_steps": 3}}"#).contains("got 3"));
    assert!(err(r#"{"1": {"candidate_steps": [-1]}}"#).contains("candidate_steps[0]"));
    assert!(err(r#"{"1": {"candidate_steps": [1.0]}}"#).contains("got 1.0"));
    assert!(err(r#"{"1": {"candidate_steps": [true]}}"#).contains("got true"));
    assert!(err(r#"{"1": {"candidate_steps": [33]}}"#).contains("0..=32"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "ema_alpha": 0}}"#).contains("slot \"1\": ema_alpha must be in (0, 1]"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "ema_alpha": 1.5}}"#).contains("got 1.5"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "ema_alpha": true}}"#).contains("must be a number, got true"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "update_interval": 0}}"#).contains("update_interval must be an integer >= 1"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "update_interval": 2.0}}"#).contains("got 2.0"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "warmup_batches": -1}}"#).contains("warmup_batches"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "ceiling_coeff": -0.1}}"#).contains("ceiling_coeff must be >= 0"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "down_hysteresis": "x"}}"#).contains("down_hysteresis must be a number"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "speed": 1}}"#).contains("unknown key \"speed\" in slot \"1\"; allowed:"));
    assert!(err(r#"{"speed": 1, "1": {"candidate_steps": [1]}}"#).contains("unknown key \"speed\" in adaptive config"));
    assert!(err(r#"{"1": {"candidate_steps": [1], "strategy": "ema"}}"#).contains("global key"));
    assert!(err(r#"{"strategy": "fast", "1": {"candidate_steps": [1]}}"#).contains("got \"fast\""));
    assert!(err(r#"{"1": [1]}"#).contains("slot \"1\" must be an object"));
    assert!(err(r#"{"99999999999": {"candidate_steps": [1]}}"#).contains("too large"));
    // A bad global value is reported even when every slot overrides it.
    assert!(err(r#"{"ema_alpha": 2, "1": {"candidate_steps": [1], "ema_alpha": 0.5}}"#).contains("ema_alpha must be in (0, 1]"));
}

#[test]
fn non_finite_numbers_are_rejected() {
    let root = ConfigValue::Map(vec![
        ("candidate_steps".into(), ConfigValue::List(vec![ConfigValue::Int(1)])),
        ("up_hysteresis".into(), ConfigValue::Float(f64::NAN)),
    ]);
    assert!(AdaptiveConfig::from_value(&root).unwrap_err().0.contains("up_hysteresis must be finite"));
}

#[test]
fn initial_steps_must_be_a_candidate() {
    let c = AdaptiveConfig::ema_default();
    assert!(c.validate_initial_steps(3).is_ok());
    assert!(c.validate_initial_steps(0).is_ok());
    assert!(c.validate_initial_steps(2).unwrap_err().0.contains("candidate of no slot"));
    assert!(c.validate_initial_steps(-1).is_err());
}


#[test]
fn default_is_goodput_over_pruned_slots() {
    let c = AdaptiveConfig::default_config();
    assert_eq!(c.strategy.name(), "goodput");
    assert_eq!(c.strategy, Strategy::Goodput(GoodputConfig::default()));
    let bounds: Vec<u32> = c.slots.iter().map(|s| s.0).collect();
    assert_eq!(bounds, vec![1, 128, 256]);
    assert_eq!(c.slots[0].1.candidate_steps, (0..=7).collect::<Vec<_>>());
    assert_eq!(c.slots[1].1.candidate_steps, vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(c.slots[2].1.candidate_steps, vec![0, 1, 2, 3]);
    assert_eq!(AdaptiveConfig::from_json(&c.to_json()).unwrap(), c);
    assert!(c.profile().is_none());
}

#[test]
fn goodput_keys_parse_and_round_trip() {
    let c = AdaptiveConfig::from_json(
        r#"{"strategy": "goodput", "switch_margin": 0.1, "min_dwell": 2, "acceptance_window": 8,
            "cost_window": 16, "probe_budget": 0.0, "1": {"candidate_steps": [0, 1, 2, 3, 4, 5, 6, 7]}}"#,
    )
    .unwrap();
    let Strategy::Goodput(g) = &c.strategy else { panic!("goodput expected") };
    assert_eq!((g.switch_margin, g.min_dwell, g.acceptance_window, g.cost_window, g.probe_budget), (0.1, 2, 8, 16, 0.0));
    assert!(g.profile.is_none());
    assert_eq!(AdaptiveConfig::from_json(&c.to_json()).unwrap(), c);
    // Any profile_run_* key turns the sweep on; the others keep their defaults.
    let c = AdaptiveConfig::from_json(r#"{"strategy": "goodput", "profile_run_n_measure": 3, "candidate_steps": [0, 2]}"#).unwrap();
    let p = c.profile().unwrap();
    assert_eq!((p.profile_run_n_measure, p.profile_run_n_warmup, p.profile_run_batch_sizes.clone()), (3, 5, None));
    assert_eq!(c.slots, vec![(1, SlotConfig::with_candidates(&[0, 2]))]);
    assert_eq!(AdaptiveConfig::from_json(&c.to_json()).unwrap(), c);
}

#[test]
fn sglang_throughput_aware_config_loads_verbatim() {
    // The example of SGLang's throughput_aware_controller docstring, plus switch_hysteresis.
    let c = AdaptiveConfig::from_json(
        r#"{"strategy": "throughput_aware", "window_size": 20, "update_interval": 10,
            "switch_hysteresis": 0.1, "profile_run_batch_sizes": null, "max_profile_run_batch_size": 128,
            "profile_run_n_warmup": 5, "profile_run_n_measure": 10, "profile_run_seq_len": 128,
            "1": {"candidate_steps": [1, 3, 5, 7]}, "8": {"candidate_steps": [1, 3, 5]},
            "32": {"candidate_steps": [1, 3]}, "128": {"candidate_steps": [1]}}"#,
    )
    .unwrap();
    let Strategy::ThroughputAware(t) = &c.strategy else { panic!("throughput_aware expected") };
    assert_eq!((t.window_size, t.update_interval, t.switch_hysteresis), (20, 10, 0.1));
    assert_eq!(t.profile.max_profile_run_batch_size, Some(128));
    assert_eq!(t.profile.profile_run_seq_len, Some(128));
    assert_eq!(c.slots.len(), 4);
    assert_eq!(c.profile(), Some(&t.profile));
    assert_eq!(AdaptiveConfig::from_json(&c.to_json()).unwrap(), c);
    let bs = AdaptiveConfig::from_json(r#"{"strategy": "throughput_aware", "profile_run_batch_sizes": [8, 1, 8], "1": {"candidate_steps": [1]}}"#).unwrap();
    assert_eq!(bs.profile().unwrap().profile_run_batch_sizes, Some(vec![1, 8]));
}

#[test]
fn strategy_keys_are_checked_per_strategy() {
    let g = r#""strategy": "goodput""#;
    let t = r#""strategy": "throughput_aware""#;
    let e = |body: &str| err(&format!("{{{body}}}"));
    assert!(e(&format!(r#"{g}, "ema_alpha": 0.2, "1": {{"candidate_steps": [1]}}"#))
        .contains("ema_alpha is a setting of strategy \"ema\", not of \"goodput\""));
    assert!(e(&format!(r#"{g}, "1": {{"candidate_steps": [1], "warmup_batches": 3}}"#))
        .contains("slot \"1\": warmup_batches is a setting of strategy \"ema\""));
    assert!(e(&format!(r#"{g}, "1": {{"candidate_steps": [1], "switch_margin": 0.1}}"#))
        .contains("switch_margin is a global key of strategy \"goodput\""));
    assert!(e(&format!(r#"{g}, "window_size": 3, "1": {{"candidate_steps": [1]}}"#))
        .contains("window_size is a setting of strategy \"throughput_aware\""));
    assert!(e(&format!(r#"{t}, "switch_margin": 0.1, "1": {{"candidate_steps": [1]}}"#))
        .contains("switch_margin is a setting of strategy \"goodput\""));
    assert!(e(&format!(r#"{g}, "speed": 1, "1": {{"candidate_steps": [1]}}"#)).contains("unknown key \"speed\""));
    assert!(e(&format!(r#"{g}, "1": {{"candidate_steps": [1], "speed": 1}}"#)).contains("allowed: candidate_steps"));
    assert!(e(r#""window_size": 3, "1": {"candidate_steps": [1]}"#).contains("window_size is a setting of strategy \"throughput_aware\", not of \"ema\""));
    assert!(e(r#""profile_run_n_measure": 3, "1": {"candidate_steps": [1]}"#).contains("strategy \"goodput\" or \"throughput_aware\""));
    assert!(e(&format!(r#"{t}, "1": {{"candidate_steps": [0, 1]}}"#)).contains("takes steps > 0"));
    assert!(e(&format!(r#"{g}, "switch_margin": 1.0, "1": {{"candidate_steps": [1]}}"#)).contains("switch_margin must be in [0, 1), got 1"));
    assert!(e(&format!(r#"{g}, "switch_margin": -0.1, "1": {{"candidate_steps": [1]}}"#)).contains("got -0.1"));
    assert!(e(&format!(r#"{g}, "probe_budget": 0.6, "1": {{"candidate_steps": [1]}}"#)).contains("probe_budget must be in [0, 0.5]"));
    assert!(e(&format!(r#"{g}, "min_dwell": 0, "1": {{"candidate_steps": [1]}}"#)).contains("min_dwell must be an integer >= 1"));
    assert!(e(&format!(r#"{g}, "acceptance_window": 0, "1": {{"candidate_steps": [1]}}"#)).contains("acceptance_window must be an integer >= 1"));
    assert!(e(&format!(r#"{g}, "cost_window": 1.5, "1": {{"candidate_steps": [1]}}"#)).contains("cost_window must be an integer >= 1, got 1.5"));
    assert!(e(&format!(r#"{t}, "switch_hysteresis": -1, "1": {{"candidate_steps": [1]}}"#)).contains("switch_hysteresis must be >= 0"));
    assert!(e(&format!(r#"{t}, "window_size": 0, "1": {{"candidate_steps": [1]}}"#)).contains("window_size must be an integer >= 1"));
    assert!(e(&format!(r#"{t}, "profile_run_batch_sizes": [], "1": {{"candidate_steps": [1]}}"#)).contains("non-empty list"));
    assert!(e(&format!(r#"{t}, "profile_run_batch_sizes": [0], "1": {{"candidate_steps": [1]}}"#)).contains("profile_run_batch_sizes[0] must be an integer >= 1"));
    assert!(e(&format!(r#"{t}, "profile_run_n_measure": 0, "1": {{"candidate_steps": [1]}}"#)).contains("profile_run_n_measure must be an integer >= 1"));
    assert!(e(&format!(r#"{t}, "profile_run_seq_len": "x", "1": {{"candidate_steps": [1]}}"#)).contains("must be null or an integer >= 1"));
    assert!(e(r#""strategy": 3, "1": {"candidate_steps": [1]}"#).contains("strategy must be one of"));
    assert!(e(&format!(r#"{g}, "1": {{"candidate_steps": [1], "strategy": "ema"}}"#)).contains("global key"));
    assert!(e(&format!(r#"{g}"#)).contains("no slot"));
}

/// The `min_survival` key (issue 28's confidence stop): null, a number in (0, 1) or "auto", only
/// with `"verify": "per_request"`; errors name the key and the allowed values.
#[test]
fn min_survival_takes_null_a_probability_or_auto() {
    let goodput = |extra: &str| format!(r#"{{"strategy": "goodput", "candidate_steps": [0, 1, 3]{extra}}}"#);
    let min_survival = |extra: &str| match AdaptiveConfig::from_json(&goodput(extra)).unwrap().strategy {
        Strategy::Goodput(g) => g.min_survival,
        other => panic!("{other:?}"),
    };
    let pr = r#", "verify": "per_request""#;
    assert_eq!(min_survival(""), MinSurvival::Off);
    assert_eq!(min_survival(&format!(r#"{pr}, "min_survival": null"#)), MinSurvival::Off);
    assert_eq!(min_survival(&format!(r#"{pr}, "min_survival": 0.25"#)), MinSurvival::Fixed(0.25));
    assert_eq!(min_survival(&format!(r#"{pr}, "min_survival": "auto""#)), MinSurvival::Auto);
    // 1e-300 and 0.99999999999 round to 0 and 1 as the f32 the decision carries
    for bad in ["0", "1", "1.5", "-0.1", "\"fast\"", "true", "[0.5]", "1e-300", "0.99999999999"] {
        let e = err(&goodput(&format!(r#"{pr}, "min_survival": {bad}"#)));
        assert!(e.contains("min_survival must be null, a number in (0, 1) or \"auto\""), "{bad}: {e}");
    }
    let e = err(&goodput(r#", "min_survival": 0.5"#));
    assert!(e.contains("min_survival needs \"verify\": \"per_request\""), "{e}");
    assert!(err(r#"{"1": {"candidate_steps": [1]}, "min_survival": 0.5}"#).contains("setting of strategy \"goodput\""));
}
