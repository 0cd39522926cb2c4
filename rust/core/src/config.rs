//! The adaptive config: per-batch-size slots of candidate steps and EMA/hysteresis settings.
//!
//! The file format is SGLang's `--speculative-adaptive-config` (PRs #21599, #24055), so a user's
//! file loads unchanged: a JSON object whose keys made only of ASCII digits are batch-size lower
//! bounds (one slot each; `"08"` is 8, `"0"` is an error) and whose other keys are global values
//! merged under every slot (the slot's own value wins). specdial also accepts a flat object with a
//! top-level `candidate_steps` and no slot keys, as the single slot `"1"`.
//!
//! Parsing goes through [`ConfigValue`], a neutral tree that both JSON text and Python objects map
//! onto, so that both front doors apply exactly the same rules and error messages.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use crate::error::ConfigError;

/// Largest `speculative_num_steps` a config may list (inclusive).
pub const MAX_CANDIDATE_STEPS: u32 = 32;

/// Keys allowed inside a slot and at top level (where they act as defaults for every slot).
pub const SLOT_KEYS: [&str; 7] = [
    "candidate_steps",
    "ceiling_coeff",
    "down_hysteresis",
    "ema_alpha",
    "up_hysteresis",
    "update_interval",
    "warmup_batches",
];

/// How the steps are chosen. Only `ema` exists today; `throughput_aware` (SGLang #28045) is
/// reserved and rejected with a "not yet supported" error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    Ema,
}

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
}

/// A validated adaptive config: the strategy and the slots, ascending by batch-size lower bound.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveConfig {
    pub strategy: Strategy,
    /// `(lower bound of the batch-size range, settings)`, ascending, lower bounds >= 1 and unique.
    pub slots: Vec<(u32, SlotConfig)>,
}

/// A config value as read from JSON or from a Python object, before validation.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigValue {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<ConfigValue>),
    Map(Vec<(String, ConfigValue)>),
    /// Anything else (an integer too large for i64, an unsupported Python type), described for
    /// the error message.
    Other(String),
}

impl From<&serde_json::Value> for ConfigValue {
    fn from(v: &serde_json::Value) -> Self {
        use serde_json::Value as J;
        match v {
            J::Null => ConfigValue::Null,
            J::Bool(b) => ConfigValue::Bool(*b),
            J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                (Some(i), _, _) => ConfigValue::Int(i),
                (None, Some(u), _) => ConfigValue::Other(format!("integer {u} (too large)")),
                (_, _, Some(f)) => ConfigValue::Float(f),
                _ => ConfigValue::Other(format!("number {n}")),
            },
            J::String(s) => ConfigValue::Str(s.clone()),
            J::Array(a) => ConfigValue::List(a.iter().map(ConfigValue::from).collect()),
            J::Object(m) => ConfigValue::Map(
                m.iter().map(|(k, v)| (k.clone(), ConfigValue::from(v))).collect(),
            ),
        }
    }
}

impl fmt::Display for ConfigValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigValue::Null => write!(f, "null"),
            ConfigValue::Bool(b) => write!(f, "{b}"),
            ConfigValue::Int(i) => write!(f, "{i}"),
            ConfigValue::Float(x) if x.is_finite() && x.fract() == 0.0 => write!(f, "{x:.1}"),
            ConfigValue::Float(x) => write!(f, "{x}"),
            ConfigValue::Str(s) => write!(f, "{s:?}"),
            ConfigValue::List(_) => write!(f, "a list"),
            ConfigValue::Map(_) => write!(f, "an object"),
            ConfigValue::Other(d) => write!(f, "{d}"),
        }
    }
}

/// Where a value was found, for error messages: top level or one slot.
#[derive(Clone, Copy)]
enum Scope<'a> {
    Global,
    Slot(&'a str),
    /// A lone slot's settings (`AdaptiveStepSlot(initial_steps, slot_config)`).
    Alone,
}

impl Scope<'_> {
    fn name(&self, key: &str) -> String {
        match self {
            Scope::Global | Scope::Alone => key.to_string(),
            Scope::Slot(s) => format!("slot \"{s}\": {key}"),
        }
    }
}

fn allowed_keys() -> String {
    format!(
        "slot keys made of digits (batch-size lower bounds such as \"1\", \"8\"), {}, strategy",
        SLOT_KEYS.join(", ")
    )
}

fn number(scope: Scope, key: &str, v: &ConfigValue) -> Result<f64, ConfigError> {
    let x = match v {
        ConfigValue::Int(i) => *i as f64,
        ConfigValue::Float(x) => *x,
        other => {
            return Err(ConfigError::new(format!(
                "{} must be a number, got {other}",
                scope.name(key)
            )))
        }
    };
    if !x.is_finite() {
        return Err(ConfigError::new(format!("{} must be finite, got {x}", scope.name(key))));
    }
    Ok(x)
}

