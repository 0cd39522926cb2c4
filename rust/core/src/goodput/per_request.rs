//! Per-request verify budgets for the `goodput` strategy (`"verify": "per_request"`, issue 28).
//!
//! Each decode iteration the strategy picks the batch's draft depth `D` among the slot's
//! candidates and, for request `r`, a verify length `v_r` in `0..=D` (0: a plain decode through
//! verify, and the request need not draft), maximising expected emitted tokens per second:
//!
//! ```text
//! G(D, v) = (b + sum_r sum_{j <= v_r} S_r(j)) / t(b, D, V = sum_r v_r, drafting requests)
//! ```
//!
//! - `S_r(j)` is request `r`'s survival probability of draft position `j` (all of `1..=j`
//!   accepted), the product of its conditional rates `alpha_rj = clamp(rate_r shape_j)`:
//!   `rate_r` is the request's accepted drafts over the draft positions it reached, shrunk by
//!   `PRIOR_DRAFTS` pseudo-drafts toward the shared position-1 rate ([`super::acceptance`]) times
//!   its *draft confidence* (so a young request follows the shared estimates and, once the
//!   drafter has spoken for it, its confidence); `shape_j` is the shared depth profile
//!   `alpha_j / alpha_1` where it falls (a shared rate that rises with depth reflects the
//!   population's surviving, better requests, not this one; [`PerRequest::multiplier`], the
//!   ratio to what the shared rates expected, is kept for metrics).
//! - The draft confidence is the lagged signal of DSpark (vLLM PR #47808) and SpecDec++: the
//!   drafter's probability of each draft token it proposed in the previous iteration
//!   (`Scheduler::report(draft_probs=)`), mapped through a calibration learned online (acceptance
//!   rate of drafts per probability bin), relative to the mean rate.
//! - `t` is the cost model *in tokens*: the seconds of the uniform iteration with as many verify
//!   tokens (`b + V`: the cost model's prediction interpolated at depth `V / b`, so where the
//!   roofline's knee lies, cutting verify tokens below it saves nothing, and the cells say so),
//!   plus two drafter terms learned online from the per-request iterations' seconds beyond their
//!   uniform equivalent ([`PerRequest::learn_cost`], [`DraftCost`]): the drafted tokens that are
//!   not verified (`D` per request that drafts, minus `V`; a request at `v_r = 0` skips the
//!   drafter) at a cost per token, and the drafter's fixed cost per draft step, paid `D` times
//!   whenever any request drafts (a draft forward's weights and launch do not shrink when fewer
//!   requests draft, where the interpolation at `V / b` charges only `V / b` of them; measured
//!   through the engine on the CPU, BENCHMARKS.md section 29). The uniform cells learn uniform
//!   iterations only ([`super::report`]); a shortened iteration in which every request drafted
//!   (the confidence stop) teaches cells of its own keyed by verify tokens, whose factor a stop
//!   row's price carries ([`super::shortened`]); an allocation's rows are priced without them.
//!
//! For a fixed `D` the best `v` admits draft positions in descending survival order (a global
//! top-N; survival falls with depth, so each request's admitted positions form a prefix), so the
//! search is a sort and one pass. The depth itself goes through the batch-level machinery
//! (switch margin, dwell, probes) with these per-request scores.
//!
//! **Why the decision is made before drafting.** The core speaks once per iteration, before the
//! worker drafts: the plan's KV reservation, `qo_lens` and `out_loc` are laid out from the
//! lengths, so lengths chosen after drafting would need a second crossing or a device-side rule
//! whose KV layout the core no longer owns. The draft confidence therefore arrives one iteration
//! late; a request's confidence changes slowly next to its history (DSpark smooths it with an EMA
//! for the same reason), so the lag costs little, and the plan stays exact (KV reserved only for
//! each request's own `v_r + 1` tokens).

use super::cost::CostModel;
use crate::id_hash::IdMap;

/// Pseudo-drafts of the prior in a request's multiplier (its history outweighs the prior after
/// about this many verified drafts).
const PRIOR_DRAFTS: f64 = 3.0;
/// Bins of the draft-probability calibration.
const BINS: usize = 10;
/// Pseudo-drafts that shrink a calibration bin toward the mean rate.
const BIN_PRIOR: f64 = 8.0;
/// Weight of the newest iteration in a request's smoothed confidence.
const CONF_GAIN: f64 = 0.5;
/// Iterations after which an unseen request's history is dropped.
const FORGET: u64 = 256;
/// Bounds of a per-request conditional rate.
const RATE_BOUNDS: (f64, f64) = (0.01, 0.98);

