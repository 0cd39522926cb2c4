//! Draft trees in the `goodput` decision (issue 29): the acceptance of an EAGLE-2 dynamic tree of
//! shape (depth `D`, top-k `K`, `N` nodes) from a per-position top-k acceptance profile.
//!
//! **The top-k profile.** At a draft position whose chain (top-1) acceptance is `alpha`, the
//! probability that the target's token is among the drafter's top `k` candidates is modelled as
//!
//! ```text
//! hit(alpha, k) = 1 - (1 - alpha) k^(-TOPK_EXPONENT)
//! ```
//!
//! (`hit(alpha, 1) = alpha`; the miss falls as a power of `k`, so each extra child adds less).
//! The exponent 0.5 is fitted to published figures, not measured here: Medusa (arXiv 2401.10774,
//! fig. 3) reads its first head's top-1 accuracy near 0.6 and top-5 near 0.8 (miss 0.4 -> 0.2 at
//! `k = 5`: exponent 0.43); with it, an EAGLE-like rate of 0.8 per position gives trees of
//! `K = 8`, `N = 32..64`, `D = 6` an acceptance length 25-35 % above the chain of the same depth,
//! the range EAGLE-2 (arXiv 2406.16858, table 1: acceptance length 4.83 against EAGLE-1's 3.57
//! on MT-bench, Vicuna 7B, T=0) and the issue quote (20-40 %). The rule is a prior: the policy
//! learns each shape's acceptance from its reports ([`TreeAcceptance`]).
//!
//! **The tree.** EAGLE-2 (and SGLang's `organize_draft_results`) grows the tree level by level:
//! the root's top `K` children form level 1; each level's `K` best nodes by cumulative score
//! (the product of its path's probabilities) are expanded by their top `K` children, and the `K^2`
//! candidates of the next level all enter the pool, the best `K` of them forming its frontier.
//! After `D` levels the best `N` nodes of the pool are verified. A node's value (the probability
//! that the target follows its path) never exceeds its parent's, so the best `N` form a subtree,
//! and since the target follows at most one child of each node, `P(accepted >= j)` is the sum of
//! the values of the kept nodes at level `j`: the tree's *survival*. The expected accepted
//! drafts are its sum (the chain's formula when `K = 1`, `N = D`).

use crate::decision::TreeShape;

/// Exponent of the top-k miss rate (module docs).
pub const TOPK_EXPONENT: f64 = 0.5;

/// `hit(alpha, k)`: probability that the target's token is among the drafter's top `k` at a
/// position of chain acceptance `alpha` (module docs); 0 for `k = 0`.
#[inline]
pub fn topk_hit(alpha: f64, k: u32, exponent: f64) -> f64 {
    if k == 0 {
        return 0.0;
    }
    let a = alpha.clamp(0.0, 1.0);
    1.0 - (1.0 - a) * f64::from(k).powf(-exponent)
}

/// The pool of an EAGLE-2 beam of width `topk` over `alpha.len()` levels (module docs): every
/// candidate node as `(value, level)`, level 1-based, sorted by value descending (a parent before
/// its children on ties). `exponent`: the top-k profile's ([`TOPK_EXPONENT`] for the policy's
/// prior). Allocates `out` to about `topk + (levels - 1) topk^2` entries.
pub fn beam_pool(alpha: &[f64], topk: u32, exponent: f64, out: &mut Vec<(f64, u32)>) {
    out.clear();
    let k = topk.max(1) as usize;
    let mut frontier = vec![1.0f64];
    let mut cands: Vec<f64> = Vec::with_capacity(k * k);
    for (j, &a) in alpha.iter().enumerate() {
        let probs: Vec<f64> = (1..=k as u32)
            .map(|r| topk_hit(a, r, exponent) - topk_hit(a, r - 1, exponent))
            .collect();
        cands.clear();
        for &f in &frontier {
            cands.extend(probs.iter().map(|p| f * p));
        }
        cands.sort_by(|x, y| y.total_cmp(x));
        out.extend(cands.iter().map(|&v| (v, j as u32 + 1)));
        frontier.clear();
        frontier.extend(cands.iter().take(k));
    }
    out.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
}

