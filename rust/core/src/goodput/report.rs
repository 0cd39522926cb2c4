//! What the `goodput` strategy learns from a report: acceptance (shared and per request), the cost
//! model, the catch-up estimate and probe credit (the module docs of [`super`]).

use super::per_request::{self, RequestVerify};
use super::GoodputPolicy;
use crate::config::MinSurvival;

impl GoodputPolicy {
    /// Feeds one measurement of a startup sweep to the cost model (not a decode iteration:
    /// acceptance, probe credit and slots are untouched).
    pub fn seed_cost(&mut self, bucket: u32, b: u32, steps: u32, seconds: f64, context_tokens: u64) {
        self.cost.observe(bucket, b, steps, context_tokens as f64, 0.0, seconds, false);
    }

    /// Records one decode iteration of slot `slot` at `steps` (validated by the caller):
    /// accepted drafts of the requests that ran the full `steps`, measured `seconds` if any.
    /// Returns the slot's new current steps if a switch happened since the last report.
    #[allow(clippy::too_many_arguments)]
    pub fn observe(
        &mut self,
        slot: usize,
        bucket: u32,
        b: u32,
        b_cost: u32,
        steps: u32,
        accepted: &[i64],
        seconds: Option<f64>,
        context_tokens: u64,
    ) -> Option<u32> {
        self.observe_with(slot, bucket, b, b_cost, steps, accepted, seconds, context_tokens, None)
    }

    /// [`Self::observe`] told the drafter catch-up tokens the iteration ran (`caught_up`: 0 when
    /// the drafter was not behind, e.g. with the zero-step extend not skipped; deferred drafter
    /// prefills included). The cost model learns the iteration's seconds with exactly that
    /// catch-up. `None`: the estimate ([`Self::decide_with`]).
    #[allow(clippy::too_many_arguments)]
    pub fn observe_with(
        &mut self,
        slot: usize,
        bucket: u32,
        b: u32,
        b_cost: u32,
        steps: u32,
        accepted: &[i64],
        seconds: Option<f64>,
        context_tokens: u64,
        caught_up: Option<u64>,
    ) -> Option<u32> {
        if let Some(switch) = self.observe_tree(slot, bucket, b_cost, steps, accepted, seconds, context_tokens as f64, caught_up, None) {
            return switch;
        }
        self.iteration += 1;
        if steps > 0 {
            self.acceptance.observe(self.iteration, steps, accepted);
        }
        self.learn_iteration(slot, bucket, b, b_cost, steps, (steps, 0.0), seconds, seconds, context_tokens, caught_up)
    }

