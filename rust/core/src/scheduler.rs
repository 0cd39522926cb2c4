//! Continuous-batching scheduler: request queues, admission, chunked prefill, KV pages,
//! per-iteration `steps`, preemption. Python runs the passes; this decides what they run on.
//!
//! # The loop
//!
//! ```text
//! id = add_request(prompt_ids, max_new_tokens, stop_token_ids, ignore_eos)   // any time
//! loop { plan = schedule()?  (None: nothing to do)
//!        run the passes of `plan`
//!        outcome = report(tokens, offsets, accepted)? }                       // stream outcome
//! abort(id) / finish_request(id, reason)                                     // any time
//! ```
//!
//! `schedule` and `report` alternate strictly: one plan is in flight at a time.
//!
//! # Rules
//!
//! - **KV convention.** A running request with `T` tokens (prompt + output) holds KV for positions
//!   `0 .. T - 1`: its last token has no KV yet and is the input of its next decode. The target
//!   and the drafter share KV indices, so one page table serves both.
//! - **FCFS admission.** Waiting requests are admitted strictly in queue order (no skipping; the
//!   prefix cache orders the queue longest cached prefix first, see below),
//!   while the prefill token budget (`max_prefill_tokens`), the running bound
//!   (`max_running_requests`, prefilling included) and the pages allow. A request is admitted only
//!   if, after its chunk, the free pages still cover one decode iteration of every running
//!   request and of itself (if the chunk ends its prefill) at the largest steps the policy can
//!   choose. So the decode right after an admission never preempts what was just prefilled
//!   (which would waste the prefill and could thrash). Every decode iteration emits at least one
//!   token per request in it, so the loop always progresses.
//! - **Chunked prefill.** The last request admitted in a prefill iteration takes what is left of
//!   the budget; if its prompt is longer it stays *prefilling* (at most one such request) and
//!   later prefill iterations continue it first.
//! - **Prefill before decode, with alternation.** A prefill iteration runs whenever something
//!   can be prefilled, except right after a prefill iteration that left a prompt unfinished: then,
//!   if any request is running, a decode iteration runs first. So a long prompt costs the running
//!   requests at most every other iteration; short prompts are admitted with priority (as in
//!   SGLang and nano-vllm), which is bounded by `max_running_requests`.
//! - **Steps.** A decode iteration over `B` running requests with `C` KV tokens asks the policy
//!   (the adaptive [`AdaptiveSpeculativeParams::decide`] with `C` as `context_tokens`, once per
//!   plan, or the fixed steps) for `steps` at `B`; request `r`, which may still produce `rem`
//!   tokens (by `max_new_tokens` and the context end), gets `steps_r = min(steps, rem - 1)`
//!   drafts, so one iteration never emits more than it may keep, and reserves exactly
//!   `steps_r + 1` slots (positions `L ..= L + steps_r`).
//! - **Draft trees** (issue 29; rules in `scheduler/tree.rs`). With a tree configured
//!   ([`Scheduler::set_draft_tree`], SGLang's `speculative_eagle_topk` /
//!   `speculative_num_draft_tokens`), a decode iteration at steps `D > 0` (fixed steps, or a
//!   strategy's `Decision::tree`) reserves KV as a chain of `D` steps plus `N` scratch slots per
//!   request (`Plan::scratch_loc`), freed at its report; admission counts the scratch pages of
//!   every request that will decode, so the decode after an admission never preempts for them.
//! - **Capacity first.** The pages the iteration needs at the chosen steps are counted before
//!   anything is reserved. While they exceed the free pages, the plan first runs fewer steps (the
//!   slot's lower candidates, largest first; adaptive only), and only when even the lowest does
//!   not fit preempts the most recently admitted request (prefilling or running) and decides
//!   again for the smaller batch. The plan carries the steps it actually runs.
//! - **Prefix cache** (`enable_prefix_caching`; rules in `scheduler/cache.rs`). Admission takes
//!   the longest cached prefix of whole pages (one token left to prefill) and counts only the
//!   suffix; a request that would recompute a page an earlier request of the same prefill plan
//!   computes waits for the next plan. After each report a request's committed, drafter-covered
//!   full pages join the tree (never a rejected verify slot). Pages only the cache holds count as
//!   free and are evicted (LRU leaves first) before anything is preempted. New waiting requests
//!   are admitted longest cached prefix first (SGLang's `lpm`) while at most 128 wait, else FCFS.
//! - **Preemption.** A preempted request frees all its pages and goes back to the *front* of the
//!   waiting queue (earlier-admitted ones in front), keeping its tokens. It is re-prefilled later
//!   over `prompt + output[..-1]` (no token is sampled then; with the prefix cache, from the
//!   pages of its own it cached) and continues where it stopped, so its output is unchanged. The plan's `preempted` lists it; `stats().preemptions` counts.
//! - **Report.** Emitted tokens are appended one by one; the first EOS (unless `ignore_eos`),
//!   stop token, `max_new_tokens`-th token or `context_length`-th token finishes the request and
//!   drops what follows. Unfinished requests keep KV `L ..= L + accepted` (rejected drafts' slots
//!   are freed); finished ones free everything.
//! - **Rows.** Every admitted request holds a worker row in `0 .. max_running_requests`,
//!   taken at admission (the lowest free one first, then the most recently freed) and given back
//!   when it finishes, is aborted or is preempted. No two admitted requests share a row; the plan
//!   carries each request's row (`Plan::rows`), so the worker keeps no request -> row map. A
//!   prefill chunk starting at position 0 is a (re)start of its row.
//! - **Policy feedback.** After a decode iteration the policy's slot for `B` is fed the accepted
//!   drafts of the requests with `steps_r == steps` (all of them at `steps = 0`), the steps the plan
//!   ran, the batch's context tokens and, through [`Scheduler::report_timed`], the iteration's
//!   measured seconds. Requests capped near their end are left out of the accepted drafts: their
//!   count is bounded by the cap, not by the drafter. Not fed in fixed-steps mode.
//! - **Drafter catch-up.** With `skip_zero_step_draft_extend`, a steps-0 iteration leaves the
//!   drafter behind by the tokens it emitted, and a prefill planned while the last decode ran
//!   steps 0 leaves the drafter's prefill to the catch-up (`Plan::draft_prefill` false). Each
//!   request counts what its drafter has not run over (`draft_lag`, 0 at admission); a drafting
//!   iteration catches the whole batch up, and the policy is told those tokens
//!   ([`crate::Observation::catch_up_tokens`]) and, when it decides, the batch's pending ones.
//!
mod cache;
#[cfg(test)]
mod cache_tests;
mod config;
mod invariants;
mod plan;
mod report;
mod request;
mod schedule;
mod stats;
#[cfg(test)]
mod tests;
mod tree;
#[cfg(test)]
mod tree_tests;

