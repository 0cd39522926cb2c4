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
