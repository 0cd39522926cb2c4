//! docs/design.md invariant 6: the `goodput` strategy's tokens per second stay close to the clairvoyant
//! oracle's in the policy simulator, over cost curves of very different hardware, and it beats
//! SGLang's EMA rules where load, content or context move. One run of the standard simulation
//! (every regime x every named curve, 16k segments each) feeds every assertion.

use std::sync::OnceLock;

use specdial_core::sim::{run_all, run::Noise, Case, SimSpec};

fn standard() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| run_all(&SimSpec::standard()))
}

fn table(cases: &[Case]) -> String {
    cases
        .iter()
        .map(|c| {
            format!(
                "{:15} {:16} goodput {:.3} ema {:.3} throughput_aware {:.3} best fixed {:.3} ({})\n",
                c.regime,
                c.curve,
                c.ratio("goodput"),
                c.ratio("ema"),
                c.ratio("throughput_aware"),
                c.best_fixed().goodput / c.oracle.goodput,
                c.best_fixed().name
            )
        })
        .collect()
}

#[test]
fn goodput_reaches_the_oracle_on_average_and_in_every_case() {
    let cases = standard();
    let mean = cases.iter().map(|c| c.ratio("goodput")).sum::<f64>() / cases.len() as f64;
    assert!(mean >= 0.95, "mean goodput / oracle {mean:.4}\n{}", table(cases));
    for c in cases {
        assert!(c.ratio("goodput") >= 0.90, "{} on {}\n{}", c.regime, c.curve, table(cases));
        // The oracle is an upper bound of every contender (up to sampling noise).
        for r in &c.results {
            assert!(r.goodput <= c.oracle.goodput * 1.005, "{} beats the oracle in {} / {}", r.name, c.regime, c.curve);
        }
    }
}

#[test]
fn goodput_matches_the_best_fixed_steps_where_load_and_content_are_steady() {
    let cases = standard();
    for c in cases.iter().filter(|c| c.steady) {
        let vs_fixed = c.get("goodput").unwrap().goodput / c.best_fixed().goodput;
        assert!(vs_fixed >= 0.97, "{} on {}: {vs_fixed:.4} of {}\n{}", c.regime, c.curve, c.best_fixed().name, table(cases));
    }
}

#[test]
fn goodput_beats_sglang_ema_where_things_move() {
    let cases = standard();
    // Per curve, averaged over the moving regimes (on the CPU-like curve SGLang's GPU-shaped
    // default happens to suit two of them; the margin there comes from the load ramp and the
    // growing context).
    let curves: Vec<&str> = cases.iter().map(|c| c.curve.as_str()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    for curve in curves {
        let moving: Vec<&Case> = cases.iter().filter(|c| !c.steady && c.curve == curve).collect();
        let gain = moving.iter().map(|c| c.ratio("goodput") - c.ratio("ema")).sum::<f64>() / moving.len() as f64;
        assert!(gain >= 0.05, "{curve}: goodput - ema = {gain:.4} of the oracle\n{}", table(cases));
    }
    // And in every moving case it is at least as good.
    for c in cases.iter().filter(|c| !c.steady) {
        assert!(c.ratio("goodput") >= c.ratio("ema") - 0.005, "{} on {}\n{}", c.regime, c.curve, table(cases));
    }
}

#[test]
fn context_length_moves_the_best_steps_at_a_constant_batch_size() {
    let case = standard().iter().find(|c| c.regime == "context-growth" && c.curve == "h200-llama8b").unwrap();
    // The oracle itself changes its steps as contexts grow (same batch size throughout) ...
    let h = &case.oracle.steps_histogram;
    assert!(h.iter().filter(|&&n| n > 50).count() >= 2, "oracle histogram {h:?}");
    // ... and goodput follows: it is within 5 % of the oracle, which no fixed steps value is
    // with its own best by a margin (ema, blind to context, is far off).
    assert!(case.ratio("goodput") >= 0.95, "{}", case.ratio("goodput"));
    assert!(case.ratio("ema") < 0.5);
}

/// Runs the `goodput` strategy alone over every regime and curve with `noise`, once per seed, and
/// returns per case `(label, goodput / oracle averaged over the seeds)` and the table of each run.
fn over_seeds(noise: Noise, seeds: &[u64]) -> (Vec<(String, f64)>, String) {
    let mut sums: Vec<(String, f64)> = Vec::new();
    let mut tables = String::new();
    for &seed in seeds {
        let spec = SimSpec {
            noise,
            segments: 8000,
            seed,
            policies: specdial_core::sim::default_policies()[..1].to_vec(),
            ..SimSpec::standard()
        };
        let cases = run_all(&spec);
        tables += &format!("seed {seed}\n{}", table(&cases));
        for (i, c) in cases.iter().enumerate() {
            if sums.len() <= i {
                sums.push((format!("{} on {}", c.regime, c.curve), 0.0));
            }
            sums[i].1 += c.ratio("goodput") / seeds.len() as f64;
        }
    }
    (sums, tables)
}

#[test]
fn goodput_holds_under_heavy_timing_noise() {
    // 30 % per-iteration timing noise, 5 % stalls and a +-20 % slow drift of the device's speed
    // (a shared CPU), three seeds: still >= 0.95 of the oracle on average, >= 0.85 in every case.
    let (cases, tables) = over_seeds(Noise { sigma: 0.3, spike_probability: 0.05, drift: 0.2, interference: 0.0 }, &[11, 12, 13]);
    let mean = cases.iter().map(|c| c.1).sum::<f64>() / cases.len() as f64;
    assert!(mean >= 0.95, "mean {mean:.4}\n{tables}");
    for (label, r) in &cases {
        assert!(*r >= 0.85, "{label}: {r:.3}\n{tables}");
    }
}

#[test]
fn goodput_holds_while_other_work_slows_the_machine() {
    // A quarter of the run, in stretches of ~50-150 iterations, 2-4x slower (a compile or a test
    // suite beside the engine on a shared machine), three seeds: measurements from those
    // stretches must not steer it for the rest of the run (the cost model's pace check). Before
    // the pace check: 0.936 of the oracle on average (0.852 in the worst case); with it 0.961 (0.889).
    let (cases, tables) = over_seeds(Noise { interference: 0.25, ..Noise::default() }, &[0, 1, 2]);
    let mean = cases.iter().map(|c| c.1).sum::<f64>() / cases.len() as f64;
    assert!(mean >= 0.95, "mean {mean:.4}\n{tables}");
    for (label, r) in &cases {
        assert!(*r >= 0.85, "{label}: {r:.3}\n{tables}");
    }
}
