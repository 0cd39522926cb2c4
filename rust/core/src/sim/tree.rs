//! Draft trees in the simulator (issue 29): what a tree of shape (depth `D`, top-k `K`, `N`
//! nodes) accepts per request and costs per iteration, and a runner for fixed shapes and the
//! adaptive policy.
//!
//! - **Acceptance.** Each request's tree is the EAGLE-2 beam of [`crate::goodput::tree`] over
//!   its true per-position chain rates, with a top-k profile exponent of its own: drawn per
//!   request in `0.35..0.65` around the policy's prior of 0.5 (so the policy's prior is right on
//!   average only, and its calibration has something to learn). A request's accepted drafts in a
//!   tree iteration are drawn from the tree's survival `P(a >= j)`; the tokens a contender is
//!   credited are the expected ones (`1 + sum_j P(a >= j)`), as for chains ([`super::run`]).
//! - **Cost.** The curve's seconds of an iteration at depth `D` whose verify covers `b N` draft
//!   tokens and whose `D` draft forwards run over `b K` tokens each (the beam's frontier; the
//!   first level's `b` tokens are charged as `b K`, and the drafter's extend as over the whole
//!   verify, both slightly against trees), the batch padded to the curve's graph sizes (a graph
//!   per padded batch and shape).
//! - **Runs.** As [`super::run`]'s walk: an iteration in segment `i` moves on by its expected
//!   tokens per request, the noise factor and acceptance draws come from a generator seeded by
//!   `(seed, segment)` (common random numbers for every contender), the policy sees the batch
//!   size, context, accepted drafts and noisy seconds, and is scored on expected tokens over
//!   noise-free seconds.

use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;

use super::curve::{CostCurve, Shape};
use super::run::{iteration_seconds, padded};
use super::workload::{normal, Workload, MAX_STEPS};
use crate::config::AdaptiveConfig;
use crate::decision::TreeShape;
use crate::goodput::tree::{beam_pool, survival};
use crate::policy::{AdaptiveSpeculativeParams, Observation};

/// What one iteration runs: a chain of `steps` (0: no drafting) or a tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    Chain(u32),
    Tree(TreeShape),
}

impl Plan {
    /// The iteration's steps (a tree's depth).
    pub fn steps(&self) -> u32 {
        match self {
            Plan::Chain(k) => *k,
            Plan::Tree(s) => s.depth,
        }
    }

    /// `(steps, topk, num_draft_tokens)` (a chain: top-k 0).
    pub fn key(&self) -> (u32, u32, u32) {
        match self {
            Plan::Chain(k) => (*k, 0, *k),
            Plan::Tree(s) => (s.depth, s.topk, s.num_draft_tokens),
        }
    }

    /// `chain-k` or `tree-DxKxN`.
    pub fn name(&self) -> String {
        match self {
            Plan::Chain(k) => format!("chain-{k}"),
            Plan::Tree(s) => format!("tree-{}x{}x{}", s.depth, s.topk, s.num_draft_tokens),
        }
    }
}

/// A request's top-k profile exponent (see the module docs): `0.35..0.65`, fixed per request id.
pub fn request_exponent(id: u32) -> f64 {
    let h = u64::from(id).wrapping_add(0x51_7CC1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
    0.35 + 0.3 * (h as f64 / (1u64 << 53) as f64)
}

/// Memoised tree survival per (request, class phase, shape).
/// `(request id, after its class switch, plan key)`.
type TruthKey = (u32, bool, (u32, u32, u32));

#[derive(Debug, Default)]
pub struct TreeTruth {
    memo: HashMap<TruthKey, [f64; MAX_STEPS]>,
    pool: Vec<(f64, u32)>,
}

impl TreeTruth {
    /// Survival `P(a >= j)` of request `id`'s tree of `shape` at segment `seg` (entries beyond
    /// the depth are 0).
    pub fn survival(&mut self, w: &Workload, id: u32, seg: u32, shape: TreeShape) -> [f64; MAX_STEPS] {
        let r = &w.requests[id as usize];
        let after = seg >= r.switch_at;
        let pool = &mut self.pool;
        *self.memo.entry((id, after, Plan::Tree(shape).key())).or_insert_with(|| {
            let d = (shape.depth as usize).min(MAX_STEPS);
            let mut s = [0.0; MAX_STEPS];
            beam_pool(&r.alpha_at(seg)[..d], shape.topk, request_exponent(id), pool);
            survival(pool, d as u32, shape.num_draft_tokens, &mut s);
            s
        })
    }

    /// Expected tokens of segment `i`'s batch under `plan` (true acceptance).
    pub fn tokens(&mut self, w: &Workload, i: usize, plan: Plan) -> f64 {
        match plan {
            Plan::Chain(k) => w.expected_tokens(i, k),
            Plan::Tree(s) => w.batch(i).iter().map(|&r| 1.0 + self.survival(w, r, i as u32, s).iter().sum::<f64>()).sum(),
        }
    }
}

/// Noise-free seconds of segment `i`'s iteration under `plan` (module docs).
pub fn plan_seconds(curve: &CostCurve, w: &Workload, i: usize, plan: Plan) -> f64 {
    match plan {
        Plan::Chain(k) => iteration_seconds(curve, w, i, k, 0.0, false),
        Plan::Tree(s) => {
            let b = padded(curve, w.batch(i).len() as u32);
            let bf = f64::from(b);
            let shape = Shape { verified: bf * f64::from(s.num_draft_tokens), drafting: bf * f64::from(s.topk) };
            curve.seconds_shape(b, s.depth, shape, w.context(i), 0.0)
        }
    }
}

/// What one contender achieved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TreeRunResult {
    pub name: String,
    pub tokens: f64,
    pub seconds: f64,
    /// `tokens / seconds`.
    pub goodput: f64,
    /// Iterations run, and of them tree iterations.
    pub iterations: u64,
    pub tree_iterations: u64,
    /// The plan run most often (by iterations).
    pub most_run: String,
    /// Iterations per plan run, most run first (ties by name).
    pub plans: Vec<(String, u64)>,
}

