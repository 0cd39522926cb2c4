//! Draft trees in the scheduler (issue 29): the tree configuration and its checks, the tree a
//! decode iteration runs, and the scratch KV slots of its nodes.
//!
//! # Counting the root
//!
//! The configuration takes SGLang's `speculative_num_draft_tokens`: the tokens each request
//! verifies per iteration, *the root included* (the root is the request's last emitted token,
//! verified at position `L`; with `speculative_eagle_topk = 1`, a chain, SGLang requires
//! `speculative_num_steps + 1`). Everything past the configuration counts the tree's nodes
//! *without* the root, `N = speculative_num_draft_tokens - 1` ([`TreeShape::num_draft_tokens`],
//! `Plan::num_draft_tokens`): the root already has its KV slot (position `L` of the chain's
//! `out_loc`), so `N` is exactly the scratch slots a request needs, and a chain's `N` is its
//! `steps`. The one conversion is [`validate_tree`].
//!
//! # Which trees
//!
//! An EAGLE-2 tree of depth `D` and top-k `K` (SGLang's `build_tree`): level 1 keeps the `K`
//! children of the root, each further level expands the `K` best frontier nodes into `K`
//! children each, so the candidates are `K + (D - 1) * K^2` nodes, of which the best `N` (by
//! cumulative draft probability) are verified. Hence `D <= N <= min(K + (D - 1) K^2, 64)`:
//! at least one full-depth path fits, at most every candidate.
//!
//! # Scratch slots
//!
//! A tree iteration reserves KV as a chain of `steps_per_request[b]` steps (positions
//! `L ..= L + steps_r`, `Plan::out_loc`) **plus** `N` scratch slots per request
//! (`Plan::scratch_loc`, `[B * S]`, request-major, `S = max(N, K (D - 1))`: see
//! [`scratch_per_request`]), taken from the page pool as one batch-wide
//! page run held by a reserved pool owner ([`SCRATCH_OWNER`]), so the pool's accounting sees
//! them and admission counts them (`ceil(R * N / page_size)` pages for `R` running requests).
//! The worker writes tree nodes' KV there, copies the accepted path into the chain slots, and
//! the scheduler frees the whole run when the iteration's report comes in (or the plan is
//! abandoned); a request aborted or preempted while the plan is in flight gives its scratch
//! slots back with the rest of the run at that report (its other pages are freed at once).
//! Between iterations no scratch slot is held.

use super::{Scheduler, SchedulerError};
use crate::decision::TreeShape;

/// Most tree nodes per request (the root excluded), and most `speculative_eagle_topk`.
pub const MAX_TREE_NODES: u32 = 64;

/// The page-pool owner id of a tree iteration's scratch slots (request ids count up from 0
/// and never reach it).
pub(super) const SCRATCH_OWNER: u64 = u64::MAX;

/// A configured draft tree: fixed steps run it at every depth `steps > 0`; with the adaptive
/// policy it bounds the trees a strategy may return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeConfig {
    /// `speculative_eagle_topk`, 2..=64 (a top-k of 1 is a chain: no `TreeConfig`).
    pub topk: u32,
    /// Tree nodes per request, the root excluded (`speculative_num_draft_tokens - 1`).
    pub num_draft_tokens: u32,
}

/// Scratch slots one request of a tree iteration holds: its `N` nodes' target KV and the
/// drafter's fed frontier nodes (`K` per level `2..=D`, in the drafter's own pool at the same
/// slot indices), so `max(N, K (D - 1))`. The worker uses the first `N` for the nodes and the
/// first `K (D - 1)` for the drafter (`worker/tree_step.py`).
pub fn scratch_per_request(depth: u32, topk: u32, num_draft_tokens: u32) -> u64 {
    u64::from(num_draft_tokens).max(u64::from(topk) * u64::from(depth.saturating_sub(1)))
}

/// Candidate nodes of an EAGLE-2 tree of `depth >= 1` and `topk`: `topk + (depth - 1) topk^2`.
pub fn max_tree_nodes(depth: u32, topk: u32) -> u64 {
    let k = u64::from(topk);
    k + u64::from(depth.saturating_sub(1)) * k * k
}

fn invalid(field: &'static str, message: String) -> SchedulerError {
    SchedulerError::InvalidConfig { field, message }
}

