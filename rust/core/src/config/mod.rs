//! The adaptive config: a strategy and per-batch-size slots of candidate steps.
//!
//! The file format is SGLang's `--speculative-adaptive-config` (PRs #21599, #24055, #28045), so a
//! user's file loads unchanged: a JSON object whose keys made only of ASCII digits are batch-size
//! lower bounds (one slot each; `"08"` is 8, `"0"` is an error) and whose other keys are global.
//! specdial also accepts a flat object with a top-level `candidate_steps` and no slot keys, as the
//! single slot `"1"`.
//!
//! The global `strategy` key selects the rules, and with them the keys that are allowed:
//!
//! - `"ema"` (SGLang's EMA + hysteresis): every [`SLOT_KEYS`] key, per slot or at top level (where
//!   it is a default merged under every slot; the slot's own value wins).
//! - `"goodput"` ([`crate::goodput`]): `candidate_steps` per slot, the [`GOODPUT_KEYS`] at top level.
//! - `"throughput_aware"` (SGLang PR #28045, [`crate::throughput`]): `candidate_steps` per slot
//!   (each > 0, SGLang's rule), the [`THROUGHPUT_AWARE_KEYS`] at top level.
//!
//! A key of another strategy is an error that says whose key it is; an unknown key is an error
//! listing the allowed ones. Parsing goes through [`ConfigValue`], a neutral tree that JSON text and
//! Python objects both map onto, so both front doors apply the same rules and messages.

mod slot;
mod strategy;
#[cfg(test)]
mod tests;
pub mod tree;
mod value;

use std::collections::BTreeMap;

pub use slot::{SlotConfig, SLOT_KEYS};
pub use strategy::{
    GoodputConfig, MinSurvival, ProfileConfig, Strategy, ThroughputAwareConfig, VerifyMode, GOODPUT_KEYS, PROFILE_KEYS,
    STRATEGY_NAMES, THROUGHPUT_AWARE_KEYS, VERIFY_MODES,
};
pub use value::ConfigValue;

use crate::error::ConfigError;
use value::Scope;

/// Largest `speculative_num_steps` a config may list (inclusive).
pub const MAX_CANDIDATE_STEPS: u32 = 32;

/// A validated adaptive config: the strategy (with its global settings) and the slots, ascending
/// by batch-size lower bound.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveConfig {
    pub strategy: Strategy,
    /// `(lower bound of the batch-size range, settings)`, ascending, lower bounds >= 1 and unique.
    /// Under `goodput` and `throughput_aware` only `candidate_steps` is used.
    pub slots: Vec<(u32, SlotConfig)>,
}

/// The allowed top-level keys of `strategy`, for error messages.
pub(crate) fn allowed_global_keys(strategy: &str) -> String {
    let keys: Vec<&str> = match strategy {
        "goodput" => GOODPUT_KEYS.to_vec(),
        "throughput_aware" => THROUGHPUT_AWARE_KEYS.to_vec(),
        _ => SLOT_KEYS.to_vec(),
    };
    let extra = if strategy == "ema" { "" } else { "candidate_steps (flat form), " };
    format!(
        "slot keys made of digits (batch-size lower bounds such as \"1\", \"8\"), {extra}{}, strategy",
        keys.join(", ")
    )
}

/// Which strategy a misplaced key belongs to, for error messages.
fn owner_of(key: &str) -> Option<&'static str> {
    if SLOT_KEYS.contains(&key) && key != "candidate_steps" {
        Some("ema")
    } else if GOODPUT_KEYS.contains(&key) && !PROFILE_KEYS.contains(&key) {
        Some("goodput")
    } else if THROUGHPUT_AWARE_KEYS.contains(&key) && !PROFILE_KEYS.contains(&key) {
        Some("throughput_aware")
    } else if PROFILE_KEYS.contains(&key) {
        Some("goodput\" or \"throughput_aware")
    } else {
        None
    }
}

/// Validates a top-level key of a non-`ema` strategy (its own keys, or the flat form's
/// `candidate_steps`).
fn apply_global(strat: &mut Strategy, key: &str, v: &ConfigValue) -> Result<(), ConfigError> {
    if key == "candidate_steps" {
        return slot::candidates(Scope::Global, v).map(|_| ());
    }
    if strat.apply(key, v)? {
        return Ok(());
    }
    let name = strat.name();
    Err(ConfigError::new(match owner_of(key) {
        Some(owner) => format!(
            "{key} is a setting of strategy \"{owner}\", not of \"{name}\"; allowed: {}",
            allowed_global_keys(name)
        ),
        None => format!("unknown key \"{key}\" in adaptive config; allowed: {}", allowed_global_keys(name)),
    }))
}

