//! Issue 28's simulator floors ("Done means"): the `goodput` strategy with `"verify":
//! "per_request"` against the batch-level one, the per-request oracle and the best fixed depth,
//! over the mixed regimes (request classes shaped after the measured spreads, classes changing
//! midway) and the standard ones, on the GPU cost curves and the CPU-like one. The per-request
//! contender decides with `"min_survival": "auto"` (the confidence stop, draft confidences drawn
//! by [`specdial_core::sim::confidence`]). Floors this build does not reach are `#[ignore]`d with
//! the measured figure, not lowered (BENCHMARKS.md sections "Issue 28: the confidence stop",
//! "Issue 28: the request classes against the measured spreads", "Issue 28: per-request budgets
//! yield to the batch-level decision", "Issue 28: shortened iterations teach no cell", "Issue 28:
//! the rest of the stop's fixes" and "Issue 28: shortened iterations teach cells of their own",
//! issue 28).
//!
//! **Seeds.** One run per seed of `SEEDS` (workload, noise, acceptance and confidence draws all
//! follow the seed) feeds every assertion. On one seed the per-request contender's per-case
//! figures moved 1-3 % with small policy changes (BENCHMARKS.md, "Issue 28: the rest of the
//! stop's fixes"), so a floor met on seed 0 alone said little: each per-case floor is asserted on
//! the case's mean over the seeds, each mean floor on the mean over cases and seeds. The tables
//! print every seed's figure beside the mean.

use std::sync::OnceLock;

use specdial_core::sim::workload::Regime;
use specdial_core::sim::{default_policies_with_per_request, run_all, Case, SimSpec, PER_REQUEST};

const GPU_CURVES: [&str; 4] = ["h200-llama8b", "a100-llama8b", "l40s-llama8b", "h200x4-llama70b"];
/// The seeds every floor is taken over.
const SEEDS: [u64; 3] = [0, 1, 2];

/// One (regime, curve) over the seeds, in `SEEDS` order.
struct Seeded {
    regime: String,
    curve: String,
    runs: Vec<Case>,
}

impl Seeded {
    /// Mean over the seeds of `f` of each run.
    fn mean(&self, f: impl Fn(&Case) -> f64) -> f64 {
        self.runs.iter().map(f).sum::<f64>() / self.runs.len() as f64
    }

    fn each(&self, f: impl Fn(&Case) -> f64) -> String {
        self.runs.iter().map(|c| format!("{:.3}", f(c))).collect::<Vec<_>>().join(" ")
    }
}

fn cases() -> &'static [Seeded] {
    static CASES: OnceLock<Vec<Seeded>> = OnceLock::new();
    CASES.get_or_init(|| {
        let mut spec = SimSpec::standard();
        // the mixed regimes, and of the standard ones a homogeneous steady one, the load ramp
        // and the growing context
        let standard = ["steady-code", "load-ramp", "context-growth"];
        spec.regimes = Regime::every().filter(|r| r.name.starts_with("mixed") || r.name.starts_with("switching") || standard.contains(&r.name)).collect();
        spec.segments = 6000;
        spec.policies = default_policies_with_per_request().into_iter().filter(|(n, _)| n == "goodput" || n == PER_REQUEST).collect();
        // the seeds in parallel (each run is deterministic in its seed)
        let per_seed: Vec<Vec<Case>> = std::thread::scope(|s| {
            let handles: Vec<_> = SEEDS
                .iter()
                .map(|&seed| {
                    let spec = SimSpec { seed, ..spec.clone() };
                    s.spawn(move || run_all(&spec))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a seed's run")).collect()
        });
        let mut out: Vec<Seeded> = per_seed[0].iter().map(|c| Seeded { regime: c.regime.clone(), curve: c.curve.clone(), runs: Vec::new() }).collect();
        for runs in per_seed {
            for (o, c) in out.iter_mut().zip(runs) {
                assert_eq!((o.regime.as_str(), o.curve.as_str()), (c.regime.as_str(), c.curve.as_str()));
                o.runs.push(c);
            }
        }
        out
    })
}

fn per_request_over_batch(c: &Case) -> f64 {
    c.get(PER_REQUEST).unwrap().goodput / c.get("goodput").unwrap().goodput
}

fn over_per_request_oracle(c: &Case) -> f64 {
    c.get(PER_REQUEST).unwrap().goodput / c.oracle_per_request.as_ref().unwrap().goodput
}

fn over_best_fixed(c: &Case) -> f64 {
    c.get(PER_REQUEST).unwrap().goodput / c.best_fixed().goodput
}

/// Over the batch-level oracle: the per-request oracle, the confidence oracle, the batch-level
/// strategy and the per-request strategy.
fn ceilings(c: &Case) -> [f64; 4] {
    let o = c.oracle.goodput;
    [
        c.oracle_per_request.as_ref().unwrap().goodput / o,
        c.oracle_confidence.as_ref().unwrap().goodput / o,
        c.get("goodput").unwrap().goodput / o,
        c.get(PER_REQUEST).unwrap().goodput / o,
    ]
}

fn table(cases: &[&Seeded]) -> String {
    cases
        .iter()
        .map(|s| {
            format!(
                "{:15} {:16} per-request/batch {:.3} [{}] /oracle-per-request {:.3} /best fixed {:.3}; over the oracle: oracle-per-request {:.3}, oracle-confidence {:.3}, batch {:.3}, per-request {:.3}\n",
                s.regime,
                s.curve,
                s.mean(per_request_over_batch),
                s.each(per_request_over_batch),
                s.mean(over_per_request_oracle),
                s.mean(over_best_fixed),
                s.mean(|c| ceilings(c)[0]),
                s.mean(|c| ceilings(c)[1]),
                s.mean(|c| ceilings(c)[2]),
                s.mean(|c| ceilings(c)[3]),
            )
        })
        .collect()
}

fn all() -> Vec<&'static Seeded> {
    cases().iter().collect()
}

