//! Counters and gauges for metrics and logging.

use super::Scheduler;

/// Counters and gauges for metrics and logging. Counters only grow.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SchedulerStats {
    /// Requests in decode iterations now.
    pub running: usize,
    /// Requests admitted and prefilling now.
    pub prefilling: usize,
    /// Requests waiting now (new and preempted).
    pub queued: usize,
    /// Of `queued`, those preempted and waiting to resume.
    pub queued_preempted: usize,
    /// Pages held by at least one admitted request (shared pages count once).
    pub kv_pages_used: u32,
    pub kv_pages_total: u32,
    /// Pages held by the prefix cache now, shared with requests or not (those no request holds
    /// are evicted, least recently used first, before anything is preempted).
    pub cached_pages: u32,
    /// Requests accepted by `add_request`.
    pub requests_added: u64,
    /// Requests finished with reason length or stop.
    pub requests_finished: u64,
    /// Requests aborted.
    pub requests_aborted: u64,
    /// Preemptions (a request preempted twice counts twice).
    pub preemptions: u64,
    /// Times the adaptive policy changed a slot's steps.
    pub step_switches: u64,
    /// Output tokens appended (after stop truncation).
    pub tokens_generated: u64,
    /// Prompt (and re-prefill) tokens scheduled in prefill plans (cached prefixes excluded).
    pub prefill_tokens: u64,
    /// Prompt tokens of requests at their first admission (vLLM's `prompt_tokens_total`).
    pub prompt_tokens: u64,
    /// Of `prompt_tokens`, those served from the prefix cache at the first admission (hit
    /// rate = `cached_tokens / prompt_tokens`).
    pub cached_tokens: u64,
    /// Cached pages evicted to make room (least recently used first).
    pub evicted_pages: u64,
    pub prefill_iterations: u64,
    pub decode_iterations: u64,
    /// `(steps, decode iterations reported at those steps)`, ascending by steps.
    pub decode_iterations_by_steps: Vec<(u32, u64)>,
    /// vLLM's `spec_decode_num_drafts`: requests verified with `steps_r > 0`.
    pub spec_num_drafts: u64,
    /// vLLM's `spec_decode_num_draft_tokens`: sum of the drafts verified (`steps_r`, or what a
    /// confidence stop left; a draft tree's verified nodes: its kept ones, else its `N`).
    pub spec_num_draft_tokens: u64,
    /// vLLM's `spec_decode_num_accepted_tokens`: sum of accepted drafts.
    pub spec_num_accepted_tokens: u64,
    /// vLLM's `..._accepted_tokens_per_pos`: entry `i` counts requests that accepted more than
    /// `i` drafts.
    pub spec_accepted_per_pos: Vec<u64>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Counters {
    pub(super) requests_added: u64,
    pub(super) requests_finished: u64,
    pub(super) requests_aborted: u64,
    pub(super) preemptions: u64,
    pub(super) step_switches: u64,
    pub(super) tokens_generated: u64,
    pub(super) prefill_tokens: u64,
    pub(super) prompt_tokens: u64,
    pub(super) cached_tokens: u64,
    pub(super) evicted_pages: u64,
    pub(super) prefill_iterations: u64,
    pub(super) decode_iterations: u64,
    pub(super) by_steps: Vec<u64>,
    pub(super) spec_num_drafts: u64,
    pub(super) spec_num_draft_tokens: u64,
    pub(super) spec_num_accepted_tokens: u64,
    pub(super) spec_accepted_per_pos: Vec<u64>,
}

impl Scheduler {
    /// Gauges now and counters since creation.
    pub fn stats(&self) -> SchedulerStats {
        let c = &self.counters;
        SchedulerStats {
            running: self.num_running,
            prefilling: self.admitted.len() - self.num_running,
            queued: self.waiting.len(),
            queued_preempted: self.waiting_preempted,
            kv_pages_used: self.pool.num_held_pages(),
            kv_pages_total: self.pool.num_pages(),
            cached_pages: self.cached_pages(),
            requests_added: c.requests_added,
            requests_finished: c.requests_finished,
            requests_aborted: c.requests_aborted,
            preemptions: c.preemptions,
            step_switches: c.step_switches,
            tokens_generated: c.tokens_generated,
            prefill_tokens: c.prefill_tokens,
            prompt_tokens: c.prompt_tokens,
            cached_tokens: c.cached_tokens,
            evicted_pages: c.evicted_pages,
            prefill_iterations: c.prefill_iterations,
            decode_iterations: c.decode_iterations,
            decode_iterations_by_steps: c
                .by_steps
                .iter()
                .enumerate()
                .filter(|(_, &n)| n > 0)
                .map(|(s, &n)| (s as u32, n))
                .collect(),
            spec_num_drafts: c.spec_num_drafts,
            spec_num_draft_tokens: c.spec_num_draft_tokens,
            spec_num_accepted_tokens: c.spec_num_accepted_tokens,
            spec_accepted_per_pos: c.spec_accepted_per_pos.clone(),
        }
    }
}