/// Reads one slot's settings under a non-`ema` strategy: only `candidate_steps`.
fn slot_of(strat: &Strategy, name: &str, settings: &[(String, ConfigValue)], flat: Option<&ConfigValue>) -> Result<SlotConfig, ConfigError> {
    let mut cfg = SlotConfig::with_candidates(&[]);
    if let Some(v) = flat {
        cfg.candidate_steps = slot::candidates(Scope::Global, v)?;
    }
    let scope = Scope::Slot(name);
    for (k, v) in settings {
        match k.as_str() {
            "candidate_steps" => cfg.candidate_steps = slot::candidates(scope, v)?,
            "strategy" => {
                return Err(ConfigError::new(format!("strategy is a global key; found in slot \"{name}\"")))
            }
            other => {
                let s = strat.name();
                return Err(ConfigError::new(match owner_of(other) {
                    Some(owner) if owner != s => format!(
                        "slot \"{name}\": {other} is a setting of strategy \"{owner}\"; strategy \"{s}\" takes only candidate_steps per slot"
                    ),
                    _ if strat.global_keys().contains(&other) => format!(
                        "slot \"{name}\": {other} is a global key of strategy \"{s}\" (put it at top level)"
                    ),
                    _ => format!("unknown key \"{other}\" in slot \"{name}\"; allowed: candidate_steps"),
                }));
            }
        }
    }
    if matches!(strat, Strategy::ThroughputAware(_)) && cfg.candidate_steps.first() == Some(&0) {
        return Err(ConfigError::new(format!(
            "slot \"{name}\": candidate_steps contains 0, but strategy \"throughput_aware\" takes steps > 0 \
             (SGLang's rule); strategy \"goodput\" can choose 0"
        )));
    }
    Ok(cfg)
}

impl AdaptiveConfig {
    /// SGLang's default EMA config (`DEFAULT_ADAPTIVE_CONFIG`): slot 1 `[1, 3, 5, 7]` (down
    /// -0.25), slot 8 `[0, 1, 3]`, slot 32 `[0, 1]`, slot 64 `[0]` (down 0.0 for the last three;
    /// up 0.0 and ceiling 0 everywhere).
    pub fn ema_default() -> Self {
        let slot = |c: &[u32], down: f64| SlotConfig { down_hysteresis: down, ..SlotConfig::with_candidates(c) };
        AdaptiveConfig {
            strategy: Strategy::Ema,
            slots: vec![
                (1, slot(&[1, 3, 5, 7], -0.25)),
                (8, slot(&[0, 1, 3], 0.0)),
                (32, slot(&[0, 1], 0.0)),
                (64, slot(&[0], 0.0)),
            ],
        }
    }

    /// specdial's default: the `goodput` strategy with its default settings over slot 1
    /// `0..=7`, slot 128 `0..=5`, slot 256 `0..=3`. The candidates only bound what can ever be
    /// chosen (and so which CUDA graphs are captured): the strategy picks among them by
    /// measured goodput, 0 included, on any hardware.
    pub fn default_config() -> Self {
        let range = |hi: u32| SlotConfig::with_candidates(&(0..=hi).collect::<Vec<_>>());
        AdaptiveConfig {
            strategy: Strategy::Goodput(GoodputConfig::default()),
            slots: vec![(1, range(7)), (128, range(5)), (256, range(3))],
        }
    }

