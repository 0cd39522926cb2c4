//! Issue 28's simulator floors ("Done means"): the `goodput` strategy with `"verify":
//! "per_request"` against the batch-level one, the per-request oracle and the best fixed depth,
//! over the mixed regimes (request classes shaped after the measured spreads, classes changing
//! midway) and the standard ones, on the GPU cost curves and the CPU-like one. The per-request
//! contender decides with `"min_survival": "auto"` (the confidence stop, draft confidences drawn
//! by [`specdial_core::sim::confidence`]). One run feeds every assertion. Floors this build does
//! not reach are `#[ignore]`d with the measured figure, not lowered (BENCHMARKS.md sections "Issue 28: the confidence stop", "Issue 28: the request classes against the measured spreads", "Issue 28: per-request
//! budgets yield to the batch-level decision", "Issue 28: shortened iterations teach no cell" and "Issue 28: the rest of the stop's fixes", issue 28).

use std::sync::OnceLock;

use specdial_core::sim::workload::Regime;
use specdial_core::sim::{default_policies_with_per_request, run_all, Case, SimSpec, PER_REQUEST};

const GPU_CURVES: [&str; 4] = ["h200-llama8b", "a100-llama8b", "l40s-llama8b", "h200x4-llama70b"];

fn cases() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| {
        let mut spec = SimSpec::standard();
        // the mixed regimes, and of the standard ones a homogeneous steady one, the load ramp
        // and the growing context
        let standard = ["steady-code", "load-ramp", "context-growth"];
        spec.regimes = Regime::every().filter(|r| r.name.starts_with("mixed") || r.name.starts_with("switching") || standard.contains(&r.name)).collect();
        spec.segments = 6000;
        spec.policies = default_policies_with_per_request().into_iter().filter(|(n, _)| n == "goodput" || n == PER_REQUEST).collect();
        run_all(&spec)
    })
}

fn per_request_over_batch(c: &Case) -> f64 {
    c.get(PER_REQUEST).unwrap().goodput / c.get("goodput").unwrap().goodput
}

fn table(cases: &[&Case]) -> String {
    cases
        .iter()
        .map(|c| {
            let pr = c.get(PER_REQUEST).unwrap().goodput;
            format!(
                "{:15} {:16} per-request/batch {:.3} /oracle-per-request {:.3} /best fixed {:.3}; oracle-per-request/oracle {:.3}, oracle-confidence/oracle {:.3}\n",
                c.regime,
                c.curve,
                per_request_over_batch(c),
                pr / c.oracle_per_request.as_ref().unwrap().goodput,
                pr / c.best_fixed().goodput,
                c.oracle_per_request.as_ref().unwrap().goodput / c.oracle.goodput,
                c.oracle_confidence.as_ref().unwrap().goodput / c.oracle.goodput
            )
        })
        .collect()
}

fn all() -> Vec<&'static Case> {
    cases().iter().collect()
}

#[test]
fn per_request_is_never_much_worse_than_batch_level() {
    let all = all();
    let min = all.iter().map(|c| per_request_over_batch(c)).fold(f64::INFINITY, f64::min);
    println!("least per-request / batch-level {min:.4}\n{}", table(&all));
    for c in &all {
        assert!(per_request_over_batch(c) >= 0.98, "{} on {}\n{}", c.regime, c.curve, table(&all));
    }
}

#[test]
fn per_request_reaches_the_per_request_oracle_on_average() {
    let all = all();
    let mean = all.iter().map(|c| c.get(PER_REQUEST).unwrap().goodput / c.oracle_per_request.as_ref().unwrap().goodput).sum::<f64>() / all.len() as f64;
    println!("mean per-request / per-request oracle {mean:.4}");
    assert!(mean >= 0.95, "mean per-request / per-request oracle {mean:.4}\n{}", table(&all));
}

#[test]
fn per_request_keeps_up_with_the_best_fixed_depth_as_contexts_grow() {
    let all = all();
    for c in all.iter().filter(|c| c.regime == "context-growth") {
        let r = c.get(PER_REQUEST).unwrap().goodput / c.best_fixed().goodput;
        println!("context-growth on {}: per-request / best fixed {r:.4}", c.curve);
        assert!(r >= 0.99, "{} on {}: {r:.4}\n{}", c.regime, c.curve, table(&all));
    }
}

#[test]
#[ignore = "floor out of reach with this confidence model (BENCHMARKS.md, issue 28: the request classes against the measured spreads): mean per-request / batch-level 1.023 (0.990-1.097; 1.022 before the rest of the stop's fixes and the 5 % margin over the batch-level row, BENCHMARKS.md, issue 28: the rest of the stop's fixes; 1.016 before the stopped iteration stopped teaching the shared estimates and probes verified uniformly, BENCHMARKS.md, issue 28: the plain-bug fixes of the per-request stop); against the batch-level oracle on these 16 cases the batch-level strategy averages 0.983, the per-request oracle 1.046, the confidence oracle (exact survival of every draft position) 1.086 and an oracle ranking by the drafter's reported confidence (depth and count chosen clairvoyantly) 1.082, which is 1.101x the batch-level strategy, the floor itself; with request classes fitted to the measured spreads (not applied) 1.018, the ceilings 1.054, 1.095 and 1.091 against 0.982"]
fn per_request_gains_a_tenth_over_batch_level_on_mixed_batches_at_high_concurrency() {
    let all = all();
    let high: Vec<&Case> =
        all.iter().copied().filter(|c| Regime::HETEROGENEOUS_HIGH.contains(&c.regime.as_str()) && GPU_CURVES.contains(&c.curve.as_str())).collect();
    let mean = high.iter().map(|c| per_request_over_batch(c)).sum::<f64>() / high.len() as f64;
    let ceiling = |o: &dyn Fn(&Case) -> f64| high.iter().map(|c| o(c) / c.oracle.goodput).sum::<f64>() / high.len() as f64;
    println!(
        "mean per-request / batch-level {mean:.4}; mean over the batch-level oracle: per-request oracle {:.4}, confidence oracle {:.4}, batch-level strategy {:.4}",
        ceiling(&|c| c.oracle_per_request.as_ref().unwrap().goodput),
        ceiling(&|c| c.oracle_confidence.as_ref().unwrap().goodput),
        ceiling(&|c| c.get("goodput").unwrap().goodput)
    );
    assert!(mean >= 1.10, "mean per-request / batch-level {mean:.4}\n{}", table(&high));
}
