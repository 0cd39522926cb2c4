//! Routing a batch size to its slot, and the per-iteration decision of every strategy.
//!
//! Names follow SGLang's `AdaptiveSpeculativeParams` (PR #24055) so that users and tests move
//! between the two. Routing: with CUDA-graph batch sizes set, the batch size is first padded up to
//! the first graph size >= it (left unchanged when larger than all); the slot is then the one with
//! the largest lower bound <= the padded size, or the smallest slot if none.
//!
//! The contract every caller (the scheduler, users embedding the policy, the simulator) follows:
//!
//! - [`AdaptiveSpeculativeParams::decide`] once per decode iteration returns the steps and records
//!   them as the slot's *pending* decision (a repeated `decide` before the report replaces it).
//!   [`AdaptiveSpeculativeParams::get_steps_for_batch`] is a pure read of the slot's current steps.
//! - [`AdaptiveSpeculativeParams::on_verify_complete_with`] reports that iteration: accepted drafts
//!   per request (bonus excluded), checked against the steps it ran (the `steps` given, else the
//!   pending decision, else the slot's current steps), and optionally its measured wall time and
//!   the batch's context tokens, which the `goodput` strategy learns its cost model from (`ema` and
//!   `throughput_aware` ignore both).
//!
//! The strategies themselves live in [`crate::strategies`], one file each behind the
//! [`StepStrategy`] trait: the policy routes, validates and keeps the pending decision; the
//! strategy decides and learns.

use crate::config::AdaptiveConfig;
use crate::decision::{TreeShape, VerifyShape};
use crate::error::PolicyError;
use crate::goodput::GoodputPolicy;
use crate::slot::AdaptiveStepSlot;
use crate::strategies::{self, ema::EmaStrategy, DecideContext, RequestVerify, StepStrategy, VerifyObservation};
use crate::throughput::ThroughputAwarePolicy;

/// What one decode iteration runs: the strategy's [`crate::decision::Decision`] plus where the
/// policy routed it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepDecision {
    /// `speculative_num_steps` for this iteration (0 = plain decoding through the verify path).
    pub steps: u32,
    /// Tokens verified per request, the root included (SGLang's counting): `steps + 1` for a
    /// chain, `1 + ` the tree's nodes for a draft tree.
    pub num_draft_tokens: u32,
    /// The CUDA-graph batch size to replay (padded), or `None` when no graph sizes are set or the
    /// batch is larger than all of them (eager).
    pub graph_bs: Option<u32>,
    /// Index of the slot that decided (into the config's slots, ascending by lower bound).
    pub slot: usize,
    /// Per-request verify lengths (every strategy decides [`VerifyShape::Uniform`] today).
    pub verify: VerifyShape,
    /// The draft tree's shape; `None` (a chain) from every strategy today.
    pub tree: Option<TreeShape>,
    /// The confidence stop the worker applies after drafting (the `goodput` strategy's
    /// `min_survival` key; `None`: no rule).
    pub confidence_stop: Option<crate::decision::ConfidenceStop>,
}

/// What a report carries besides the accepted drafts. Every field is optional.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observation {
    /// Wall time of the decode iteration, seconds (finite, > 0).
    pub seconds: Option<f64>,
    /// Sum of the batch's KV lengths before the iteration, tokens.
    pub context_tokens: Option<u64>,
    /// The steps the iteration actually ran (overrides the pending decision).
    pub steps: Option<u32>,
    /// Tokens the drafter caught up on in this iteration before drafting (a deferred drafter
    /// prefill, tokens of steps-0 iterations whose extend was skipped); 0 when nothing was
    /// skipped or the iteration did not draft. `None`: unknown (the `goodput` strategy then
    /// assumes every request emitted at steps 0 since it last drafted is caught up).
    pub catch_up_tokens: Option<u64>,
}

