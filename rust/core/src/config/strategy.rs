//! The strategy selector and the global settings of the `goodput` and `throughput_aware`
//! strategies (the `ema` strategy's settings are per slot: [`super::SlotConfig`]).

use serde::Serialize;

use super::value::{
    integer, number_in, optional_integer, optional_integer_list, ConfigValue, Scope,
};
use crate::error::ConfigError;

/// Strategy names accepted by the `strategy` key.
pub const STRATEGY_NAMES: [&str; 3] = ["ema", "goodput", "throughput_aware"];

/// Global keys of the `goodput` strategy (besides `strategy` and slot keys).
pub const GOODPUT_KEYS: [&str; 13] = [
    "acceptance_window",
    "cost_window",
    "max_profile_run_batch_size",
    "min_dwell",
    "min_survival",
    "probe_budget",
    "profile_run_batch_sizes",
    "profile_run_n_measure",
    "profile_run_n_warmup",
    "profile_run_seq_len",
    "switch_margin",
    "tree",
    "verify",
];

/// Global keys of the `throughput_aware` strategy (SGLang PR #28045, `throughput_aware_controller`).
pub const THROUGHPUT_AWARE_KEYS: [&str; 8] = [
    "max_profile_run_batch_size",
    "profile_run_batch_sizes",
    "profile_run_n_measure",
    "profile_run_n_warmup",
    "profile_run_seq_len",
    "switch_hysteresis",
    "update_interval",
    "window_size",
];

/// How the steps are chosen, with the strategy's global settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "strategy")]
pub enum Strategy {
    /// SGLang's EMA + hysteresis rules per slot (PRs #21599, #24055, #23994).
    Ema,
    /// Expected emitted tokens per second from per-position acceptance and an online cost model
    /// ([`crate::goodput`]).
    Goodput(GoodputConfig),
    /// SGLang's throughput-aware strategy (PR #28045): a windowed per-position acceptance, a cost
    /// table profiled at start, a switch only when `switch_hysteresis` better ([`crate::throughput`]).
    ThroughputAware(ThroughputAwareConfig),
}

impl Strategy {
    /// The `strategy` key's value.
    pub fn name(&self) -> &'static str {
        match self {
            Strategy::Ema => "ema",
            Strategy::Goodput(_) => "goodput",
            Strategy::ThroughputAware(_) => "throughput_aware",
        }
    }

    /// The strategy named `name` with default settings.
    pub(crate) fn from_name(v: &ConfigValue) -> Result<Strategy, ConfigError> {
        match v {
            ConfigValue::Str(s) if s == "ema" => Ok(Strategy::Ema),
            ConfigValue::Str(s) if s == "goodput" => {
                Ok(Strategy::Goodput(GoodputConfig::default()))
            }
            ConfigValue::Str(s) if s == "throughput_aware" => {
                Ok(Strategy::ThroughputAware(ThroughputAwareConfig::default()))
            }
            other => Err(ConfigError::new(format!(
                "strategy must be one of \"ema\", \"goodput\", \"throughput_aware\", got {other}"
            ))),
        }
    }

    /// The global keys this strategy takes (besides `strategy`); empty for `ema`, whose keys are
    /// slot keys.
    pub fn global_keys(&self) -> &'static [&'static str] {
        match self {
            Strategy::Ema => &[],
            Strategy::Goodput(_) => &GOODPUT_KEYS,
            Strategy::ThroughputAware(_) => &THROUGHPUT_AWARE_KEYS,
        }
    }

    /// Validates a global `key: value` of this strategy and stores it. `Ok(false)` when the key
    /// is not one of [`Strategy::global_keys`].
    pub(crate) fn apply(&mut self, key: &str, v: &ConfigValue) -> Result<bool, ConfigError> {
        match self {
            Strategy::Ema => Ok(false),
            Strategy::Goodput(g) => g.apply(key, v),
            Strategy::ThroughputAware(t) => t.apply(key, v),
        }
    }
}

/// Keys of the startup profiling run, shared by `goodput` and `throughput_aware`.
pub const PROFILE_KEYS: [&str; 5] = [
    "max_profile_run_batch_size",
    "profile_run_batch_sizes",
    "profile_run_n_measure",
    "profile_run_n_warmup",
    "profile_run_seq_len",
];

