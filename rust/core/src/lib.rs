//! specdial-core: the decision side of specdial, with no Python dependency.
//!
//! - [`config`]: the adaptive config (SGLang `--speculative-adaptive-config` compatible).
//! - [`slot`]: one per-batch-size slot's EMA + hysteresis state machine (the `ema` strategy).
//! - [`policy`]: routing a batch size to its slot (with CUDA-graph padding) and the per-iteration decision.
//! - [`decision`]: what a strategy decides for one iteration (steps; room for per-request verify lengths and a tree).
//! - [`strategies`]: the [`StepStrategy`] trait and one file per strategy.
//! - [`goodput`]: the `goodput` strategy (acceptance estimates, online cost model, probes).
//! - [`throughput`]: SGLang's `throughput_aware` strategy.
//! - [`kv`]: the KV page allocator shared by the target and drafter pools.
//!
//! Terms (one meaning each in the Rust core):
//!
//! - **slot**: a batch-size range of the adaptive config (`"8": {...}` covers batch sizes from 8
//!   up to the next lower bound); each has its own candidate steps and strategy state.
//! - **bucket**: the `goodput` cost model's grouping of batch sizes into cost cells
//!   ([`goodput::cost::bucket_of`]: powers of two and 1.5x between them, or the CUDA-graph size
//!   that replays). Finer than a slot and independent of the config: one slot spans several
//!   buckets, and costs learned at one bucket carry to the next.
//! - **KV slot** / **KV index**: one token's place in the KV buffers ([`kv`]). The Python-facing
//!   names (`num_slots`, `slots(...)`, `pad_slot`) keep the worker's and SGLang's spelling.
//! - **row**: a running request's index into the worker's per-request buffers
//!   (`max_running_requests` of them).
//! - **steps**: `speculative_num_steps`, drafts per request in one iteration; the tokens
//!   verified per request are `steps + 1` (`num_draft_tokens` in [`StepDecision`]).

pub mod config;
pub mod decision;
pub mod error;
pub mod goodput;
mod id_hash;
pub mod kv;
pub mod policy;
pub mod prefix_cache;
pub mod scheduler;
pub mod sim;
pub mod slot;
pub mod strategies;
pub mod throughput;

pub use config::{AdaptiveConfig, GoodputConfig, SlotConfig, Strategy, ThroughputAwareConfig};
pub use decision::{ConfidenceStop, Decision, TreeShape, VerifyShape};
pub use error::{ConfigError, PolicyError};
pub use policy::{AdaptiveSpeculativeParams, Observation, SlotState, StepDecision};
pub use scheduler::{Plan, PlanKind, ReportExtras, Scheduler, SchedulerConfig, SchedulerError, StepsSource};
pub use slot::AdaptiveStepSlot;
pub use strategies::StepStrategy;
