//! One slot's settings: its candidate steps and, for the `ema` strategy, the EMA and hysteresis
//! settings (SGLang PR #21599's slot keys and defaults).

use serde::Serialize;

use super::value::{integer, number, ConfigValue, Scope};
use super::MAX_CANDIDATE_STEPS;
use crate::error::ConfigError;

/// Keys allowed inside a slot and at top level (where they act as defaults for every slot) under
/// the `ema` strategy. The other strategies take only `candidate_steps` per slot.
pub const SLOT_KEYS: [&str; 7] = [
    "candidate_steps",
    "ceiling_coeff",
    "down_hysteresis",
    "ema_alpha",
    "up_hysteresis",
    "update_interval",
    "warmup_batches",
];

/// One slot's settings, after merging the global values under the slot's own.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlotConfig {
    /// Candidate `speculative_num_steps`, sorted ascending, without duplicates, each in 0..=32.
    pub candidate_steps: Vec<u32>,
    /// EMA weight of a new observation, in (0, 1]. Default 0.2.
    pub ema_alpha: f64,
    /// Recompute the steps every this many verifies after warm-up (>= 1). Default 5.
    pub update_interval: u32,
    /// Verifies observed before the first recompute (>= 0). Default 10.
    pub warmup_batches: u32,
    /// Added to the lower rung's threshold when deciding to step down (finite). Default -0.25.
    pub down_hysteresis: f64,
    /// Added to the current rung's threshold when deciding to step up (finite). Default 0.0.
    pub up_hysteresis: f64,
    /// Caps the steps at `max(1, ceil(ema * ceiling_coeff))` when > 0 (finite, >= 0). Default 0 (off).
    pub ceiling_coeff: f64,
}

impl SlotConfig {
    /// A slot with these candidates and every other setting at its default.
    pub fn with_candidates(candidates: &[u32]) -> Self {
        let mut candidate_steps = candidates.to_vec();
        candidate_steps.sort_unstable();
        candidate_steps.dedup();
        SlotConfig {
            candidate_steps,
            ema_alpha: 0.2,
            update_interval: 5,
            warmup_batches: 10,
            down_hysteresis: -0.25,
            up_hysteresis: 0.0,
            ceiling_coeff: 0.0,
        }
    }

    /// Validates one slot's `ema` settings on their own (the keys of [`SLOT_KEYS`];
    /// `candidate_steps` required, the rest defaulted), with the same rules and messages as
    /// inside a config.
    pub fn from_value(v: &ConfigValue) -> Result<Self, ConfigError> {
        let ConfigValue::Map(entries) = v else {
            return Err(ConfigError::new(format!("slot config must be an object of slot settings, got {v}")));
        };
        let mut cfg = SlotConfig::with_candidates(&[]);
        for (k, v) in entries {
            apply(&mut cfg, Scope::Alone, k, v)?;
        }
        if cfg.candidate_steps.is_empty() {
            return Err(ConfigError::new(format!(
                "candidate_steps is missing (a non-empty list of integers in 0..={MAX_CANDIDATE_STEPS})"
            )));
        }
        Ok(cfg)
    }
}

/// A non-empty list of steps in `0..=MAX_CANDIDATE_STEPS`, sorted and deduplicated.
pub(crate) fn candidates(scope: Scope, v: &ConfigValue) -> Result<Vec<u32>, ConfigError> {
    let key = scope.name("candidate_steps");
    let ConfigValue::List(items) = v else {
        return Err(ConfigError::new(format!(
            "{key} must be a non-empty list of integers in 0..={MAX_CANDIDATE_STEPS}, got {v}"
        )));
    };
    if items.is_empty() {
        return Err(ConfigError::new(format!(
            "{key} must be a non-empty list of integers in 0..={MAX_CANDIDATE_STEPS}, got []"
        )));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item {
            ConfigValue::Int(s) if (0..=MAX_CANDIDATE_STEPS as i64).contains(s) => out.push(*s as u32),
            other => {
                return Err(ConfigError::new(format!(
                    "{key}[{i}] must be an integer in 0..={MAX_CANDIDATE_STEPS}, got {other}"
                )))
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Validates an `ema` slot key's value and writes it into `cfg`. Unknown keys are errors listing
/// the allowed ones.
pub(crate) fn apply(cfg: &mut SlotConfig, scope: Scope, key: &str, v: &ConfigValue) -> Result<(), ConfigError> {
    match key {
        "candidate_steps" => cfg.candidate_steps = candidates(scope, v)?,
        "ema_alpha" => {
            let a = number(scope, key, v)?;
            if !(a > 0.0 && a <= 1.0) {
                return Err(ConfigError::new(format!(
                    "{} must be in (0, 1], got {a}",
                    scope.name(key)
                )));
            }
            cfg.ema_alpha = a;
        }
        "update_interval" => cfg.update_interval = integer(scope, key, v, 1)?,
        "warmup_batches" => cfg.warmup_batches = integer(scope, key, v, 0)?,
        "down_hysteresis" => cfg.down_hysteresis = number(scope, key, v)?,
        "up_hysteresis" => cfg.up_hysteresis = number(scope, key, v)?,
        "ceiling_coeff" => {
            let c = number(scope, key, v)?;
            if c < 0.0 {
                return Err(ConfigError::new(format!("{} must be >= 0, got {c}", scope.name(key))));
            }
            cfg.ceiling_coeff = c;
        }
        "strategy" => {
            return Err(ConfigError::new(match scope {
                Scope::Slot(s) => format!("strategy is a global key; found in slot \"{s}\""),
                Scope::Global | Scope::Alone => "strategy is not a slot setting".to_string(),
            }))
        }
        other => {
            let (place, allowed) = match scope {
                Scope::Global => ("adaptive config".to_string(), super::allowed_global_keys("ema")),
                Scope::Slot(s) => (format!("slot \"{s}\""), SLOT_KEYS.join(", ")),
                Scope::Alone => ("slot config".to_string(), SLOT_KEYS.join(", ")),
            };
            return Err(ConfigError::new(format!(
                "unknown key \"{other}\" in {place}; allowed: {allowed}"
            )));
        }
    }
    Ok(())
}
