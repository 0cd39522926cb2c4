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

pub mod config;
pub mod decision;
pub mod error;
pub mod goodput;
mod id_hash;
pub mod kv;
pub mod policy;
pub mod scheduler;
pub mod sim;
pub mod slot;
pub mod strategies;
pub mod throughput;

pub use config::{AdaptiveConfig, GoodputConfig, SlotConfig, Strategy, ThroughputAwareConfig};
pub use decision::{Decision, TreeShape, VerifyShape};
pub use error::{ConfigError, PolicyError};
pub use policy::{AdaptiveSpeculativeParams, Observation, SlotState, StepDecision};
pub use scheduler::{Plan, PlanKind, Scheduler, SchedulerConfig, SchedulerError, StepsSource};
pub use slot::AdaptiveStepSlot;
pub use strategies::StepStrategy;
