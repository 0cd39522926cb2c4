//! The `goodput` strategy: each decode iteration, among the routed slot's candidate steps
//! (0 included), the steps that maximise expected emitted tokens per second,
//!
//! ```text
//! goodput(k) = b * E(k) / t(b, k, C)
//! ```
//!
//! with `E(k)` the expected acceptance length from per-position conditional acceptance
//! ([`acceptance`]) and `t` the iteration seconds an online cost model predicts for this batch
//! size, steps and context ([`cost`]). The rule is SmartSpec's goodput criterion (arXiv 2406.14066)
//! and SGLang's throughput-aware score (PR #28045), with the costs learned online instead of
//! profiled at start, a context axis, and steps 0 inside the same decision.
//!
//! Keeping the estimates honest:
//!
//! - **Switches.** A slot moves from its current steps to the best candidate only when the
//!   challenger's predicted goodput is `switch_margin` higher and the slot has kept its steps for
//!   `min_dwell` iterations (no ping-pong between near-ties), or the batch is at least twice or
//!   half the size it was when the current steps were chosen (a new condition: a load step
//!   should not run the old load's steps for a whole dwell).
//! - **Probes.** A cost the model has not measured, or acceptance while drafting is off, can only be
//!   learned by running it. A slot earns probe credit of `probe_budget` times the seconds of every
//!   iteration it runs and spends it on one-iteration probes: at steps 0 the smallest positive
//!   candidate (which measures acceptance, so a change of content is noticed); otherwise the
//!   candidates next to the current steps, least measured first (which keeps the local cost
//!   slope measured). A neighbour never measured at a batch-size bucket where the current steps
//!   have been is probed at once, on credit (the slot's credit goes negative and is repaid before the next probe), so a
//!   slot that arrives at a new batch size learns the local slope within a few iterations. Each
//!   `(bucket, steps)` cell can borrow only once, so over a run probes still take about
//!   `probe_budget` of the decode time; their tokens count like any others. While the cost model
//!   finds the machine off its usual pace ([`cost`], layer 3) no probe runs and no credit accrues.
//! - **Catch-up.** After a stretch at steps 0 with the drafter's extend skipped, the first drafting
//!   iteration also runs the drafter over the missed tokens (and over prompts whose drafter
//!   prefill was deferred meanwhile). The cost model learns that cost per catch-up token; a
//!   switch away from 0 is charged for it, spread over `max(min_dwell, 8)` iterations. The
//!   scheduler counts those tokens per request and passes them in ([`GoodputPolicy::observe_with`],
//!   [`GoodputPolicy::decide_with`]), 0 when the engine does not skip the zero-step extend;
//!   without them (the simulator, a bare policy) every request emitted at steps 0 since the last
//!   drafting iteration is assumed to be caught up.
//!
//! Without measured seconds the cost model keeps its prior shape (each draft step adds 10 % to an
//! iteration), so the choice then follows acceptance alone against that shape; probes are then
//! budgeted on predicted seconds.

pub mod acceptance;
pub mod confidence;
pub mod cost;
pub mod per_request;
pub mod tree;
pub mod tree_plan;

use crate::config::{GoodputConfig, MinSurvival, VerifyMode};
use crate::decision::{ConfidenceStop, Decision, VerifyShape};
use confidence::ConfidenceModel;
use acceptance::{expected_tokens, AcceptanceModel, AcceptanceState};
use cost::{CostModel, CostState};
use per_request::{PerRequest, RequestVerify};
use serde::{Deserialize, Serialize};

/// Version of the saved learned state ([`GoodputPolicy::export_state`]); a state of another
/// version is refused. Bump it whenever [`CostState`] or [`AcceptanceState`] change meaning.
pub const STATE_VERSION: u32 = 1;

/// What the strategy saves across runs on one machine: the cost model and the long-run
/// acceptance counts (the slots' steps, probe credit and counters start afresh).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct LearnedState {
    version: u32,
    cost: CostState,
    acceptance: AcceptanceState,
}

/// Per-slot state of the strategy.
#[derive(Debug, Clone, PartialEq)]
struct Slot {
    candidates: Vec<u32>,
    current: u32,
    /// Decode iterations since the last switch.
    since_switch: u64,
    /// The batch-size bucket of the decision that set `current`.
    chosen_at: u32,
    /// Probe credit, seconds.
    credit: f64,
    /// Alternates the neighbour probed when both are equally measured.
    probe_turn: bool,
    /// A switch happened since the last report (returned by `observe`).
    switched: bool,
    verifies: u64,
}