    /// [`Self::observe_with`] of an iteration with a verify length per request (`requests`: every
    /// request of the batch, in batch order, with the steps it verified, its accepted drafts and
    /// the drafter's probabilities of its verified drafts if known). The shared per-position
    /// estimates learn from each request at its own length, the per-request histories and the
    /// confidence calibration from each request, the cost model the iteration's tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn observe_requests(
        &mut self,
        slot: usize,
        bucket: u32,
        b_cost: u32,
        steps: u32,
        requests: &[RequestVerify<'_>],
        seconds: Option<f64>,
        context_tokens: u64,
        caught_up: Option<u64>,
    ) -> Option<u32> {
        // a draft tree's report (issue 29 item 5: `steps` of a request are its kept nodes)
        // teaches the tree planner, as under uniform verify, and the confidence calibration
        // (its nodes' path confidences and which were accepted), never the chain estimates
        let accepted: Vec<i64> = requests.iter().map(|r| r.accepted).collect();
        let nodes = requests.iter().map(|r| u64::from(r.steps)).sum();
        if let Some(switch) = self.observe_tree(slot, bucket, b_cost, steps, &accepted, seconds, context_tokens as f64, caught_up, Some(nodes)) {
            if self.cfg.min_survival != MinSurvival::Off {
                self.confidence.observe_nodes(requests.iter().map(|r| (r.accepted, r.draft_probs)));
            }
            return switch;
        }
        let shared = self.acceptance.rates(self.iteration);
        self.iteration += 1;
        let rule = self.last_rule.take();
        // Under a confidence stop a request reaches position `j` only if its cumulative draft
        // probability up to `j` passed the threshold: the requests that verify deep are the
        // confident ones, so their acceptance overstates the population's (mixed-128 on
        // h200-llama8b: the shared estimates rose from E(5) = 3.0 to 4.4 within 400 stopped
        // iterations and the stop drafted depth 5 where depth 3 pays). The shared estimates,
        // which price every uniform row and a stop's tokens, learn from iterations no rule cut;
        // a stopped iteration teaches the per-request histories and the confidence model.
        let mut group = Vec::with_capacity(requests.len());
        for v in (1..=steps).filter(|_| rule.is_none()) {
            group.clear();
            group.extend(requests.iter().filter(|r| r.steps == v).map(|r| r.accepted));
            self.acceptance.observe(self.iteration, v, &group);
        }
        self.per_request.observe(self.iteration, &shared, requests.iter().copied());
        if self.cfg.min_survival != MinSurvival::Off {
            self.confidence.observe(steps, requests.iter().map(|r| (r.steps, r.accepted, r.draft_probs)), rule);
        }
        let b = requests.len() as u32;
        let verified: u32 = requests.iter().map(|r| r.steps).sum();
        // The drafter's terms learn from the seconds beyond the uniform iteration with as many
        // verify tokens (per_request, "the cost model in tokens"); the cells and the plane learn
        // uniform iterations only. A shortened iteration used to teach the cell of the depth it
        // drafted, scaled to the uniform iteration by the ratio its decision predicted; but that
        // ratio is the model's own, so the scaled seconds confirmed whatever the model believed
        // of the uniform depth (within the noise), counted as measurements of it (so its probes
        // never came), and fed the model's error at the depths the ratio was interpolated from
        // into the plane and every other depth (h200x4-llama70b mixed-128: steps 5's cell held
        // 0.034 s against the curve's 0.044 s, steps 1 read 0.019-0.022 s against 0.015 s, and the
        // slot never went back to steps 1; BENCHMARKS.md, issue 28 floors). The cells a
        // per-request decision is priced from are kept current by staleness probes instead
        // ([`super::decide::STALE_AFTER`]).
        self.per_request.age_draft_fit();
        let shortened = verified != steps * b;
        let cells = seconds.filter(|_| !shortened);
        // A shortened iteration in which every request drafted (the stop, or lengths all > 0)
        // teaches the shortened cells of its verify depth how far its seconds were from the price
        // a stop row puts on it (`super::shortened`), taken before the drafter's fit learns it.
        let all_drafted = rule.is_some() || requests.iter().all(|r| r.steps > 0);
        let learnable = self.cost.observations() >= per_request::DRAFT_MIN_OBSERVATIONS && !self.cost.off_pace();
        if let Some(t) = seconds.filter(|_| shortened && all_drafted && steps > 0 && learnable) {
            let catch = caught_up.unwrap_or(self.catch_up) as f64;
            let base = self.shortened_price(bucket, b_cost, steps, b, verified, context_tokens as f64, catch);
            self.shortened.observe(bucket, steps, f64::from(verified) / f64::from(b.max(1)), t, base);
        }
        let shape = match seconds {
            Some(t) => self.per_request.learn_cost(&self.cost, bucket, b_cost, steps, requests, context_tokens as f64, t, rule.is_some()),
            None => per_request::uniform_shape(requests),
        };
        self.learn_iteration(slot, bucket, b, b_cost, steps, shape, seconds, cells, context_tokens, caught_up)
    }

    /// What a stop row prices an iteration at `steps` (`steps > 0`) with `verified` drafts
    /// verified in all by `b` requests, every one drafting, at `context_tokens` (no catch-up):
    /// the uniform iterations interpolated at the verify depth and the drafter's terms, times
    /// the factor the shortened iterations' own cells learned there ([`super::shortened`]).
    pub fn predict_shortened(&self, bucket: u32, b: u32, b_cost: u32, steps: u32, verified: u32, context_tokens: u64) -> f64 {
        let price = self.shortened_price(bucket, b_cost, steps, b, verified, context_tokens as f64, 0.0);
        let depth = f64::from(verified) / f64::from(b.max(1));
        if depth < f64::from(steps) {
            price * self.shortened.factor(bucket, steps, depth)
        } else {
            price
        }
    }

    /// What a stop row prices an iteration at `steps` with `verified` drafts verified by `b`
    /// requests, every one drafting, before the shortened cells' factor
    /// ([`super::confidence::stop_rows`]): the uniform iterations interpolated at the verify
    /// depth, the drafter's terms, and the catch-up of `catch` tokens the cost model predicts.
    #[allow(clippy::too_many_arguments)]
    fn shortened_price(&self, bucket: u32, b_cost: u32, steps: u32, b: u32, verified: u32, ctx: f64, catch: f64) -> f64 {
        let bf = f64::from(b.max(1));
        let depth = f64::from(verified) / bf;
        let (lo, frac) = (depth.floor() as u32, depth.fract());
        let at = |k: u32| self.cost.predict(bucket, b_cost, k.min(steps), ctx, 0.0);
        let catch_up = (self.cost.predict(bucket, b_cost, steps, ctx, catch) - at(steps)).max(0.0);
        at(lo) * (1.0 - frac) + at(lo + 1) * frac + self.per_request.draft_cost().extra(bf, steps, bf, f64::from(verified)) + catch_up
    }