/// One slot's state as every strategy reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotState {
    /// Batch-size lower bound of the slot.
    pub lower_bound: u32,
    /// Steps the slot runs now.
    pub current_steps: u32,
    /// `ema`: the EMA of accepted drafts (SGLang's `ema_accept_len`); `goodput` and
    /// `throughput_aware`: the expected accepted drafts per request at the current steps from
    /// their acceptance estimates (0 when unknown).
    pub accepted_estimate: f64,
    /// Verifies reported to the slot (`throughput_aware`: to the policy).
    pub verify_count: u64,
}

/// The adaptive policy: the strategy's state per batch-size slot, plus the router.
#[derive(Debug, Clone)]
pub struct AdaptiveSpeculativeParams {
    config: AdaptiveConfig,
    strategy: Box<dyn StepStrategy>,
    /// Lower bounds of the slots, ascending.
    bounds: Vec<u32>,
    graph_bs: Option<Vec<u32>>,
    candidate_union: Vec<u32>,
    /// Per slot: the steps of the last `decide` not reported yet.
    pending: Vec<Option<u32>>,
    /// The accepted counts of the report being checked, kept between reports so that a report
    /// allocates nothing (issue 25: a fresh `Vec` grown per report cost about 40 % of
    /// `on_verify_complete` from Python).
    scratch: Vec<i64>,
}

impl AdaptiveSpeculativeParams {
    /// One slot per config slot, each started at `initial_steps` (or its middle candidate when
    /// `initial_steps` is not one of its candidates; `throughput_aware`: one engine-wide steps
    /// value, SGLang's rule).
    pub fn new(initial_steps: u32, config: AdaptiveConfig) -> Self {
        let strategy = strategies::build(initial_steps, &config);
        Self::with_strategy(config, strategy)
    }

    /// A policy deciding with `strategy` instead of the one `config` names (a strategy outside
    /// this crate, or a test's). `strategy` must know `config.slots.len()` slots; the config
    /// still gives the routing and each slot's candidate steps.
    pub fn with_strategy(config: AdaptiveConfig, strategy: Box<dyn StepStrategy>) -> Self {
        let candidate_union = config.candidate_union();
        let bounds = config.slots.iter().map(|(b, _)| *b).collect();
        let pending = vec![None; config.slots.len()];
        AdaptiveSpeculativeParams { config, strategy, bounds, graph_bs: None, candidate_union, pending, scratch: Vec::new() }
    }

    /// The validated config this policy was built from.
    pub fn config(&self) -> &AdaptiveConfig {
        &self.config
    }

    /// Sorted union of every slot's candidate steps.
    pub fn candidate_steps(&self) -> &[u32] {
        &self.candidate_union
    }

    /// The strategy deciding the steps.
    pub fn strategy(&self) -> &dyn StepStrategy {
        self.strategy.as_ref()
    }

    /// The strategy deciding the steps, mutable (an outside strategy's own settings; reach its
    /// type through `as_any_mut`).
    pub fn strategy_mut(&mut self) -> &mut dyn StepStrategy {
        self.strategy.as_mut()
    }

    /// The `ema` slots (None under another strategy).
    pub fn ema_slots(&self) -> Option<&[AdaptiveStepSlot]> {
        self.strategy.as_any().downcast_ref::<EmaStrategy>().map(EmaStrategy::slots)
    }

    /// The `goodput` strategy's state (None under another strategy).
    pub fn goodput(&self) -> Option<&GoodputPolicy> {
        self.strategy.as_any().downcast_ref()
    }

    /// The `goodput` strategy's state, mutable (to seed it with a saved state; None under
    /// another strategy).
    pub fn goodput_mut(&mut self) -> Option<&mut GoodputPolicy> {
        self.strategy.as_any_mut().downcast_mut()
    }

    /// The `throughput_aware` strategy's state (None under another strategy).
    pub fn throughput_aware(&self) -> Option<&ThroughputAwarePolicy> {
        self.strategy.as_any().downcast_ref()
    }

    /// Every slot's state, ascending by lower bound.
    pub fn slot_states(&self) -> Vec<SlotState> {
        (0..self.bounds.len())
            .map(|i| {
                let (current_steps, accepted_estimate, verify_count) = self.strategy.slot_state(i);
                SlotState { lower_bound: self.bounds[i], current_steps, accepted_estimate, verify_count }
            })
            .collect()
    }

