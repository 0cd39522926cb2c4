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
//!   A probe verifies its depth uniformly, under the automatic confidence stop too: it is there to
//!   measure the depth's cell, and a shortened iteration teaches no cell.
//! - **Shortened iterations' own cells.** The uniform cells learn uniform iterations only; a
//!   stopped iteration teaches a cell keyed by bucket, drafted depth and verify tokens per
//!   request how far its seconds were from the stop row's interpolated price, and the stop's
//!   rows carry that factor ([`shortened`]).
//! - **Survivors of a stop.** An iteration the confidence stop cut teaches the per-request
//!   histories and the confidence model, not the shared per-position acceptance: under a stop
//!   only the confident requests reach deep positions, and their acceptance overstates the
//!   population's.
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
pub mod shortened;
pub mod tree;
pub mod tree_plan;
mod decide;
mod report;
mod state;
#[cfg(test)]
mod tests;

use crate::config::{GoodputConfig, VerifyMode};
use confidence::ConfidenceModel;
use acceptance::{expected_tokens, AcceptanceModel};
use cost::CostModel;
use per_request::PerRequest;
use shortened::ShortenedCells;
pub use state::STATE_VERSION;

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
    /// Cost cells of shortened iterations, keyed by verify tokens ([`shortened`]).
    shortened: ShortenedCells,
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
        let cfg_cost_window = cfg.cost_window;
        let mut cost = CostModel::new(cfg.cost_window);
        if cfg.verify == VerifyMode::PerRequest {
            cost.use_cell_context_slopes();
        }
        GoodputPolicy {
            tree,
            acceptance: AcceptanceModel::new(max_steps.max(1), window),
            cost,
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
            shortened: ShortenedCells::new(cfg_cost_window),
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

    /// The draft-confidence calibration's decayed `(reported, survived)` counts per bin of
    /// cumulative draft probability ([`confidence::bin`]): chain positions and, under per-request
    /// node budgets, draft-tree nodes ([`ConfidenceModel::observe_nodes`]).
    pub fn confidence_calibration(&self) -> Vec<(f64, f64)> {
        self.confidence.calibration().to_vec()
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
}