/// What the last decision saw, for metrics and logs.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionView {
    /// Slot index.
    pub slot: usize,
    /// Batch size used for costs (padded to the graph size where one replays).
    pub batch_size: u32,
    /// Context tokens of the batch (0 when not given).
    pub context_tokens: u64,
    /// `(steps, predicted seconds, expected tokens per request)` per candidate of the slot.
    pub candidates: Vec<(u32, f64, f64)>,
    /// The steps returned.
    pub steps: u32,
    /// Whether they were a probe.
    pub probe: bool,
}

/// The `goodput` strategy's state (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct GoodputPolicy {
    cfg: GoodputConfig,
    acceptance: AcceptanceModel,
    cost: CostModel,
    slots: Vec<Slot>,
    /// Decode iterations reported.
    iteration: u64,
    /// Tokens emitted at steps 0 since the last drafting iteration (what a skipped drafter must
    /// catch up on).
    catch_up: u64,
    probes: u64,
    switches: u64,
    last: Option<DecisionView>,
    /// Per-request histories and the draft-confidence calibration (`verify = per_request`).
    per_request: PerRequest,
    /// Draft trees (the `tree` key; [`tree_plan`]).
    tree: Option<tree_plan::TreePlanner>,
    /// Draft confidence for the confidence stop (`min_survival`), and the bin edge of the rule
    /// of the last decision (`None`: no rule).
    confidence: ConfidenceModel,
    last_rule: Option<usize>,
}

impl GoodputPolicy {
    /// One slot per candidate list; every slot starts at `initial_steps` if it is a candidate,
    /// else at its middle candidate.
    pub fn new(cfg: GoodputConfig, initial_steps: u32, candidates: Vec<Vec<u32>>) -> Self {
        let max_steps = candidates.iter().flatten().copied().max().unwrap_or(0);
        let slots = candidates
            .into_iter()
            .map(|c| {
                let current = if c.contains(&initial_steps) { initial_steps } else { c[c.len() / 2] };
                Slot {
                    candidates: c,
                    current,
                    since_switch: u64::MAX / 2,
                    chosen_at: 1,
                    credit: 0.0,
                    probe_turn: false,
                    switched: false,
                    verifies: 0,
                }
            })
            .collect::<Vec<Slot>>();
        let window = cfg.acceptance_window;
        let depths: Vec<u32> = slots.iter().flat_map(|s| s.candidates.iter().copied()).collect();
        let tree = cfg.tree.map(|t| tree_plan::TreePlanner::new(t, &depths, 4 * window));
        GoodputPolicy {
            tree,
            acceptance: AcceptanceModel::new(max_steps.max(1), window),
            cost: CostModel::new(cfg.cost_window),
            cfg,
            slots,
            iteration: 0,
            catch_up: 0,
            probes: 0,
            switches: 0,
            last: None,
            per_request: PerRequest::new(window),
            confidence: ConfidenceModel::new(window.saturating_mul(4)),
            last_rule: None,
        }
    }

    /// Whether the strategy decides per request or per batch (the `verify` key).
    pub fn verify_mode(&self) -> VerifyMode {
        self.cfg.verify
    }

    /// Requests whose history the per-request decision keeps now.
    pub fn tracked_requests(&self) -> usize {
        self.per_request.tracked()
    }

    /// Steps slot `slot` runs now (a pure read).
    pub fn current_steps(&self, slot: usize) -> u32 {
        self.slots[slot].current
    }

    /// Verifies reported to slot `slot`.
    pub fn verify_count(&self, slot: usize) -> u64 {
        self.slots[slot].verifies
    }

    /// Probes run so far.
    pub fn probes(&self) -> u64 {
        self.probes
    }

    /// Iterations whose seconds the cost model left out because the machine was off its usual
    /// pace ([`cost`], layer 3).
    pub fn off_pace_skipped(&self) -> u64 {
        self.cost.skipped()
    }

    /// Switches of a slot's steps so far (probes excluded).
    pub fn switches(&self) -> u64 {
        self.switches
    }