    /// Switches of the steps so far (every strategy; `goodput` probes excluded).
    pub fn switches(&self) -> u64 {
        self.strategy.switches()
    }

    /// Sets one entry of the `throughput_aware` cost table (or, under `goodput`, feeds the
    /// measurement to its cost model, the optional startup sweep). Errors on seconds that are not
    /// finite and > 0; a no-op under `ema`.
    pub fn set_profiled_cost(&mut self, batch_size: u32, steps: u32, seconds: f64, context_tokens: u64) -> Result<(), PolicyError> {
        if !(seconds.is_finite() && seconds > 0.0) {
            return Err(PolicyError::Seconds(seconds));
        }
        if batch_size < 1 {
            return Err(PolicyError::BatchSize(i64::from(batch_size)));
        }
        self.strategy.set_profiled_cost(batch_size, steps, seconds, context_tokens);
        Ok(())
    }

    /// Sets the captured CUDA-graph batch sizes (sorted and deduplicated here), or clears them.
    /// Errors on a size < 1.
    pub fn set_cuda_graph_bs(&mut self, sizes: Option<&[i64]>) -> Result<(), PolicyError> {
        self.graph_bs = match sizes {
            None => None,
            Some(sizes) => {
                let mut out = Vec::with_capacity(sizes.len());
                for (index, &value) in sizes.iter().enumerate() {
                    if value < 1 || value > u32::MAX as i64 {
                        return Err(PolicyError::GraphBatchSize { index, value });
                    }
                    out.push(value as u32);
                }
                out.sort_unstable();
                out.dedup();
                Some(out)
            }
        };
        Ok(())
    }

    /// The graph batch sizes, if set (ascending).
    pub fn cuda_graph_bs(&self) -> Option<&[u32]> {
        self.graph_bs.as_deref()
    }

    fn slot_for_padded(&self, padded: u32) -> usize {
        // Largest lower bound <= padded, or the smallest slot.
        self.bounds.partition_point(|&b| b <= padded).saturating_sub(1)
    }

    /// `(slot index, padded graph batch size)` for a batch of `batch_size` requests.
    pub fn route(&self, batch_size: i64) -> Result<(usize, Option<u32>), PolicyError> {
        if batch_size < 1 || batch_size > u32::MAX as i64 {
            return Err(PolicyError::BatchSize(batch_size));
        }
        let bs = batch_size as u32;
        let graph = self
            .graph_bs
            .as_ref()
            .and_then(|g| g.get(g.partition_point(|&s| s < bs)).copied());
        Ok((self.slot_for_padded(graph.unwrap_or(bs)), graph))
    }

    /// The steps a decode iteration of `batch_size` requests can run: the candidates of the slot
    /// it routes to, after padding to the graph size that replays (what start-up profiling
    /// measures, so no caller re-implements this routing). Errors for a batch size < 1.
    pub fn reachable_steps(&self, batch_size: i64) -> Result<&[u32], PolicyError> {
        let (slot, _) = self.route(batch_size)?;
        Ok(&self.config.slots[slot].1.candidate_steps)
    }

    /// Steps the slot for this batch size runs now (a pure read).
    pub fn get_steps_for_batch(&self, batch_size: i64) -> Result<u32, PolicyError> {
        let (slot, _) = self.route(batch_size)?;
        Ok(self.current_steps(slot))
    }

    fn current_steps(&self, slot: usize) -> u32 {
        self.strategy.current_steps(slot)
    }

    /// The decision for one decode iteration of `batch_size` requests with `context_tokens`
    /// tokens of context (the sum of their KV lengths before it; None: unknown). Records the steps
    /// as the slot's pending decision.
    ///
    /// Panics if the strategy breaks its contract: a per-request verify list whose length is not
    /// the batch size, or an entry above the decision's steps.
    pub fn decide(&mut self, batch_size: i64, context_tokens: Option<u64>) -> Result<StepDecision, PolicyError> {
        self.decide_with(batch_size, context_tokens, None)
    }