use std::collections::VecDeque;

pub use config::{SchedulerConfig, SchedulerError};
pub use plan::{GraphKey, Plan, PlanKind, ReportOutcome, TraceRecord};
pub use request::{FinishReason, Finished, RequestState};
pub use report::ReportExtras;
pub use stats::SchedulerStats;
pub use tree::{max_tree_nodes, scratch_per_request, validate_tree, TreeConfig, MAX_TREE_NODES};

use crate::id_hash::IdMap;
use crate::kv::PagePool;
use crate::policy::AdaptiveSpeculativeParams;
use crate::prefix_cache::{PrefixCache, ROOT};
use request::Request;
use stats::Counters;

type RequestMap = IdMap<Request>;

/// Where the steps of a decode iteration come from.
#[derive(Debug, Clone)]
pub enum StepsSource {
    /// The same steps every iteration (0..=32).
    Fixed(u32),
    /// The adaptive policy, fed after every decode iteration.
    Adaptive(AdaptiveSpeculativeParams),
}

/// What `report` needs to check and apply the plan in flight.
#[derive(Debug, Clone)]
struct InFlight {
    kind: PlanKind,
    ids: Vec<u64>,
    steps: u32,
    /// Decode: the steps came from the policy (which is then fed the results).
    from_policy: bool,
    /// Decode: the batch's KV tokens before the iteration (the policy's `context_tokens`).
    context: u64,
    /// Decode: the `goodput` cost model's predicted seconds for the steps run (for the trace).
    predicted: Option<f64>,
    /// Decode: steps per request. Prefill: unused.
    steps_r: Vec<u32>,
    /// Prefill: the chunk ends the request's prefill.
    done: Vec<bool>,
    /// Prefill: the request samples its first token.
    sample: Vec<bool>,
    /// Decode: the drafter catch-up tokens this iteration runs (the `draft_lag` of the requests
    /// that draft or extend now) when the iteration drafts, else 0.
    catch_up: u64,
    /// Decode: the draft tree run (its scratch slots are held until the report), `None`: a chain.
    tree: Option<crate::decision::TreeShape>,
    /// Decode: the request skips its draft extend (`Plan::skip_extend`). Prefill: empty.
    skip: Vec<bool>,
    /// Decode: the plan's `min_survival` (0: no confidence stop).
    min_survival: f32,
}