/// Survival `P(accepted >= j)`, `j = 1..=depth`, of the tree that keeps the best `n` nodes of
/// levels `1..=depth` of `pool` ([`beam_pool`]), into `out[..depth]` (`out` at least `depth`
/// long; entries beyond are left alone). Returns the expected accepted drafts (their sum).
pub fn survival(pool: &[(f64, u32)], depth: u32, n: u32, out: &mut [f64]) -> f64 {
    let d = depth as usize;
    out[..d].iter_mut().for_each(|s| *s = 0.0);
    let mut kept = 0;
    for &(v, level) in pool {
        if kept == n {
            break;
        }
        if level <= depth {
            out[level as usize - 1] += v;
            kept += 1;
        }
    }
    // A sum of disjoint events' probabilities: at most 1 (rounding aside).
    out[..d].iter_mut().for_each(|s| *s = s.min(1.0));
    out[..d].iter().sum()
}

/// Nodes of the pool of a beam of width `topk` and depth `depth`: the most a tree of that shape
/// can verify (`topk + (depth - 1) topk^2`, within the full tree's `topk + ... + topk^depth`).
pub fn pool_size(depth: u32, topk: u32) -> u32 {
    if depth == 0 {
        return 0;
    }
    let k = topk.max(1);
    k.saturating_add((depth - 1).saturating_mul(k.saturating_mul(k)))
}

/// The shapes the policy chooses among, for depths `depths` (each > 0), within `max_topk` and
/// `max_num_draft_tokens`: top-k in the powers of two below `max_topk` and `max_topk` itself
/// (>= 2), node counts in the powers of two above the depth, the pool's size and the bound. A
/// chain is not a tree shape (the chain's steps are the slot's candidates).
pub fn candidate_shapes(
    depths: &[u32],
    max_topk: u32,
    max_num_draft_tokens: u32,
) -> Vec<TreeShape> {
    let mut topks: Vec<u32> = (1..5)
        .map(|p| 1u32 << p)
        .filter(|&k| k < max_topk)
        .collect();
    if max_topk >= 2 {
        topks.push(max_topk);
    }
    let mut out = Vec::new();
    for &depth in depths.iter().filter(|&&d| d > 0) {
        for &topk in &topks {
            let bound = pool_size(depth, topk).min(max_num_draft_tokens);
            let mut ns: Vec<u32> = (1..7)
                .map(|p| 1u32 << p)
                .filter(|&n| n > depth && n < bound)
                .collect();
            if bound > depth {
                ns.push(bound);
            }
            out.extend(ns.into_iter().map(|num_draft_tokens| TreeShape {
                depth,
                topk,
                num_draft_tokens,
            }));
        }
    }
    out.sort_by_key(|s| (s.depth, s.topk, s.num_draft_tokens));
    out.dedup();
    out
}

/// Pseudo prior-predicted drafts of a shape's learned ratio (held at the calibration).
pub const PRIOR_DRAFTS: f64 = 32.0;
/// Pseudo accepted drafts that hold the calibration ratio at 1.
const CALIBRATION_PRIOR: f64 = 32.0;

/// Learned acceptance of the tree shapes from reports (a tree's report is a chain's: the
/// accepted path's length `a <= depth` per request). Per shape, a *ratio* to the prior: decayed
/// sums of accepted drafts and of the prior's predictions for those requests, shrunk toward one
/// calibration ratio shared by all shapes (accepted over prior-predicted drafts on every tree
/// report). A shape's estimate is its ratio times the prior *now*, so when the chain rates move
/// (another request class, a weaker phase) every shape follows at once, a shape not run since
/// keeping what it said about the prior's bias rather than the acceptance of another time (with
/// absolute sums, a shape last run in a weak phase kept its low figure until it ran again, which
/// it then never did: BENCHMARKS.md, issue 29's policy floor); a shape never run follows what
/// the run ones say about the prior's bias.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeAcceptance {
    shapes: Vec<TreeShape>,
    /// `(accepted drafts, prior-predicted drafts)` per shape, decayed.
    learned: Vec<(f64, f64)>,
    /// `(accepted drafts, prior-predicted drafts)` over every tree report, decayed.
    calibration: (f64, f64),
    decay: f64,
}