    /// [`Self::decide`] also told the drafter catch-up tokens pending in the batch,
    /// `catch_up_tokens` (what a drafting iteration would run first; `None`: unknown), which the
    /// `goodput` strategy charges a switch from steps 0 with.
    pub fn decide_with(
        &mut self,
        batch_size: i64,
        context_tokens: Option<u64>,
        catch_up_tokens: Option<u64>,
    ) -> Result<StepDecision, PolicyError> {
        self.decide_requests(batch_size, context_tokens, catch_up_tokens, None)
    }

    /// [`Self::decide_with`] told the batch's request ids in batch order (`request_ids`, one per
    /// request), which a per-request decision (`goodput` with `verify = per_request`) needs.
    pub fn decide_requests(
        &mut self,
        batch_size: i64,
        context_tokens: Option<u64>,
        catch_up_tokens: Option<u64>,
        request_ids: Option<&[u64]>,
    ) -> Result<StepDecision, PolicyError> {
        let (slot, graph_bs) = self.route(batch_size)?;
        let ctx = DecideContext {
            slot,
            batch_size: batch_size as u32,
            graph_bs,
            context_tokens,
            catch_up_tokens,
            candidates: &self.config.slots[slot].1.candidate_steps,
            request_ids,
        };
        let d = self.strategy.decide(&ctx);
        if let VerifyShape::PerRequest(lengths) = &d.verify {
            assert!(
                lengths.len() as i64 == batch_size && lengths.iter().all(|&n| n <= d.steps),
                "strategy {} returned per-request verify lengths {lengths:?} for a batch of {batch_size} at steps {}",
                self.strategy.name(),
                d.steps
            );
        }
        self.pending[slot] = Some(d.steps);
        Ok(StepDecision { steps: d.steps, num_draft_tokens: d.tree.map_or(d.steps, |t| t.num_draft_tokens) + 1, graph_bs, slot, verify: d.verify, tree: d.tree, confidence_stop: d.confidence_stop })
    }

    /// [`Self::on_verify_complete_with`] with nothing but the accepted drafts.
    pub fn on_verify_complete<I>(&mut self, accepted: I, batch_size: i64) -> Result<Option<u32>, PolicyError>
    where
        I: IntoIterator<Item = i64>,
    {
        self.on_verify_complete_with(accepted, batch_size, Observation::default())
    }

    /// Reports one verify of the slot of `batch_size`: accepted drafts per request (bonus
    /// excluded, each in `0..=steps` where `steps` = `obs.steps`, else the pending decision, else
    /// the slot's current steps; requests capped below the steps near their end should be left
    /// out). Returns the slot's new steps if they changed (`ema`: at this report; `goodput`,
    /// `throughput_aware`: at the decision this report answers).
    ///
    /// `ema` feeds its EMA only with verifies at the slot's current steps (an EMA of another depth
    /// means something else); `obs.seconds` and `obs.context_tokens` are used by `goodput` only.
    ///
    /// Errors (nothing changes): a batch size < 1, an accepted count out of range, seconds that
    /// are not finite and > 0.
    pub fn on_verify_complete_with<I>(&mut self, accepted: I, batch_size: i64, obs: Observation) -> Result<Option<u32>, PolicyError>
    where
        I: IntoIterator<Item = i64>,
    {
        self.report(accepted, batch_size, obs, None)
    }

