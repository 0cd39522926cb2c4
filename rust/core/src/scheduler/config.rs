//! The scheduler's settings and its error type.

use thiserror::Error;

use crate::config::MAX_CANDIDATE_STEPS;

/// Limits and sizes of one [`Scheduler`](super::Scheduler). Units are in each field's doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Requests admitted at once (prefilling + running), >= 1: the batch capacity of the worker.
    pub max_running_requests: u32,
    /// Requests waiting for their first admission beyond the free running slots, >= 1:
    /// `add_request` fails with [`SchedulerError::QueueFull`] when that many new requests wait
    /// and no running slot is free for another (so up to `max_running_requests - running +
    /// max_queued_requests` new requests can wait between two iterations). Preempted requests
    /// waiting to resume are not counted (they were admitted already and are never refused).
    pub max_queued_requests: u32,
    /// Prompt tokens prefilled per prefill iteration, >= 1 (all requests of the iteration
    /// together; SGLang's `max_prefill_tokens`); longer prompts are prefilled in chunks.
    pub max_prefill_tokens: u32,
    /// Most prompt tokens of one request per prefill iteration, >= 1 (SGLang's
    /// `chunked_prefill_size`): a longer prompt is prefilled in chunks of at most this many
    /// tokens even when the budget `max_prefill_tokens` has room. `None`: the budget only.
    pub chunked_prefill_size: Option<u32>,
    /// Longest request in tokens (prompt + output), >= 2. A prompt may have at most
    /// `context_length - 1` tokens; a request that reaches `context_length` tokens finishes with
    /// reason `length`. KV positions used never exceed `context_length - 1`.
    pub context_length: u32,
    /// KV pages in the pool shared by the target and the drafter, >= 1.
    pub num_pages: u32,
    /// Tokens (KV slots) per page, >= 1. `num_pages * page_size` must be >= `context_length`, so
    /// that one request alone always fits.
    pub page_size: u32,
    /// Tokens that end a request (reason `stop`) unless the request sets `ignore_eos`; each >= 0.
    pub eos_token_ids: Vec<i64>,
    /// Keep a per-verify trace record in memory (drained with
    /// [`Scheduler::drain_trace`](super::Scheduler::drain_trace)), for `--record-trace`.
    pub record_trace: bool,
    /// The worker skips the drafter's extend at `steps = 0` (the engine's
    /// `skip_zero_step_draft_extend`; false without a drafter). The scheduler then defers the
    /// drafter's prefill while decoding runs steps 0 ([`Plan::draft_prefill`]) and counts, per
    /// request, the tokens the drafter has not run over, so the policy is told the catch-up each
    /// drafting iteration really runs ([`crate::Observation::catch_up_tokens`]).
    ///
    /// [`Plan::draft_prefill`]: super::Plan::draft_prefill
    pub skip_zero_step_draft_extend: bool,
    /// Keep full KV pages of finished and running requests in a prefix cache (a radix tree over
    /// pages, `crate::prefix_cache`) and admit later requests with the same token prefix from
    /// it (SGLang's RadixAttention, vLLM's automatic prefix caching). Off in this `Default` so
    /// that the core's own tests see plain page accounting; the engine turns it on by default.
    pub enable_prefix_caching: bool,
}

impl Default for SchedulerConfig {
    /// 64 running, 1024 queued, 2048 prefill tokens per iteration, context 2048, 1024 pages of 16
    /// tokens, no EOS, no trace, zero-step draft extends skipped (the engine's default), no prefix
    /// cache.
    fn default() -> Self {
        SchedulerConfig {
            max_running_requests: 64,
            max_queued_requests: 1024,
            max_prefill_tokens: 2048,
            chunked_prefill_size: None,
            context_length: 2048,
            num_pages: 1024,
            page_size: 16,
            eos_token_ids: Vec::new(),
            record_trace: false,
            skip_zero_step_draft_extend: true,
            enable_prefix_caching: false,
        }
    }
}

impl SchedulerConfig {
    /// Checks every rule of the field docs; the error names the field.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let at_least = |field: &'static str, value: u32, min: u32| {
            if value < min {
                Err(SchedulerError::InvalidConfig {
                    field,
                    message: format!("must be >= {min}, got {value}"),
                })
            } else {
                Ok(())
            }
        };
        at_least("max_running_requests", self.max_running_requests, 1)?;
        at_least("max_queued_requests", self.max_queued_requests, 1)?;
        at_least("max_prefill_tokens", self.max_prefill_tokens, 1)?;
        if let Some(chunk) = self.chunked_prefill_size {
            at_least("chunked_prefill_size", chunk, 1)?;
        }
        at_least("context_length", self.context_length, 2)?;
        at_least("num_pages", self.num_pages, 1)?;
        at_least("page_size", self.page_size, 1)?;
        let tokens = u64::from(self.num_pages) * u64::from(self.page_size);
        if tokens < u64::from(self.context_length) {
            return Err(SchedulerError::InvalidConfig {
                field: "num_pages",
                message: format!(
                    "num_pages * page_size = {} * {} = {tokens} KV tokens cannot hold one request \
                     of context_length = {} tokens",
                    self.num_pages, self.page_size, self.context_length
                ),
            });
        }
        if let Some((i, &t)) = self.eos_token_ids.iter().enumerate().find(|(_, &t)| t < 0) {
            return Err(SchedulerError::InvalidConfig {
                field: "eos_token_ids",
                message: format!("eos_token_ids[{i}] = {t}: token ids must be >= 0"),
            });
        }
        Ok(())
    }
}

/// Checks a fixed `speculative_num_steps` (0..=32, like config candidates).
pub(crate) fn validate_fixed_steps(steps: u32) -> Result<(), SchedulerError> {
    if steps > MAX_CANDIDATE_STEPS {
        return Err(SchedulerError::InvalidConfig {
            field: "speculative_num_steps",
            message: format!("must be in 0..={MAX_CANDIDATE_STEPS}, got {steps}"),
        });
    }
    Ok(())
}

/// A refused scheduler operation. The scheduler is unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SchedulerError {
    /// `add_request` while `max_queued_requests` requests wait for admission. Python:
    /// `specdial.QueueFullError` (a `RuntimeError`); a server answers HTTP 503.
    #[error(
        "queue full: {queued} requests are waiting for admission beyond the free running slots \
         (max_queued_requests = {max}); \
         retry later"
    )]
    QueueFull { queued: usize, max: u32 },
    /// A bad argument of `add_request`. Python: `specdial.InvalidRequestError` (a `ValueError`).
    #[error("{field}: {message}")]
    InvalidRequest {
        field: &'static str,
        message: String,
    },
    /// A bad [`SchedulerConfig`] field or fixed steps value. Python: `specdial.ConfigError`.
    #[error("{field}: {message}")]
    InvalidConfig {
        field: &'static str,
        message: String,
    },
    /// `schedule` while the previous plan still waits for its `report`. Python:
    /// `specdial.SchedulerError` (a `RuntimeError`).
    #[error("a plan is in flight: call report() with its results before schedule()")]
    PlanInFlight,
    /// `report` with no plan in flight. Python: `specdial.SchedulerError`.
    #[error("no plan in flight: report() answers the plan of the last schedule() call")]
    NoPlanInFlight,
    /// Results that do not match the plan in flight (which stays in flight). Python: `ValueError`.
    #[error("{field}: {message}")]
    InvalidReport {
        field: &'static str,
        message: String,
    },
}