impl TreeAcceptance {
    /// For `shapes`, sums decayed by `1 - 1/window` per tree report.
    pub fn new(shapes: Vec<TreeShape>, window: u32) -> Self {
        let n = shapes.len();
        TreeAcceptance {
            shapes,
            learned: vec![(0.0, 0.0); n],
            calibration: (0.0, 0.0),
            decay: 1.0 - 1.0 / f64::from(window.max(1)),
        }
    }

    /// The shapes, in the order of [`Self::expected`]'s index.
    pub fn shapes(&self) -> &[TreeShape] {
        &self.shapes
    }

    /// Index of `shape` among the shapes.
    pub fn index(&self, shape: TreeShape) -> Option<usize> {
        self.shapes.iter().position(|&s| s == shape)
    }

    /// The calibration ratio (accepted over the prior's prediction, shrunk toward 1).
    pub fn calibration(&self) -> f64 {
        let (obs, pred) = self.calibration;
        ((obs + CALIBRATION_PRIOR) / (pred + CALIBRATION_PRIOR)).clamp(0.25, 4.0)
    }

    /// Expected accepted drafts per request of shape `i` given its prior `prior` (accepted
    /// drafts the top-k profile predicts from the chain rates now): `prior` times the shape's
    /// ratio, at most its depth.
    pub fn expected(&self, i: usize, prior: f64) -> f64 {
        let (acc, pred) = self.learned[i];
        let w = PRIOR_DRAFTS;
        (prior * (acc + w * self.calibration()) / (pred + w)).min(f64::from(self.shapes[i].depth))
    }

