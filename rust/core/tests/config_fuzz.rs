//! Fuzzing of the adaptive-config parser through its public API only (`AdaptiveConfig::from_json`,
//! `AdaptiveConfig::from_value`, `SlotConfig::from_value`), with proptest (cargo-fuzz needs a
//! nightly toolchain).
//!
//! Inputs: arbitrary JSON-like trees whose keys mix the documented keys (slot keys, `strategy`,
//! each strategy's global keys), batch-size keys (digits, leading zeros, zero, overflowing),
//! other strings and random text, and whose values are any kind (ints at the edges of `i64`,
//! floats including NaN and infinities, strings, lists, objects, values no JSON can hold);
//! plausible configs of each strategy (values mostly of the right shape, so many are accepted);
//! the same trees as JSON text, and that text cut and corrupted byte by byte; deep nesting.
//!
//! Properties: nothing panics; every config that is accepted satisfies the documented
//! invariants (at least one slot, lower bounds >= 1 and strictly ascending, candidate steps
//! non-empty, strictly ascending and <= `MAX_CANDIDATE_STEPS`, `ema_alpha` in (0, 1],
//! `update_interval` >= 1, finite hysteresis, finite `ceiling_coeff` >= 0; `goodput`:
//! `switch_margin` in [0, 1), `probe_budget` in [0, 0.5], dwell and windows >= 1;
//! `throughput_aware`: windows >= 1, `switch_hysteresis` >= 0, no candidate 0; profile runs:
//! at least one measured iteration, batch sizes and lengths >= 1) and survives its own canonical
//! JSON (`to_json` then `from_json` gives it back); JSON text and the equivalent tree are accepted
//! or refused alike (the two front doors apply the same rules); an error message is never empty.
//! The plausible-config run counts its accepted configs per strategy and fails when too few were
//! accepted, so the properties are not checked vacuously on errors only.

use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use specdial_core::config::{
    AdaptiveConfig, ConfigValue, ProfileConfig, SlotConfig, Strategy as Policy, GOODPUT_KEYS,
    MAX_CANDIDATE_STEPS, PROFILE_KEYS, SLOT_KEYS, STRATEGY_NAMES, THROUGHPUT_AWARE_KEYS,
};

/// Every documented key: slot keys, `strategy`, the global keys of each strategy.
fn known_keys() -> Vec<&'static str> {
    let mut keys: Vec<&'static str> = SLOT_KEYS.to_vec();
    keys.extend(GOODPUT_KEYS);
    keys.extend(THROUGHPUT_AWARE_KEYS);
    keys.extend(PROFILE_KEYS);
    keys.push("strategy");
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// Keys a fuzzed object draws from: the documented ones, batch-size keys and strangers.
fn key() -> impl Strategy<Value = String> {
    let known: Vec<String> = known_keys().into_iter().map(str::to_string).collect();
    prop_oneof![
        4 => prop::sample::select(known),
        3 => (1u32..200).prop_map(|n| n.to_string()),
        1 => prop::sample::select(vec![
            "0".to_string(), "00".to_string(), "08".to_string(), "4294967296".to_string(),
            "99999999999999999999".to_string(), "".to_string(), " 1".to_string(), "1.0".to_string(),
            "-1".to_string(), "Ema".to_string(), "candidate_steps ".to_string(),
            "throughput_aware".to_string(), "goodput".to_string(), "window_size".to_string(),
        ]),
        1 => "\\PC{0,12}",
    ]
}

fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        3 => -2.0f64..2.0,
        1 => prop::sample::select(vec![
            0.0, -0.0, 1.0, 1e-300, f64::MIN_POSITIVE, f64::MAX, f64::MIN, f64::EPSILON,
            f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.2, 0.5, 32.0, 33.0,
        ]),
        1 => any::<f64>(),
    ]
}

fn leaf() -> impl Strategy<Value = ConfigValue> {
    prop_oneof![
        1 => Just(ConfigValue::Null),
        1 => any::<bool>().prop_map(ConfigValue::Bool),
        4 => (-2i64..40).prop_map(ConfigValue::Int),
        1 => prop::sample::select(vec![i64::MIN, i64::MAX, u32::MAX as i64, u32::MAX as i64 + 1, -1])
            .prop_map(ConfigValue::Int),
        2 => float().prop_map(ConfigValue::Float),
        2 => prop_oneof![
            3 => prop::sample::select([STRATEGY_NAMES.to_vec(), vec!["EMA", "", "oracle"]].concat())
                .prop_map(str::to_string),
            1 => "\\PC{0,8}",
        ]
        .prop_map(ConfigValue::Str),
        1 => "\\PC{0,8}".prop_map(ConfigValue::Other),
    ]
}