/// The continuous-batching scheduler. See the [module docs](self) for the rules.
#[derive(Debug, Clone)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: PagePool,
    /// The prefix cache's tree (empty while `enable_prefix_caching` is off).
    cache: PrefixCache,
    policy: Option<AdaptiveSpeculativeParams>,
    /// Overrides the policy when set.
    fixed_steps: Option<u32>,
    /// The configured draft tree (`None`: chains); see `scheduler/tree.rs`.
    tree: Option<TreeConfig>,
    graph_bs: Option<Vec<u32>>,
    requests: RequestMap,
    waiting: VecDeque<u64>,
    /// Waiting requests that were preempted (not bounded by `max_queued_requests`).
    waiting_preempted: usize,
    /// Admitted requests (prefilling and running), in admission order.
    admitted: Vec<u64>,
    /// Requests in state `Running`.
    num_running: usize,
    /// The prefilling request whose prefill range is not fully scheduled yet.
    partial: Option<u64>,
    /// The last prefill plan left `partial` unfinished: decode goes next.
    decode_turn: bool,
    /// The steps of the last decode iteration reported (`None` before the first).
    last_decode_steps: Option<u32>,
    next_id: u64,
    in_flight: Option<InFlight>,
    /// Preempted since the last plan was handed out (reported in the next plan).
    pending_preempted: Vec<i64>,
    /// Worker rows not held by an admitted request; `pop` gives the next one.
    free_rows: Vec<u32>,
    /// Plans carry `kv_indices` and the page table (a backend that plans from them asks).
    plan_kv_layout: bool,
    counters: Counters,
    trace: Vec<TraceRecord>,
}