    /// The cost model, catch-up and probe-credit part of a report (`cells`: the measured seconds
    /// the cost model learns, `None` for an iteration it must not learn, which only advances the
    /// cells' ages).
    #[allow(clippy::too_many_arguments)]
    fn learn_iteration(
        &mut self,
        slot: usize,
        bucket: u32,
        b: u32,
        b_cost: u32,
        steps: u32,
        (cell_steps, draft_only): (u32, f64),
        seconds: Option<f64>,
        cells: Option<f64>,
        context_tokens: u64,
        caught_up: Option<u64>,
    ) -> Option<u32> {
        self.shortened.tick();
        let estimated = if steps > 0 { std::mem::take(&mut self.catch_up) } else { 0 };
        let catch = caught_up.unwrap_or(estimated);
        let settled = steps == self.slots[slot].current;
        let ctx = context_tokens as f64;
        let spent = match seconds {
            Some(t) => {
                match cells {
                    Some(t) => {
                        let uniform = (t - draft_only).max(0.5 * t);
                        self.cost.observe(bucket, b_cost, cell_steps, ctx, catch as f64, uniform, settled);
                    }
                    None => self.cost.tick(),
                }
                t
            }
            None => self.cost.predict(bucket, b_cost, cell_steps, ctx, catch as f64) + draft_only,
        };
        if steps == 0 {
            self.catch_up += u64::from(b);
        }
        let s = &mut self.slots[slot];
        s.verifies += 1;
        s.since_switch = s.since_switch.saturating_add(1);
        // Credit is capped at a few iterations' worth, so a long quiet stretch does not buy a
        // burst of probes.
        if !self.cost.off_pace() {
            s.credit = (s.credit + self.cfg.probe_budget * spent).min(4.0 * spent);
        }
        std::mem::take(&mut s.switched).then_some(s.current)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{GoodputConfig, GoodputPolicy};
    use super::RequestVerify;
    use crate::config::{MinSurvival, VerifyMode};

    /// 8 requests, uniform iterations at steps 0..=5 (10 ms + 2 ms per draft step).
    fn trained() -> GoodputPolicy {
        let cfg = GoodputConfig { probe_budget: 0.0, verify: VerifyMode::PerRequest, min_survival: MinSurvival::Off, ..GoodputConfig::default() };
        let mut p = GoodputPolicy::new(cfg, 3, vec![(0..=7).collect()]);
        for i in 0..120u32 {
            let k = i % 6;
            let req: Vec<RequestVerify<'_>> = (0..8).map(|id| RequestVerify { id, steps: k, accepted: i64::from(k / 2), draft_probs: None }).collect();
            p.observe_requests(0, 8, 8, k, &req, Some(0.010 + 0.002 * f64::from(k)), 800, None);
        }
        p
    }

    /// Under a confidence stop only confident requests reach deep positions, so a stopped
    /// iteration must leave the shared per-position estimates alone (they price every uniform
    /// row): two policies told opposite outcomes of stopped iterations keep the same estimates;
    /// told them without a rule, they part.
    #[test]
    fn a_stopped_iteration_does_not_teach_the_shared_acceptance() {
        let probs = [0.9; 5];
        let report = |rule: Option<usize>, accepted: i64| {
            let mut p = trained();
            let req: Vec<RequestVerify<'_>> = (0..8).map(|id| RequestVerify { id, steps: if id < 4 { 5 } else { 1 }, accepted: accepted.min(if id < 4 { 5 } else { 1 }), draft_probs: Some(&probs[..]) }).collect();
            for _ in 0..20 {
                p.last_rule = rule;
                p.observe_requests(0, 8, 8, 5, &req, Some(0.02), 800, None);
            }
            p.acceptance_rates()
        };
        assert_eq!(report(Some(3), 5), report(Some(3), 0), "a stopped iteration moved the shared estimates");
        assert!(report(None, 5)[4] > report(None, 0)[4], "an iteration without a rule teaches them");
    }

    #[test]
    fn a_shortened_iteration_teaches_the_drafters_terms_and_no_cell() {
        let mut p = trained();
        let ids: Vec<u64> = (0..8).collect();
        let predict = |p: &GoodputPolicy| (0..8).map(|k| p.cost.predict(8, 8, k, 800.0, 0.0)).collect::<Vec<f64>>();
        // what the uniform iterations taught, aged by 20 iterations none of them measured
        let mut aged = p.cost.clone();
        for _ in 0..20 {
            aged.tick();
        }
        let before = (0..8).map(|k| aged.predict(8, 8, k, 800.0, 0.0)).collect::<Vec<f64>>();
        let drafter = p.per_request.draft_cost();
        for _ in 0..20 {
            p.decide_requests(0, 8, 8, 8, 800, None, Some(&ids));
            // depth 5, half the requests verify 1: slower than its uniform-equivalent iteration
            let req: Vec<RequestVerify<'_>> = ids.iter().map(|&id| RequestVerify { id, steps: if id < 4 { 5 } else { 1 }, accepted: 1, draft_probs: None }).collect();
            p.observe_requests(0, 8, 8, 5, &req, Some(0.030), 800, None);
        }
        // the cells and the plane are what the uniform iterations taught, to the last bit
        // (only aged: `CostModel::predict` gives a cell less weight the longer since it was
        // measured)
        assert_eq!(predict(&p), before);
        // the seconds beyond the uniform-equivalent iteration went to the drafter's terms
        let learned = p.per_request.draft_cost();
        assert!(learned.per_token + learned.per_step > drafter.per_token + drafter.per_step, "{learned:?} vs {drafter:?}");
    }
}