    /// Parses JSON text. Errors: invalid JSON (with line and column) and every rule of
    /// [`AdaptiveConfig::from_value`].
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ConfigError::new(format!("adaptive config is not valid JSON: {e}")))?;
        Self::from_value(&ConfigValue::from(&v))
    }

    /// Validates a config tree. Every error names the key (and slot) and the bad value; unknown
    /// keys are errors listing the allowed ones.
    pub fn from_value(root: &ConfigValue) -> Result<Self, ConfigError> {
        let ConfigValue::Map(entries) = root else {
            return Err(ConfigError::new(format!("adaptive config must be a JSON object, got {root}")));
        };
        let mut strat = match entries.iter().find(|(k, _)| k == "strategy") {
            Some((_, v)) => Strategy::from_name(v)?,
            None => Strategy::Ema,
        };
        let ema = strat == Strategy::Ema;
        let mut globals: Vec<(&str, &ConfigValue)> = Vec::new();
        let mut slot_entries: BTreeMap<u32, (&str, &Vec<(String, ConfigValue)>)> = BTreeMap::new();
        for (key, value) in entries {
            if !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()) {
                let bound: u32 = key.parse().map_err(|_| {
                    ConfigError::new(format!("slot key \"{key}\": batch-size lower bound too large"))
                })?;
                if bound == 0 {
                    return Err(ConfigError::new(format!(
                        "slot key \"{key}\": batch-size lower bounds start at 1"
                    )));
                }
                let ConfigValue::Map(settings) = value else {
                    return Err(ConfigError::new(format!(
                        "slot \"{key}\" must be an object of slot settings, got {value}"
                    )));
                };
                if let Some((other, _)) = slot_entries.insert(bound, (key, settings)) {
                    return Err(ConfigError::new(format!(
                        "slot keys \"{other}\" and \"{key}\" both mean batch size {bound}"
                    )));
                }
            } else if key == "strategy" {
                continue;
            } else if ema {
                if let Some(owner) = owner_of(key).filter(|o| *o != "ema") {
                    return Err(ConfigError::new(format!(
                        "{key} is a setting of strategy \"{owner}\", not of \"ema\" (set \"strategy\" to use it); allowed: {}",
                        allowed_global_keys("ema")
                    )));
                }
                slot::apply(&mut SlotConfig::with_candidates(&[0]), Scope::Global, key, value)?;
                globals.push((key, value));
            } else {
                apply_global(&mut strat, key, value)?;
                if key == "candidate_steps" {
                    globals.push((key, value));
                }
            }
        }
        let flat = globals.iter().find(|(k, _)| *k == "candidate_steps").map(|(_, v)| *v);
        let empty = Vec::new();
        if slot_entries.is_empty() {
            if flat.is_none() {
                return Err(ConfigError::new(
                    "adaptive config has no slot: add batch-size keys such as \
                     {\"1\": {\"candidate_steps\": [1, 3]}} or a top-level candidate_steps",
                ));
            }
            slot_entries.insert(1, ("1", &empty));
        }
        let mut slots = Vec::with_capacity(slot_entries.len());
        for (bound, (name, settings)) in slot_entries {
            let cfg = if ema {
                let mut cfg = SlotConfig::with_candidates(&[]);
                for (k, v) in &globals {
                    slot::apply(&mut cfg, Scope::Global, k, v)?;
                }
                for (k, v) in settings {
                    slot::apply(&mut cfg, Scope::Slot(name), k, v)?;
                }
                cfg
            } else {
                slot_of(&strat, name, settings, flat)?
            };
            if cfg.candidate_steps.is_empty() {
                return Err(ConfigError::new(format!(
                    "slot \"{name}\": candidate_steps is missing (a non-empty list of integers in 0..={MAX_CANDIDATE_STEPS})"
                )));
            }
            slots.push((bound, cfg));
        }
        if let Strategy::Goodput(g) = &strat {
            if g.min_survival != MinSurvival::Off && g.verify != VerifyMode::PerRequest {
                return Err(ConfigError::new(
                    "min_survival needs \"verify\": \"per_request\" (the confidence stop gives each request \
                     its own verify length); set verify to \"per_request\" or min_survival to null",
                ));
            }
        }
        Ok(AdaptiveConfig { strategy: strat, slots })
    }

    /// Sorted union of every slot's candidate steps.
    pub fn candidate_union(&self) -> Vec<u32> {
        let mut all: Vec<u32> = self.slots.iter().flat_map(|(_, s)| s.candidate_steps.iter().copied()).collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Errors when `steps` is a candidate of no slot (an adaptive engine could never return to it).
    pub fn validate_initial_steps(&self, steps: i64) -> Result<(), ConfigError> {
        let union = self.candidate_union();
        if steps < 0 || !union.contains(&(steps as u32)) {
            return Err(ConfigError::new(format!(
                "speculative_num_steps = {steps} is a candidate of no slot; candidates: {union:?}"
            )));
        }
        Ok(())
    }

    /// The startup profiling run this config asks for: always for `throughput_aware`, for
    /// `goodput` when a `profile_run_*` key is given, never for `ema`.
    pub fn profile(&self) -> Option<&ProfileConfig> {
        match &self.strategy {
            Strategy::Ema => None,
            Strategy::Goodput(g) => g.profile.as_ref(),
            Strategy::ThroughputAware(t) => Some(&t.profile),
        }
    }

    /// The canonical JSON form: `strategy`, the strategy's global settings, and one fully merged
    /// object per slot (every `ema` slot key under `ema`; only `candidate_steps` otherwise).
    pub fn to_json(&self) -> String {
        let mut root = serde_json::Map::new();
        if let serde_json::Value::Object(m) = serde_json::to_value(&self.strategy).expect("serializable") {
            for (k, v) in m {
                if k == "profile" {
                    if let serde_json::Value::Object(p) = v {
                        root.extend(p);
                    }
                } else {
                    root.insert(k, v);
                }
            }
        }
        for (bound, cfg) in &self.slots {
            let slot = if self.strategy == Strategy::Ema {
                serde_json::to_value(cfg).expect("serializable")
            } else {
                serde_json::json!({ "candidate_steps": cfg.candidate_steps })
            };
            root.insert(bound.to_string(), slot);
        }
        serde_json::Value::Object(root).to_string()
    }
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        Self::default_config()
    }
}
