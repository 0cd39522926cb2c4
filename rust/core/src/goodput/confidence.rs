//! The confidence stop's threshold (`"min_survival"`, issue 28): which cumulative draft
//! probability the worker stops verifying below, chosen each iteration before drafting.
//!
//! DSpark (vLLM PR #47808) admits, after drafting, a global top-B of draft positions by survival
//! probability, `B* = argmax (bonus tokens + sum of survival) / (draft cost + verify cost[T + B])`.
//! A threshold on the cumulative draft probability `c_j = q_1 ... q_j` (the product of the
//! drafter's probabilities of its drafted tokens up to position `j`) admits the same set once the
//! threshold is the B*-th largest survival, and the worker can apply it on the device without a
//! second crossing (the contract in [`crate::decision::ConfidenceStop`]). Since the core speaks
//! before drafting, it chooses the threshold from what past iterations showed:
//!
//! - **occupancy** `f_j(bin)`: how the cumulative draft probability of position `j` is spread
//!   over log-spaced bins (factor `2^(1/4)` per bin), decayed. Positions cut by the rule are
//!   not reported; each is spread over the bins below the threshold that cut it as the row
//!   already spreads there (learned when no rule or a lower one ran), or counted just below the
//!   threshold where the row has nothing there. Counting every cut position just below the
//!   threshold (as before) underrated the share of accepted drafts the running rule keeps
//!   (BENCHMARKS.md, "Issue 28: why the per-request stop falls short", fault 4).
//!   A position seen too rarely is extrapolated from the one before, shifted by the shared
//!   conditional rate (the mean draft probability tracks it).
//! - **calibration** `s(bin)`: the share of reported positions in a bin that survived (all drafts
//!   up to them accepted), shrunk toward the bin's own cumulative probability (a calibrated
//!   drafter; EAGLE-2 reports draft confidence close to the acceptance rate) and made
//!   non-increasing as the probability falls.
//!
//! For a depth `k` and a threshold at bin edge `t`, a request verifies `sum_{j<k} P_j(t)` drafts
//! and keeps the share `sum_{j<k} Q_j(t) / sum_{j<k} Q_j(all)` of its accepted drafts (prefix
//! sums of `f_j` and `f_j s` over the bins above the threshold; the prefix property holds since
//! `c_j` falls with `j`), applied to the batch-level expected tokens at depth `k`. The strategy
//! scores each (depth, threshold) with the cost model in tokens ([`super::per_request`]) and keeps
//! the best threshold per depth; "no rule" is scored exactly as the batch-level strategy scores
//! the depth, so where cutting verify tokens saves nothing (memory-bound) the decision is the
//! batch-level one.

use super::per_request::DraftCost;

/// Bins of the cumulative draft probability: bin `b` holds `c` in `(e^{-(b+1)W}, e^{-bW}]`,
/// the last one everything below.
pub const BINS: usize = 48;
/// Width of a bin in `-ln c` (a factor `2^(1/4)`; a factor `sqrt 2` set the stop's threshold too
/// coarsely: on mixed-128 at batch 128 the best verify depth fell between two edges that kept
/// 62 % and 85 % of the drafts).
pub const WIDTH: f64 = std::f64::consts::LN_2 / 4.0;
/// Pseudo-observations that shrink a calibration bin toward its own probability.
const CAL_PRIOR: f64 = 4.0;
/// Least relative gain of a rule over no rule for the rule to be chosen.
const RULE_MARGIN: f64 = 0.01;
/// Observations of a position below which its occupancy is extrapolated from the one before.
const MIN_SEEN: f64 = 4.0;

/// The bin of cumulative draft probability `c`.
#[inline]
pub fn bin(c: f64) -> usize {
    if c.is_nan() || c <= 0.0 {
        return BINS - 1;
    }
    ((-c.ln() / WIDTH).max(0.0) as usize).min(BINS - 1)
}