#[derive(Debug, Clone, Default, PartialEq)]
struct History {
    /// Verified drafts that were accepted, decayed.
    accepted: f64,
    /// Drafts the shared rates expected to be accepted among those reached, decayed.
    expected: f64,
    /// Draft positions reached (verified with all before them accepted), decayed.
    reached: f64,
    /// Calibrated confidence relative to the mean rate (smoothed), if the drafter spoke.
    confidence: Option<f64>,
    /// Iteration last observed.
    seen: u64,
}

/// One request's verify of the iteration, as reported.
#[derive(Debug, Clone, Copy)]
pub struct RequestVerify<'a> {
    pub id: u64,
    /// Draft tokens it verified (`v_r`; a draft tree's: the nodes it verified).
    pub steps: u32,
    /// Of which accepted (`<= steps`).
    pub accepted: i64,
    /// The drafter's probability of each of its `steps` verified draft tokens, if reported (a
    /// draft tree's: each verified node's path confidence, the accepted path's `accepted`
    /// nodes first; [`crate::scheduler::ReportExtras::draft_probs`]).
    pub draft_probs: Option<&'a [f64]>,
}

/// The per-request state of the strategy: histories and the confidence calibration.
#[derive(Debug, Clone, PartialEq)]
pub struct PerRequest {
    requests: IdMap<History>,
    decay: f64,
    /// `(reached, accepted)` draft tokens per draft-probability bin, decayed.
    calibration: [(f64, f64); BINS],
    /// Least squares through 0 of the seconds beyond the uniform-equivalent iteration on the
    /// drafter's two terms ([`DraftCost`]): `(X'e, X'X)` over `x = (unverified drafted tokens,
    /// draft steps the interpolation does not charge)`, decayed.
    draft_fit: ([f64; 2], [[f64; 2]; 2]),
    /// Samples the drafter's fit learned, decayed as the fit is and aged by iterations without
    /// one ([`PerRequest::age_draft_fit`]): the fit's weight against its prior at 0.
    draft_weight: f64,
}

/// The drafter's costs beyond the uniform iteration with as many verify tokens, learned from
/// per-request iterations (both >= 0; 0 before any).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DraftCost {
    /// Seconds per drafted token that is not verified.
    pub per_token: f64,
    /// Seconds per draft step of the drafter's fixed cost (weights read, launches), paid once per
    /// step whatever the number of drafting requests.
    pub per_step: f64,
}

impl DraftCost {
    /// Seconds beyond the uniform iteration at verify depth `verified / b` of an iteration at depth
    /// `d` with `drafting` requests drafting and `verified` draft tokens verified in all (0 when
    /// nobody drafts).
    pub fn extra(&self, b: f64, d: u32, drafting: f64, verified: f64) -> f64 {
        if drafting <= 0.0 || d == 0 {
            return 0.0;
        }
        let d = f64::from(d);
        self.per_token * (drafting * d - verified).max(0.0) + self.per_step * (d - verified / b).max(0.0)
    }
}

/// Ridge weight of the drafter's two-term fit, relative to its data (keeps the terms apart where
/// the data cannot, e.g. when every request drafts and they are collinear).
const DRAFT_RIDGE: f64 = 1e-3;
/// Pseudo-samples of the drafter's prior at 0 (no cost beyond the uniform iteration): the fit is
/// scaled by `w / (w + DRAFT_PRIOR)`, `w` its weight of samples.
const DRAFT_PRIOR: f64 = 2.0;
/// Iterations over which the drafter's fit fades (by `e`) toward that prior when no shortened
/// iteration teaches it. Without it a fit learned in the first iterations, against a cost model
/// that barely knew the cells, priced every shortened candidate out, so none ran again and the
/// fit never moved (mixed-128 on h200-llama8b: `per_token` 1.0e-5 s from iteration ~300 to the
/// end, about 6x the curve's cost of a draft step, and no confidence stop chosen in 6000
/// segments). Fading to the prior is optimism: a stop that looks good again runs and is measured.
const DRAFT_FORGET: f64 = 256.0;
/// Uniform iterations the cost model learns before the drafter's fit learns residuals from its
/// predictions (before that the model's own error would be taken for the drafter's).
pub(crate) const DRAFT_MIN_OBSERVATIONS: u64 = 8;

