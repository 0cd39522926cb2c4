//! The `goodput` strategy's choice of a draft tree (issue 29): each decode iteration, besides the
//! chain's steps (0 included), the tree shapes within the config's `tree` bounds
//! ([`crate::config::tree::TreeConfig`]) whose depth is one of the slot's candidates, scored like
//! the chains:
//!
//! ```text
//! goodput(D, K, N) = b (1 + E_tree(D, K, N)) / (t(b, D) + theta_v x_v + theta_d x_d)
//! ```
//!
//! - `E_tree`: the shape's learned acceptance ([`super::tree::TreeAcceptance`]), shrunk toward the
//!   top-k profile's prediction from the chain rates ([`super::tree`]) times the calibration.
//! - The cost sees verify and draft tokens: `t(b, D)` is the cost model's chain of depth `D` (its
//!   `b (D + 1)` verify tokens, `D` draft forwards over `b` tokens, the extend); a tree adds
//!   `x_v = b (N - D)` verify tokens and `x_d = b (D - 1)(K - 1)` draft tokens (levels after the
//!   first expand `K` nodes per request instead of 1). Their seconds per token `theta` are fitted
//!   per batch-size bucket on the tree iterations' seconds beyond `t(b, D)` (ridge least squares
//!   through 0), pulled toward a prior from the cost model itself: the seconds per request and
//!   draft step its plane learned (the `k b` term, so nearly nothing where the device is
//!   memory-bound and a token's compute where it is not), `VERIFY_SHARE` of it per verify token
//!   and the rest per draft token. So a tree looks as cheap as the chain's data says extra tokens
//!   are, is tried, and its measured seconds correct every shape of that bucket at once; at a
//!   large batch the extra tokens cost their compute and the choice shrinks to a chain, then to
//!   steps 0 (the chain's own decision).
//! - Trees are only considered at a batch-size bucket where the chain of their depth is
//!   measured, and grow there: at most twice the nodes of the largest tree measured
//!   at the bucket, or of the chain of their depth (the fit is linear while the roofline's cost
//!   of extra tokens is convex, so a fit on a large tree would price small ones out unseen).
//! - Switches between a chain and a tree, or between trees, take the chain's rules: the
//!   challenger must beat the current choice by `switch_margin`, after `min_dwell` iterations or
//!   when the batch has doubled or halved. A chain probe runs as a chain (it keeps the chain
//!   rates, the prior's source, fresh).
//!
//! A tree iteration's report is a chain's (accepted path length `a <= D` per request): it feeds
//! the shape's acceptance and the bucket's token-cost fit, never the chain estimates.
//!
//! Per-request budgets (`"verify": "per_request"`, issue 29 item 5): a request's budget is its
//! node count. The tree competes with the batch-level chain (or the confidence-stopped chain;
//! per-request allocations of chain lengths, when they beat the batch level, stand). When a
//! tree is chosen and `min_survival` is set, the decision carries a node threshold the worker
//! applies after drafting: request `r` verifies the `n_r` nodes (`0..=N`; 0 is a plain decode
//! through verify) whose path confidence, the cumulative draft probability the tree's drafting
//! computed, is at least the threshold. A child's path probability is at most its parent's,
//! so the kept set is ancestor-closed and is a subset of EAGLE-2's best `N` (the N cap holds).
//! Chosen this way because the confidence is known only after drafting, and a rule on it needs
//! no second crossing (the chain's stop, [`super::confidence`], is the same rule on a path).
//! The threshold: `Fixed(x)` is `x`; `"auto"` is [`node_threshold`], the lowest bin edge whose
//! calibrated survival (the chain stop's calibration, one model: a node's path probability is
//! a chain position's cumulative probability along that path) still pays for the node's
//! verify token at the bucket's fitted price `theta_v` and the shape's predicted goodput. The
//! kept counts come back as the report's `verified`; the fit then learns the verify tokens the
//! kept nodes ran (not `N` per request; a report without kept counts verified all `N`). The
//! calibration learns from chain iterations and from tree iterations: a tree's report carries
//! each verified node's path confidence, the accepted path's first
//! ([`crate::scheduler::ReportExtras::draft_probs`]), and
//! [`ConfidenceModel::observe_nodes`] counts each node in its confidence's bin, survived iff
//! accepted. With `min_survival` off a tree verifies its `N` nodes whole.