#[test]
fn per_request_is_never_much_worse_than_batch_level() {
    let all = all();
    let min = all.iter().map(|s| s.mean(per_request_over_batch)).fold(f64::INFINITY, f64::min);
    let min_any = all.iter().flat_map(|s| s.runs.iter().map(per_request_over_batch)).fold(f64::INFINITY, f64::min);
    println!("least per-request / batch-level, case mean over seeds {SEEDS:?}: {min:.4} (least of one seed {min_any:.4})\n{}", table(&all));
    for s in &all {
        let r = s.mean(per_request_over_batch);
        assert!(r >= 0.98, "{} on {}: {r:.4}\n{}", s.regime, s.curve, table(&all));
    }
}

#[test]
fn per_request_reaches_the_per_request_oracle_on_average() {
    let all = all();
    let mean = all.iter().map(|s| s.mean(over_per_request_oracle)).sum::<f64>() / all.len() as f64;
    println!("mean per-request / per-request oracle {mean:.4} (seeds {SEEDS:?})");
    assert!(mean >= 0.95, "mean per-request / per-request oracle {mean:.4}\n{}", table(&all));
}

#[test]
fn per_request_keeps_up_with_the_best_fixed_depth_as_contexts_grow() {
    let all = all();
    for s in all.iter().filter(|s| s.regime == "context-growth") {
        let r = s.mean(over_best_fixed);
        println!("context-growth on {}: per-request / best fixed {r:.4} [{}]", s.curve, s.each(over_best_fixed));
        assert!(r >= 0.99, "{} on {}: {r:.4}\n{}", s.regime, s.curve, table(&all));
    }
}

#[test]
#[ignore = "floor out of reach (BENCHMARKS.md, issue 28: shortened iterations teach cells of their own): over seeds 0-2 mean per-request / batch-level 1.032 (0.984-1.091 per case; 1.023 before the shortened iterations' cells); against the batch-level strategy the per-request oracle (true rates per request) averages 1.062 and the confidence oracle (exact survival of every draft position, cut clairvoyantly) 1.103, so the floor asks for ~97 % of the confidence oracle's gain where the strategy takes ~31 %; on one seed the reported-confidence oracle read 1.101x (BENCHMARKS.md, issue 28: the request classes against the measured spreads)"]
fn per_request_gains_a_tenth_over_batch_level_on_mixed_batches_at_high_concurrency() {
    let all = all();
    let high: Vec<&Seeded> =
        all.iter().copied().filter(|s| Regime::HETEROGENEOUS_HIGH.contains(&s.regime.as_str()) && GPU_CURVES.contains(&s.curve.as_str())).collect();
    let mean = high.iter().map(|s| s.mean(per_request_over_batch)).sum::<f64>() / high.len() as f64;
    let ceiling = |i: usize| high.iter().map(|s| s.mean(|c| ceilings(c)[i])).sum::<f64>() / high.len() as f64;
    // the share of the confidence oracle's gain over the batch-level strategy that the
    // per-request strategy takes
    let share = (ceiling(3) - ceiling(2)) / (ceiling(1) - ceiling(2));
    println!(
        "mean per-request / batch-level {mean:.4} (seeds {SEEDS:?}); mean over the batch-level oracle: per-request oracle {:.4}, confidence oracle {:.4}, batch-level strategy {:.4}, per-request strategy {:.4}; share of the confidence oracle's gain taken {share:.3}\n{}",
        ceiling(0),
        ceiling(1),
        ceiling(2),
        ceiling(3),
        table(&high)
    );
    assert!(mean >= 1.10, "mean per-request / batch-level {mean:.4}\n{}", table(&high));
}