/// The best verify lengths at one depth.
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    /// Predicted seconds of the iteration.
    pub seconds: f64,
    /// Expected emitted tokens of the batch.
    pub tokens: f64,
    /// `v_r` per request, in batch order.
    pub lengths: Vec<u32>,
    /// Expected emitted tokens of the batch if every request verified the whole depth, from the
    /// same survival estimates (what the batch-level candidate of this depth is worth to them).
    pub uniform_tokens: f64,
}

impl PerRequest {
    /// Histories decayed by `1 - 1/window` per verify of the request.
    pub fn new(window: u32) -> Self {
        PerRequest {
            requests: IdMap::default(),
            decay: 1.0 - 1.0 / f64::from(window.max(1)),
            calibration: [(0.0, 0.0); BINS],
            draft_fit: ([0.0; 2], [[0.0; 2]; 2]),
            draft_weight: 0.0,
        }
    }

    /// Requests with a history now.
    pub fn tracked(&self) -> usize {
        self.requests.len()
    }

    fn bin(q: f64) -> usize {
        ((q.clamp(0.0, 1.0) * BINS as f64) as usize).min(BINS - 1)
    }

    fn mean_rate(&self) -> f64 {
        let (r, a) = self.calibration.iter().fold((0.0, 0.0), |(r, a), c| (r + c.0, a + c.1));
        (a + 1.0) / (r + 2.0)
    }

    /// Calibrated acceptance of draft tokens proposed with probability `q`, over the mean rate.
    fn calibrated(&self, q: f64) -> f64 {
        let mean = self.mean_rate();
        let (r, a) = self.calibration[Self::bin(q)];
        ((a + BIN_PRIOR * mean) / (r + BIN_PRIOR)) / mean
    }

