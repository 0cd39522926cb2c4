//! The neutral config tree ([`ConfigValue`]) that JSON text and Python objects both map onto, and
//! the typed readers (`number`, `integer`, lists) that every key's validation goes through, so
//! that both front doors apply the same rules and error messages.

use std::fmt;

use crate::error::ConfigError;

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
pub(crate) enum Scope<'a> {
    Global,
    Slot(&'a str),
    /// A lone slot's settings (`AdaptiveStepSlot(initial_steps, slot_config)`).
    Alone,
}

impl Scope<'_> {
    pub(crate) fn name(&self, key: &str) -> String {
        match self {
            Scope::Global | Scope::Alone => key.to_string(),
            Scope::Slot(s) => format!("slot \"{s}\": {key}"),
        }
    }
}

/// A finite number (an integer is taken as its float value).
pub(crate) fn number(scope: Scope, key: &str, v: &ConfigValue) -> Result<f64, ConfigError> {
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

/// A finite number for which `ok` holds; `range` describes the allowed values in the error.
pub(crate) fn number_in(
    scope: Scope,
    key: &str,
    v: &ConfigValue,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<f64, ConfigError> {
    let x = number(scope, key, v)?;
    if !ok(x) {
        return Err(ConfigError::new(format!("{} must be {range}, got {x}", scope.name(key))));
    }
    Ok(x)
}

/// An integer `>= min` that fits u32.
pub(crate) fn integer(scope: Scope, key: &str, v: &ConfigValue, min: i64) -> Result<u32, ConfigError> {
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

/// `null` or an integer `>= min`.
pub(crate) fn optional_integer(
    scope: Scope,
    key: &str,
    v: &ConfigValue,
    min: i64,
) -> Result<Option<u32>, ConfigError> {
    match v {
        ConfigValue::Null => Ok(None),
        ConfigValue::Int(_) => integer(scope, key, v, min).map(Some),
        other => Err(ConfigError::new(format!(
            "{} must be null or an integer >= {min}, got {other}",
            scope.name(key)
        ))),
    }
}

/// `null` or a non-empty list of integers `>= min`, sorted and deduplicated.
pub(crate) fn optional_integer_list(
    scope: Scope,
    key: &str,
    v: &ConfigValue,
    min: i64,
) -> Result<Option<Vec<u32>>, ConfigError> {
    let name = scope.name(key);
    let items = match v {
        ConfigValue::Null => return Ok(None),
        ConfigValue::List(items) if !items.is_empty() => items,
        other => {
            let got = if matches!(other, ConfigValue::List(_)) { "[]".to_string() } else { other.to_string() };
            return Err(ConfigError::new(format!(
                "{name} must be null or a non-empty list of integers >= {min}, got {got}"
            )));
        }
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item {
            ConfigValue::Int(x) if *x >= min && *x <= u32::MAX as i64 => out.push(*x as u32),
            other => {
                return Err(ConfigError::new(format!(
                    "{name}[{i}] must be an integer >= {min}, got {other}"
                )))
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(Some(out))
}
