//! Error types of the decision side. Every message names the offending key or field and,
//! where there is a fixed set, the allowed values.

use thiserror::Error;

/// A rejected adaptive config or initial `speculative_num_steps`.
///
/// Surfaces in Python as `specdial.ConfigError` (a `ValueError`).
#[derive(Debug, Clone, PartialEq, Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ConfigError {
    pub(crate) fn new(msg: impl Into<String>) -> Self {
        ConfigError(msg.into())
    }
}

/// Bad input to the policy at run time (a batch size or an accepted-drafts array).
///
/// Surfaces in Python as `ValueError`.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PolicyError {
    #[error("batch_size must be >= 1, got {0}")]
    BatchSize(i64),
    #[error(
        "accepted[{index}] = {value} is outside 0..={steps} \
         (accepted drafts per request, bonus token excluded, at current steps {steps})"
    )]
    Accepted { index: usize, value: i64, steps: u32 },
    #[error("seconds must be a finite number > 0 (the decode iteration's wall time), got {0}")]
    Seconds(f64),
    #[error("cuda_graph_bs[{index}] = {value}: graph batch sizes must be >= 1")]
    GraphBatchSize { index: usize, value: i64 },
    /// A per-request report (issue 28) that does not fit the iteration; the message names the
    /// field (`steps_per_request`, `accepted`, `draft_probs`).
    #[error("{0}")]
    Requests(String),
}