/// A contender: one plan for the whole run, or an adaptive policy.
#[derive(Debug, Clone)]
pub enum Contender {
    Fixed(Plan),
    Adaptive(String, AdaptiveConfig),
}

fn noise_and_uniforms(seed: u64, i: usize, b: usize) -> (f64, Vec<[f64; MAX_STEPS]>) {
    let mut rng = SmallRng::seed_from_u64(seed.wrapping_mul(0xA24B_AED4_963E_E407) ^ (i as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25));
    let sigma = 0.1;
    let mut f = (sigma * normal(&mut rng) - 0.5 * sigma * sigma).exp();
    if rng.random::<f64>() < 0.01 {
        f *= 1.5 + 1.5 * rng.random::<f64>();
    }
    (f, (0..b).map(|_| std::array::from_fn(|_| rng.random::<f64>())).collect())
}

/// Runs `contender` over `w` on `curve` (module docs).
pub fn run_tree_contender(w: &Workload, curve: &CostCurve, contender: &Contender, truth: &mut TreeTruth, seed: u64) -> TreeRunResult {
    let mut params = match contender {
        Contender::Fixed(_) => None,
        Contender::Adaptive(_, cfg) => {
            let union = cfg.candidate_union();
            let mut p = AdaptiveSpeculativeParams::new(union[union.len() / 2], cfg.clone());
            let graphs: Option<Vec<i64>> = curve.graph_sizes().map(|g| g.iter().map(|&x| i64::from(x)).collect());
            p.set_cuda_graph_bs(graphs.as_deref()).expect("graph sizes >= 1");
            Some(p)
        }
    };
    let (mut tokens, mut seconds, mut iterations, mut trees) = (0.0, 0.0, 0u64, 0u64);
    let mut runs: HashMap<(u32, u32, u32), (Plan, u64)> = HashMap::new();
    let mut x = 0.0f64;
    while (x as usize) < w.len() {
        let i = x as usize;
        let batch = w.batch(i);
        let b = batch.len();
        let ctx = w.context(i);
        let plan = match (contender, params.as_mut()) {
            (Contender::Fixed(p), _) => *p,
            (_, Some(p)) => {
                let d = p.decide_requests(b as i64, Some(ctx as u64), None, None).expect("batch >= 1");
                d.tree.map_or(Plan::Chain(d.steps), Plan::Tree)
            }
            _ => unreachable!("an adaptive contender has params"),
        };
        let t = plan_seconds(curve, w, i, plan);
        let e = truth.tokens(w, i, plan);
        if let Some(p) = params.as_mut() {
            let (factor, uniforms) = noise_and_uniforms(seed, i, b);
            let seg = i as u32;
            let accepted: Vec<i64> = batch
                .iter()
                .zip(&uniforms)
                .map(|(&id, u)| match plan {
                    Plan::Chain(k) => {
                        let alpha = w.requests[id as usize].alpha_at(seg);
                        (0..k as usize).take_while(|&j| u[j] < alpha[j]).count() as i64
                    }
                    Plan::Tree(s) => truth.survival(w, id, seg, s).iter().take_while(|&&p| u[0] < p).count() as i64,
                })
                .collect();
            let obs = Observation { seconds: Some(t * factor), context_tokens: Some(ctx as u64), steps: Some(plan.steps()), catch_up_tokens: None };
            p.on_verify_complete_with(accepted, b as i64, obs).expect("valid report");
        }
        tokens += e;
        seconds += t;
        iterations += 1;
        trees += u64::from(matches!(plan, Plan::Tree(_)));
        runs.entry(plan.key()).or_insert((plan, 0)).1 += 1;
        x += e / b as f64;
    }
    let name = match contender {
        Contender::Fixed(p) => p.name(),
        Contender::Adaptive(n, _) => n.clone(),
    };
    let most_run = runs.values().max_by_key(|(p, n)| (*n, p.key())).map_or(String::new(), |(p, _)| p.name());
    let mut plans: Vec<(String, u64)> = runs.values().map(|(p, n)| (p.name(), *n)).collect();
    plans.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    TreeRunResult { name, goodput: tokens / seconds, tokens, seconds, iterations, tree_iterations: trees, most_run, plans }
}
