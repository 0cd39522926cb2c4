//! Issue 29's simulator figures and floors: the `goodput` strategy with draft trees (bounds
//! top-k 8, 64 draft tokens) against the best fixed plan (every chain and tree shape it may
//! choose) and against the same strategy with chains only, at concurrency 1, 4, 16, 64 and 256
//! on every named cost curve. One run feeds every assertion; `cargo test --test sim_trees --
//! --nocapture` prints the table (BENCHMARKS.md, issue 29).

use std::sync::OnceLock;

use specdial_core::sim::curve::CostCurve;
use specdial_core::sim::tree_report::{run_tree_case, TreeCase, CONCURRENCY};

const SEGMENTS: u32 = 3000;
const GPU_CURVES: [&str; 4] = ["h200-llama8b", "a100-llama8b", "l40s-llama8b", "h200x4-llama70b"];

fn cases() -> &'static [TreeCase] {
    static CASES: OnceLock<Vec<TreeCase>> = OnceLock::new();
    CASES.get_or_init(|| {
        let mut out = Vec::new();
        for name in CostCurve::NAMES {
            let curve = CostCurve::named(name).expect("named curve");
            for c in CONCURRENCY {
                out.push(run_tree_case(c, name, &curve, SEGMENTS, 0));
            }
        }
        out
    })
}

fn table(cases: &[&TreeCase]) -> String {
    cases.iter().map(|c| c.line() + "\n").collect()
}

#[test]
fn print_the_table() {
    let all: Vec<&TreeCase> = cases().iter().collect();
    println!("{}", table(&all));
}

fn at(concurrency: &[u32], curves: &[&str]) -> Vec<&'static TreeCase> {
    cases().iter().filter(|c| concurrency.contains(&c.concurrency) && curves.contains(&c.curve.as_str())).collect()
}

/// At high batch the extra tokens cost their compute: the strategy shrinks to a chain (or steps
/// 0) and gives up next to nothing for having trees to choose from (issue 29's floor: 0.98x).
/// Measured: 0.995 to 1.009.
#[test]
fn trees_cost_nothing_at_concurrency_64_and_up() {
    let high = at(&[64, 256], &CostCurve::NAMES);
    let t = table(&high);
    for c in &high {
        assert!(c.trees_over_chains() >= 0.98, "{}: trees/chains {:.3}\n{t}", c.curve, c.trees_over_chains());
        assert!(c.trees.tree_iterations * 20 <= c.trees.iterations, "{}: trees ran at high batch\n{t}", c.curve);
    }
}

/// At batch 1 an accelerator verifies 65 tokens for the price of one: trees win there, as
/// EAGLE-2 reports (acceptance length +20-40 %). Measured on the GPU curves 1.27x to 1.36x
/// adaptive chains (the best fixed tree is 1.43x to 1.47x the best fixed chain); on the CPU-like
/// curve, where tokens cost in proportion, 1.07x.
#[test]
fn trees_beat_chains_at_batch_one() {
    let one = at(&[1], &CostCurve::NAMES);
    let t = table(&one);
    for c in &one {
        let floor = if c.curve == "cpu-like" { 1.03 } else { 1.25 };
        assert!(c.trees_over_chains() >= floor, "{}: trees/chains {:.3} < {floor}\n{t}", c.curve, c.trees_over_chains());
    }
}

/// Against the best fixed plan of each case (chosen in hindsight among every chain and tree
/// shape): no case below 0.85 (measured worst 0.874, concurrency 4 on h200x4-llama70b, where the
/// strategy runs trees of 32 nodes at depth 7 but of top-k 4 rather than 8, and reaches them by
/// growing from small ones; 0.810 before, when it stayed on chains there: see BENCHMARKS.md).
#[test]
fn trees_follow_the_best_fixed_shape() {
    let all: Vec<&TreeCase> = cases().iter().collect();
    let t = table(&all);
    let mean = all.iter().map(|c| c.trees_over_best_fixed()).sum::<f64>() / all.len() as f64;
    assert!(mean >= 0.93, "mean trees/best-fixed {mean:.3}\n{t}");
    for c in &all {
        assert!(c.trees_over_best_fixed() >= 0.85, "{} c={}: {:.3}\n{t}", c.curve, c.concurrency, c.trees_over_best_fixed());
    }
}

/// The suggested floor, 0.95 of the best fixed shape on average. Measured 0.957 (0.948
/// before the per-shape acceptance became a ratio to the prior and trees waited for the chain of
/// their depth to be measured; BENCHMARKS.md, issue 29).
#[test]
fn trees_reach_095_of_the_best_fixed_shape_on_average() {
    let all: Vec<&TreeCase> = cases().iter().collect();
    let mean = all.iter().map(|c| c.trees_over_best_fixed()).sum::<f64>() / all.len() as f64;
    assert!(mean >= 0.95, "mean trees/best-fixed {mean:.3}\n{}", table(&all));
}

#[test]
fn gpu_curves_are_covered() {
    assert_eq!(at(&CONCURRENCY, &GPU_CURVES).len(), 20);
}
