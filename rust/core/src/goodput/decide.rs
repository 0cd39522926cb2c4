//! The `goodput` strategy's decision of one iteration: scores of every candidate depth (batch-level,
//! per-request allocations or the confidence stop), the switch rule and probes (the module docs of
//! [`super`]).

use super::acceptance::expected_tokens;
use super::cost::CostModel;
use super::{confidence, per_request, DecisionView, GoodputPolicy, Slot};
use crate::config::{MinSurvival, VerifyMode};
use crate::decision::{ConfidenceStop, Decision, VerifyShape};

/// Least relative gain of the best per-request candidate over the best batch-level one for the
/// per-request rows to be used (issue 28: "a per-request allocation must beat the batch-level
/// decision's choice on the same cost model, or yield to it"). 5 %, the slot's default
/// `switch_margin`: a per-request row is priced from more estimates than a batch-level one
/// (uniform cells interpolated at the mean verify depth and refreshed only by staleness probes,
/// the drafter's terms, the occupancy below the threshold), and with the stop's fixes of
/// BENCHMARKS.md "Issue 28: why the per-request stop falls short" at 1 % rows predicted 1-5 %
/// better lost in the simulator (mixed-256: 0.966 of batch-level on a100-llama8b, 0.970 on
/// cpu-like; context-growth on l40s-llama8b 0.983 of the best fixed depth), at 3 % as well
/// (0.963 steady-code l40s-llama8b); at 5 % every floor holds (BENCHMARKS.md, "Issue 28: the
/// rest of the stop's fixes"). Taken again over seeds 0-2 once shortened iterations taught cells
/// of their own ([`super::shortened`]): at 3 % and 2 % the mean at concurrency >= 64 rose by
/// 0.003-0.004 but one seed of mixed-256 on cpu-like fell to 0.953 of batch-level (case mean
/// 0.981-0.982); at 5 % no seed of any case fell below 0.983 (BENCHMARKS.md, "Issue 28:
/// shortened iterations teach cells of their own").
pub const YIELD_MARGIN: f64 = 0.05;

/// Iterations after which a cell a per-request decision is priced from counts as stale: the
/// decision then runs that depth uniformly once (a staleness probe), since shortened iterations
/// teach the cells nothing ([`super::report`]).
pub const STALE_AFTER: u64 = 48;

impl GoodputPolicy {
    /// The decision for slot `slot` with `b` requests (`b_cost` after graph padding, bucketed as
    /// `bucket`) and `context_tokens` tokens of context, the catch-up estimated.
    pub fn decide(&mut self, slot: usize, bucket: u32, b: u32, b_cost: u32, context_tokens: u64) -> u32 {
        self.decide_with(slot, bucket, b, b_cost, context_tokens, None)
    }

    /// [`Self::decide`] told the drafter catch-up tokens pending in the batch (`catch_up`; the
    /// scheduler counts them per request). `None`: the estimate, the requests emitted at steps 0
    /// since the last drafting iteration.
    pub fn decide_with(
        &mut self,
        slot: usize,
        bucket: u32,
        b: u32,
        b_cost: u32,
        context_tokens: u64,
        catch_up: Option<u64>,
    ) -> u32 {
        self.decide_requests(slot, bucket, b, b_cost, context_tokens, catch_up, None).steps
    }