/// Checks SGLang's `speculative_eagle_topk` and `speculative_num_draft_tokens` (root included;
/// `None`: the chain's `steps + 1` at top-k 1, required above) against `steps`, the largest
/// steps (tree depth) the scheduler can run, and returns the tree (`None`: a chain).
///
/// Errors: [`SchedulerError::InvalidConfig`] naming the field and its allowed values:
/// `speculative_eagle_topk` outside `1..=64`, or above 1 with `steps == 0`;
/// `speculative_num_draft_tokens` other than `steps + 1` at top-k 1 (SGLang silently adjusts
/// it; specdial refuses), missing at top-k > 1, or outside
/// `steps + 1 ..= min(topk + (steps - 1) topk^2, 64) + 1`.
pub fn validate_tree(
    steps: u32,
    topk: u32,
    num_draft_tokens: Option<u32>,
) -> Result<Option<TreeConfig>, SchedulerError> {
    if !(1..=MAX_TREE_NODES).contains(&topk) {
        return Err(invalid(
            "speculative_eagle_topk",
            format!("must be in 1..={MAX_TREE_NODES} (1: a chain), got {topk}"),
        ));
    }
    if topk == 1 {
        return match num_draft_tokens {
            Some(m) if m != steps + 1 => Err(invalid(
                "speculative_num_draft_tokens",
                format!(
                    "with speculative_eagle_topk 1 (a chain) it must be speculative_num_steps + 1 \
                     = {} (the last token plus the drafts, SGLang's counting), got {m}",
                    steps + 1
                ),
            )),
            _ => Ok(None),
        };
    }
    if steps == 0 {
        return Err(invalid(
            "speculative_eagle_topk",
            format!(
                "{topk} drafts a tree, which needs speculative_num_steps >= 1 (its depth), got 0; \
                 pass speculative_eagle_topk 1 for plain decoding"
            ),
        ));
    }
    let hi = max_tree_nodes(steps, topk).min(u64::from(MAX_TREE_NODES)) as u32;
    let allowed = format!(
        "{}..={} (the root plus {steps}..={hi} tree nodes: at least one path of \
         speculative_num_steps {steps}, at most min(topk + (steps - 1) * topk^2, \
         {MAX_TREE_NODES}) nodes at speculative_eagle_topk {topk})",
        steps + 1,
        hi + 1
    );
    match num_draft_tokens {
        None => Err(invalid(
            "speculative_num_draft_tokens",
            format!("is required with speculative_eagle_topk {topk} > 1: pass one of {allowed}"),
        )),
        Some(m) if m < steps + 1 || m > hi + 1 => Err(invalid(
            "speculative_num_draft_tokens",
            format!("must be in {allowed}, got {m}"),
        )),
        Some(m) => Ok(Some(TreeConfig {
            topk,
            num_draft_tokens: m - 1,
        })),
    }
}

impl TreeConfig {
    /// The tree a decode iteration at `steps` runs under this config: `None` at steps 0.
    pub fn at_depth(self, steps: u32) -> Option<TreeShape> {
        (steps > 0).then_some(TreeShape {
            depth: steps,
            topk: self.topk,
            num_draft_tokens: self.num_draft_tokens,
        })
    }
}

impl Scheduler {
    /// Sets the draft tree from SGLang's `speculative_eagle_topk` and
    /// `speculative_num_draft_tokens` (root included, see the [module docs](self)), checked
    /// against the largest steps this scheduler can run (the fixed steps, or the policy's
    /// largest candidate). Top-k 1 clears it (chains). With fixed steps every decode iteration
    /// at steps `D > 0` is the tree `(D, topk, N)`; with the adaptive policy the config bounds
    /// the trees its strategy returns (`Decision::tree`), and admission reserves scratch slots
    /// for `N` nodes per request either way. Takes effect at the next plan.
    ///
    /// Errors: those of [`validate_tree`], and [`SchedulerError::InvalidConfig`] naming
    /// `speculative_num_draft_tokens` when one request of `context_length` tokens and its `N`
    /// scratch slots do not fit the pool together (the scheduler is unchanged).
    pub fn set_draft_tree(
        &mut self,
        topk: u32,
        num_draft_tokens: Option<u32>,
    ) -> Result<(), SchedulerError> {
        let tree = validate_tree(self.max_steps(), topk, num_draft_tokens)?;
        self.check_scratch_fits(self.max_steps(), tree)?;
        self.tree = tree;
        Ok(())
    }

