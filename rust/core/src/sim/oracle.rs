//! The per-request oracle of issue 28: like [`super::run::run_oracle`] it knows every request's
//! true acceptance (its conditional rates at each segment, not the realised draws) and the
//! noise-free cost, but it chooses, per segment, the batch's depth `D` *and* a verify length per
//! request: for each `D` it admits draft positions in descending true survival order (a
//! request's positions form a prefix) and keeps the count of highest expected tokens per second
//! on the curve ([`CostCurve::seconds_shape`]: packed verify, requests at 0 not drafting). The
//! count is searched on a grid of about `GRID` points, then exactly around the best.

use super::curve::{CostCurve, Shape};
use super::run::{choice_seconds, choice_tokens, padded, walk_choices, Choice, RunOptions, RunResult};
use super::workload::{Workload, MAX_STEPS};

/// Points of the coarse search over the number of admitted draft positions.
const GRID: usize = 48;

/// Expected tokens per second and lengths of the best allocation at depth `d` in segment `i`.
/// `rates(r)`: the conditional acceptance per position of request `r` of the batch that the
/// oracle ranks by (true rates, or this iteration's acceptance probabilities).
fn best_at(w: &Workload, curve: &CostCurve, i: usize, d: u32, skip: bool, order: &mut Vec<(f64, usize)>, rates: &dyn Fn(usize) -> [f64; MAX_STEPS]) -> (f64, Choice) {
    let batch = w.batch(i);
    let b = batch.len();
    if d == 0 {
        let c = Choice::uniform(0);
        return (choice_tokens(w, i, &c) / choice_seconds(curve, w, i, &c, 0.0, skip), c);
    }
    order.clear();
    for r in 0..b {
        let alpha = rates(r);
        let mut s = 1.0;
        for a in alpha.iter().take(d as usize) {
            s *= a;
            order.push((s, r));
        }
    }
    order.sort_unstable_by(|x, y| y.0.total_cmp(&x.0));
    // prefix sums: expected tokens and drafting requests with the first n positions admitted
    let (mut tokens, mut drafting) = (vec![b as f64], vec![0.0]);
    let mut seen = vec![false; b];
    for &(s, r) in order.iter() {
        tokens.push(tokens.last().unwrap() + s);
        let new = !std::mem::replace(&mut seen[r], true);
        drafting.push(drafting.last().unwrap() + if new { 1.0 } else { 0.0 });
    }
    let (bp, ctx) = (padded(curve, b as u32), w.context(i));
    let score = |n: usize| {
        let shape = Shape { verified: n as f64, drafting: drafting[n] };
        tokens[n] / curve.seconds_shape(bp, d, shape, ctx, 0.0)
    };
    let total = order.len();
    let step = (total / GRID).max(1);
    let mut best = (score(0), 0usize);
    for n in (step..=total).step_by(step).chain(std::iter::once(total)) {
        let g = score(n);
        if g > best.0 {
            best = (g, n);
        }
    }
    let (lo, hi) = (best.1.saturating_sub(step), (best.1 + step).min(total));
    for n in lo..=hi {
        let g = score(n);
        if g > best.0 {
            best = (g, n);
        }
    }
    let mut l = vec![0u32; b];
    for &(_, r) in &order[..best.1] {
        l[r] += 1;
    }
    (best.0, Choice::lengths(d, l))
}

/// The per-request oracle's choice in segment `i`, depths `0..=max_steps`.
pub fn choose(w: &Workload, curve: &CostCurve, i: usize, max_steps: u32, skip: bool) -> Choice {
    let batch = w.batch(i);
    choose_by(w, curve, i, max_steps, skip, &|r| *w.requests[batch[r] as usize].alpha_at(i as u32))
}

fn choose_by(w: &Workload, curve: &CostCurve, i: usize, max_steps: u32, skip: bool, rates: &dyn Fn(usize) -> [f64; MAX_STEPS]) -> Choice {
    let mut order = Vec::new();
    let mut best: Option<(f64, Choice)> = None;
    for d in 0..=max_steps {
        let (g, c) = best_at(w, curve, i, d, skip, &mut order, rates);
        if best.as_ref().map_or(true, |b| g > b.0) {
            best = Some((g, c));
        }
    }
    best.expect("depth 0 at least").1
}

/// Runs the per-request oracle over the workload (see the module docs).
pub fn run_oracle_per_request(w: &Workload, curve: &CostCurve, max_steps: u32, opts: &RunOptions) -> RunResult {
    let skip = opts.skip_zero_step_draft_extend;
    walk_choices(w, curve, "oracle-per-request", opts, |i| choose(w, curve, i, max_steps, skip))
}

/// The confidence oracle: like [`run_oracle_per_request`] but it ranks draft positions by this
/// iteration's acceptance probabilities `pi` ([`super::confidence`]), which no drafter reports
/// exactly: the ceiling of any rule that admits positions by draft confidence (DSpark's global
/// top-B with a perfect survival estimate).
pub fn run_oracle_confidence(w: &Workload, curve: &CostCurve, max_steps: u32, opts: &RunOptions) -> RunResult {
    let skip = opts.skip_zero_step_draft_extend;
    walk_choices(w, curve, "oracle-confidence", opts, |i| {
        let pi = opts.confidence.draw(w, i, opts.seed).pi;
        choose_by(w, curve, i, max_steps, skip, &|r| pi[r])
    })
}