/// The threshold that admits bins `0..t` (`t < BINS`): `c >= e^{-tW}`.
#[inline]
pub fn edge(t: usize) -> f64 {
    (-(t as f64) * WIDTH).exp()
}

/// The bin edge nearest a fixed threshold `tau` (bins `0..t` admitted).
pub fn edge_index(tau: f64) -> usize {
    ((-tau.ln() / WIDTH).round().max(0.0) as usize).min(BINS)
}

/// What the strategy learned of draft confidence (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct ConfidenceModel {
    /// Per draft position, decayed counts per bin.
    occupancy: Vec<[f64; BINS]>,
    /// Per bin, `(reported positions, of which survived)`, decayed.
    calibration: [(f64, f64); BINS],
    decay: f64,
}

/// The best threshold at one depth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cut {
    /// Bins admitted (`BINS`: no rule).
    pub edge: usize,
    /// Fraction of the depth's verify tokens kept (`0..=1`).
    pub kept: f64,
    /// Expected accepted drafts per request.
    pub accepted: f64,
}

impl ConfidenceModel {
    /// Counts decayed by `1 - 1/window` per iteration.
    pub fn new(window: u32) -> Self {
        ConfidenceModel {
            occupancy: Vec::new(),
            calibration: [(0.0, 0.0); BINS],
            decay: 1.0 - 1.0 / f64::from(window.max(1)),
        }
    }

    /// Learns one iteration at depth `steps`: per request its verified length, accepted drafts and
    /// the drafter's probabilities of its verified drafts (`None`: not reported, skipped), and the
    /// bin edge of the rule the iteration ran (`None`: no rule, so a request that verified fewer
    /// than `steps` was cut by its budget, which says nothing of its confidence).
    pub fn observe<'a>(
        &mut self,
        steps: u32,
        requests: impl IntoIterator<Item = (u32, i64, Option<&'a [f64]>)>,
        rule: Option<usize>,
    ) {
        let d = steps as usize;
        if self.occupancy.len() < d {
            self.occupancy.resize(d, [0.0; BINS]);
        }
        for row in &mut self.occupancy {
            row.iter_mut().for_each(|x| *x *= self.decay);
        }
        // the calibration decays per iteration too, slower (it is shared by every position)
        let slow = self.decay.sqrt();
        self.calibration
            .iter_mut()
            .for_each(|c| *c = (c.0 * slow, c.1 * slow));
        for (v, accepted, probs) in requests {
            let Some(q) = probs else { continue };
            let v = (v as usize).min(q.len()).min(d);
            let mut c = 1.0;
            for (j, &p) in q[..v].iter().enumerate() {
                c *= p;
                let b = bin(c);
                self.occupancy[j][b] += 1.0;
                let cal = &mut self.calibration[b];
                cal.0 += 1.0;
                cal.1 += if (j as i64) < accepted { 1.0 } else { 0.0 };
            }
            if let Some(t) = rule.filter(|&t| t < BINS) {
                // a cut position lies somewhere below the threshold: spread it over the bins
                // below as the row's spread there says (learned when no rule or a lower one
                // ran), or just below the threshold if the row has nothing there
                for row in &mut self.occupancy[v..d] {
                    let below: f64 = row[t..].iter().sum();
                    if below > 1e-9 {
                        let f = (below + 1.0) / below;
                        row[t..].iter_mut().for_each(|x| *x *= f);
                    } else {
                        row[t] += 1.0;
                    }
                }
            }
        }
    }