/// The startup profiling run (SGLang's `profile_run_*` keys): decode iterations timed on the real
/// path per (steps, batch size) before serving.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProfileConfig {
    /// Batch sizes to profile; `None`: the CUDA-graph batch sizes (or, without graphs, the
    /// default capture sizes of the engine).
    pub profile_run_batch_sizes: Option<Vec<u32>>,
    /// Upper bound on the profiled batch sizes (`None`: no bound).
    pub max_profile_run_batch_size: Option<u32>,
    /// Untimed iterations per point (default 5).
    pub profile_run_n_warmup: u32,
    /// Timed iterations per point (>= 1, default 10).
    pub profile_run_n_measure: u32,
    /// Prompt tokens per synthetic request (`None`: `min(2048, max(256, context - headroom))`).
    pub profile_run_seq_len: Option<u32>,
}

impl Default for ProfileConfig {
    fn default() -> Self {
        ProfileConfig {
            profile_run_batch_sizes: None,
            max_profile_run_batch_size: None,
            profile_run_n_warmup: 5,
            profile_run_n_measure: 10,
            profile_run_seq_len: None,
        }
    }
}

impl ProfileConfig {
    fn apply(&mut self, key: &str, v: &ConfigValue) -> Result<bool, ConfigError> {
        let g = Scope::Global;
        match key {
            "profile_run_batch_sizes" => {
                self.profile_run_batch_sizes = optional_integer_list(g, key, v, 1)?
            }
            "max_profile_run_batch_size" => {
                self.max_profile_run_batch_size = optional_integer(g, key, v, 1)?
            }
            "profile_run_n_warmup" => self.profile_run_n_warmup = integer(g, key, v, 0)?,
            "profile_run_n_measure" => self.profile_run_n_measure = integer(g, key, v, 1)?,
            "profile_run_seq_len" => self.profile_run_seq_len = optional_integer(g, key, v, 1)?,
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Settings of the `goodput` strategy. Every one changes its decisions (tests pin each).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GoodputConfig {
    /// A challenger's predicted goodput must exceed the current steps' by this fraction to
    /// replace them (in `[0, 1)`, default 0.05).
    pub switch_margin: f64,
    /// Decode iterations a slot keeps steps it switched to before it may switch again (>= 1,
    /// default 8). Probes are not switches.
    pub min_dwell: u32,
    /// Time constant, in decode iterations, of the per-position acceptance estimates (>= 1,
    /// default 16): each iteration discounts older observations by `1 - 1 / acceptance_window`.
    pub acceptance_window: u32,
    /// Time constant, in observations of one (batch size, steps) cell, of the cost model's
    /// per-cell means (>= 1, default 64).
    pub cost_window: u32,
    /// Largest share of decode time spent on probes (in `[0, 0.5]`, default 0.03): runs of steps
    /// that are not the predicted best, made to measure a cost not yet measured or the acceptance
    /// while a slot sits at steps 0. 0 turns probing off.
    pub probe_budget: f64,
    /// A startup sweep that seeds the cost model (`None`, the default: no sweep; any
    /// `profile_run_*` key turns it on).
    pub profile: Option<ProfileConfig>,
    /// Whether the strategy chooses one steps value for the batch (`"batch"`, the default) or
    /// also a verify length per request (`"per_request"`, issue 28; [`crate::goodput::per_request`]).
    pub verify: VerifyMode,
    /// The confidence stop the decision carries (the `min_survival` key, issue 28): none
    /// (`null`, the default), a fixed threshold, or one the strategy chooses each iteration
    /// (`"auto"`, [`crate::goodput::confidence`]). Needs `"verify": "per_request"` (the worker
    /// then verifies a length per request and reports it).
    pub min_survival: MinSurvival,
    /// Upper bounds of the draft trees the strategy may choose (`None`, the default: chains
    /// only; [`super::tree`], issue 29).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tree: Option<super::tree::TreeConfig>,
}

/// The `goodput` strategy's `min_survival` key: the confidence stop (DSpark, vLLM PR #47808;
/// SpecDec++): after drafting, a request's verify ends at the first draft position whose
/// cumulative draft probability is below the threshold.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum MinSurvival {
    /// No rule (`null`): every request verifies its whole budget.
    #[default]
    Off,
    /// A fixed threshold in (0, 1).
    Fixed(f64),
    /// The strategy chooses the threshold each iteration from its cost model and its calibration
    /// of draft confidence (`"auto"`).
    Auto,
}

impl Serialize for MinSurvival {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            MinSurvival::Off => s.serialize_none(),
            MinSurvival::Fixed(x) => s.serialize_f64(*x),
            MinSurvival::Auto => s.serialize_str("auto"),
        }
    }
}