    /// Learns one iteration's verifies: `shared` are the shared conditional rates before this
    /// iteration (positions `1..`), `iteration` the decode iteration's counter.
    pub fn observe<'a>(&mut self, iteration: u64, shared: &[f64], verifies: impl IntoIterator<Item = RequestVerify<'a>>) {
        for v in verifies {
            let a = v.accepted.max(0) as usize;
            if let Some(q) = v.draft_probs {
                for (j, &p) in q.iter().enumerate().take(a + 1) {
                    let c = &mut self.calibration[Self::bin(p)];
                    c.0 = c.0 * 0.999 + 1.0;
                    c.1 = c.1 * 0.999 + if j < a { 1.0 } else { 0.0 };
                }
            }
            let confidence = v
                .draft_probs
                .filter(|q| !q.is_empty())
                .map(|q| q.iter().map(|&p| self.calibrated(p)).sum::<f64>() / q.len() as f64);
            let h = self.requests.entry(v.id).or_default();
            h.seen = iteration;
            if v.steps == 0 {
                continue;
            }
            // Expected accepted drafts of the positions it reached (1..=min(a + 1, steps)).
            let reached = (a + 1).min(v.steps as usize);
            let expected: f64 = shared.iter().take(reached).sum();
            h.accepted = h.accepted * self.decay + a as f64;
            h.expected = h.expected * self.decay + expected;
            h.reached = h.reached * self.decay + reached as f64;
            if let Some(c) = confidence {
                h.confidence = Some(h.confidence.map_or(c, |old| old + CONF_GAIN * (c - old)));
            }
        }
        if self.requests.len() > 64 && iteration % 64 == 0 {
            self.requests.retain(|_, h| iteration.saturating_sub(h.seen) <= FORGET);
        }
    }

    /// Seconds per drafted token that is not verified (a request drafting beyond its verify
    /// length), learned from per-request iterations (>= 0; 0 before any).
    pub fn draft_only_cost(&self) -> f64 {
        self.draft_cost().per_token
    }

    /// The drafter's two cost terms ([`DraftCost`]): a ridge least-squares fit through 0, each
    /// term held >= 0 (a negative one is dropped and the other refitted alone).
    pub fn draft_cost(&self) -> DraftCost {
        let (xe, xx) = self.draft_fit;
        let scale = (xx[0][0] + xx[1][1]).max(1e-300);
        let r = DRAFT_RIDGE * scale;
        let (a, b, c) = (xx[0][0] + r, xx[0][1], xx[1][1] + r);
        let det = a * c - b * b;
        if xx[0][0] + xx[1][1] <= 0.0 || det <= 0.0 {
            return DraftCost::default();
        }
        let shrink = self.draft_weight / (self.draft_weight + DRAFT_PRIOR);
        let (t, s) = (shrink * (c * xe[0] - b * xe[1]) / det, shrink * (a * xe[1] - b * xe[0]) / det);
        match (t >= 0.0, s >= 0.0) {
            (true, true) => DraftCost { per_token: t, per_step: s },
            _ => {
                // one term alone, the better of the two (both >= 0)
                let t1 = (shrink * xe[0] / a).max(0.0);
                let s1 = (shrink * xe[1] / c).max(0.0);
                if t1 * xe[0] >= s1 * xe[1] {
                    DraftCost { per_token: t1, per_step: 0.0 }
                } else {
                    DraftCost { per_token: 0.0, per_step: s1 }
                }
            }
        }
    }

    /// Learns what the drafter costs beyond the verify from one iteration's `seconds` at depth `d`
    /// and returns how the cost model should learn it: `(uniform depth with as many verify
    /// tokens, seconds of the drafter's terms)`. The uniform-equivalent seconds are the cost
    /// model's prediction interpolated at the verify depth `V / b`. `all_drafted`: every request
    /// drafted `d` whatever it verified (a confidence stop cuts after drafting); otherwise a
    /// request that verified nothing did not draft.
    #[allow(clippy::too_many_arguments)]
    pub fn learn_cost(&mut self, cost: &CostModel, bucket: u32, b_cost: u32, d: u32, requests: &[RequestVerify<'_>], ctx: f64, seconds: f64, all_drafted: bool) -> (u32, f64) {
        let (cell, _) = uniform_shape(requests);
        let verified: u32 = requests.iter().map(|r| r.steps).sum();
        let drafting = requests.iter().filter(|r| all_drafted || r.steps > 0).count() as u32;
        let b = requests.len().max(1) as f64;
        let x = [f64::from(d * drafting - verified), if drafting > 0 { f64::from(d) - f64::from(verified) / b } else { 0.0 }];
        let depth = f64::from(verified) / b;
        let (lo, frac) = (depth.floor() as u32, depth.fract());
        if (x[0] > 0.0 || x[1] > 0.0) && cost.observations() >= DRAFT_MIN_OBSERVATIONS && !cost.off_pace() {
            let at = |k: u32| cost.predict(bucket, b_cost, k.min(d), ctx, 0.0);
            let uniform = at(lo) * (1.0 - frac) + at(lo + 1) * frac;
            self.learn_draft(x, seconds - uniform);
        }
        (cell, self.draft_cost().extra(b, d, f64::from(drafting), f64::from(verified)))
    }

    /// Ages the drafter's fit by one decode iteration (toward its prior at 0, `DRAFT_FORGET`).
    pub fn age_draft_fit(&mut self) {
        self.draft_weight *= 1.0 - 1.0 / DRAFT_FORGET;
    }

    /// One sample of the drafter's fit: regressors `x`, seconds beyond the uniform iteration `e`.
    fn learn_draft(&mut self, x: [f64; 2], e: f64) {
        {
            let (xe, xx) = &mut self.draft_fit;
            for i in 0..2 {
                xe[i] = xe[i] * 0.99 + x[i] * e;
                for j in 0..2 {
                    xx[i][j] = xx[i][j] * 0.99 + x[i] * x[j];
                }
            }
        }
        self.draft_weight = self.draft_weight * 0.99 + 1.0;
    }

    /// Request `id`'s multiplier of the shared rates (1 for a request never seen).
    pub fn multiplier(&self, id: u64) -> f64 {
        match self.requests.get(&id) {
            None => 1.0,
            Some(h) => {
                let prior = h.confidence.unwrap_or(1.0);
                (h.accepted + PRIOR_DRAFTS * prior) / (h.expected + PRIOR_DRAFTS)
            }
        }
    }

    /// Survival `S_r(1..=d)` of each request of `ids` into `out` (`ids.len() * d` values, request
    /// after request), from the shared conditional rates `shared` (at least `d` of them).
    pub fn survival(&self, ids: &[u64], shared: &[f64], d: usize, out: &mut Vec<f64>) {
        out.clear();
        let first = shared.first().copied().unwrap_or(0.5).max(RATE_BOUNDS.0);
        for &id in ids {
            let rate = self.rate(id, first);
            let mut s = 1.0;
            for j in 0..d {
                // the shared depth profile, where it falls: deeper shared rates that rise are the
                // population's survivors (its better requests), not this request getting better
                let shape = (shared.get(j).copied().unwrap_or(0.0) / first).min(1.0);
                s *= (rate * shape).clamp(RATE_BOUNDS.0, RATE_BOUNDS.1);
                out.push(s);
            }
        }
    }

    /// Request `id`'s acceptance rate per reached draft position: its accepted over reached
    /// drafts, shrunk by `PRIOR_DRAFTS` pseudo-drafts toward the shared position-1 rate `first`
    /// times its draft confidence.
    pub fn rate(&self, id: u64, first: f64) -> f64 {
        match self.requests.get(&id) {
            None => first,
            Some(h) => {
                let prior = first * h.confidence.unwrap_or(1.0);
                (h.accepted + PRIOR_DRAFTS * prior) / (h.reached + PRIOR_DRAFTS)
            }
        }
    }
}