    /// Records one tree iteration of shape `i`: accepted drafts per request (`accepted[r]`, in
    /// `0..=depth`, checked by the caller), the prior's prediction per request `prior`.
    pub fn observe(&mut self, i: usize, accepted: &[i64], prior: f64) {
        let n = accepted.len() as f64;
        let sum: f64 = accepted.iter().map(|&a| a.max(0) as f64).sum();
        let d = self.decay;
        let (a, p) = &mut self.learned[i];
        *a = *a * d + sum;
        *p = *p * d + prior * n;
        let (o, p) = &mut self.calibration;
        *o = *o * d + sum;
        *p = *p * d + prior * n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected(alpha: &[f64], depth: u32, topk: u32, n: u32) -> f64 {
        let mut pool = Vec::new();
        beam_pool(&alpha[..depth as usize], topk, TOPK_EXPONENT, &mut pool);
        let mut s = vec![0.0; depth as usize];
        survival(&pool, depth, n, &mut s)
    }

    #[test]
    fn a_top1_tree_is_the_chain() {
        let alpha = [0.8, 0.7, 0.75, 0.6];
        let chain: f64 = (1..=4).map(|i| alpha[..i].iter().product::<f64>()).sum();
        assert!((expected(&alpha, 4, 1, 4) - chain).abs() < 1e-12);
        let mut pool = Vec::new();
        beam_pool(&alpha, 1, TOPK_EXPONENT, &mut pool);
        let mut s = [0.0; 4];
        survival(&pool, 4, 4, &mut s);
        assert!((s[1] - 0.8 * 0.7).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn acceptance_grows_with_topk_and_nodes_with_diminishing_returns() {
        let alpha = [0.8; 6];
        let chain = expected(&alpha, 6, 1, 6);
        let e = |k, n| expected(&alpha, 6, k, n);
        assert!(e(2, 12) > chain && e(4, 24) > e(2, 12) && e(8, 48) > e(4, 24));
        assert!(e(4, 16) < e(4, 32) && e(4, 32) < e(4, 64));
        // diminishing: the second doubling of nodes adds less than the first
        assert!(e(8, 64) - e(8, 32) < e(8, 32) - e(8, 16));
        // the EAGLE-2 range: 20-40 % more accepted tokens than the chain of the same depth
        let gain = (1.0 + e(8, 48)) / (1.0 + chain);
        assert!((1.2..1.4).contains(&gain), "gain {gain}");
        // never more than a full-width tree could accept, nor than the depth
        assert!(e(8, 64) < 6.0);
    }

    #[test]
    fn the_best_nodes_form_a_subtree_whose_levels_survive_in_order() {
        let alpha = [0.9, 0.5, 0.7, 0.3, 0.8];
        let mut pool = Vec::new();
        beam_pool(&alpha, 4, TOPK_EXPONENT, &mut pool);
        assert_eq!(pool.len() as u32, pool_size(5, 4));
        for n in [5, 9, 17, 40, 68] {
            let mut s = [0.0; 5];
            survival(&pool, 5, n, &mut s);
            assert!(s.windows(2).all(|w| w[0] >= w[1] - 1e-12), "n {n}: {s:?}");
            assert!(s[0] <= 1.0);
        }
    }

    #[test]
    fn candidate_shapes_respect_the_bounds() {
        let shapes = candidate_shapes(&[0, 1, 3, 7], 8, 64);
        assert!(shapes
            .iter()
            .all(|s| s.depth > 0 && (2..=8).contains(&s.topk)));
        assert!(shapes
            .iter()
            .all(|s| s.num_draft_tokens > s.depth && s.num_draft_tokens <= 64));
        assert!(shapes
            .iter()
            .all(|s| s.num_draft_tokens <= pool_size(s.depth, s.topk)));
        assert!(shapes.contains(&TreeShape {
            depth: 7,
            topk: 8,
            num_draft_tokens: 64
        }));
        assert!(shapes.contains(&TreeShape {
            depth: 1,
            topk: 8,
            num_draft_tokens: 8
        }));
        assert!(
            candidate_shapes(&[3], 1, 64).is_empty(),
            "top-k 1 is chains only"
        );
        let few = candidate_shapes(&[2], 3, 5);
        let t = |topk, num_draft_tokens| TreeShape {
            depth: 2,
            topk,
            num_draft_tokens,
        };
        assert_eq!(few, vec![t(2, 4), t(2, 5), t(3, 4), t(3, 5)]);
    }

    #[test]
    fn learned_acceptance_follows_reports_and_calibrates_unrun_shapes() {
        let shapes = vec![
            TreeShape {
                depth: 3,
                topk: 4,
                num_draft_tokens: 16,
            },
            TreeShape {
                depth: 5,
                topk: 4,
                num_draft_tokens: 32,
            },
        ];
        let mut m = TreeAcceptance::new(shapes, 64);
        assert!((m.expected(0, 2.0) - 2.0).abs() < 1e-12);
        // shape 0 accepts 1 draft per request where the prior said 2
        for _ in 0..200 {
            m.observe(0, &[1; 8], 2.0);
        }
        assert!(
            (m.expected(0, 2.0) - 1.0).abs() < 0.05,
            "{}",
            m.expected(0, 2.0)
        );
        // shape 1 never ran: its prior is halved by the calibration
        assert!(
            (m.expected(1, 3.0) - 1.5).abs() < 0.1,
            "{}",
            m.expected(1, 3.0)
        );
        assert!(m.expected(1, 30.0) <= 5.0);
    }

    #[test]
    fn a_shape_not_run_lately_follows_the_chain_rates() {
        let shape = TreeShape { depth: 4, topk: 4, num_draft_tokens: 16 };
        let mut m = TreeAcceptance::new(vec![shape], 64);
        // a weak phase: the prior said 1.0 and 0.8 were accepted
        for _ in 0..100 {
            m.observe(0, &[1, 1, 0, 1, 1], 1.0);
        }
        assert!((m.expected(0, 1.0) - 0.8).abs() < 0.05, "{}", m.expected(0, 1.0));
        // the chain rates recover (the prior now says 3.0): the estimate follows without a
        // report of the shape, keeping its learned bias
        assert!((m.expected(0, 3.0) - 2.4).abs() < 0.15, "{}", m.expected(0, 3.0));
    }
}