use std::collections::BTreeMap;

use super::acceptance::expected_tokens;
use super::confidence::{edge, ConfidenceModel, BINS};
use super::tree::{beam_pool, candidate_shapes, survival, TreeAcceptance, TOPK_EXPONENT};
use super::GoodputPolicy;
use crate::config::tree::TreeConfig;
use crate::config::{MinSurvival, VerifyMode};
use crate::decision::{ConfidenceStop, Decision, TreeShape, VerifyShape};

/// Share of a chain step's per-request seconds taken as its verify token's (the rest: its draft
/// token). An 8B target's token costs about 5x an EAGLE head's (one layer and the LM head) in
/// compute; the extend's token is the head's too.
pub const VERIFY_SHARE: f64 = 0.8;
/// Pseudo-observations of the token-cost prior, each of 8 extra tokens per request: half of
/// one, so the first measured tree outweighs it (with 2, a tree measured at 1.7x its predicted
/// seconds at concurrency 64 ran some 9 iterations before the fit priced it out).
const PRIOR_OBSERVATIONS: f64 = 0.5;
/// Decay per tree iteration of a bucket's token-cost sums.
const FIT_DECAY: f64 = 0.97;
/// Most nodes per request of the first tree tried at a bucket (then twice the largest measured).
const FIRST_TREE_NODES: u32 = 8;
/// Tree iterations of a bucket after which its fit clips outliers.
const FIT_SETTLED: u64 = 8;
/// The prior of every shape is recomputed when a chain rate moved by more than this, or after
/// `PRIOR_MAX_AGE` decisions.
const PRIOR_REFRESH: f64 = 0.05;
const PRIOR_MAX_AGE: u64 = 16;

/// Ridge least squares through 0 of seconds on `(x_v, x_d)`, decayed.
#[derive(Debug, Clone, Default, PartialEq)]
struct TokenFit {
    xx: [[f64; 2]; 2],
    xy: [f64; 2],
    /// Tree iterations learned.
    count: u64,
    /// Most nodes per request of a tree measured at the bucket.
    largest: u32,
}

impl TokenFit {
    fn observe(&mut self, x: [f64; 2], e: f64) {
        self.count += 1;
        for i in 0..2 {
            self.xy[i] = self.xy[i] * FIT_DECAY + x[i] * e;
            for j in 0..2 {
                self.xx[i][j] = self.xx[i][j] * FIT_DECAY + x[i] * x[j];
            }
        }
    }

    /// Seconds per (verify, draft) token: `(XX + l I) theta = Xy + l prior`, each held >= 0.
    fn theta(&self, prior: [f64; 2], l: f64) -> [f64; 2] {
        let a = [
            [self.xx[0][0] + l, self.xx[0][1]],
            [self.xx[1][0], self.xx[1][1] + l],
        ];
        let y = [self.xy[0] + l * prior[0], self.xy[1] + l * prior[1]];
        let det = a[0][0] * a[1][1] - a[0][1] * a[1][0];
        if det.abs() < 1e-300 {
            return prior;
        }
        let t0 = (y[0] * a[1][1] - a[0][1] * y[1]) / det;
        let t1 = (a[0][0] * y[1] - a[1][0] * y[0]) / det;
        match (t0 >= 0.0, t1 >= 0.0) {
            (true, true) => [t0, t1],
            // one held at 0: the other's one-dimensional fit
            (false, _) => [0.0, (y[1] / a[1][1]).max(0.0)],
            (_, false) => [(y[0] / a[0][0]).max(0.0), 0.0],
        }
    }
}

/// The tree part of the `goodput` strategy's state (module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct TreePlanner {
    acceptance: TreeAcceptance,
    /// Prior expected accepted drafts per shape, and the chain rates it was computed from.
    prior: Vec<f64>,
    prior_alpha: Vec<f64>,
    prior_age: u64,
    fits: BTreeMap<u32, TokenFit>,
    /// The tree the strategy runs now (`None`: the chain's decision).
    current: Option<TreeShape>,
    since_switch: u64,
    chosen_at: u32,
    /// Shape index of the decision not yet reported.
    pending: Option<usize>,
    iterations: u64,
    pool: Vec<(f64, u32)>,
}