    /// Learns one draft tree's outcome (issue 29 item 5): per request, its accepted drafts
    /// and the path confidences of the nodes it verified (`None`: not reported, skipped), the
    /// accepted path's `accepted` nodes first. Each node counts in the calibration bin of its
    /// path confidence, as survived iff it is on the accepted path: a node survives iff every
    /// node of its path is accepted, as a chain position does, and its path confidence is the
    /// cumulative draft probability along that path, so the one calibration serves the chain's
    /// stop and the node threshold ([`Self::node_edge`]). The per-position occupancy is left
    /// alone: a tree's nodes per depth are not a chain's positions. The calibration decays by
    /// the same per-iteration factor as under [`Self::observe`].
    pub fn observe_nodes<'a>(&mut self, requests: impl IntoIterator<Item = (i64, Option<&'a [f64]>)>) {
        let slow = self.decay.sqrt();
        self.calibration
            .iter_mut()
            .for_each(|c| *c = (c.0 * slow, c.1 * slow));
        for (accepted, confidences) in requests {
            let Some(c) = confidences else { continue };
            for (j, &c) in c.iter().enumerate() {
                let cal = &mut self.calibration[bin(c)];
                cal.0 += 1.0;
                cal.1 += if (j as i64) < accepted { 1.0 } else { 0.0 };
            }
        }
    }

    /// Per bin, the decayed `(reported, survived)` counts the calibration learned.
    pub fn calibration(&self) -> &[(f64, f64); BINS] {
        &self.calibration
    }

    /// Calibrated survival per bin (non-increasing).
    fn survival(&self) -> [f64; BINS] {
        let mut s = [0.0; BINS];
        let mut cap = 1.0f64;
        for (b, (&(n, ok), out)) in self.calibration.iter().zip(s.iter_mut()).enumerate() {
            let prior = (-(b as f64 + 0.5) * WIDTH).exp();
            cap = cap.min((ok + CAL_PRIOR * prior) / (n + CAL_PRIOR));
            *out = cap;
        }
        s
    }

    /// Whether position 1 has been seen enough to choose a threshold.
    pub fn ready(&self) -> bool {
        self.occupancy
            .first()
            .is_some_and(|r| r.iter().sum::<f64>() >= MIN_SEEN)
    }

    /// The best threshold at each depth `0..=max_depth` for a batch of `b` requests, given the
    /// shared conditional rates `alpha` (for positions seen too rarely) and `seconds(verify_depth,
    /// unverified)`: the predicted seconds when a request verifies `verify_depth` drafts on
    /// average and `unverified` drafted tokens per request are not verified. `none[k]` is the
    /// expected tokens per request at depth `k` with no rule (the batch-level estimate), the
    /// score a cut must beat. Returns `None` before position 1 was seen.
    pub fn best_cuts(
        &self,
        alpha: &[f64],
        max_depth: usize,
        none: &[f64],
        seconds: impl Fn(usize, f64, f64) -> f64,
    ) -> Option<Vec<Cut>> {
        if !self.ready() || max_depth == 0 {
            return None;
        }
        let s = self.survival();
        // prefix sums over bins per position: P (kept) and Q (kept survival)
        let mut rows: Vec<[f64; BINS]> = Vec::with_capacity(max_depth);
        for j in 0..max_depth {
            let seen = self.occupancy.get(j).map_or(0.0, |r| r.iter().sum::<f64>());
            let row = if seen >= MIN_SEEN {
                self.occupancy[j].map(|x| x / seen)
            } else {
                // shift the previous position's spread down by its conditional rate
                let prev = rows[j - 1];
                let shift = -alpha.get(j).copied().unwrap_or(0.5).clamp(1e-3, 1.0).ln() / WIDTH;
                let (whole, frac) = (shift.floor() as usize, shift.fract());
                let mut row = [0.0; BINS];
                for (b, &x) in prev.iter().enumerate() {
                    row[(b + whole).min(BINS - 1)] += x * (1.0 - frac);
                    row[(b + whole + 1).min(BINS - 1)] += x * frac;
                }
                row
            };
            rows.push(row);
        }
        let mut p = vec![[0.0; BINS + 1]; max_depth];
        let mut q = vec![[0.0; BINS + 1]; max_depth];
        for j in 0..max_depth {
            for b in 0..BINS {
                p[j][b + 1] = p[j][b] + rows[j][b];
                q[j][b + 1] = q[j][b] + rows[j][b] * s[b];
            }
        }
        let mut out = vec![Cut {
            edge: BINS,
            kept: 1.0,
            accepted: 0.0,
        }];
        for k in 1..=max_depth {
            let e = none.get(k).copied().unwrap_or(1.0);
            let no_rule = (
                e / seconds(k, k as f64, 0.0),
                Cut {
                    edge: BINS,
                    kept: 1.0,
                    accepted: e - 1.0,
                },
            );
            let mut best = (0.0, no_rule.1);
            // A rule keeps the share acc(t) / acc(all) of the accepted drafts the calibration
            // expects without it, applied to the batch-level estimate: both rows then count
            // tokens alike, and a rule wins only by the seconds it saves.
            let all: f64 = (0..k).map(|j| q[j][BINS]).sum();
            if all <= 0.0 {
                out.push(no_rule.1);
                continue;
            }
            // edge 0 would admit nothing and is no threshold in (0, 1)
            for t in 1..BINS {
                let kept: f64 = (0..k).map(|j| p[j][t]).sum();
                let acc = (e - 1.0) * (0..k).map(|j| q[j][t]).sum::<f64>() / all;
                let g = (1.0 + acc) / seconds(k, kept, k as f64 - kept);
                if g > best.0 {
                    best = (
                        g,
                        Cut {
                            edge: t,
                            kept: kept / k as f64,
                            accepted: acc,
                        },
                    );
                }
            }
            // a rule must beat no rule by a margin: its tokens come from another estimate than
            // the batch-level ones, and a rule that saves almost nothing is not worth that doubt
            out.push(if best.0 > no_rule.0 * (1.0 + RULE_MARGIN) {
                best.1
            } else {
                no_rule.1
            });
        }
        Some(out)
    }

    /// The node threshold of a draft tree under per-request budgets (issue 29 item 5,
    /// [`super::tree_plan`]): the bins `0..t` whose calibrated survival is at least `price` (the
    /// goodput-neutral survival of one more verified node, in tokens), so the worker keeps a node
    /// iff its path's cumulative draft probability is `>= edge(t)`. The same calibration as the
    /// chain's stop (one model: a tree node's path probability is a chain position's cumulative
    /// probability along that path). Returns `t` in `1..=BINS` (`BINS`: every bin is worth its
    /// price, no rule); bin 0 (`c >= 0.71`) is always kept, so a request never verifies fewer
    /// nodes than a confident chain would.
    pub fn node_edge(&self, price: f64) -> usize {
        let s = self.survival();
        (1..BINS).find(|&t| s[t] < price).unwrap_or(BINS)
    }

    /// The cut at depth `k` with the threshold fixed at bin edge `t`.
    pub fn cut_at(&self, k: usize, t: usize) -> Option<Cut> {
        if !self.ready() {
            return None;
        }
        let s = self.survival();
        let (mut kept, mut acc) = (0.0, 0.0);
        for j in 0..k {
            let Some(row) = self.occupancy.get(j) else {
                break;
            };
            let seen: f64 = row.iter().sum();
            if seen < MIN_SEEN {
                break;
            }
            for b in 0..t.min(BINS) {
                kept += row[b] / seen;
                acc += row[b] / seen * s[b];
            }
        }
        Some(Cut {
            edge: t,
            kept: kept / k.max(1) as f64,
            accepted: acc,
        })
    }
}