impl MinSurvival {
    /// Parses the `min_survival` key: `null`, a number in (0, 1), or `"auto"`.
    fn parse(v: &ConfigValue) -> Result<MinSurvival, ConfigError> {
        let bad = || ConfigError::new(format!("min_survival must be null, a number in (0, 1) or \"auto\", got {v}"));
        let x = match v {
            ConfigValue::Null => return Ok(MinSurvival::Off),
            ConfigValue::Str(s) if s == "auto" => return Ok(MinSurvival::Auto),
            ConfigValue::Int(i) => *i as f64,
            ConfigValue::Float(f) => *f,
            _ => return Err(bad()),
        };
        // checked as the f32 the decision carries (1e-300 would round to 0: no rule)
        if (x as f32) > 0.0 && (x as f32) < 1.0 {
            Ok(MinSurvival::Fixed(x))
        } else {
            Err(bad())
        }
    }
}

/// The `goodput` strategy's `verify` key: what it decides per decode iteration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifyMode {
    /// One steps value for every request of the batch (SGLang's and TensorRT-LLM's granularity).
    #[default]
    Batch,
    /// The batch's draft depth plus a verify length `0..=depth` per request, from each request's
    /// survival estimates and the cost model in tokens (vLLM DSpark's granularity).
    PerRequest,
}

/// Values of the `verify` key, for error messages.
pub const VERIFY_MODES: [&str; 2] = ["batch", "per_request"];

impl VerifyMode {
    fn parse(v: &ConfigValue) -> Result<VerifyMode, ConfigError> {
        match v {
            ConfigValue::Str(s) if s == "batch" => Ok(VerifyMode::Batch),
            ConfigValue::Str(s) if s == "per_request" => Ok(VerifyMode::PerRequest),
            other => Err(ConfigError::new(format!(
                "verify must be one of \"batch\", \"per_request\", got {other}"
            ))),
        }
    }
}

impl Default for GoodputConfig {
    fn default() -> Self {
        GoodputConfig {
            switch_margin: 0.05,
            min_dwell: 8,
            acceptance_window: 16,
            cost_window: 64,
            probe_budget: 0.03,
            profile: None,
            verify: VerifyMode::Batch,
            min_survival: MinSurvival::Off,
            tree: None,
        }
    }
}

impl GoodputConfig {
    fn apply(&mut self, key: &str, v: &ConfigValue) -> Result<bool, ConfigError> {
        let g = Scope::Global;
        match key {
            "switch_margin" => {
                self.switch_margin = number_in(g, key, v, |x| (0.0..1.0).contains(&x), "in [0, 1)")?
            }
            "min_dwell" => self.min_dwell = integer(g, key, v, 1)?,
            "acceptance_window" => self.acceptance_window = integer(g, key, v, 1)?,
            "cost_window" => self.cost_window = integer(g, key, v, 1)?,
            "probe_budget" => {
                self.probe_budget =
                    number_in(g, key, v, |x| (0.0..=0.5).contains(&x), "in [0, 0.5]")?
            }
            "verify" => self.verify = VerifyMode::parse(v)?,
            "min_survival" => self.min_survival = MinSurvival::parse(v)?,
            "tree" => self.tree = super::tree::TreeConfig::parse(v)?,
            k if PROFILE_KEYS.contains(&k) => {
                return self
                    .profile
                    .get_or_insert_with(ProfileConfig::default)
                    .apply(key, v)
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Settings of the `throughput_aware` strategy, SGLang's names and defaults.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ThroughputAwareConfig {
    /// Batches in each position's acceptance window (>= 1, default 20).
    pub window_size: u32,
    /// Re-score the candidates every this many batches (>= 1, default 10).
    pub update_interval: u32,
    /// A challenger must score above `current * (1 + switch_hysteresis)` (>= 0, default 0.1).
    pub switch_hysteresis: f64,
    /// The startup profiling run that fills the cost table (always on for this strategy).
    pub profile: ProfileConfig,
}

impl Default for ThroughputAwareConfig {
    fn default() -> Self {
        ThroughputAwareConfig {
            window_size: 20,
            update_interval: 10,
            switch_hysteresis: 0.1,
            profile: ProfileConfig::default(),
        }
    }
}

impl ThroughputAwareConfig {
    fn apply(&mut self, key: &str, v: &ConfigValue) -> Result<bool, ConfigError> {
        let g = Scope::Global;
        match key {
            "window_size" => self.window_size = integer(g, key, v, 1)?,
            "update_interval" => self.update_interval = integer(g, key, v, 1)?,
            "switch_hysteresis" => {
                self.switch_hysteresis = number_in(g, key, v, |x| x >= 0.0, ">= 0")?
            }
            _ => return self.profile.apply(key, v),
        }
        Ok(true)
    }
}
