//! Fidelity of the simulator's request classes (issue 28, item 4: "request classes whose
//! per-position acceptance matches the spreads measured"). The issue measured, with the built-in
//! EAGLE head at fixed steps 5 and 16 prompts per class, each prompt's acceptance length as the
//! engine reports it: the tokens the request emitted over the verifies it took, a mean over its
//! iterations. That figure carries the spread of the prompts' true rates *and* the sampling spread
//! of a finite number of verifies. So this test draws each class's requests as the simulator
//! draws them ([`Request::new`], output lengths from [`OUTPUT_TOKENS`]), runs each one through its
//! lifetime at fixed steps 5 (position `j` accepted with the request's conditional rate
//! `alpha_j`, in sequence, stopping at the first rejection: the acceptance the simulator's runs
//! draw, whose draft-confidence model keeps these rates as the mean, `sim::confidence`), and
//! compares the per-request means with the measurements:
//!
//! | class | measured (16 prompts) |
//! | --- | --- |
//! | code, temperature 0 | 2.35-4.70, sd 0.71 |
//! | prose, temperature 0 | 2.61-5.88, sd 1.00 |
//! | code, temperature 1.0 | 2.24-4.27, sd ~0.58 (a later engine measurement) |
//!
//! The range is compared as the mean, over groups of 16 simulated requests, of the group's
//! smallest and largest value (what 16 prompts show). Tolerances, from the measurement's own
//! uncertainty with 16 prompts: an sd within 20 % (one standard error of an sd from 16 samples is
//! about 18 %), each end of the range within 0.3 tokens (the standard error of the smallest or
//! largest of 16 draws is about 0.45 sd, 0.26-0.45 tokens here). Temperature-1.0 prose was not
//! measured: printed, not asserted.
//!
//! The simulator's classes fail it (greedy code 2.48-5.15, greedy prose 2.22-5.52,
//! temperature-1 code 2.19-3.83, sd 0.47), so it is ignored with those figures. Rates fitted to
//! the measurements pass it ([`fitted_rates_match_the_measured_spreads`]), but are not applied:
//! with any one of them the draft-tree floors of `tests/sim_trees.rs` (issue 29) fail
//! (BENCHMARKS.md, "Issue 28: the request classes against the measured spreads").

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use specdial_core::sim::workload::{Content, Request, CODE_GREEDY, CODE_T1, MAX_STEPS, OUTPUT_TOKENS, PROSE_GREEDY, PROSE_T1};

/// Fixed steps of the measurement.
const STEPS: usize = 5;
/// Prompts per measured class.
const GROUP: usize = 16;
/// Simulated groups per class.
const GROUPS: usize = 200;

/// Per request of `GROUPS * GROUP` drawn of `content`: its realised acceptance length at fixed
/// steps 5 over its lifetime (emitted tokens / verifies).
fn realised(content: Content, seed: u64) -> Vec<f64> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..GROUPS * GROUP)
        .map(|_| {
            let r = Request::new(content, 1000.0, 0, &mut rng);
            let life = rng.random_range(OUTPUT_TOKENS);
            let (mut tokens, mut verifies) = (0u32, 0u32);
            while tokens < life {
                let alpha = r.alpha_at(tokens);
                let accepted = (0..STEPS.min(MAX_STEPS)).take_while(|&j| rng.random::<f64>() < alpha[j]).count() as u32;
                tokens += accepted + 1;
                verifies += 1;
            }
            f64::from(tokens) / f64::from(verifies)
        })
        .collect()
}

/// `(mean, sd, mean smallest of 16, mean largest of 16)`.
fn spread(x: &[f64]) -> (f64, f64, f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let sd = (x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
    let groups = x.chunks(GROUP).filter(|g| g.len() == GROUP);
    let (mut lo, mut hi, mut k) = (0.0, 0.0, 0.0);
    for g in groups {
        lo += g.iter().copied().fold(f64::INFINITY, f64::min);
        hi += g.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        k += 1.0;
    }
    (mean, sd, lo / k, hi / k)
}

/// Checks `classes` (greedy code, greedy prose, temperature-1 code) against the measurements.
fn check(classes: [Content; 3]) {
    // (class, measured sd, measured smallest, measured largest)
    let [a, b, c] = classes;
    let measured = [(a, 0.71, 2.35, 4.70), (b, 1.00, 2.61, 5.88), (c, 0.58, 2.24, 4.27)];
    let mut report = String::new();
    let mut failures = Vec::new();
    for (i, (c, sd_m, lo_m, hi_m)) in measured.into_iter().enumerate() {
        let (mean, sd, lo, hi) = spread(&realised(c, 28 + i as u64));
        report += &format!("{:13} mean {mean:.2} sd {sd:.2} (measured {sd_m:.2}) range of 16 {lo:.2}-{hi:.2} (measured {lo_m:.2}-{hi_m:.2})\n", c.name);
        if (sd / sd_m - 1.0).abs() > 0.2 || (lo - lo_m).abs() > 0.3 || (hi - hi_m).abs() > 0.3 {
            failures.push(c.name);
        }
    }
    let (mean, sd, lo, hi) = spread(&realised(PROSE_T1, 31));
    report += &format!("{:13} mean {mean:.2} sd {sd:.2} range of 16 {lo:.2}-{hi:.2} (not measured)\n", PROSE_T1.name);
    println!("{report}");
    assert!(failures.is_empty(), "classes off the measured spreads: {failures:?}\n{report}");
}

#[test]
#[ignore = "the simulator's classes are off the measured spreads (greedy code 16-prompt range 2.48-5.15 against 2.35-4.70, greedy prose 2.22-5.52 against 2.61-5.88, temperature-1 code 2.19-3.83 sd 0.47 against 2.24-4.27 sd ~0.58); the fitted rates that pass are not applied because the draft-tree floors of sim_trees fail with them (BENCHMARKS.md, issue 28: the request classes against the measured spreads)"]
fn request_classes_match_the_measured_spreads_of_acceptance_length() {
    check([CODE_GREEDY, PROSE_GREEDY, CODE_T1]);
}

/// Rates fitted to the measurements (a grid over alpha and spread, depth factors kept): what
/// the classes would be if `sim_trees` allowed it.
#[test]
fn fitted_rates_match_the_measured_spreads() {
    let fitted = [
        Content { alpha: 0.75, spread: 0.09, ..CODE_GREEDY },
        Content { alpha: 0.92, spread: 0.15, ..PROSE_GREEDY },
        Content { alpha: 0.73, spread: 0.08, ..CODE_T1 },
    ];
    check(fitted);
}