impl TreePlanner {
    /// Shapes within `limits` for the depths `depths` (the slots' candidate steps), acceptance
    /// sums decayed over `window` tree iterations.
    pub fn new(limits: TreeConfig, depths: &[u32], window: u32) -> Self {
        let shapes = candidate_shapes(depths, limits.max_topk, limits.max_num_draft_tokens);
        let n = shapes.len();
        TreePlanner {
            acceptance: TreeAcceptance::new(shapes, window),
            prior: vec![0.0; n],
            prior_alpha: Vec::new(),
            prior_age: 0,
            fits: BTreeMap::new(),
            current: None,
            since_switch: u64::MAX / 2,
            chosen_at: 1,
            pending: None,
            iterations: 0,
            pool: Vec::new(),
        }
    }

    /// The shapes considered.
    pub fn shapes(&self) -> &[TreeShape] {
        self.acceptance.shapes()
    }

    /// Expected accepted drafts per request of `shape` now (None: not a candidate shape).
    pub fn expected_accepted(&self, shape: TreeShape) -> Option<f64> {
        self.acceptance
            .index(shape)
            .map(|i| self.acceptance.expected(i, self.prior[i]))
    }

    fn refresh_prior(&mut self, alpha: &[f64]) {
        self.prior_age += 1;
        let moved = self.prior_alpha.len() != alpha.len()
            || self
                .prior_alpha
                .iter()
                .zip(alpha)
                .any(|(a, b)| (a - b).abs() > PRIOR_REFRESH);
        if !moved && self.prior_age < PRIOR_MAX_AGE {
            return;
        }
        self.prior_alpha = alpha.to_vec();
        self.prior_age = 0;
        let shapes = self.acceptance.shapes().to_vec();
        let mut s = vec![0.0; alpha.len()];
        let mut last_topk = 0;
        for (i, shape) in shapes.iter().enumerate() {
            if shape.topk != last_topk {
                beam_pool(alpha, shape.topk, TOPK_EXPONENT, &mut self.pool);
                last_topk = shape.topk;
            }
            self.prior[i] = survival(
                &self.pool,
                shape.depth.min(alpha.len() as u32),
                shape.num_draft_tokens,
                &mut s,
            );
        }
    }
}

/// Extra (verify, draft) tokens of a tree of `shape` over the chain of its depth, batch `b`.
pub fn extra_tokens(shape: TreeShape, b: u32) -> [f64; 2] {
    let (d, k, n, b) = (
        f64::from(shape.depth),
        f64::from(shape.topk),
        f64::from(shape.num_draft_tokens),
        f64::from(b),
    );
    [b * (n - d).max(0.0), b * (d - 1.0).max(0.0) * (k - 1.0)]
}

/// The node threshold of a tree under per-request budgets with `min_survival = "auto"`: a
/// node is worth verifying while its calibrated survival `s` (the expected tokens it adds) is at
/// least what its verify token costs in tokens, `theta_v * G`, `G = tokens / seconds` the
/// iteration's predicted goodput (adding a token of `s` expected tokens and `theta_v` seconds
/// raises `tokens / seconds` iff `s > theta_v * G`). Returns the cumulative draft probability
/// below which the worker drops a node, `None` where every node pays (no rule).
pub fn node_threshold(model: &ConfidenceModel, theta_v: f64, tokens: f64, seconds: f64) -> Option<f64> {
    if !(seconds > 0.0 && theta_v > 0.0 && tokens > 0.0) {
        return None;
    }
    let t = model.node_edge(theta_v * tokens / seconds);
    (t < BINS).then(|| edge(t))
}

impl GoodputPolicy {
    /// The tree the strategy runs now, if any.
    pub fn current_tree(&self) -> Option<TreeShape> {
        self.tree.as_ref().and_then(|t| t.current)
    }