    /// [`Self::decide_with`] told the batch's request ids (`ids`, in batch order, one per
    /// request). With `verify = per_request` and ids given, the decision carries a verify length
    /// per request ([`per_request`]); otherwise it is uniform, exactly the batch-level decision.
    #[allow(clippy::too_many_arguments)]
    pub fn decide_requests(
        &mut self,
        slot: usize,
        bucket: u32,
        b: u32,
        b_cost: u32,
        context_tokens: u64,
        catch_up: Option<u64>,
        ids: Option<&[u64]>,
    ) -> Decision {
        let alpha = self.acceptance.rates(self.iteration);
        let ids = ids.filter(|i| self.cfg.verify == VerifyMode::PerRequest && i.len() == b as usize);
        let ctx = context_tokens as f64;
        let catch = catch_up.unwrap_or(self.catch_up) as f64;
        let horizon = f64::from(self.cfg.min_dwell.max(8));
        let mut allocations = Vec::new();
        let mut stops = Vec::new();
        let stop = ids.is_some() && self.cfg.min_survival != MinSurvival::Off;
        if stop {
            // the confidence stop: every request drafts the depth, the worker cuts by confidence
            let c = &self.slots[slot].candidates;
            let d_max = c.iter().copied().max().unwrap_or(0);
            let uniform: Vec<f64> = (0..=d_max).map(|k| self.cost.predict(bucket, b_cost, k, ctx, 0.0)).collect();
            let none: Vec<f64> = (0..=d_max).map(|k| expected_tokens(&alpha, k)).collect();
            let fixed = if let MinSurvival::Fixed(x) = self.cfg.min_survival { Some(x) } else { None };
            let draft = self.per_request.draft_cost();
            let learned = |k: u32, v: f64| self.shortened.factor(bucket, k, v);
            stops = confidence::stop_rows(&self.confidence, &alpha, c, &uniform, draft, f64::from(b), &none, fixed, learned);
        } else if let Some(ids) = ids {
            let s = &self.slots[slot];
            allocations = per_request::allocate_candidates(&self.cost, &self.per_request, &alpha, ids, &s.candidates, bucket, b_cost, ctx);
        }
        let cost = &self.cost;
        let s = &self.slots[slot];
        let row = |i: usize, k: u32, per_request: bool| {
            let (t, e) = match (allocations.get(i).filter(|_| per_request), stops.get(i).copied().flatten().filter(|_| per_request)) {
                (Some(a), _) => (a.seconds, a.tokens / f64::from(b)),
                (None, Some((cut, t))) => (t, 1.0 + cut.accepted),
                // the batch-level candidate, its tokens from the per-request survival where the
                // allocation ran: the shared estimates learn only from requests that verified,
                // so under per-request budgets they see the strong requests and overrate depth
                (None, None) => {
                    let e = allocations.get(i).map_or_else(|| expected_tokens(&alpha, k), |a| a.uniform_tokens / f64::from(b));
                    (cost.predict(bucket, b_cost, k, ctx, 0.0), e)
                }
            };
            // A switch from 0 to drafting pays the catch-up once, spread over the horizon.
            let extra = if k > 0 && s.current == 0 && catch > 0.0 {
                (cost.predict(bucket, b_cost, k, ctx, catch) - cost.predict(bucket, b_cost, k, ctx, 0.0)).max(0.0) / horizon
            } else {
                0.0
            };
            (k, t, e, f64::from(b) * e / (t + extra))
        };
        let batch: Vec<(u32, f64, f64, f64)> = s.candidates.iter().enumerate().map(|(i, &k)| row(i, k, false)).collect();
        let mut rows = batch.clone();
        if !(allocations.is_empty() && stops.is_empty()) {
            let chosen: Vec<(u32, f64, f64, f64)> = s.candidates.iter().enumerate().map(|(i, &k)| row(i, k, true)).collect();
            // A per-request allocation (or a stop) must beat the batch-level decision's best
            // candidate on the same cost model by `YIELD_MARGIN`, or yield to it: its tokens come
            // from another estimate, and a depth it favours by less than that is noise.
            let top = |r: &[(u32, f64, f64, f64)]| r.iter().map(|x| x.3).fold(0.0, f64::max);
            if top(&chosen) > top(&batch) * (1.0 + YIELD_MARGIN) {
                rows = chosen;
            } else {
                allocations.clear();
                stops.clear();
            }
        }
        let score = |k: u32| rows.iter().find(|r| r.0 == k).map_or(0.0, |r| r.3);
        let best = rows.iter().fold(rows[0], |a, r| if r.3 > a.3 { *r } else { a });
        let need = 1.0 + self.cfg.switch_margin;
        let dwell = u64::from(self.cfg.min_dwell);
        let s = &mut self.slots[slot];
        // The dwell keeps a slot from ping-ponging under the conditions it switched in; a batch
        // at least twice or half the size of the one the current steps were chosen at is another
        // condition, and waiting out the dwell there runs steps chosen for the old one.
        let moved = (f64::from(bucket).log2() - f64::from(s.chosen_at).log2()).abs() >= 1.0;
        if best.0 != s.current && best.3 > score(s.current) * need && (s.since_switch >= dwell || moved) {
            s.current = best.0;
            s.chosen_at = bucket;
            s.since_switch = 0;
            s.switched = true;
            self.switches += 1;
        }
        let mut steps = s.current;
        let mut probe = false;
        if let Some(target) = Self::probe_target(s, cost, bucket) {
            let t = rows.iter().find(|r| r.0 == target).map_or(0.0, |r| r.1);
            // A neighbour never measured at this batch size (where the current steps are) is
            // probed at once, on credit: its cost is only extrapolated, and a slot that arrives at a new batch size with
            // too-high steps would otherwise wait some 30 iterations for enough credit to learn
            // that lower steps pay (BENCHMARKS.md, issue 11). Each cell borrows at most once.
            let unmeasured = cost.cell_count(bucket, target) == 0 && cost.cell_count(bucket, s.current) > 0;
            // Off the machine's usual pace a probe's seconds would not be learned.
            if self.cfg.probe_budget > 0.0 && !cost.off_pace() && (s.credit >= t || unmeasured) {
                s.credit -= t;
                s.probe_turn = !s.probe_turn;
                steps = target;
                probe = true;
                self.probes += 1;
            }
        }
        // A staleness probe: the per-request row at `steps` is priced from the uniform cells of
        // `steps` (the depth drafted) and of the candidates either side of its mean verify depth,
        // and must keep beating the best batch-level row and the smallest candidate; the most
        // overdue of these cells (stale after `STALE_AFTER` iterations, the last two after 2x and
        // 4x that) runs uniformly this iteration.
        let mut stale = false;
        if !probe {
            let i = self.slots[slot].candidates.iter().position(|&k| k == steps);
            let verify_depth = i.and_then(|i| match (allocations.get(i), stops.get(i).copied().flatten()) {
                (Some(a), _) => Some(f64::from(a.lengths.iter().sum::<u32>()) / f64::from(b)),
                (None, Some((cut, _))) => Some(cut.kept * f64::from(steps)),
                _ => None,
            });
            if let Some(v) = verify_depth {
                let c = &self.slots[slot].candidates;
                // the cells the row is priced from: the depth drafted and the candidates on
                // either side of the mean verify depth (the interpolation's two ends)
                let below = c.iter().copied().filter(|&k| f64::from(k) <= v).max().unwrap_or(steps);
                let above = c.iter().copied().filter(|&k| f64::from(k) >= v).min().unwrap_or(steps);
                let age = |k: u32| cost.cell_age(bucket, k).map_or(f64::INFINITY, |a| a as f64);
                // and, less often, the alternatives a per-request row has to keep beating: the
                // best batch-level row and the smallest candidate (cpu-like mixed-256: a stale
                // cell of steps 0 read 21 % dear, so the stop stayed at depth 3 for 1900
                // iterations where steps 0 paid 7 % more)
                let top = batch.iter().fold(batch[0], |a, r| if r.3 > a.3 { *r } else { a }).0;
                let watch = [(steps, 1.0), (below, 1.0), (above, 1.0), (top, 2.0), (c[0], 4.0)];
                let (target, overdue) = watch
                    .into_iter()
                    .map(|(k, slack)| (k, age(k) / (slack * STALE_AFTER as f64)))
                    .fold((steps, 0.0), |a, x| if x.1 > a.1 { x } else { a });
                if overdue > 1.0 {
                    steps = target;
                    probe = true;
                    stale = true;
                    self.probes += 1;
                    allocations.clear();
                    stops.clear();
                }
            }
        }
        self.last = Some(DecisionView {
            slot,
            batch_size: b_cost,
            context_tokens,
            candidates: rows.iter().map(|r| (r.0, r.1, r.2)).collect(),
            steps,
            probe,
        });
        let c = &self.slots[slot].candidates;
        if stop {
            // a probe runs its depth uniformly: it is there to measure the depth's cell, and a
            // shortened iteration teaches no cell (a stopped probe left the neighbours' cells
            // unmeasured, so the next iteration probed them again: mixed-128 on h200-llama8b
            // probed steps 3 and 5 in turn for 2243 of 2250 iterations)
            let i = c.iter().position(|&k| k == steps).filter(|_| !probe);
            let cut = i.and_then(|i| stops.get(i).copied().flatten()).map(|(cut, _)| cut.edge);
            // a staleness probe verifies uniformly, a fixed threshold included
            let min_survival = match self.cfg.min_survival {
                MinSurvival::Fixed(x) if !stale => Some(x),
                MinSurvival::Fixed(_) => None,
                _ => cut.filter(|&e| e < confidence::BINS).map(confidence::edge),
            };
            self.last_rule = min_survival.map(confidence::edge_index);
            let mut d = Decision::uniform(steps);
            d.confidence_stop = min_survival.map(|x| ConfidenceStop { min_survival: x as f32 });
            // a draft tree may beat the stopped chain (issue 29 item 5, `super::tree_plan`)
            return self.tree_decision(slot, bucket, b, b_cost, ctx, &alpha, d, probe);
        }
        let chain = match c.iter().position(|&k| k == steps).and_then(|i| allocations.into_iter().nth(i)) {
            // The batch drafts as deep as its longest verify needs (the smallest candidate that
            // covers it, so the depth keeps a captured graph): drafting deeper would be paid for
            // nothing.
            Some(a) => {
                let longest = a.lengths.iter().copied().max().unwrap_or(0);
                let depth = c.iter().copied().find(|&k| k >= longest).unwrap_or(steps);
                Decision { steps: depth, verify: VerifyShape::PerRequest(a.lengths), tree: None, confidence_stop: None }
            }
            None => Decision::uniform(steps),
        };
        self.tree_decision(slot, bucket, b, b_cost, ctx, &alpha, chain, probe)
    }

    /// The candidate a probe would run now, if any: at steps 0 the smallest positive candidate;
    /// otherwise the neighbour (next lower or higher candidate) measured least at this bucket,
    /// alternating on ties.
    fn probe_target(s: &Slot, cost: &CostModel, bucket: u32) -> Option<u32> {
        let c = &s.candidates;
        let i = c.iter().position(|&k| k == s.current)?;
        if s.current == 0 {
            return c.get(i + 1).copied();
        }
        let lower = i.checked_sub(1).map(|j| c[j]);
        let upper = c.get(i + 1).copied();
        match (lower, upper) {
            (Some(l), Some(u)) => {
                let (nl, nu) = (cost.cell_count(bucket, l), cost.cell_count(bucket, u));
                Some(if nl < nu || (nl == nu && s.probe_turn) { l } else { u })
            }
            (l, u) => l.or(u),
        }
    }
}