/// The verify lengths at depth `d` that maximise expected tokens per second for `b` requests,
/// given each request's survival (`surv`: `d` values per request) and `seconds(n, drafting)`,
/// the predicted seconds of the iteration when `n` draft tokens are verified in all and
/// `drafting` requests draft (those with `v_r > 0`). `order` is scratch space.
pub fn allocate(surv: &[f64], b: usize, d: u32, seconds: impl Fn(f64, f64) -> f64, order: &mut Vec<(f64, u32)>) -> Allocation {
    let d = d as usize;
    let mut lengths = vec![0u32; b];
    if d == 0 || b == 0 {
        return Allocation { seconds: seconds(0.0, 0.0), tokens: b as f64, lengths, uniform_tokens: b as f64 };
    }
    order.clear();
    order.extend(surv.iter().enumerate().map(|(i, &s)| (s, (i / d) as u32)));
    order.sort_unstable_by(|x, y| y.0.total_cmp(&x.0));
    let (mut best_n, mut best) = (0usize, (b as f64, seconds(0.0, 0.0)));
    let (mut tokens, mut drafting) = (b as f64, 0.0);
    let mut started = vec![false; b];
    for (n, &(s, r)) in order.iter().enumerate() {
        tokens += s;
        if !std::mem::replace(&mut started[r as usize], true) {
            drafting += 1.0;
        }
        let t = seconds((n + 1) as f64, drafting);
        if tokens / t > best.0 / best.1 {
            best_n = n + 1;
            best = (tokens, t);
        }
    }
    for &(_, r) in &order[..best_n] {
        lengths[r as usize] += 1;
    }
    Allocation { seconds: best.1, tokens: best.0, lengths, uniform_tokens: b as f64 + surv.iter().sum::<f64>() }
}

/// The best [`Allocation`] at each of `candidates` for the batch `ids` (`b_cost` after graph
/// padding, bucketed as `bucket`, `ctx` context tokens), from the shared conditional rates
/// `shared` and each request's multiplier.
#[allow(clippy::too_many_arguments)]
pub fn allocate_candidates(
    cost: &CostModel,
    requests: &PerRequest,
    shared: &[f64],
    ids: &[u64],
    candidates: &[u32],
    bucket: u32,
    b_cost: u32,
    ctx: f64,
) -> Vec<Allocation> {
    let d_max = candidates.iter().copied().max().unwrap_or(0) as usize;
    let mut surv_max = Vec::with_capacity(ids.len() * d_max);
    requests.survival(ids, shared, d_max, &mut surv_max);
    let uniform: Vec<f64> = (0..=d_max as u32).map(|k| cost.predict(bucket, b_cost, k, ctx, 0.0)).collect();
    let b = ids.len() as f64;
    let draft = requests.draft_cost();
    let (mut surv, mut order) = (Vec::new(), Vec::new());
    candidates
        .iter()
        .map(|&k| {
            let d = k as usize;
            surv.clear();
            surv.extend(surv_max.chunks(d_max.max(1)).flat_map(|c| c[..d].iter().copied()));
            // the uniform iteration with as many verify tokens, plus the drafter's terms
            let seconds = |n: f64, drafting: f64| {
                let depth = n / b;
                let (lo, frac) = (depth.floor() as usize, depth.fract());
                let t = uniform[lo.min(d)] * (1.0 - frac) + uniform[(lo + 1).min(d)] * frac;
                t + draft.extra(b, k, drafting, n)
            };
            allocate(&surv, ids.len(), k, seconds, &mut order)
        })
        .collect()
}