    /// The tree decided and not yet reported (its report's per-request counts are kept nodes,
    /// up to its `num_draft_tokens`), if the last decision was a tree.
    pub fn pending_tree(&self) -> Option<TreeShape> {
        let plan = self.tree.as_ref()?;
        plan.pending.map(|i| plan.acceptance.shapes()[i])
    }

    /// Tree iterations reported so far.
    pub fn tree_iterations(&self) -> u64 {
        self.tree.as_ref().map_or(0, |t| t.iterations)
    }

    /// The tree planner (None without the `tree` key).
    pub fn tree_planner(&self) -> Option<&TreePlanner> {
        self.tree.as_ref()
    }

    /// Seconds of a tree iteration of `shape` the strategy predicts at `(bucket, b, context)`.
    pub fn predict_tree_seconds(
        &self,
        bucket: u32,
        b: u32,
        shape: TreeShape,
        context_tokens: u64,
    ) -> f64 {
        let ctx = context_tokens as f64;
        let chain = self.cost.predict(bucket, b, shape.depth, ctx, 0.0);
        let theta = self.tree.as_ref().map_or([0.0; 2], |t| {
            self.token_theta(t, bucket, b, shape.depth, ctx)
        });
        let x = extra_tokens(shape, b);
        chain + theta[0] * x[0] + theta[1] * x[1]
    }

    /// Seconds per extra (verify, draft) token at `bucket` (module docs).
    fn token_theta(&self, plan: &TreePlanner, bucket: u32, b: u32, depth: u32, ctx: f64) -> [f64; 2] {
        let slope = |k: u32| self.cost.predict(bucket, b + 1, k, ctx, 0.0) - self.cost.predict(bucket, b, k, ctx, 0.0);
        Self::theta_from(plan, bucket, b, slope(depth) - slope(depth.saturating_sub(1)))
    }

    /// [`Self::token_theta`] given the plane's seconds per request and draft step at the depth
    /// (its slope in `b` at depth `D` minus at `D - 1`).
    fn theta_from(plan: &TreePlanner, bucket: u32, b: u32, per_step_request: f64) -> [f64; 2] {
        let per_token = per_step_request.max(0.0);
        let prior = [VERIFY_SHARE * per_token, (1.0 - VERIFY_SHARE) * per_token];
        let scale = 8.0 * f64::from(b);
        let l = PRIOR_OBSERVATIONS * scale * scale;
        plan.fits.get(&bucket).map_or(prior, |f| f.theta(prior, l))
    }

