//! What a step strategy decides for one decode iteration, in a shape that can grow.
//!
//! Today every strategy decides one steps value for the whole batch ([`VerifyShape::Uniform`],
//! a chain: no tree). The type already has room for what the next changes need:
//!
//! - a verify length per request ([`VerifyShape::PerRequest`]): request `i` of the batch (in the
//!   scheduler's admission order, the order of the plan's `request_ids`) drafts and verifies
//!   `lengths[i] <= steps` tokens beyond its last one;
//! - a draft tree ([`TreeShape`], EAGLE/SGLang's `speculative_eagle_topk` and
//!   `speculative_num_draft_tokens`): `None` is a chain (top-k 1).
//!
//! The scheduler builds the plan's `steps_per_request` from [`VerifyShape::steps_for`], then caps
//! each request near its end (`max_new_tokens`, the context length) and falls back to fewer steps
//! when KV pages run short, as before.

/// How many tokens each request of the batch drafts and verifies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum VerifyShape {
    /// Every request runs the decision's `steps` (before the scheduler's caps).
    #[default]
    Uniform,
    /// Request `i` of the batch runs `lengths[i]` steps, each `<= steps` (the batch's steps are
    /// the largest, which sizes the drafter's and the verify's shapes). One entry per request.
    PerRequest(Vec<u32>),
}

impl VerifyShape {
    /// Steps of request `index` of the batch when the batch runs `steps` (a per-request length
    /// above `steps`, as after the scheduler's fallback to fewer steps, is cut to `steps`).
    ///
    /// Panics on an `index` past a `PerRequest` list (the policy checks its length against the
    /// batch size when a strategy returns it).
    #[inline]
    pub fn steps_for(&self, index: usize, steps: u32) -> u32 {
        match self {
            VerifyShape::Uniform => steps,
            VerifyShape::PerRequest(lengths) => lengths[index].min(steps),
        }
    }
}

/// The shape of a draft tree (EAGLE-2 / SGLang `--speculative-eagle-topk`,
/// `--speculative-num-draft-tokens`). Not produced by any strategy yet: reserved so that a tree
/// strategy changes no signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeShape {
    /// Draft depth (the steps of the tree's longest path).
    pub depth: u32,
    /// Children kept per node (1: a chain).
    pub topk: u32,
    /// Draft tokens verified per request (tree nodes, the root excluded).
    pub num_draft_tokens: u32,
}

/// A stop rule the worker applies after drafting (DSpark / SpecDec++): a request's verify ends
/// at the first draft position whose cumulative draft probability is below `min_survival`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConfidenceStop {
    /// Cumulative draft probability in (0, 1) below which drafts are not verified.
    pub min_survival: f32,
}

/// One strategy's decision for a decode iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// `speculative_num_steps` of the batch (0 = plain decoding through the verify path).
    pub steps: u32,
    /// Per-request verify lengths (uniform: every request runs `steps`).
    pub verify: VerifyShape,
    /// The draft tree's shape, `None` for a chain.
    pub tree: Option<TreeShape>,
    /// The confidence stop the worker applies after drafting (`None`: every request verifies its
    /// whole length). Set by the `goodput` strategy's `min_survival` key.
    pub confidence_stop: Option<ConfidenceStop>,
}

impl Decision {
    /// A chain of `steps` drafts for every request: what every strategy decides today.
    #[inline]
    pub fn uniform(steps: u32) -> Self {
        Decision { steps, verify: VerifyShape::Uniform, tree: None, confidence_stop: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_runs_the_batch_steps_for_every_request() {
        let d = Decision::uniform(3);
        assert_eq!((d.steps, d.tree, d.confidence_stop), (3, None, None));
        assert_eq!([d.verify.steps_for(0, 3), d.verify.steps_for(7, 1)], [3, 1]);
    }

    #[test]
    fn per_request_lengths_are_cut_to_the_batch_steps() {
        let v = VerifyShape::PerRequest(vec![4, 1, 0]);
        assert_eq!([v.steps_for(0, 4), v.steps_for(1, 4), v.steps_for(2, 4)], [4, 1, 0]);
        // After a fallback to 2 steps (KV pages short) no request runs more than 2.
        assert_eq!([v.steps_for(0, 2), v.steps_for(1, 2)], [2, 1]);
    }
}