    fn report<I>(&mut self, accepted: I, batch_size: i64, obs: Observation, requests: Option<&[RequestVerify<'_>]>) -> Result<Option<u32>, PolicyError>
    where
        I: IntoIterator<Item = i64>,
    {
        let (slot, graph_bs) = self.route(batch_size)?;
        if let Some(t) = obs.seconds {
            if !(t.is_finite() && t > 0.0) {
                return Err(PolicyError::Seconds(t));
            }
        }
        let steps = obs.steps.or(self.pending[slot]).unwrap_or_else(|| self.current_steps(slot));
        // one pass: check every value (nothing changes on an error) and keep them
        let mut values = std::mem::take(&mut self.scratch);
        values.clear();
        for (index, value) in accepted.into_iter().enumerate() {
            if value < 0 || value > i64::from(steps) {
                self.scratch = values;
                return Err(PolicyError::Accepted { index, value, steps });
            }
            values.push(value);
        }
        self.pending[slot] = None;
        let out = self.strategy.on_verify_complete(&VerifyObservation {
            slot,
            batch_size: batch_size as u32,
            graph_bs,
            steps,
            accepted: &values,
            seconds: obs.seconds,
            context_tokens: obs.context_tokens,
            catch_up_tokens: obs.catch_up_tokens,
            requests,
        });
        self.scratch = values;
        out
    }

    /// Reports one verify with a verify length per request (issue 28): `requests` holds every
    /// request of the batch in batch order, with the steps it verified (`<= steps`, the
    /// iteration's depth: `obs.steps`, else the pending decision), its accepted drafts (`0..=`
    /// its steps) and, optionally, the drafter's probability of each verified draft (one per
    /// step, finite, in `[0, 1]`). A batch-level strategy learns from the requests that ran the
    /// full depth, as [`Self::on_verify_complete_with`].
    ///
    /// Errors (nothing changes): those of [`Self::on_verify_complete_with`], and
    /// [`PolicyError::Requests`] naming `steps_per_request`, `accepted` or `draft_probs`.
    pub fn on_verify_complete_requests(&mut self, requests: &[RequestVerify<'_>], obs: Observation) -> Result<Option<u32>, PolicyError> {
        let batch_size = requests.len() as i64;
        let (slot, _) = self.route(batch_size)?;
        let steps = obs.steps.or(self.pending[slot]).unwrap_or_else(|| self.current_steps(slot));
        // a draft tree's per-request counts are its kept nodes (issue 29 item 5): up to N
        let tree = self.goodput().and_then(|g| g.pending_tree()).filter(|t| t.depth == steps);
        let most = tree.map_or(steps, |t| t.num_draft_tokens);
        for (i, r) in requests.iter().enumerate() {
            let bad = |m: String| Err(PolicyError::Requests(m));
            if r.steps > most {
                return bad(format!("steps_per_request[{i}] = {} is above the iteration's steps {most}", r.steps));
            }
            if r.accepted < 0 || r.accepted > i64::from(r.steps) {
                return bad(format!("accepted[{i}] = {} is outside 0..={} (its steps_per_request)", r.accepted, r.steps));
            }
            if let Some(q) = r.draft_probs {
                if q.len() != r.steps as usize || !q.iter().all(|p| (0.0..=1.0).contains(p)) {
                    return bad(format!("draft_probs of request {i}: {} probabilities in [0, 1] expected (its steps_per_request), got {q:?}", r.steps));
                }
            }
        }
        let full = requests.iter().filter(|r| r.steps == steps).map(|r| r.accepted);
        self.report(full, batch_size, Observation { steps: Some(steps), ..obs }, Some(requests))
    }

    /// The graph batch sizes whose slot can choose `steps` (only those graphs need capturing for
    /// it), or `None` when no graph sizes are set.
    pub fn cuda_graph_bs_for_step(&self, steps: u32) -> Option<Vec<u32>> {
        self.graph_bs.as_ref().map(|sizes| {
            sizes
                .iter()
                .copied()
                .filter(|&g| self.config.slots[self.slot_for_padded(g)].1.candidate_steps.contains(&steps))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> AdaptiveSpeculativeParams {
        AdaptiveSpeculativeParams::new(3, AdaptiveConfig::ema_default())
    }

    #[test]
    fn routes_to_largest_bound_at_or_below() {
        let p = params();
        let slot = |bs| p.route(bs).unwrap().0;
        assert_eq!([slot(1), slot(7), slot(8), slot(31), slot(32), slot(63), slot(64), slot(1000)], [0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(p.route(0), Err(PolicyError::BatchSize(0)));
    }

    #[test]
    fn smallest_slot_when_below_every_bound() {
        let cfg = AdaptiveConfig::from_json(r#"{"4": {"candidate_steps": [2]}, "16": {"candidate_steps": [0]}}"#).unwrap();
        let p = AdaptiveSpeculativeParams::new(2, cfg);
        assert_eq!(p.route(1).unwrap().0, 0);
        assert_eq!(p.get_steps_for_batch(1).unwrap(), 2);
    }

    #[test]
    fn graph_padding_decides_the_slot() {
        let mut p = params();
        p.set_cuda_graph_bs(Some(&[16, 1, 2, 4, 8, 8])).unwrap();
        assert_eq!(p.cuda_graph_bs(), Some(&[1, 2, 4, 8, 16][..]));
        // 5 pads to 8, which is slot 8.
        assert_eq!(p.route(5).unwrap(), (1, Some(8)));
        // Larger than every graph: unchanged, eager.
        assert_eq!(p.route(40).unwrap(), (2, None));
        let d = p.decide(5, None).unwrap();
        assert_eq!((d.steps, d.num_draft_tokens, d.graph_bs), (3, 4, Some(8)));
        assert!(p.set_cuda_graph_bs(Some(&[0])).is_err());
        p.set_cuda_graph_bs(None).unwrap();
        assert_eq!(p.route(5).unwrap(), (0, None));
    }

    #[test]
    fn initial_steps_per_slot() {
        let p = params();
        // 3 is a candidate of slots 1 and 8; slot 32 falls back to its middle ([0, 1][1] = 1).
        let steps: Vec<u32> = p.slot_states().iter().map(|s| s.current_steps).collect();
        assert_eq!(steps, vec![3, 3, 1, 0]);
        assert_eq!(p.candidate_steps(), &[0, 1, 3, 5, 7]);
    }

    #[test]
    fn graph_sizes_per_steps_are_pruned() {
        let mut p = params();
        p.set_cuda_graph_bs(Some(&[1, 2, 4, 8, 16, 32, 48, 64, 128])).unwrap();
        assert_eq!(p.cuda_graph_bs_for_step(7).unwrap(), vec![1, 2, 4]);
        assert_eq!(p.cuda_graph_bs_for_step(3).unwrap(), vec![1, 2, 4, 8, 16]);
        assert_eq!(p.cuda_graph_bs_for_step(1).unwrap(), vec![1, 2, 4, 8, 16, 32, 48]);
        assert_eq!(p.cuda_graph_bs_for_step(0).unwrap(), vec![8, 16, 32, 48, 64, 128]);
        assert_eq!(p.cuda_graph_bs_for_step(2).unwrap(), Vec::<u32>::new());
        assert!(params().cuda_graph_bs_for_step(3).is_none());
    }

    #[test]
    fn reachable_steps_follow_the_routing_with_graph_padding() {
        let mut p = params();
        assert_eq!(p.reachable_steps(7).unwrap(), &[1, 3, 5, 7]);
        assert_eq!(p.reachable_steps(8).unwrap(), &[0, 1, 3]);
        assert_eq!(p.reachable_steps(100).unwrap(), &[0]);
        // 7 requests replay the graph of 16: slot 8's candidates
        p.set_cuda_graph_bs(Some(&[1, 2, 4, 16])).unwrap();
        assert_eq!(p.reachable_steps(7).unwrap(), &[0, 1, 3]);
        assert_eq!(p.reachable_steps(4).unwrap(), &[1, 3, 5, 7]);
        // above the largest graph: eager, the batch size itself routes
        assert_eq!(p.reachable_steps(40).unwrap(), &[0, 1]);
        assert!(p.reachable_steps(0).is_err());
    }

    #[test]
    fn verify_feeds_only_the_routed_slot() {
        let mut p = params();
        for _ in 0..15 {
            p.on_verify_complete([0i64, 0, 0], 2).unwrap();
        }
        let steps: Vec<u32> = p.slot_states().iter().map(|s| s.current_steps).collect();
        assert_eq!(steps, vec![1, 3, 1, 0]);
        assert!(p.on_verify_complete([0i64], 0).is_err());
    }
}
