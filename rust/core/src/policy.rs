//! Routing a batch size to its slot, and the per-iteration decision.
//!
//! Names follow SGLang's `AdaptiveSpeculativeParams` (PR #24055) so that users and tests move
//! between the two. Routing: with CUDA-graph batch sizes set, the batch size is first padded up to
//! the first graph size >= it (left unchanged when larger than all); the slot is then the one with
//! the largest lower bound <= the padded size, or the smallest slot if none.

use crate::config::AdaptiveConfig;
use crate::error::PolicyError;
use crate::slot::AdaptiveStepSlot;

/// What one decode iteration runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepDecision {
    /// `speculative_num_steps` for this iteration (0 = plain decoding through the verify path).
    pub steps: u32,
    /// Tokens verified per request: `steps + 1`.
    pub num_draft_tokens: u32,
    /// The CUDA-graph batch size to replay (padded), or `None` when no graph sizes are set or the
    /// batch is larger than all of them (eager).
    pub graph_bs: Option<u32>,
    /// Index of the slot that decided (into the config's slots, ascending by lower bound).
    pub slot: usize,
}

/// The adaptive policy: one [`AdaptiveStepSlot`] per batch-size range, plus the router.
#[derive(Debug, Clone)]
pub struct AdaptiveSpeculativeParams {
    config: AdaptiveConfig,
    slots: Vec<AdaptiveStepSlot>,
    /// Lower bounds of the slots, ascending (parallel to `slots`).
    bounds: Vec<u32>,
    graph_bs: Option<Vec<u32>>,
    candidate_union: Vec<u32>,
}

impl AdaptiveSpeculativeParams {
    /// One slot per config slot, each started at `initial_steps` (or its middle candidate when
    /// `initial_steps` is not one of its candidates).
    pub fn new(initial_steps: u32, config: AdaptiveConfig) -> Self {
        let slots = config
            .slots
            .iter()
            .map(|(_, c)| AdaptiveStepSlot::new(initial_steps, c.clone()))
            .collect();
        let bounds = config.slots.iter().map(|(b, _)| *b).collect();
        let candidate_union = config.candidate_union();
        AdaptiveSpeculativeParams { config, slots, bounds, graph_bs: None, candidate_union }
    }

    /// The validated config this policy was built from.
    pub fn config(&self) -> &AdaptiveConfig {
        &self.config
    }

    /// Sorted union of every slot's candidate steps.
    pub fn candidate_steps(&self) -> &[u32] {
        &self.candidate_union
    }

    /// The slots, ascending by lower bound, with their lower bounds.
    pub fn slots(&self) -> impl Iterator<Item = (u32, &AdaptiveStepSlot)> {
        self.bounds.iter().copied().zip(self.slots.iter())
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

    /// Steps the slot for this batch size chooses now.
    pub fn get_steps_for_batch(&self, batch_size: i64) -> Result<u32, PolicyError> {
        let (slot, _) = self.route(batch_size)?;
        Ok(self.slots[slot].current_steps())
    }

    /// The full decision for one decode iteration.
    pub fn decide(&self, batch_size: i64) -> Result<StepDecision, PolicyError> {
        let (slot, graph_bs) = self.route(batch_size)?;
        let steps = self.slots[slot].current_steps();
        Ok(StepDecision { steps, num_draft_tokens: steps + 1, graph_bs, slot })
    }

    /// Feeds one verify's accepted drafts per request (bonus excluded, each in
    /// `0..=steps`) to the slot of `batch_size`. Returns the slot's new steps if they changed.
    pub fn on_verify_complete<I>(&mut self, accepted: I, batch_size: i64) -> Result<Option<u32>, PolicyError>
    where
        I: IntoIterator<Item = i64>,
    {
        let (slot, _) = self.route(batch_size)?;
        self.slots[slot].update(accepted)
    }

    /// The graph batch sizes whose slot can choose `steps` (only those graphs need capturing for
    /// it), or `None` when no graph sizes are set.
    pub fn cuda_graph_bs_for_step(&self, steps: u32) -> Option<Vec<u32>> {
        self.graph_bs.as_ref().map(|sizes| {
            sizes
                .iter()
                .copied()
                .filter(|&g| self.slots[self.slot_for_padded(g)].config().candidate_steps.contains(&steps))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> AdaptiveSpeculativeParams {
        AdaptiveSpeculativeParams::new(3, AdaptiveConfig::default_config())
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
        let d = p.decide(5).unwrap();
        assert_eq!((d.steps, d.num_draft_tokens, d.graph_bs), (3, 4, Some(8)));
        assert!(p.set_cuda_graph_bs(Some(&[0])).is_err());
        p.set_cuda_graph_bs(None).unwrap();
        assert_eq!(p.route(5).unwrap(), (0, None));
    }

    #[test]
    fn initial_steps_per_slot() {
        let p = params();
        // 3 is a candidate of slots 1 and 8; slot 32 falls back to its middle ([0, 1][1] = 1).
        let steps: Vec<u32> = p.slots().map(|(_, s)| s.current_steps()).collect();
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
    fn verify_feeds_only_the_routed_slot() {
        let mut p = params();
        for _ in 0..15 {
            p.on_verify_complete([0i64, 0, 0], 2).unwrap();
        }
        let steps: Vec<u32> = p.slots().map(|(_, s)| s.current_steps()).collect();
        assert_eq!(steps, vec![1, 3, 1, 0]);
        assert!(p.on_verify_complete([0i64], 0).is_err());
    }
}