/// Any tree: leaves, lists and objects (possibly with repeated keys), up to 4 levels deep.
fn tree() -> impl Strategy<Value = ConfigValue> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(ConfigValue::List),
            prop::collection::vec((key(), inner), 0..6).prop_map(ConfigValue::Map),
        ]
    })
}

/// A value shaped like the documented one for `key`, now and then anything at all.
fn plausible_value(key: &'static str) -> BoxedStrategy<ConfigValue> {
    let fitting: BoxedStrategy<ConfigValue> = match key {
        "candidate_steps" => prop::collection::vec(
            prop_oneof![19 => (0i64..=32).prop_map(ConfigValue::Int), 1 => leaf()], 0..6)
            .prop_map(ConfigValue::List)
            .boxed(),
        "update_interval" | "warmup_batches" | "min_dwell" | "acceptance_window" | "cost_window"
        | "window_size" | "profile_run_n_warmup" | "profile_run_n_measure" => {
            (-1i64..12).prop_map(ConfigValue::Int).boxed()
        }
        "max_profile_run_batch_size" | "profile_run_seq_len" => prop_oneof![
            Just(ConfigValue::Null),
            (-1i64..300).prop_map(ConfigValue::Int)
        ]
        .boxed(),
        "profile_run_batch_sizes" => prop_oneof![
            Just(ConfigValue::Null),
            prop::collection::vec((-1i64..300).prop_map(ConfigValue::Int), 0..5).prop_map(ConfigValue::List)
        ]
        .boxed(),
        "ema_alpha" | "switch_margin" | "probe_budget" => {
            prop_oneof![4 => 0.0f64..=1.0, 1 => float()].prop_map(ConfigValue::Float).boxed()
        }
        "ceiling_coeff" | "switch_hysteresis" => {
            prop_oneof![4 => 0.0f64..4.0, 1 => float()].prop_map(ConfigValue::Float).boxed()
        }
        _ => prop_oneof![
            3 => float().prop_map(ConfigValue::Float),
            1 => (-3i64..3).prop_map(ConfigValue::Int)
        ]
        .boxed(),
    };
    prop_oneof![12 => fitting, 1 => leaf()].boxed()
}

fn slot_key() -> impl Strategy<Value = &'static str> {
    prop::sample::select(SLOT_KEYS.to_vec())
}

/// Slot settings: usually `candidate_steps` plus a few other documented keys.
fn plausible_slot() -> impl Strategy<Value = ConfigValue> {
    let with_candidates = prop_oneof![4 => Just(true), 1 => Just(false)];
    (with_candidates, prop::collection::vec(slot_key(), 0..4)).prop_flat_map(|(cand, mut keys)| {
        if cand {
            keys.insert(0, "candidate_steps");
        }
        keys.into_iter()
            .map(|k| plausible_value(k).prop_map(move |v| (k.to_string(), v)))
            .collect::<Vec<_>>()
            .prop_map(ConfigValue::Map)
    })
}

/// Slot settings of the `goodput` / `throughput_aware` strategies: `candidate_steps` only
/// (now and then another key).
fn candidates_only() -> impl Strategy<Value = ConfigValue> {
    prop_oneof![
        6 => plausible_value("candidate_steps").prop_map(|v| ConfigValue::Map(vec![("candidate_steps".into(), v)])),
        1 => plausible_slot().boxed(),
    ]
}

/// A top-level object: a strategy (usually a valid name), slots (sometimes under odd keys),
/// that strategy's global keys (now and then another strategy's) and, rarely, junk.
fn plausible_config() -> impl Strategy<Value = ConfigValue> {
    prop_oneof![Just(None), prop::sample::select(STRATEGY_NAMES.to_vec()).prop_map(Some)]
        .prop_flat_map(|name| {
            let globals: Vec<&'static str> = match name {
                Some("goodput") => GOODPUT_KEYS.to_vec(),
                Some("throughput_aware") => THROUGHPUT_AWARE_KEYS.to_vec(),
                _ => SLOT_KEYS.to_vec(),
            };
            let ema = matches!(name, None | Some("ema"));
            let slot = if ema { plausible_slot().boxed() } else { candidates_only().boxed() };
            let entry = prop_oneof![
                4 => ((1u32..100).prop_map(|n| n.to_string()), slot),
                2 => prop::sample::select(globals)
                    .prop_flat_map(|k| plausible_value(k).prop_map(move |v| (k.to_string(), v))),
                1 => prop::sample::select(known_keys())
                    .prop_flat_map(|k| plausible_value(k).prop_map(move |v| (k.to_string(), v))),
                1 => (key(), prop_oneof![plausible_slot().boxed(), leaf().boxed()]),
            ];
            let strategy: Vec<(String, ConfigValue)> =
                name.map(|n| vec![("strategy".to_string(), ConfigValue::Str(n.into()))]).unwrap_or_default();
            prop::collection::vec(entry, 0..6).prop_map(move |mut e| {
                e.splice(0..0, strategy.clone());
                ConfigValue::Map(e)
            })
        })
}