fn integer(scope: Scope, key: &str, v: &ConfigValue, min: i64) -> Result<u32, ConfigError> {
    match v {
        ConfigValue::Int(i) if *i >= min && *i <= u32::MAX as i64 => Ok(*i as u32),
        ConfigValue::Int(i) => Err(ConfigError::new(format!(
            "{} must be an integer >= {min}, got {i}",
            scope.name(key)
        ))),
        other => Err(ConfigError::new(format!(
            "{} must be an integer >= {min}, got {other}",
            scope.name(key)
        ))),
    }
}

fn candidates(scope: Scope, v: &ConfigValue) -> Result<Vec<u32>, ConfigError> {
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

/// Validates one `key: value` pair that may appear in a slot or at top level.
fn check_slot_value(scope: Scope, key: &str, v: &ConfigValue) -> Result<(), ConfigError> {
    apply(&mut SlotConfig::with_candidates(&[0]), scope, key, v)
}

/// Validates `key: value` and writes it into `cfg`.
fn apply(cfg: &mut SlotConfig, scope: Scope, key: &str, v: &ConfigValue) -> Result<(), ConfigError> {
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
                Scope::Global => ("adaptive config".to_string(), allowed_keys()),
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

fn strategy(v: &ConfigValue) -> Result<Strategy, ConfigError> {
    match v {
        ConfigValue::Str(s) if s == "ema" => Ok(Strategy::Ema),
        ConfigValue::Str(s) if s == "throughput_aware" => Err(ConfigError::new(
            "strategy \"throughput_aware\" is not yet supported; supported: \"ema\"",
        )),
        other => Err(ConfigError::new(format!(
            "strategy must be \"ema\" (\"throughput_aware\" is reserved, not yet supported), got {other}"
        ))),
    }
}

impl SlotConfig {
    /// Validates one slot's settings on their own (the keys of [`SLOT_KEYS`]; `candidate_steps`
    /// required, the rest defaulted), with the same rules and messages as inside a config.
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

impl AdaptiveConfig {
    /// The built-in default: slot 1 `[1, 3, 5, 7]` (down -0.25), slot 8 `[0, 1, 3]`, slot 32
    /// `[0, 1]`, slot 64 `[0]` (down 0.0 for the last three; up 0.0 and ceiling 0 everywhere).
    pub fn default_config() -> Self {
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
        let mut strat = Strategy::Ema;
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
                strat = strategy(value)?;
            } else {
                check_slot_value(Scope::Global, key, value)?;
                globals.push((key, value));
            }
        }
        let has_global_candidates = globals.iter().any(|(k, _)| *k == "candidate_steps");
        let empty = Vec::new();
        if slot_entries.is_empty() {
            if !has_global_candidates {
                return Err(ConfigError::new(
                    "adaptive config has no slot: add batch-size keys such as \
                     {\"1\": {\"candidate_steps\": [1, 3]}} or a top-level candidate_steps",
                ));
            }
            slot_entries.insert(1, ("1", &empty));
        }
        let mut slots = Vec::with_capacity(slot_entries.len());
        for (bound, (name, settings)) in slot_entries {
            let mut cfg = SlotConfig::with_candidates(&[]);
            for (k, v) in &globals {
                apply(&mut cfg, Scope::Global, k, v)?;
            }
            for (k, v) in settings {
                apply(&mut cfg, Scope::Slot(name), k, v)?;
            }
            if cfg.candidate_steps.is_empty() {
                return Err(ConfigError::new(format!(
                    "slot \"{name}\": candidate_steps is missing (a non-empty list of integers in 0..={MAX_CANDIDATE_STEPS})"
                )));
            }
            slots.push((bound, cfg));
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

    /// The canonical JSON form: `strategy` plus one fully merged object per slot.
    pub fn to_json(&self) -> String {
        let mut root = serde_json::Map::new();
        root.insert("strategy".into(), serde_json::to_value(self.strategy).expect("serializable"));
        for (bound, cfg) in &self.slots {
            root.insert(bound.to_string(), serde_json::to_value(cfg).expect("serializable"));
        }
        serde_json::Value::Object(root).to_string()
    }
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        Self::default_config()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        AdaptiveConfig::from_json(text).unwrap_err().0
    }

    #[test]
    fn slot_keys_merge_globals_and_normalise() {
        let c = AdaptiveConfig::from_json(
            r#"{"ema_alpha": 0.5, "08": {"candidate_steps": [3, 0, 3]}, "1": {"candidate_steps": [1], "ema_alpha": 0.1}}"#,
        )
        .unwrap();
        assert_eq!(c.slots.len(), 2);
        assert_eq!(c.slots[0].0, 1);
        assert_eq!(c.slots[0].1.ema_alpha, 0.1);
        assert_eq!(c.slots[1].0, 8);
        assert_eq!(c.slots[1].1.candidate_steps, vec![0, 3]);
        assert_eq!(c.slots[1].1.ema_alpha, 0.5);
        assert_eq!(c.slots[1].1.update_interval, 5);
        assert_eq!(c.slots[1].1.warmup_batches, 10);
        assert_eq!(c.slots[1].1.down_hysteresis, -0.25);
    }

    #[test]
    fn flat_object_is_slot_one() {
        let c = AdaptiveConfig::from_json(r#"{"candidate_steps": [2, 4], "warmup_batches": 0}"#).unwrap();
        assert_eq!(c.slots.len(), 1);
        assert_eq!(c.slots[0].0, 1);
        assert_eq!(c.slots[0].1.candidate_steps, vec![2, 4]);
        assert_eq!(c.slots[0].1.warmup_batches, 0);
    }

    #[test]
    fn default_matches_spec() {
        let c = AdaptiveConfig::default_config();
        let bounds: Vec<u32> = c.slots.iter().map(|s| s.0).collect();
        assert_eq!(bounds, vec![1, 8, 32, 64]);
        assert_eq!(c.slots[0].1.candidate_steps, vec![1, 3, 5, 7]);
        assert_eq!(c.slots[0].1.down_hysteresis, -0.25);
        assert_eq!(c.slots[1].1.candidate_steps, vec![0, 1, 3]);
        assert_eq!(c.slots[3].1.candidate_steps, vec![0]);
        assert!(c.slots[1..].iter().all(|s| s.1.down_hysteresis == 0.0));
        assert_eq!(c.candidate_union(), vec![0, 1, 3, 5, 7]);
        // The canonical JSON round-trips.
        assert_eq!(AdaptiveConfig::from_json(&c.to_json()).unwrap(), c);
    }

    #[test]
    fn errors_name_key_and_value() {
        assert!(err("[1]").contains("must be a JSON object"));
        assert!(err("{").contains("not valid JSON"));
        assert!(err("{}").contains("no slot"));
        assert!(err(r#"{"0": {"candidate_steps": [1]}}"#).contains("slot key \"0\""));
        assert!(err(r#"{"8": {"candidate_steps": [1]}, "08": {"candidate_steps": [1]}}"#).contains("both mean batch size 8"));
        assert!(err(r#"{"1": {}}"#).contains("candidate_steps is missing"));
        assert!(err(r#"{"1": {"candidate_steps": []}}"#).contains("non-empty"));
        assert!(err(r#"{"1": {"candidate_steps": 3}}"#).contains("got 3"));
        assert!(err(r#"{"1": {"candidate_steps": [-1]}}"#).contains("candidate_steps[0]"));
        assert!(err(r#"{"1": {"candidate_steps": [1.0]}}"#).contains("got 1.0"));
        assert!(err(r#"{"1": {"candidate_steps": [true]}}"#).contains("got true"));
        assert!(err(r#"{"1": {"candidate_steps": [33]}}"#).contains("0..=32"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "ema_alpha": 0}}"#).contains("slot \"1\": ema_alpha must be in (0, 1]"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "ema_alpha": 1.5}}"#).contains("got 1.5"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "ema_alpha": true}}"#).contains("must be a number, got true"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "update_interval": 0}}"#).contains("update_interval must be an integer >= 1"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "update_interval": 2.0}}"#).contains("got 2.0"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "warmup_batches": -1}}"#).contains("warmup_batches"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "ceiling_coeff": -0.1}}"#).contains("ceiling_coeff must be >= 0"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "down_hysteresis": "x"}}"#).contains("down_hysteresis must be a number"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "speed": 1}}"#).contains("unknown key \"speed\" in slot \"1\"; allowed:"));
        assert!(err(r#"{"speed": 1, "1": {"candidate_steps": [1]}}"#).contains("unknown key \"speed\" in adaptive config"));
        assert!(err(r#"{"1": {"candidate_steps": [1], "strategy": "ema"}}"#).contains("global key"));
        assert!(err(r#"{"strategy": "throughput_aware", "1": {"candidate_steps": [1]}}"#).contains("not yet supported"));
        assert!(err(r#"{"strategy": "fast", "1": {"candidate_steps": [1]}}"#).contains("got \"fast\""));
        assert!(err(r#"{"1": [1]}"#).contains("slot \"1\" must be an object"));
        assert!(err(r#"{"99999999999": {"candidate_steps": [1]}}"#).contains("too large"));
        // A bad global value is reported even when every slot overrides it.
        assert!(err(r#"{"ema_alpha": 2, "1": {"candidate_steps": [1], "ema_alpha": 0.5}}"#).contains("ema_alpha must be in (0, 1]"));
    }

    #[test]
    fn non_finite_numbers_are_rejected() {
        let root = ConfigValue::Map(vec![
            ("candidate_steps".into(), ConfigValue::List(vec![ConfigValue::Int(1)])),
            ("up_hysteresis".into(), ConfigValue::Float(f64::NAN)),
        ]);
        assert!(AdaptiveConfig::from_value(&root).unwrap_err().0.contains("up_hysteresis must be finite"));
    }

    #[test]
    fn initial_steps_must_be_a_candidate() {
        let c = AdaptiveConfig::default_config();
        assert!(c.validate_initial_steps(3).is_ok());
        assert!(c.validate_initial_steps(0).is_ok());
        assert!(c.validate_initial_steps(2).unwrap_err().0.contains("candidate of no slot"));
        assert!(c.validate_initial_steps(-1).is_err());
    }
}