    /// The last decision's view (None before the first).
    pub fn last_decision(&self) -> Option<&DecisionView> {
        self.last.as_ref()
    }

    /// Conditional acceptance per draft position `1..=max candidate` now.
    pub fn acceptance_rates(&self) -> Vec<f64> {
        self.acceptance.clone().rates(self.iteration)
    }

    /// Expected accepted drafts per request at `steps` now (`E(steps) - 1`).
    pub fn expected_accepted(&self, steps: u32) -> f64 {
        expected_tokens(&self.acceptance_rates(), steps) - 1.0
    }

    /// Predicted seconds of an iteration at `(b, steps, context)` (no catch-up).
    pub fn predict_seconds(&self, bucket: u32, b: u32, steps: u32, context_tokens: u64) -> f64 {
        self.cost.predict(bucket, b, steps, context_tokens as f64, 0.0)
    }

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
            let draft_only = self.per_request.draft_only_cost();
            stops = confidence::stop_rows(&self.confidence, &alpha, c, &uniform, draft_only, f64::from(b), &none, fixed);
        } else if let Some(ids) = ids {
            let s = &self.slots[slot];
            allocations = per_request::allocate_candidates(&self.cost, &self.per_request, &alpha, ids, &s.candidates, bucket, b_cost, ctx);
        }
        let cost = &self.cost;
        let s = &self.slots[slot];
        let rows: Vec<(u32, f64, f64, f64)> = s
            .candidates
            .iter()
            .enumerate()
            .map(|(i, &k)| {
                let (t, e) = match (allocations.get(i), stops.get(i).copied().flatten()) {
                    (Some(a), _) => (a.seconds, a.tokens / f64::from(b)),
                    (None, Some((cut, t))) => (t, 1.0 + cut.accepted),
                    (None, None) => (cost.predict(bucket, b_cost, k, ctx, 0.0), expected_tokens(&alpha, k)),
                };
                // A switch from 0 to drafting pays the catch-up once, spread over the horizon.
                let extra = if k > 0 && s.current == 0 && catch > 0.0 {
                    (cost.predict(bucket, b_cost, k, ctx, catch) - cost.predict(bucket, b_cost, k, ctx, 0.0)).max(0.0) / horizon
                } else {
                    0.0
                };
                (k, t, e, f64::from(b) * e / (t + extra))
            })
            .collect();
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
            let i = c.iter().position(|&k| k == steps);
            let cut = i.and_then(|i| stops.get(i).copied().flatten()).map(|(cut, _)| cut.edge);
            let min_survival = match self.cfg.min_survival {
                MinSurvival::Fixed(x) => Some(x),
                _ => cut.filter(|&e| e < confidence::BINS).map(confidence::edge),
            };
            self.last_rule = min_survival.map(confidence::edge_index);
            let mut d = Decision::uniform(steps);
            d.confidence_stop = min_survival.map(|x| ConfidenceStop { min_survival: x as f32 });
            return d;
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

    /// What the strategy learned, as JSON: `{"version": STATE_VERSION, "cost": ..., "acceptance":
    /// ...}` (the cost model and the long-run acceptance counts; [`Self::import_state`] reads it).
    pub fn export_state(&self) -> String {
        let state = LearnedState { version: STATE_VERSION, cost: self.cost.state(), acceptance: self.acceptance.state() };
        serde_json::to_string(&state).expect("the learned state is plain numbers")
    }

    /// Seeds the cost model and the acceptance prior with a state [`Self::export_state`] wrote
    /// (on the same machine, model and drafter: the caller keys it). Errors, with nothing
    /// changed, on text that does not parse, another `version`, or values out of range.
    pub fn import_state(&mut self, text: &str) -> Result<(), String> {
        let version = serde_json::from_str::<serde_json::Value>(text)
            .map_err(|e| format!("not JSON: {e}"))?
            .get("version")
            .and_then(serde_json::Value::as_u64);
        if version != Some(u64::from(STATE_VERSION)) {
            return Err(format!("version {version:?}, expected {STATE_VERSION}"));
        }
        let state: LearnedState = serde_json::from_str(text).map_err(|e| format!("bad state: {e}"))?;
        let mut cost = self.cost.clone();
        cost.restore(state.cost)?;
        let mut acceptance = self.acceptance.clone();
        acceptance.restore(&state.acceptance)?;
        self.cost = cost;
        self.acceptance = acceptance;
        Ok(())
    }

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
        if let Some(switch) = self.observe_tree(slot, bucket, b_cost, steps, accepted, seconds, context_tokens as f64, caught_up) {
            return switch;
        }
        self.iteration += 1;
        if steps > 0 {
            self.acceptance.observe(self.iteration, steps, accepted);
        }
        self.learn_iteration(slot, bucket, b, b_cost, steps, (steps, 0.0), seconds, context_tokens, caught_up)
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
        let shared = self.acceptance.rates(self.iteration);
        self.iteration += 1;
        let mut group = Vec::with_capacity(requests.len());
        for v in 1..=steps {
            group.clear();
            group.extend(requests.iter().filter(|r| r.steps == v).map(|r| r.accepted));
            self.acceptance.observe(self.iteration, v, &group);
        }
        self.per_request.observe(self.iteration, &shared, requests.iter().copied());
        let rule = self.last_rule.take();
        if self.cfg.min_survival != MinSurvival::Off {
            self.confidence.observe(steps, requests.iter().map(|r| (r.steps, r.accepted, r.draft_probs)), rule);
        }
        let b = requests.len() as u32;
        // The cost model learns the iteration as the uniform one with as many verify tokens, its
        // drafts beyond them apart (per_request, "the cost model in tokens").
        let shape = match seconds {
            Some(t) => self.per_request.learn_cost(&self.cost, bucket, b_cost, steps, requests, context_tokens as f64, t, rule.is_some()),
            None => per_request::uniform_shape(requests),
        };
        self.learn_iteration(slot, bucket, b, b_cost, steps, shape, seconds, context_tokens, caught_up)
    }

    /// The cost model, catch-up and probe-credit part of a report.
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
        context_tokens: u64,
        caught_up: Option<u64>,
    ) -> Option<u32> {
        let estimated = if steps > 0 { std::mem::take(&mut self.catch_up) } else { 0 };
        let catch = caught_up.unwrap_or(estimated);
        let settled = steps == self.slots[slot].current;
        let ctx = context_tokens as f64;
        let spent = match seconds {
            Some(t) => {
                let uniform = (t - draft_only).max(0.5 * t);
                self.cost.observe(bucket, b_cost, cell_steps, ctx, catch as f64, uniform, settled);
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
    use super::*;

    fn policy() -> GoodputPolicy {
        let cfg = GoodputConfig { probe_budget: 0.0, ..GoodputConfig::default() };
        GoodputPolicy::new(cfg, 3, vec![(0..=7).collect()])
    }

    /// A run on a device where each draft step costs 40 % of a plain decode and half the drafts
    /// are accepted: steps 1 is best.
    fn trained() -> GoodputPolicy {
        let mut p = policy();
        // 8 requests: 4 accept 0, 2 accept 1, 1 accepts 2, 1 accepts all (alpha = 0.5 per position).
        for i in 0..400u32 {
            let k = i % 8;
            let acc: Vec<i64> = [0, 0, 0, 0, 1, 1, 2, 7].iter().map(|&a: &i64| a.min(i64::from(k))).collect();
            p.observe(0, 8, 8, 8, k, &acc, Some(0.01 * (1.0 + 0.4 * f64::from(k))), 800);
        }
        p
    }

    #[test]
    fn a_seeded_policy_decides_like_the_trained_one_at_once() {
        let t = trained();
        let mut warm = trained();
        assert_eq!(warm.decide(0, 8, 8, 8, 800), 1);
        let mut fresh = policy();
        assert_ne!(fresh.decide(0, 8, 8, 8, 800), 1, "the prior alone must not already pick 1");
        let mut seeded = policy();
        seeded.import_state(&t.export_state()).unwrap();
        assert_eq!(seeded.decide(0, 8, 8, 8, 800), 1);
        for k in 0..8 {
            assert_eq!(seeded.predict_seconds(8, 8, k, 800), t.predict_seconds(8, 8, k, 800));
        }
        // Exported again, the seeded policy writes what it read.
        let again: serde_json::Value = serde_json::from_str(&seeded.export_state()).unwrap();
        let orig: serde_json::Value = serde_json::from_str(&t.export_state()).unwrap();
        assert_eq!(again["cost"]["theta"], orig["cost"]["theta"]);
        assert_eq!(again["version"], STATE_VERSION);
    }

    /// Seconds of an iteration at steps `k` that caught the drafter up over `catch` tokens: a
    /// draft step costs 40 % of a plain decode, a catch-up token 1e-5 s.
    fn secs(k: u32, catch: u64) -> f64 {
        0.01 * (1.0 + 0.4 * f64::from(k)) + 1e-5 * catch as f64
    }

    /// `policy()` started at `initial`, trained on the acceptance of `trained()` with the
    /// catch-up tokens each drafting iteration ran told (`told`) or left to the estimate.
    fn trained_with_catch_up(initial: u32, told: bool) -> GoodputPolicy {
        let cfg = GoodputConfig { probe_budget: 0.0, ..GoodputConfig::default() };
        let mut p = GoodputPolicy::new(cfg, initial, vec![(0..=7).collect()]);
        for i in 0..400u32 {
            let k = i % 8;
            let acc: Vec<i64> = [0, 0, 0, 0, 1, 1, 2, 7].iter().map(|&a: &i64| a.min(i64::from(k))).collect();
            // deferred prompts and skipped zero-step extends: a catch-up of 0..2000 tokens
            let catch = if k > 0 { u64::from(i * 397 % 2000) } else { 0 };
            let caught_up = told.then_some(catch);
            p.observe_with(0, 8, 8, 8, k, &acc, Some(secs(k, catch)), 800, caught_up);
        }
        p
    }

    #[test]
    fn the_cost_model_learns_the_catch_up_the_report_tells() {
        let told = trained_with_catch_up(3, true);
        let extra = |p: &GoodputPolicy| p.cost.predict(8, 8, 2, 800.0, 4000.0) - p.cost.predict(8, 8, 2, 800.0, 0.0);
        // told: 4000 catch-up tokens cost about 4000 * 1e-5 s
        let learned = extra(&told);
        assert!((learned - 0.04).abs() < 0.01, "learned catch-up cost {learned}, expected ~0.04");
        // without being told, the estimate (tokens emitted at steps 0 since the last drafting
        // iteration: 8 per iteration of this cycle) cannot explain the seconds
        let guessed = extra(&trained_with_catch_up(3, false));
        assert!((guessed - 0.04).abs() > 0.01, "estimated catch-up cost {guessed}");
    }

    #[test]
    fn a_switch_from_zero_is_charged_the_catch_up_the_scheduler_counts() {
        // at steps 0, the best drafting steps (1) pays off unless the catch-up it must run
        // first is large; with the zero-step extend not skipped there is none (Some(0))
        let mut none_pending = trained_with_catch_up(0, true);
        assert_eq!(none_pending.current_steps(0), 0);
        assert_eq!(none_pending.decide_with(0, 8, 8, 8, 800, Some(0)), 1);
        let mut long_pending = trained_with_catch_up(0, true);
        assert_eq!(long_pending.decide_with(0, 8, 8, 8, 800, Some(1_000_000)), 0);
        // the catch-up tokens are those told, not the estimate: after 50 iterations at steps 0
        // the estimate is 400 tokens, but the scheduler says none are pending
        let mut p = trained_with_catch_up(0, true);
        for _ in 0..50 {
            p.observe_with(0, 8, 8, 8, 0, &[0; 8], Some(secs(0, 0)), 800, Some(0));
        }
        assert_eq!(p.catch_up, 400);
        let mut estimated = p.clone();
        assert_eq!(p.decide_with(0, 8, 8, 8, 800, Some(0)), 1);
        assert_eq!(estimated.decide_with(0, 8, 8, 8, 800, None), 0, "the estimate charges 400 tokens");
    }

    #[test]
    fn another_version_or_corrupt_text_is_refused_and_changes_nothing() {
        let text = trained().export_state();
        let mut p = policy();
        let before = p.clone();
        let other = text.replacen(&format!("\"version\":{STATE_VERSION}"), "\"version\":999", 1);
        assert!(p.import_state(&other).unwrap_err().contains("version"));
        assert!(p.import_state("{not json").is_err());
        assert!(p.import_state(&text[..text.len() / 2]).is_err());
        assert!(p.import_state(&format!("{{\"version\":{STATE_VERSION}}}")).is_err());
        assert_eq!(p, before);
    }
}