/// The documented invariants of an accepted config (see the module docstring).
fn check_invariants(cfg: &AdaptiveConfig) -> Result<(), TestCaseError> {
    prop_assert!(!cfg.slots.is_empty(), "accepted config without a slot: {cfg:?}");
    prop_assert!(cfg.slots[0].0 >= 1, "lower bound 0 accepted: {cfg:?}");
    prop_assert!(cfg.slots.windows(2).all(|w| w[0].0 < w[1].0), "bounds not ascending: {cfg:?}");
    for (_, s) in &cfg.slots {
        check_slot(s)?;
    }
    match &cfg.strategy {
        Policy::Ema => {}
        Policy::Goodput(g) => {
            prop_assert!((0.0..1.0).contains(&g.switch_margin), "switch_margin: {g:?}");
            prop_assert!((0.0..=0.5).contains(&g.probe_budget), "probe_budget: {g:?}");
            prop_assert!(g.min_dwell >= 1 && g.acceptance_window >= 1 && g.cost_window >= 1, "{g:?}");
            if let Some(p) = &g.profile {
                check_profile(p)?;
            }
        }
        Policy::ThroughputAware(t) => {
            prop_assert!(t.window_size >= 1 && t.update_interval >= 1, "{t:?}");
            prop_assert!(t.switch_hysteresis.is_finite() && t.switch_hysteresis >= 0.0, "{t:?}");
            check_profile(&t.profile)?;
            prop_assert!(
                cfg.slots.iter().all(|(_, s)| s.candidate_steps.iter().all(|&k| k > 0)),
                "throughput_aware accepted a candidate 0: {cfg:?}"
            );
        }
    }
    let again = AdaptiveConfig::from_json(&cfg.to_json());
    prop_assert_eq!(again.as_ref().ok(), Some(cfg), "to_json does not round-trip: {:?}", again);
    Ok(())
}

fn check_profile(p: &ProfileConfig) -> Result<(), TestCaseError> {
    prop_assert!(p.profile_run_n_measure >= 1, "{p:?}");
    prop_assert!(p.profile_run_batch_sizes.iter().flatten().all(|&b| b >= 1), "{p:?}");
    prop_assert!(p.max_profile_run_batch_size.map_or(true, |b| b >= 1), "{p:?}");
    prop_assert!(p.profile_run_seq_len.map_or(true, |n| n >= 1), "{p:?}");
    Ok(())
}

fn check_slot(s: &SlotConfig) -> Result<(), TestCaseError> {
    let c = &s.candidate_steps;
    prop_assert!(!c.is_empty(), "empty candidates accepted: {s:?}");
    prop_assert!(c.windows(2).all(|w| w[0] < w[1]), "candidates not strictly ascending: {s:?}");
    prop_assert!(c.iter().all(|&k| k <= MAX_CANDIDATE_STEPS), "candidate above the max: {s:?}");
    prop_assert!(s.ema_alpha > 0.0 && s.ema_alpha <= 1.0, "ema_alpha outside (0, 1]: {s:?}");
    prop_assert!(s.update_interval >= 1, "update_interval 0 accepted: {s:?}");
    prop_assert!(s.down_hysteresis.is_finite() && s.up_hysteresis.is_finite(), "{s:?}");
    prop_assert!(s.ceiling_coeff.is_finite() && s.ceiling_coeff >= 0.0, "{s:?}");
    Ok(())
}

/// The tree as JSON text when JSON can hold it exactly (no NaN/inf, no `Other`, no repeated
/// keys, which JSON parsers resolve differently); else None.
fn to_json_text(v: &ConfigValue) -> Option<String> {
    fn conv(v: &ConfigValue) -> Option<serde_json::Value> {
        use serde_json::Value as J;
        Some(match v {
            ConfigValue::Null => J::Null,
            ConfigValue::Bool(b) => J::Bool(*b),
            ConfigValue::Int(i) => J::from(*i),
            ConfigValue::Float(x) => J::Number(serde_json::Number::from_f64(*x)?),
            ConfigValue::Str(s) => J::String(s.clone()),
            ConfigValue::List(items) => J::Array(items.iter().map(conv).collect::<Option<_>>()?),
            ConfigValue::Map(entries) => {
                let mut m = serde_json::Map::new();
                for (k, v) in entries {
                    if m.insert(k.clone(), conv(v)?).is_some() {
                        return None;
                    }
                }
                J::Object(m)
            }
            ConfigValue::Other(_) => return None,
        })
    }
    conv(v).map(|j| j.to_string())
}