    /// One request of `context_length` tokens and the scratch slots of `tree` at depth `depth`
    /// (`max(N, K (depth - 1))`, [`scratch_per_request`]) must fit the pool alone, or admission
    /// could wait for pages forever. Checked when the tree is set and again when the largest
    /// steps grow ([`Self::set_fixed_steps`]): a deeper tree feeds more frontier nodes.
    ///
    /// Errors: [`SchedulerError::InvalidConfig`] naming `speculative_num_draft_tokens`.
    pub(super) fn check_scratch_fits(
        &self,
        depth: u32,
        tree: Option<TreeConfig>,
    ) -> Result<(), SchedulerError> {
        let ps = u64::from(self.config.page_size);
        let n = tree.map_or(0, |t| scratch_per_request(depth, t.topk, t.num_draft_tokens));
        let request_pages = u64::from(self.config.context_length).div_ceil(ps);
        if request_pages + n.div_ceil(ps) > u64::from(self.config.num_pages) {
            return Err(invalid(
                "speculative_num_draft_tokens",
                format!(
                    "{} scratch slots (tree nodes and drafter frontier at depth {}) need {} KV pages \
                     of scratch besides the {} pages of one request of context_length {}, more \
                     than num_pages = {}: enlarge the KV cache or pass fewer tokens",
                    n,
                    depth,
                    n.div_ceil(ps),
                    request_pages,
                    self.config.context_length,
                    self.config.num_pages
                ),
            ));
        }
        Ok(())
    }

    /// The configured draft tree (`None`: chains).
    pub fn draft_tree(&self) -> Option<TreeConfig> {
        self.tree
    }

    /// `(speculative_eagle_topk, speculative_num_draft_tokens)` in SGLang's counting (root
    /// included): `(1, steps + 1)` for chains at the largest steps.
    pub fn draft_tree_flags(&self) -> (u32, u32) {
        match self.tree {
            Some(t) => (t.topk, t.num_draft_tokens + 1),
            None => (1, self.max_steps() + 1),
        }
    }

    /// Scratch pages `running` requests need for one tree iteration of the configured tree
    /// (0 for chains): what admission reserves besides the chains' pages.
    pub(super) fn scratch_pages(&self, running: u64) -> u64 {
        let n = self.tree.map_or(0, |t| {
            scratch_per_request(self.max_steps(), t.topk, t.num_draft_tokens)
        });
        (running * n).div_ceil(u64::from(self.config.page_size))
    }

    /// Scratch pages of a tree iteration over `b` requests (0 for a chain).
    pub(super) fn scratch_pages_for(&self, tree: Option<TreeShape>, b: usize) -> u64 {
        let n = tree.map_or(0, |t| {
            scratch_per_request(t.depth, t.topk, t.num_draft_tokens)
        });
        (b as u64 * n).div_ceil(u64::from(self.config.page_size))
    }

    /// Reserves the scratch slots of a tree iteration over `b` requests into `out` (`[b * N]`,
    /// request-major). The pages were counted (`scratch_pages_for`) and made free.
    pub(super) fn reserve_scratch(
        &mut self,
        tree: Option<TreeShape>,
        b: usize,
        out: &mut Vec<i64>,
    ) {
        let Some(t) = tree else { return };
        self.pool
            .add_request(SCRATCH_OWNER)
            .expect("no scratch is held between iterations");
        self.pool
            .reserve_into(
                SCRATCH_OWNER,
                b as u64 * scratch_per_request(t.depth, t.topk, t.num_draft_tokens),
                out,
            )
            .expect("scratch pages were counted");
    }

    /// Frees the scratch slots of the iteration just reported or abandoned (none for a chain).
    pub(super) fn release_scratch(&mut self) {
        if self.pool.has_request(SCRATCH_OWNER) {
            self.pool
                .free_request(SCRATCH_OWNER)
                .expect("scratch owner is registered");
        }
    }

    /// The check of the scratch slots for [`Scheduler::check_invariants`]: held exactly while a
    /// tree plan is in flight, `B * N` of them. Returns the pages held.
    pub(super) fn check_scratch(&self) -> Result<u64, String> {
        let expected = self.in_flight.as_ref().and_then(|fl| {
            fl.tree.map(|t| {
                fl.ids.len() as u64 * scratch_per_request(t.depth, t.topk, t.num_draft_tokens)
            })
        });
        let held = self
            .pool
            .has_request(SCRATCH_OWNER)
            .then(|| self.pool.len(SCRATCH_OWNER).expect("registered"));
        match (expected, held) {
            (None, None) => Ok(0),
            (Some(n), Some(len)) if n == len => {
                Ok(self.pool.pages(SCRATCH_OWNER).expect("registered").len() as u64)
            }
            _ => Err(format!(
                "scratch slots held {held:?}, the plan in flight needs {expected:?}"
            )),
        }
    }
}