impl Scheduler {
    /// A scheduler with an empty pool of `config.num_pages` pages.
    ///
    /// Errors: [`SchedulerError::InvalidConfig`] naming the field (including fixed steps > 32).
    pub fn new(config: SchedulerConfig, steps: StepsSource) -> Result<Self, SchedulerError> {
        config.validate()?;
        let pool = PagePool::new(config.num_pages, config.page_size).map_err(|e| {
            SchedulerError::InvalidConfig {
                field: "num_pages",
                message: e.to_string(),
            }
        })?;
        let (policy, fixed_steps) = match steps {
            StepsSource::Fixed(k) => {
                config::validate_fixed_steps(k)?;
                (None, Some(k))
            }
            StepsSource::Adaptive(p) => (Some(p), None),
        };
        let free_rows = (0..config.max_running_requests).rev().collect();
        Ok(Scheduler {
            cache: PrefixCache::new(config.page_size),
            config,
            pool,
            policy,
            fixed_steps,
            tree: None,
            graph_bs: None,
            requests: RequestMap::default(),
            waiting: VecDeque::new(),
            waiting_preempted: 0,
            admitted: Vec::new(),
            num_running: 0,
            partial: None,
            decode_turn: false,
            last_decode_steps: None,
            next_id: 0,
            in_flight: None,
            pending_preempted: Vec::new(),
            free_rows,
            plan_kv_layout: false,
            counters: Counters::default(),
            trace: Vec::new(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV page pool (read-only: KV indices, page tables, lengths).
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// The adaptive policy, if any (also present while fixed steps override it).
    pub fn policy(&self) -> Option<&AdaptiveSpeculativeParams> {
        self.policy.as_ref()
    }

    /// The fixed steps in force, if any.
    pub fn fixed_steps(&self) -> Option<u32> {
        self.fixed_steps
    }

    /// Every steps value a decode plan can carry: the fixed steps, or the union of the
    /// policy's candidates (both when fixed steps override a policy).
    pub fn candidate_steps(&self) -> Vec<u32> {
        let mut out: Vec<u32> = self
            .policy
            .iter()
            .flat_map(|p| p.candidate_steps().iter().copied())
            .collect();
        out.extend(self.fixed_steps);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Fixes the steps (`Some(k)`, 0..=32) or returns to the adaptive policy (`None`). Takes
    /// effect at the next decode plan; the policy is not fed while fixed steps are in force.
    ///
    /// Errors: [`SchedulerError::InvalidConfig`] for `k > 32`, `None` without a policy, or
    /// (naming `speculative_num_draft_tokens`) a draft tree whose node count does not fit the new
    /// largest steps (see [`validate_tree`]) or whose scratch slots at that depth do not fit the
    /// pool beside one full-context request (the scheduler is unchanged).
    pub fn set_fixed_steps(&mut self, steps: Option<u32>) -> Result<(), SchedulerError> {
        match steps {
            Some(k) => config::validate_fixed_steps(k)?,
            None if self.policy.is_none() => {
                return Err(SchedulerError::InvalidConfig {
                    field: "speculative_num_steps",
                    message: "this scheduler has no adaptive policy to return to; pass fixed steps"
                        .into(),
                })
            }
            None => {}
        }
        if let Some(t) = self.tree {
            let max = match (steps, &self.policy) {
                (Some(k), _) => k,
                (None, p) => p.as_ref().and_then(|p| p.candidate_steps().last().copied()).unwrap_or(0),
            };
            // steps 0 runs no tree; any other depth must still fit the configured tree
            if max > 0 {
                validate_tree(max, t.topk, Some(t.num_draft_tokens + 1))?;
                self.check_scratch_fits(max, Some(t))?;
            }
        }
        self.fixed_steps = steps;
        Ok(())
    }

    /// Sets (sorted, deduplicated, each >= 1) or clears the captured CUDA-graph batch sizes:
    /// decode plans carry the padded size, and the policy routes by it.
    pub fn set_cuda_graph_bs(&mut self, sizes: Option<&[i64]>) -> Result<(), SchedulerError> {
        let normalized = match sizes {
            None => None,
            Some(sizes) => {
                let mut out = Vec::with_capacity(sizes.len());
                for (i, &g) in sizes.iter().enumerate() {
                    if g < 1 || g > i64::from(u32::MAX) {
                        return Err(SchedulerError::InvalidConfig {
                            field: "cuda_graph_bs",
                            message: format!("cuda_graph_bs[{i}] = {g}: graph batch sizes must be in 1..=2**32-1"),
                        });
                    }
                    out.push(g as u32);
                }
                out.sort_unstable();
                out.dedup();
                Some(out)
            }
        };
        if let Some(p) = &mut self.policy {
            p.set_cuda_graph_bs(sizes).expect("sizes checked above");
        }
        self.graph_bs = normalized;
        Ok(())
    }

    /// The captured CUDA-graph batch sizes, ascending, if set.
    pub fn cuda_graph_bs(&self) -> Option<&[u32]> {
        self.graph_bs.as_deref()
    }

    /// Queues a request and returns its id (ids count up from 0).
    ///
    /// Errors (nothing queued): [`SchedulerError::InvalidRequest`] naming `prompt_ids` (empty,
    /// longer than `context_length - 1`, a negative id), `max_new_tokens` (< 1) or
    /// `stop_token_ids` (a negative id); then [`SchedulerError::QueueFull`].
    pub fn add_request(
        &mut self,
        prompt_ids: Vec<i64>,
        max_new_tokens: i64,
        stop_token_ids: Vec<i64>,
        ignore_eos: bool,
    ) -> Result<u64, SchedulerError> {
        self.add_request_limited(prompt_ids, max_new_tokens, stop_token_ids, ignore_eos, None)
    }

    /// [`add_request`](Self::add_request) taking at most `max_cached_tokens` KV positions from
    /// the prefix cache at each admission (`None`: as many as match). A request that wants
    /// prompt log-probabilities from position `p` passes `p - 1`, so those positions are
    /// computed (SGLang caps its prefix match at `logprob_start_len` the same way).
    pub fn add_request_limited(
        &mut self,
        prompt_ids: Vec<i64>,
        max_new_tokens: i64,
        stop_token_ids: Vec<i64>,
        ignore_eos: bool,
        max_cached_tokens: Option<u64>,
    ) -> Result<u64, SchedulerError> {
        let invalid = |field, message| Err(SchedulerError::InvalidRequest { field, message });
        let ctx = u64::from(self.config.context_length);
        if prompt_ids.is_empty() {
            return invalid("prompt_ids", "must not be empty".to_string());
        }
        if prompt_ids.len() as u64 > ctx - 1 {
            return invalid(
                "prompt_ids",
                format!(
                    "has {} tokens, more than context_length - 1 = {} (room for at least one output token)",
                    prompt_ids.len(),
                    ctx - 1
                ),
            );
        }
        if let Some((i, t)) = prompt_ids.iter().enumerate().find(|(_, &t)| t < 0) {
            return invalid(
                "prompt_ids",
                format!("prompt_ids[{i}] = {t}: token ids must be >= 0"),
            );
        }
        if max_new_tokens < 1 {
            return invalid(
                "max_new_tokens",
                format!("must be >= 1, got {max_new_tokens}"),
            );
        }
        if let Some((i, t)) = stop_token_ids.iter().enumerate().find(|(_, &t)| t < 0) {
            return invalid(
                "stop_token_ids",
                format!("stop_token_ids[{i}] = {t}: token ids must be >= 0"),
            );
        }
        let queued = self.queued_beyond_free_rows();
        if queued >= self.config.max_queued_requests as usize {
            return Err(SchedulerError::QueueFull {
                queued,
                max: self.config.max_queued_requests,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let prompt_len = prompt_ids.len() as u64;
        self.requests.insert(
            id,
            Request {
                tokens: prompt_ids,
                prompt_len,
                max_new_tokens: max_new_tokens as u64,
                stop_token_ids,
                ignore_eos,
                state: RequestState::Waiting,
                kv_len: 0,
                admitted_before: false,
                num_preemptions: 0,
                row: None,
                draft_lag: 0,
                cached: 0,
                max_cached: max_cached_tokens.unwrap_or(u64::MAX),
                cache_pages: 0,
                cache_node: ROOT,
                cache_drafter_pages: 0,
                cache_stopped: false,
            },
        );
        self.waiting.push_back(id);
        self.counters.requests_added += 1;
        Ok(id)
    }

    /// Aborts a live request in any state, freeing everything it held. Returns its finish record
    /// (reason `Abort`), or `None` for an unknown or already finished id (aborting twice is
    /// harmless). If it is in the plan in flight, `report` ignores its results.
    pub fn abort(&mut self, request_id: u64) -> Option<Finished> {
        self.finish_request(request_id, FinishReason::Abort)
    }

    /// Finishes a live request with `reason` (e.g. `Stop(None)` for a stop string matched by the
    /// caller), freeing everything it held; its tokens stay as reported. Returns the finish record,
    /// or `None` when the id is not live.
    pub fn finish_request(&mut self, request_id: u64, reason: FinishReason) -> Option<Finished> {
        let req = self.requests.remove(&request_id)?;
        match req.state {
            RequestState::Waiting => {
                let pos = self
                    .waiting
                    .iter()
                    .position(|&i| i == request_id)
                    .expect("waiting request is queued");
                self.waiting.remove(pos);
                if req.admitted_before {
                    self.waiting_preempted -= 1;
                }
            }
            RequestState::Prefilling | RequestState::Running => {
                self.pool
                    .free_request(request_id)
                    .expect("admitted request has a page table");
                self.free_rows
                    .push(req.row.expect("an admitted request holds a row"));
                let pos = self
                    .admitted
                    .iter()
                    .position(|&i| i == request_id)
                    .expect("admitted request is listed");
                self.admitted.remove(pos);
                if req.state == RequestState::Running {
                    self.num_running -= 1;
                }
                if self.partial == Some(request_id) {
                    self.partial = None;
                }
            }
        }
        self.count_finish(reason);
        Some(req.finished(request_id, reason))
    }

    fn count_finish(&mut self, reason: FinishReason) {
        match reason {
            FinishReason::Abort => self.counters.requests_aborted += 1,
            _ => self.counters.requests_finished += 1,
        }
    }

    /// Whether a plan awaits its report.
    pub fn plan_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Gives up the plan in flight without results (its passes failed): every request in it
    /// that is still live is aborted (pages and row freed) and returned, in plan order; the
    /// next `schedule` may run. This replaces a report of made-up tokens.
    ///
    /// Errors: [`SchedulerError::NoPlanInFlight`].
    pub fn abandon_plan(&mut self) -> Result<Vec<Finished>, SchedulerError> {
        let fl = self.in_flight.take().ok_or(SchedulerError::NoPlanInFlight)?;
        self.release_scratch();
        let finished: Vec<Finished> = fl
            .ids
            .iter()
            .filter_map(|&id| self.finish_request(id, FinishReason::Abort))
            .collect();
        Ok(finished)
    }

    /// Whether plans carry `kv_indices`, `page_table` and `page_table_offsets` (default
    /// `false`: the worker builds its attention metadata from its own tables; a backend that
    /// plans from the scheduler's page tables turns this on).
    pub fn plan_kv_layout(&self) -> bool {
        self.plan_kv_layout
    }

    /// See [`Scheduler::plan_kv_layout`]; takes effect at the next plan.
    pub fn set_plan_kv_layout(&mut self, on: bool) {
        self.plan_kv_layout = on;
    }

    /// The worker row of an admitted (prefilling or running) request, `None` otherwise.
    pub fn row_of(&self, request_id: u64) -> Option<u32> {
        self.requests.get(&request_id).and_then(|r| r.row)
    }

    /// Rows held by admitted requests (`max_running_requests` minus the free rows).
    pub fn rows_in_use(&self) -> usize {
        self.config.max_running_requests as usize - self.free_rows.len()
    }

    /// Whether any request is live (waiting, prefilling or running).
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.num_running
    }

    /// Requests waiting (new and preempted).
    pub fn num_queued(&self) -> usize {
        self.waiting.len()
    }

    /// Running rows free for new requests: `max_running_requests` minus the admitted requests
    /// and the preempted ones waiting to resume (they are first in line), at least 0.
    fn free_running_rows(&self) -> usize {
        (self.config.max_running_requests as usize)
            .saturating_sub(self.admitted.len() + self.waiting_preempted)
    }

    /// New requests waiting beyond the free running rows: what `max_queued_requests` bounds.
    /// Requests submitted between two iterations wait until the next `schedule()` admits them;
    /// they are not "queued" while a running row is free for them (a server must not answer
    /// 503 to an idle engine). Page shortage is not counted: admission may still have to wait
    /// for pages.
    pub fn queued_beyond_free_rows(&self) -> usize {
        (self.waiting.len() - self.waiting_preempted).saturating_sub(self.free_running_rows())
    }

    /// State of a live request, `None` once finished (or never added).
    pub fn request_state(&self, request_id: u64) -> Option<RequestState> {
        self.requests.get(&request_id).map(|r| r.state)
    }

    /// Output tokens of a live request so far.
    pub fn output_ids(&self, request_id: u64) -> Option<&[i64]> {
        self.requests
            .get(&request_id)
            .map(|r| &r.tokens[r.prompt_len as usize..])
    }

    /// Times a live request was preempted.
    pub fn num_preemptions_of(&self, request_id: u64) -> Option<u32> {
        self.requests.get(&request_id).map(|r| r.num_preemptions)
    }

    /// Per adaptive slot, ascending: `(lower bound, current steps, accepted-drafts estimate,
    /// verifies observed)` ([`crate::SlotState`]). Empty without a policy.
    pub fn slot_states(&self) -> Vec<(u32, u32, f64, u64)> {
        self.policy
            .iter()
            .flat_map(|p| {
                p.slot_states()
                    .into_iter()
                    .map(|s| (s.lower_bound, s.current_steps, s.accepted_estimate, s.verify_count))
            })
            .collect()
    }

    /// The adaptive policy, mutable (the engine's startup profiling feeds its cost table).
    pub fn policy_mut(&mut self) -> Option<&mut AdaptiveSpeculativeParams> {
        self.policy.as_mut()
    }

    /// Takes the per-verify trace recorded since the last call (empty unless
    /// `config.record_trace`).
    pub fn drain_trace(&mut self) -> Vec<TraceRecord> {
        std::mem::take(&mut self.trace)
    }
}