/// The confidence stop's row of each candidate depth for the `goodput` strategy: `Some((cut,
/// seconds))` where a rule beats no rule (or a fixed threshold `fixed` is set), `None` where the
/// batch-level row stands. `uniform[k]` are the cost model's seconds of a uniform iteration at
/// depth `k` (`0..=max candidate`), `draft` the drafter's terms beyond the verify (every request
/// drafts `k` under a stop), `b` the batch size, `none[k]` the batch-level expected tokens per
/// request at depth `k`. `learned(k, v)`: the factor the shortened iterations' own cells put on
/// that price at depth `k` with `v < k` drafts verified per request ([`super::shortened`]; 1
/// where none was measured).
#[allow(clippy::too_many_arguments)]
pub fn stop_rows(
    model: &ConfidenceModel,
    alpha: &[f64],
    candidates: &[u32],
    uniform: &[f64],
    draft: DraftCost,
    b: f64,
    none: &[f64],
    fixed: Option<f64>,
    learned: impl Fn(u32, f64) -> f64,
) -> Vec<Option<(Cut, f64)>> {
    let d_max = uniform.len().saturating_sub(1);
    // seconds with `verified` drafts verified per request on average (every request drafts `k`)
    let seconds = |k: usize, verified: f64, _unverified: f64| {
        let (lo, frac) = (verified.floor() as usize, verified.fract());
        let priced = uniform[lo.min(k)] * (1.0 - frac) + uniform[(lo + 1).min(k)] * frac + draft.extra(b, k as u32, b, verified * b);
        if verified < k as f64 {
            priced * learned(k as u32, verified)
        } else {
            priced
        }
    };
    let cuts: Option<Vec<Cut>> = match fixed {
        Some(tau) => {
            let t = edge_index(tau);
            (0..=d_max).map(|k| model.cut_at(k, t)).collect()
        }
        None => model.best_cuts(alpha, d_max, none, seconds),
    };
    candidates
        .iter()
        .map(|&k| {
            let k = k as usize;
            let c = *cuts.as_ref()?.get(k)?;
            let keep = k > 0 && (c.edge < BINS || fixed.is_some());
            keep.then(|| (c, seconds(k, c.kept * k as f64, k as f64 * (1.0 - c.kept))))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_and_edges_agree() {
        assert_eq!(bin(1.0), 0);
        assert_eq!(bin(0.9), 0); // -ln 0.9 = 0.105 < W = 0.173
        assert_eq!(bin(0.8), 1);
        assert_eq!(bin(0.5), 4);
        assert_eq!(bin(0.0), BINS - 1);
        for t in 1..BINS {
            // the edge admits exactly the bins above it
            assert_eq!(bin(edge(t) * 1.0001), t - 1);
            assert_eq!(bin(edge(t) * 0.9999), t);
        }
        assert_eq!(edge_index(0.5), 4);
    }

    /// A position the rule cut is spread over the bins below the threshold as the row spreads
    /// there, not counted just below the threshold (fault 4 of BENCHMARKS.md, "Issue 28: why
    /// the per-request stop falls short"); a row with nothing below the threshold counts it
    /// just below.
    #[test]
    fn a_cut_position_is_spread_over_the_bins_below_the_threshold() {
        let mut m = ConfidenceModel::new(64);
        // position 2's cumulative probability: 0.81 (bin 1) or 0.1 (bin 13), equally often
        for _ in 0..50 {
            m.observe(2, [(2, 2, Some(&[0.9, 0.9][..])), (2, 0, Some(&[0.5, 0.2][..]))], None);
        }
        let (t, low) = (edge_index(0.42), bin(0.1));
        assert!(bin(0.81) < t && bin(0.5) < t && t < low, "{t} {low}");
        let before = m.occupancy[1];
        // a rule at edge `t` cut position 2 of one request (reported: position 1 only)
        m.observe(2, [(1, 0, Some(&[0.5][..]))], Some(t));
        let row = m.occupancy[1];
        assert!(row[t] < 1e-9, "counted just below the threshold: {row:?}");
        assert!((row[low] - before[low] * m.decay - 1.0).abs() < 1e-9, "{} -> {}", before[low], row[low]);
        assert!((row[bin(0.81)] - before[bin(0.81)] * m.decay).abs() < 1e-9);
        // nothing below the threshold yet: just below it
        let mut fresh = ConfidenceModel::new(64);
        fresh.observe(2, [(1, 0, Some(&[0.5][..]))], Some(t));
        assert_eq!(fresh.occupancy[1][t], 1.0);
    }

    /// Tree reports move the node threshold: nodes of confidence 0.9, 0.6 and 0.45 (bins 0, 2
    /// and 4) always accepted and nodes of 0.1 (bin 13) never raise the calibrated survival of
    /// bin 4 from its prior 0.46 to about 1 (bins 1 and 3, never seen, keep theirs, and the
    /// survival is made non-increasing), so at price 0.5 the threshold admits bin 4 too (edge 5;
    /// the prior, a calibrated drafter, stops at edge 4); an overconfident drafter's rejected
    /// nodes of 0.9 lower it to the least threshold (edge 1). The accepted path's nodes are the first
    /// `accepted` of each request; the occupancy (a chain's positions) is untouched.
    #[test]
    fn tree_nodes_calibrate_the_node_threshold() {
        let mut m = ConfidenceModel::new(64);
        assert_eq!(m.node_edge(0.5), 4);
        let path = [0.9, 0.6, 0.45, 0.1, 0.1];
        for _ in 0..100 {
            m.observe_nodes([(3, Some(&path[..])), (0, None)]);
        }
        let s = m.survival();
        assert!(s[0] > 0.9 && s[4] > 0.5 && s[13] < 0.1, "{s:?}");
        assert_eq!(m.node_edge(0.5), 5);
        assert!(m.occupancy.is_empty() && !m.ready());
        // the order says which were accepted: with 1 accepted, 0.6 and 0.45 were rejected
        let mut once = ConfidenceModel::new(64);
        once.observe_nodes([(1, Some(&path[..]))]);
        assert_eq!((once.calibration[0], once.calibration[2], once.calibration[4]), ((1.0, 1.0), (1.0, 0.0), (1.0, 0.0)));
        let mut over = ConfidenceModel::new(64);
        for _ in 0..100 {
            over.observe_nodes([(0, Some(&[0.9, 0.9][..]))]);
        }
        assert_eq!(over.node_edge(0.5), 1);
    }

    /// Two kinds of requests: confident ones (draft probability 0.97, all accepted; cumulative
    /// 0.885 at position 4, still bin 0) and doubtful
    /// ones (0.2, none accepted). When a verify token costs as much as the iteration's base, the
    /// best threshold admits the confident drafts only; when verify tokens are free, no rule.
    #[test]
    fn the_threshold_separates_confident_from_doubtful_drafts_where_tokens_cost() {
        let mut m = ConfidenceModel::new(64);
        let (hi, lo) = ([0.97; 4], [0.2; 4]);
        for _ in 0..200 {
            m.observe(4, [(4, 4, Some(&hi[..])), (4, 0, Some(&lo[..]))], None);
        }
        let alpha = [0.5; 4];
        let none = [1.0, 1.5, 2.0, 2.5, 3.0]; // what the data say: half the requests accept everything
        let dear = |_k: usize, verified: f64, _u: f64| 1.0 + verified;
        let cuts = m.best_cuts(&alpha, 4, &none, dear).unwrap();
        let c = cuts[4];
        assert!(c.edge < BINS && (c.kept - 0.5).abs() < 1e-9, "{c:?}");
        assert!((c.accepted - 0.5 * 4.0 * 0.97).abs() < 0.3, "{c:?}");
        assert!(
            edge(c.edge) > 0.2f64.powi(1) && edge(c.edge) <= 0.97f64.powi(4),
            "{}",
            edge(c.edge)
        );
        let free = |_k: usize, _v: f64, _u: f64| 1.0;
        assert_eq!(m.best_cuts(&alpha, 4, &none, free).unwrap()[4].edge, BINS);
        // positions cut by a rule count just below it
        let mut m2 = ConfidenceModel::new(64);
        for _ in 0..50 {
            m2.observe(3, [(1, 1, Some(&hi[..1]))], Some(3));
        }
        let cut = m2.cut_at(3, 3).unwrap();
        assert!((cut.kept - 1.0 / 3.0).abs() < 1e-9, "{cut:?}");
    }
}