/// Runs `cases` trees through both front doors; returns how many were accepted, per strategy
/// (in the order of `STRATEGY_NAMES`).
fn fuzz_trees(strategy: impl Strategy<Value = ConfigValue>, cases: u32) -> [usize; 3] {
    let accepted: [AtomicUsize; 3] = Default::default();
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    runner
        .run(&strategy, |tree| {
            let by_value = AdaptiveConfig::from_value(&tree);
            match &by_value {
                Ok(cfg) => {
                    let i = STRATEGY_NAMES.iter().position(|n| *n == cfg.strategy.name()).unwrap();
                    accepted[i].fetch_add(1, Ordering::Relaxed);
                    check_invariants(cfg)?;
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
            if let Some(text) = to_json_text(&tree) {
                let by_text = AdaptiveConfig::from_json(&text);
                prop_assert_eq!(by_text.is_ok(), by_value.is_ok(), "front doors disagree on {}", text);
                if let (Ok(a), Ok(b)) = (&by_text, &by_value) {
                    prop_assert_eq!(a, b);
                }
            }
            if let Ok(slot) = SlotConfig::from_value(&tree) {
                check_slot(&slot)?;
            }
            Ok(())
        })
        .unwrap();
    accepted.map(AtomicUsize::into_inner)
}

#[test]
fn arbitrary_trees_never_panic_and_accepted_configs_hold_the_invariants() {
    fuzz_trees(tree(), 4000);
}

#[test]
fn plausible_configs_are_often_accepted_and_then_hold_the_invariants() {
    let cases = 6000;
    let accepted = fuzz_trees(plausible_config(), cases);
    println!("plausible configs accepted of {cases}, per strategy {STRATEGY_NAMES:?}: {accepted:?}");
    for (name, n) in STRATEGY_NAMES.iter().zip(accepted) {
        assert!(n >= cases as usize / 100, "only {n} {name} configs of {cases} accepted: the \
                generator no longer reaches its accepting paths, so its invariants are barely checked");
    }
}

#[test]
fn plausible_slots_alone_hold_the_invariants() {
    let accepted = AtomicUsize::new(0);
    let mut runner = TestRunner::new(Config { cases: 2000, failure_persistence: None, ..Config::default() });
    runner
        .run(&plausible_slot(), |v| {
            if let Ok(slot) = SlotConfig::from_value(&v) {
                accepted.fetch_add(1, Ordering::Relaxed);
                check_slot(&slot)?;
            }
            Ok(())
        })
        .unwrap();
    assert!(accepted.into_inner() >= 50);
}

/// JSON text of a plausible config, cut at a random point and with random bytes replaced.
fn mangled_json() -> impl Strategy<Value = String> {
    (plausible_config(), any::<prop::sample::Index>(), prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4))
        .prop_map(|(tree, cut, edits)| {
            let text = to_json_text(&tree).unwrap_or_else(|| "{}".to_string());
            let mut bytes = text.into_bytes();
            for (at, b) in edits {
                if !bytes.is_empty() {
                    let i = at.index(bytes.len());
                    bytes[i] = b;
                }
            }
            let keep = if bytes.is_empty() { 0 } else { cut.index(bytes.len() + 1) };
            bytes.truncate(keep.max(bytes.len() / 2));
            String::from_utf8_lossy(&bytes).into_owned()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_and_mangled_json_text_never_panics(text in prop_oneof![mangled_json(), "\\PC{0,64}"]) {
        match AdaptiveConfig::from_json(&text) {
            Ok(cfg) => check_invariants(&cfg)?,
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_panic() {
    for depth in [64usize, 200, 10_000, 100_000] {
        for (open, close) in [("[", "]"), ("{\"1\":", "}")] {
            let text = format!("{}1{}", open.repeat(depth), close.repeat(depth));
            assert!(AdaptiveConfig::from_json(&text).is_err(), "depth {depth} {open}");
        }
    }
    // a deep tree built directly (no JSON parser depth limit in between)
    let mut v = ConfigValue::Int(1);
    for _ in 0..2_000 {
        v = ConfigValue::Map(vec![("candidate_steps".into(), ConfigValue::List(vec![v]))]);
    }
    assert!(AdaptiveConfig::from_value(&v).is_err());
    assert!(SlotConfig::from_value(&v).is_err());
    // ConfigValue's drop is recursive: dismantle the tree iteratively so the test itself cannot
    // overflow the stack
    let mut stack = vec![v];
    while let Some(node) = stack.pop() {
        match node {
            ConfigValue::Map(entries) => stack.extend(entries.into_iter().map(|(_, v)| v)),
            ConfigValue::List(items) => stack.extend(items),
            _ => {}
        }
    }
}
