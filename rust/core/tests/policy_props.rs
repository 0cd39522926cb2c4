//! Property tests of the policy: on random configs of every strategy and random verify traces
//! (with random measured seconds and context), the chosen steps are always a candidate of the
//! routed slot, `get_steps_for_batch` is a pure read, nothing panics, and under `ema`
//! observations never move the EMA while a slot is at steps 0.

use proptest::prelude::*;
use specdial_core::config::{
    AdaptiveConfig, ConfigValue, GoodputConfig, SlotConfig, Strategy as PolicyStrategy, ThroughputAwareConfig,
};
use specdial_core::{AdaptiveSpeculativeParams, Observation};

fn slot_config() -> impl Strategy<Value = SlotConfig> {
    (
        prop::collection::vec(0u32..=12, 1..5),
        0.01f64..=1.0,
        1u32..6,
        0u32..12,
        -1.0f64..1.0,
        -1.0f64..1.0,
        prop_oneof![Just(0.0), 0.0f64..4.0],
    )
        .prop_map(|(c, ema_alpha, update_interval, warmup_batches, down, up, ceiling_coeff)| SlotConfig {
            ema_alpha,
            update_interval,
            warmup_batches,
            down_hysteresis: down,
            up_hysteresis: up,
            ceiling_coeff,
            ..SlotConfig::with_candidates(&c)
        })
}