    /// Turns the chain's decision `chain` into a tree decision where a tree scores best (module
    /// docs). `probe`: the chain's decision is a probe (kept as it is).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn tree_decision(
        &mut self,
        slot: usize,
        bucket: u32,
        b: u32,
        b_cost: u32,
        ctx: f64,
        alpha: &[f64],
        chain: Decision,
        probe: bool,
    ) -> Decision {
        let Some(mut plan) = self.tree.take() else {
            return chain;
        };
        plan.pending = None;
        // per-request allocations of chain lengths stand as they are; under `verify =
        // per_request` a tree competes with the batch-level (or confidence-stop) chain
        if probe || chain.verify != VerifyShape::Uniform {
            self.tree = Some(plan);
            return chain;
        }
        plan.refresh_prior(alpha);
        let candidates = &self.slots[slot].candidates;
        let bf = f64::from(b);
        // The cost model at (b, k) and (b + 1, k) for every depth, once: its predictions are the
        // decision's dearest part.
        let top = candidates.iter().copied().max().unwrap_or(0);
        let at: Vec<(f64, f64)> = (0..=top)
            .map(|k| (self.cost.predict(bucket, b_cost, k, ctx, 0.0), self.cost.predict(bucket, b_cost + 1, k, ctx, 0.0)))
            .collect();
        let chain_t = |k: u32| at[k as usize].0;
        let slope = |k: u32| at[k as usize].1 - at[k as usize].0;
        let chain_score = |k: u32| bf * expected_tokens(alpha, k) / chain_t(k);
        let best_chain = candidates
            .iter()
            .map(|&k| chain_score(k))
            .fold(0.0, f64::max);
        // A tree's seconds are the chain's of its depth plus its extra tokens: only where the
        // chain of that depth is measured at this bucket is the sum worth more than the cost
        // model's unit-less prior. A tree's
        // seconds beyond an *extrapolated* chain would be fitted as its tokens' cost: the chain
        // model's error at that depth (25 % at depth 3 on h200x4-llama70b, concurrency 4) made
        // every tree look dear there and none was tried again (BENCHMARKS.md, issue 29).
        let known = |d: u32| self.cost.cell_count(bucket, d) > 0;
        // Trees grow at a bucket: up to twice the nodes of the largest one measured there (or
        // of the chain of their depth, so a tree can beat a long chain by the margin). The
        // extra tokens' cost is convex (free below the roofline's knee, linear beyond), so the
        // fit learned on a small tree is optimistic for a large one, which is then tried and
        // measured, while one learned on a large tree would price small ones out unseen.
        let largest = plan.fits.get(&bucket).map_or(0, |f| f.largest);
        let grow_to = (2 * largest).max(FIRST_TREE_NODES);
        // Per depth: the chain's seconds and the token costs (the cost model's predictions are
        // the decision's dearest part).
        let mut per_depth: BTreeMap<u32, (f64, [f64; 2])> = BTreeMap::new();
        let mut best: Option<(usize, f64)> = None;
        let mut current_score = if plan.current.is_none() {
            chain_score(chain.steps)
        } else {
            0.0
        };
        for (i, &shape) in plan.acceptance.shapes().iter().enumerate() {
            if !candidates.contains(&shape.depth) || !known(shape.depth) || shape.num_draft_tokens > grow_to.max(2 * shape.depth) {
                continue;
            }
            let (t_chain, theta) = *per_depth
                .entry(shape.depth)
                .or_insert_with(|| {
                    let d = shape.depth;
                    (chain_t(d), Self::theta_from(&plan, bucket, b_cost, slope(d) - slope(d.saturating_sub(1))))
                });
            let x = extra_tokens(shape, b_cost);
            let t = t_chain + theta[0] * x[0] + theta[1] * x[1];
            let g = bf * (1.0 + plan.acceptance.expected(i, plan.prior[i])) / t;
            if plan.current == Some(shape) {
                current_score = g;
            }
            if best.map_or(true, |(_, bg)| g > bg) {
                best = Some((i, g));
            }
        }
        let need = 1.0 + self.cfg.switch_margin;
        let moved = (f64::from(bucket).log2() - f64::from(plan.chosen_at).log2()).abs() >= 1.0;
        // The dwell keeps near-ties from ping-ponging; a current choice worth less than 2/3 of
        // the challenger (a tree whose first measured seconds were far above the prior's) is no
        // near-tie.
        let may_switch = plan.since_switch >= u64::from(self.cfg.min_dwell) || moved;
        plan.since_switch = plan.since_switch.saturating_add(1);
        let (tree_i, tree_g) = best.map_or((None, 0.0), |(i, g)| (Some(i), g));
        let (challenger, challenger_g) = if tree_g >= best_chain {
            (tree_i, tree_g)
        } else {
            (None, best_chain)
        };
        let challenger_shape = challenger.map(|i| plan.acceptance.shapes()[i]);
        let far_behind = challenger_g > 1.5 * current_score;
        if (may_switch || far_behind) && challenger_shape != plan.current && challenger_g > current_score * need {
            // To a chain only from a tree (the chain's own rules move among chains).
            plan.current = challenger_shape;
            plan.since_switch = 0;
            plan.chosen_at = bucket;
            self.switches += 1;
        }
        let out = match plan.current {
            Some(shape) => {
                plan.pending = plan.acceptance.index(shape);
                let stop = match (self.cfg.verify, self.cfg.min_survival) {
                    (VerifyMode::PerRequest, MinSurvival::Fixed(x)) => Some(x),
                    (VerifyMode::PerRequest, MinSurvival::Auto) => {
                        let d = shape.depth;
                        let (t_chain, slope_d) = at.get(d as usize).map_or((0.0, 0.0), |&(t0, t1)| (t0, t1 - t0));
                        let slope_lower = at.get(d.saturating_sub(1) as usize).map_or(0.0, |&(t0, t1)| t1 - t0);
                        let theta = Self::theta_from(&plan, bucket, b_cost, slope_d - slope_lower);
                        let x = extra_tokens(shape, b_cost);
                        let t = t_chain + theta[0] * x[0] + theta[1] * x[1];
                        let e = plan.pending.map_or(0.0, |i| plan.acceptance.expected(i, plan.prior[i]));
                        Some(node_threshold(&self.confidence, theta[0], bf * (1.0 + e), t)).flatten()
                    }
                    _ => None,
                };
                // the chain's stop (if any) was priced for the chain: a tree's report is the tree's
                self.last_rule = None;
                Decision {
                    steps: shape.depth,
                    verify: VerifyShape::Uniform,
                    tree: Some(shape),
                    // under per-request budgets a request verifies the tree's nodes whose path
                    // confidence reaches the threshold (module docs); otherwise the whole tree
                    confidence_stop: stop.map(|x| ConfidenceStop { min_survival: x as f32 }),
                }
            }
            None => chain,
        };
        self.tree = Some(plan);
        out
    }

    /// Records a report of the tree decision not yet reported, if it is one (`steps` = its depth):
    /// the shape's acceptance, the bucket's token-cost fit, probe credit. `Some(switch)` when it
    /// was (the value [`GoodputPolicy::observe_with`] returns), `None` for a chain's report.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn observe_tree(
        &mut self,
        slot: usize,
        bucket: u32,
        b_cost: u32,
        steps: u32,
        accepted: &[i64],
        seconds: Option<f64>,
        ctx: f64,
        caught_up: Option<u64>,
        nodes: Option<u64>,
    ) -> Option<Option<u32>> {
        let plan = self.tree.as_mut()?;
        let i = plan.pending.take()?;
        let shape = plan.acceptance.shapes()[i];
        if shape.depth != steps {
            return None;
        }
        self.iteration += 1;
        plan.iterations += 1;
        plan.acceptance.observe(i, accepted, plan.prior[i]);
        let catch = caught_up.unwrap_or(std::mem::take(&mut self.catch_up)) as f64;
        self.catch_up = 0;
        let chain = self.cost.predict(bucket, b_cost, steps, ctx, catch);
        let mut x = extra_tokens(shape, b_cost);
        if let Some(n) = nodes.filter(|_| !accepted.is_empty()) {
            // under per-request node budgets the verify ran the kept nodes (`n` in all), not N
            // per request: the fit learns the tokens verified (per request, scaled to b_cost)
            let per_request = n as f64 / accepted.len() as f64;
            x[0] = (f64::from(b_cost) * (per_request - f64::from(shape.depth))).max(0.0);
        }
        let predicted = {
            let theta = self.tree.as_ref().map_or([0.0; 2], |t| self.token_theta(t, bucket, b_cost, shape.depth, ctx));
            self.cost.predict(bucket, b_cost, shape.depth, ctx, 0.0) + theta[0] * x[0] + theta[1] * x[1]
        };
        let spent = match seconds {
            Some(t) if !self.cost.off_pace() => {
                let fit = self.tree.as_mut().expect("taken above").fits.entry(bucket).or_default();
                // Once the bucket's fit has its feet, a stall is clipped to 3x the prediction
                // (the prior may be far off at first: those seconds are what it must learn).
                let t_fit = if fit.count >= FIT_SETTLED { t.clamp(predicted / 3.0, 3.0 * predicted) } else { t };
                fit.observe(x, t_fit - chain);
                fit.largest = fit.largest.max(shape.num_draft_tokens);
                t
            }
            Some(t) => t,
            None => predicted,
        };
        let s = &mut self.slots[slot];
        s.verifies += 1;
        s.since_switch = s.since_switch.saturating_add(1);
        if !self.cost.off_pace() {
            s.credit = (s.credit + self.cfg.probe_budget * spent).min(4.0 * spent);
        }
        Some(std::mem::take(&mut s.switched).then_some(s.current))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GoodputConfig;
    use crate::goodput::per_request::RequestVerify;

    fn policy() -> GoodputPolicy {
        let tree = Some(TreeConfig { max_topk: 8, max_num_draft_tokens: 64 });
        let cfg = GoodputConfig { probe_budget: 0.0, tree, ..GoodputConfig::default() };
        GoodputPolicy::new(cfg, 3, vec![(0..=3).collect()])
    }

    /// A device where every token of a batch costs `per_token` seconds beyond 10 ms.
    fn secs(b: u32, tokens_per_request: u32, per_token: f64) -> f64 {
        0.01 + per_token * f64::from(b * tokens_per_request)
    }

    /// Chain iterations at batch `b` (steps 2 and 3, 80 % acceptance per position) on that device.
    fn train_chains(p: &mut GoodputPolicy, b: u32, per_token: f64) {
        for i in 0..40u32 {
            let k = 2 + i % 2;
            let acc: Vec<i64> = (0..b as i64).map(|r| [0, 1, 2, 3, 3][(r as usize + i as usize) % 5].min(i64::from(k))).collect();
            p.observe(0, b, b, b, k, &acc, Some(secs(b, k + 1, per_token)), 1000);
        }
    }

    #[test]
    fn cheap_tokens_choose_a_tree_whose_reports_leave_the_chain_estimates_alone() {
        let mut p = policy();
        train_chains(&mut p, 1, 1e-6);
        let d = p.decide_requests(0, 1, 1, 1, 1000, None, None);
        let shape = d.tree.expect("tokens are nearly free at batch 1: a tree pays");
        assert_eq!((d.steps, d.verify), (shape.depth, VerifyShape::Uniform));
        assert!(shape.topk >= 2 && shape.num_draft_tokens <= FIRST_TREE_NODES.max(2 * shape.depth), "{shape:?}");
        // only at a depth whose chain is measured at the bucket (2 and 3 here): a tree's extra
        // seconds are fitted against that chain's measured cost, not an extrapolated one
        assert!([2, 3].contains(&shape.depth), "{shape:?}");
        let verifies = p.acceptance.observed();
        let cells = p.cost.cell_count(1, shape.depth);
        p.observe(0, 1, 1, 1, shape.depth, &[i64::from(shape.depth)], Some(secs(1, shape.num_draft_tokens + 1, 1e-6)), 1000);
        assert_eq!(p.tree_iterations(), 1);
        assert_eq!(p.acceptance.observed(), verifies, "a tree's accepted path is not a chain's acceptance");
        assert_eq!(p.cost.cell_count(1, shape.depth), cells, "a tree's seconds are not the chain's");
        // (Growth to larger trees once one is measured: tests/sim_trees.rs, batch 1, where the
        // strategy ends on trees of 32-64 nodes from a first one of at most 8.)
    }

    #[test]
    fn dear_tokens_shrink_the_tree_to_a_chain() {
        let mut p = policy();
        // 64 requests, 0.2 ms per token: a 64-request verify of 4 tokens each is 60 ms.
        train_chains(&mut p, 64, 2e-4);
        let mut trees = 0;
        for _ in 0..30 {
            let d = p.decide_requests(0, 64, 64, 64, 64_000, None, None);
            match d.tree {
                Some(s) => {
                    trees += 1;
                    let extra = (s.num_draft_tokens - s.depth) as f64 + ((s.depth - 1) * (s.topk - 1)) as f64 * 0.25;
                    let t = secs(64, s.depth + 1, 2e-4) + 2e-4 * 64.0 * extra;
                    p.observe(0, 64, 64, 64, s.depth, &vec![i64::from(s.depth.min(2)); 64], Some(t), 64_000);
                }
                None => {
                    p.observe(0, 64, 64, 64, d.steps, &vec![i64::from(d.steps.min(2)); 64], Some(secs(64, d.steps + 1, 2e-4)), 64_000);
                }
            }
        }
        assert!(trees <= 3, "{trees} tree iterations: one measured tree should be enough");
        assert_eq!(p.current_tree(), None);
    }

    fn per_request_policy(min_survival: MinSurvival) -> GoodputPolicy {
        let tree = Some(TreeConfig { max_topk: 8, max_num_draft_tokens: 64 });
        let cfg = GoodputConfig { probe_budget: 0.0, tree, verify: VerifyMode::PerRequest, min_survival, ..GoodputConfig::default() };
        GoodputPolicy::new(cfg, 3, vec![(0..=3).collect()])
    }

    #[test]
    fn per_request_budgets_draft_trees_whose_node_counts_the_stop_cuts() {
        for (ms, want) in [(MinSurvival::Fixed(0.25), Some(0.25f32)), (MinSurvival::Off, None)] {
            let mut p = per_request_policy(ms);
            train_chains(&mut p, 1, 1e-6);
            let d = p.decide_requests(0, 1, 1, 1, 1000, None, Some(&[7]));
            let shape = d.tree.expect("per-request budgets no longer rule trees out");
            assert_eq!((d.steps, &d.verify), (shape.depth, &VerifyShape::Uniform));
            assert_eq!(d.confidence_stop.map(|c| c.min_survival), want, "{ms:?}");
            // the report: the request verified 3 kept nodes and accepted 2 of them; it teaches
            // the tree planner, never the chain estimates or the confidence calibration
            let verifies = p.acceptance.observed();
            let r = [RequestVerify { id: 7, steps: 3, accepted: 2, draft_probs: None }];
            p.observe_requests(0, 1, 1, shape.depth, &r, Some(secs(1, 4, 1e-6)), 1000, None);
            assert_eq!(p.tree_iterations(), 1);
            assert_eq!(p.acceptance.observed(), verifies);
        }
    }

    #[test]
    fn a_tree_report_with_node_confidences_feeds_the_calibration() {
        // Per request the verified nodes' path confidences, the accepted path first: with a
        // node threshold the calibration learns them (the chain estimates still do not);
        // with min_survival off nothing reads the calibration and it is left alone.
        for (ms, learns) in [(MinSurvival::Auto, true), (MinSurvival::Fixed(0.25), true), (MinSurvival::Off, false)] {
            let mut p = per_request_policy(ms);
            train_chains(&mut p, 1, 1e-6);
            let d = p.decide_requests(0, 1, 1, 1, 1000, None, Some(&[7]));
            let shape = d.tree.expect("a tree at batch 1");
            let before = p.confidence.clone();
            let verifies = p.acceptance.observed();
            let nodes = [0.9, 0.5, 0.3, 0.05];
            let r = [RequestVerify { id: 7, steps: 4, accepted: 1, draft_probs: Some(&nodes) }];
            p.observe_requests(0, 1, 1, shape.depth, &r, Some(secs(1, 5, 1e-6)), 1000, None);
            assert_eq!(p.tree_iterations(), 1);
            assert_eq!(p.acceptance.observed(), verifies);
            assert_eq!(p.confidence != before, learns, "{ms:?}");
        }
    }

    #[test]
    fn auto_node_threshold_follows_the_price_of_a_verify_token() {
        let m = ConfidenceModel::new(64);
        // free verify tokens (memory-bound): every node pays, no rule
        assert_eq!(node_threshold(&m, 0.0, 3.0, 0.01), None);
        assert_eq!(node_threshold(&m, 1e-9, 3.0, 0.01), None);
        // dearer tokens keep fewer nodes: a higher threshold, never above bin 0's edge
        let cheap = node_threshold(&m, 1e-4, 3.0, 0.01).expect("a token costs 3 % of a token");
        let dear = node_threshold(&m, 1e-3, 3.0, 0.01).expect("a token costs 30 % of a token");
        assert!(cheap < dear && dear <= edge(1), "{cheap} {dear}");
        // the calibrated survival at the threshold is below the price, above it just before
        let price = 1e-3 * 3.0 / 0.01;
        let t = crate::goodput::confidence::edge_index(dear);
        assert_eq!(m.node_edge(price), t);
        // with the calibration's prior (a calibrated drafter) survival ~ confidence
        assert!((dear / price).ln().abs() < 0.7, "{dear} vs {price}");
        // auto on the policy: cheap tokens at batch 1, the threshold (if any) is the rule's
        let mut p = per_request_policy(MinSurvival::Auto);
        train_chains(&mut p, 1, 1e-6);
        let d = p.decide_requests(0, 1, 1, 1, 1000, None, Some(&[7]));
        assert!(d.tree.is_some());
        assert!(d.confidence_stop.map_or(true, |c| c.min_survival > 0.0 && c.min_survival < 1.0));
    }
}