/// The uniform depth with the iteration's verify tokens (`V / b`, rounded) and no draft-only
/// seconds: how an iteration is learned before anything is known of the drafts' cost.
pub fn uniform_shape(requests: &[RequestVerify<'_>]) -> (u32, f64) {
    let verified: u32 = requests.iter().map(|r| r.steps).sum();
    let b = requests.len().max(1) as f64;
    ((f64::from(verified) / b).round() as u32, 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_admits_positions_by_survival_and_stops_where_they_cost_more_than_they_bring() {
        // two requests at depth 3: a strong one (0.9 per position) and a weak one (0.2)
        let mut surv = Vec::new();
        for a in [0.9f64, 0.2] {
            surv.extend((1..=3).map(|j| a.powi(j)));
        }
        let mut order = Vec::new();
        // drafts nearly free: everything is verified
        let cheap = |n: f64, _| 1.0 - 1e-4 * (6.0 - n);
        let all = allocate(&surv, 2, 3, cheap, &mut order);
        assert_eq!(all.lengths, vec![3, 3]);
        // a verified token costs 10 % of the iteration: the weak request's drafts are not worth it
        let dear = |n: f64, drafting: f64| 1.0 - 0.1 * (6.0 - n) - 0.05 * (2.0 - drafting);
        let cut = allocate(&surv, 2, 3, dear, &mut order);
        assert_eq!(cut.lengths, vec![3, 0]);
        assert!((cut.seconds - 0.65).abs() < 1e-12 && (cut.tokens - (2.0 + 0.9 + 0.81 + 0.729)).abs() < 1e-12);
    }

    /// An iteration costs 10 ms, plus `step` per draft step when any request
    /// drafts, plus `token` per drafted token, plus 0.1 ms per verified token.
    fn truth(d: u32, drafting: u32, verified: u32, step: f64, token: f64) -> f64 {
        0.010 + if drafting > 0 { step * f64::from(d) } else { 0.0 } + token * f64::from(drafting * d) + 1e-4 * f64::from(verified)
    }

    #[test]
    fn the_drafters_fixed_cost_per_step_is_learned_apart_from_its_cost_per_token() {
        let (b, step, token) = (8u32, 0.004, 2e-4);
        let mut cost = CostModel::new(64);
        for i in 0..200 {
            let k = i % 4;
            cost.observe(8, b, k, 0.0, 0.0, truth(k, if k > 0 { b } else { 0 }, b * k, step, token), true);
        }
        let mut p = PerRequest::new(16);
        for i in 0..300u32 {
            // depth 3; `n` of the 8 requests draft and verify `v` each, the others skip the drafter
            let (n, v) = (1 + i % 8, 1 + i % 3);
            let requests: Vec<RequestVerify<'_>> =
                (0..b).map(|r| RequestVerify { id: u64::from(r), steps: if r < n { v } else { 0 }, accepted: 0, draft_probs: None }).collect();
            let t = truth(3, n, n * v, step, token);
            p.learn_cost(&cost, 8, b, 3, &requests, 0.0, t, false);
        }
        let c = p.draft_cost();
        assert!((c.per_step / step - 1.0).abs() < 0.15, "{c:?}");
        assert!((c.per_token / token - 1.0).abs() < 0.15, "{c:?}");
        // one request drafting one token pays the whole draft step, not an eighth of it
        let extra = c.extra(8.0, 1, 1.0, 1.0);
        assert!((extra - step * 7.0 / 8.0).abs() < 0.15 * step, "{extra}");
        assert_eq!(c.extra(8.0, 3, 0.0, 0.0), 0.0, "nobody drafts: no drafter cost");
    }

    /// The drafter's fit learns nothing before the cost model has `DRAFT_MIN_OBSERVATIONS`
    /// uniform iterations (its predictions' error would be taken for the drafter's), and a fit
    /// no shortened iteration refreshes fades toward 0, so a stop priced out by an early
    /// estimate runs again and is measured.
    #[test]
    fn the_drafters_fit_waits_for_the_cost_model_and_fades_without_samples() {
        let (b, step, token) = (8u32, 0.004, 2e-4);
        let shortened = |n: u32| -> Vec<RequestVerify<'static>> { (0..b).map(|r| RequestVerify { id: u64::from(r), steps: if r < n { 2 } else { 0 }, accepted: 0, draft_probs: None }).collect() };
        let mut cost = CostModel::new(64);
        let mut p = PerRequest::new(16);
        cost.observe(8, b, 0, 0.0, 0.0, truth(0, 0, 0, step, token), true);
        p.learn_cost(&cost, 8, b, 3, &shortened(4), 0.0, 1.0, false);
        assert_eq!(p.draft_cost(), DraftCost::default(), "learned against a cost model of one measurement");
        for i in 0..200 {
            let k = i % 4;
            cost.observe(8, b, k, 0.0, 0.0, truth(k, if k > 0 { b } else { 0 }, b * k, step, token), true);
        }
        for i in 0..100u32 {
            let n = 1 + i % 8;
            p.learn_cost(&cost, 8, b, 3, &shortened(n), 0.0, truth(3, n, 2 * n, step, token), false);
        }
        let learned = p.draft_cost();
        assert!(learned.per_step > 0.5 * step, "{learned:?}");
        for _ in 0..1500 {
            p.age_draft_fit();
        }
        let faded = p.draft_cost();
        assert!(faded.per_step < 0.5 * learned.per_step && faded.per_token <= learned.per_token, "{faded:?} vs {learned:?}");
    }

    #[test]
    fn a_request_that_accepts_more_than_the_shared_rates_expect_gets_a_higher_multiplier() {
        let mut p = PerRequest::new(16);
        let shared = [0.5; 4];
        assert_eq!(p.multiplier(7), 1.0);
        for it in 1..=20 {
            let v = [
                RequestVerify { id: 1, steps: 4, accepted: 4, draft_probs: None },
                RequestVerify { id: 2, steps: 4, accepted: 0, draft_probs: None },
            ];
            p.observe(it, &shared, v);
        }
        assert!(p.multiplier(1) > 1.5, "{}", p.multiplier(1));
        assert!(p.multiplier(2) < 0.5, "{}", p.multiplier(2));
        let mut s = Vec::new();
        p.survival(&[1, 2, 3], &shared, 2, &mut s);
        assert_eq!(s.len(), 6);
        assert!(s[0] > s[4] && s[4] > s[2] && (s[4] - 0.5).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn draft_confidence_moves_a_young_request_before_its_history_does() {
        let mut p = PerRequest::new(16);
        let shared = [0.5; 4];
        // calibration: drafts proposed at probability 0.9 are accepted, at 0.1 rejected
        for it in 1..=200u64 {
            let hi = [0.9; 4];
            let lo = [0.1; 4];
            let v = [
                RequestVerify { id: 100 + it, steps: 4, accepted: 4, draft_probs: Some(&hi) },
                RequestVerify { id: 1000 + it, steps: 4, accepted: 0, draft_probs: Some(&lo) },
            ];
            p.observe(it, &shared, v);
        }
        // two young requests with one verify each, alike but for the drafter's confidence
        let (hi, lo) = ([0.95, 0.9], [0.15, 0.1]);
        let v = [
            RequestVerify { id: 1, steps: 2, accepted: 1, draft_probs: Some(&hi) },
            RequestVerify { id: 2, steps: 2, accepted: 1, draft_probs: Some(&lo) },
        ];
        p.observe(201, &shared, v);
        assert!(p.multiplier(1) > 1.2 * p.multiplier(2), "{} vs {}", p.multiplier(1), p.multiplier(2));
    }
}