fn config() -> impl Strategy<Value = AdaptiveConfig> {
    prop::collection::btree_map(1u32..100, slot_config(), 1..5).prop_map(|m| AdaptiveConfig {
        strategy: PolicyStrategy::Ema,
        slots: m.into_iter().collect(),
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn steps_are_candidates_and_zero_never_moves_the_ema(
        cfg in config(),
        initial in 0u32..14,
        graphs in prop::option::of(prop::collection::vec(1i64..130, 0..8)),
        trace in prop::collection::vec((1i64..150, prop::collection::vec(0i64..20, 0..6)), 1..300),
    ) {
        let mut p = AdaptiveSpeculativeParams::new(initial, cfg.clone());
        p.set_cuda_graph_bs(graphs.as_deref()).unwrap();
        for (bs, raw) in trace {
            let d = p.decide(bs, None).unwrap();
            let slot = &p.ema_slots().unwrap()[d.slot];
            prop_assert!(slot.config().candidate_steps.contains(&d.steps));
            prop_assert_eq!(d.num_draft_tokens, d.steps + 1);
            prop_assert_eq!(p.get_steps_for_batch(bs).unwrap(), d.steps);
            let ema_before = slot.ema_accept_len();
            let accepted: Vec<i64> = raw.iter().map(|a| a % (d.steps as i64 + 1)).collect();
            let changed = p.on_verify_complete(accepted.iter().copied(), bs).unwrap();
            let slot = &p.ema_slots().unwrap()[d.slot];
            if d.steps == 0 && changed.is_none() {
                prop_assert_eq!(slot.ema_accept_len().to_bits(), ema_before.to_bits());
            }
            if let Some(new) = changed {
                prop_assert_ne!(new, d.steps);
                prop_assert_eq!(slot.current_steps(), new);
            }
            prop_assert!(slot.config().candidate_steps.contains(&slot.current_steps()));
        }
        if let Some(g) = p.cuda_graph_bs() {
            for &steps in p.candidate_steps() {
                let sizes = p.cuda_graph_bs_for_step(steps).unwrap();
                prop_assert!(sizes.iter().all(|s| g.contains(s)));
            }
        }
    }

    #[test]
    fn every_strategy_chooses_a_candidate_of_the_routed_slot(
        cfg in config(),
        which in 0u8..2,
        margin in 0.0f64..0.5,
        dwell in 1u32..6,
        budget in prop_oneof![Just(0.0), 0.0f64..0.5],
        initial in 0u32..14,
        graphs in prop::option::of(prop::collection::vec(1i64..130, 0..8)),
        trace in prop::collection::vec(
            (1i64..150, prop::collection::vec(0i64..20, 0..6), prop::option::of(1e-6f64..10.0), prop::option::of(0u64..1 << 22)),
            1..200),
    ) {
        let strategy = if which == 0 {
            PolicyStrategy::Goodput(GoodputConfig { switch_margin: margin, min_dwell: dwell, probe_budget: budget, ..Default::default() })
        } else {
            PolicyStrategy::ThroughputAware(ThroughputAwareConfig { update_interval: dwell, window_size: dwell, ..Default::default() })
        };
        let mut slots = cfg.slots.clone();
        if which == 1 {
            // throughput_aware candidates are > 0
            for (_, s) in &mut slots {
                s.candidate_steps.retain(|&k| k > 0);
                if s.candidate_steps.is_empty() {
                    s.candidate_steps.push(1);
                }
            }
        }
        let cfg = AdaptiveConfig { strategy, slots };
        let mut p = AdaptiveSpeculativeParams::new(initial, cfg.clone());
        p.set_cuda_graph_bs(graphs.as_deref()).unwrap();
        if which == 1 {
            for &k in p.candidate_steps().to_vec().iter() {
                p.set_profiled_cost(8, k, 0.01 * f64::from(k + 1), 0).unwrap();
            }
        }
        for (bs, raw, seconds, ctx) in trace {
            let before = p.get_steps_for_batch(bs).unwrap();
            prop_assert_eq!(p.get_steps_for_batch(bs).unwrap(), before);
            let d = p.decide(bs, ctx).unwrap();
            prop_assert!(cfg.slots[d.slot].1.candidate_steps.contains(&d.steps), "{} not a candidate", d.steps);
            let accepted: Vec<i64> = raw.iter().map(|a| a % (d.steps as i64 + 1)).collect();
            let obs = Observation { seconds, context_tokens: ctx, steps: None, catch_up_tokens: None };
            p.on_verify_complete_with(accepted.iter().copied(), bs, obs).unwrap();
            let now = p.get_steps_for_batch(bs).unwrap();
            prop_assert!(cfg.slots[p.route(bs).unwrap().0].1.candidate_steps.contains(&now) || which == 1);
        }
    }

    #[test]
    fn arbitrary_inputs_never_panic(
        initial in any::<u32>(),
        bs in any::<i64>(),
        accepted in prop::collection::vec(any::<i64>(), 0..10),
        graphs in prop::option::of(prop::collection::vec(any::<i64>(), 0..6)),
    ) {
        for cfg in [AdaptiveConfig::default_config(), AdaptiveConfig::ema_default()] {
            let mut p = AdaptiveSpeculativeParams::new(initial, cfg);
            let _ = p.set_cuda_graph_bs(graphs.as_deref());
            let _ = p.decide(bs, Some(initial as u64));
            let _ = p.on_verify_complete_with(accepted.iter().copied(), bs, Observation { seconds: Some(f64::from(initial) - 5.0), ..Default::default() });
            let _ = p.on_verify_complete(accepted.iter().copied(), bs);
            let _ = p.cuda_graph_bs_for_step(initial);
        }
    }

    #[test]
    fn config_parser_never_panics(text in ".{0,200}") {
        let _ = AdaptiveConfig::from_json(&text);
    }

    #[test]
    fn config_values_never_panic(
        key in prop_oneof![Just("1".to_string()), Just("08".to_string()), Just("ema_alpha".to_string()), "[a-z_0-9]{0,12}"],
        v in prop_oneof![
            any::<i64>().prop_map(ConfigValue::Int),
            any::<f64>().prop_map(ConfigValue::Float),
            any::<bool>().prop_map(ConfigValue::Bool),
            Just(ConfigValue::Null),
        ],
    ) {
        let slot = ConfigValue::Map(vec![
            ("candidate_steps".into(), ConfigValue::List(vec![v.clone()])),
            (key.clone(), v.clone()),
        ]);
        let _ = AdaptiveConfig::from_value(&ConfigValue::Map(vec![(key, slot.clone())]));
        let _ = SlotConfig::from_value(&slot);
    }
}
