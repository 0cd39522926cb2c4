//! The `goodput` strategy's `tree` key: upper bounds of the draft trees it may choose (issue 29).
//!
//! ```json
//! {"strategy": "goodput", "tree": {"max_topk": 8, "max_num_draft_tokens": 32}}
//! ```
//!
//! The bounds take SGLang's names too (`speculative_eagle_topk`, `speculative_num_draft_tokens`,
//! what the engine passes from its flags of those names): with adaptation on, the flags are upper
//! bounds for the policy. `num_draft_tokens` counts the tree's nodes without the root (the shared
//! contract of issue 29; SGLang's flag counts the root too, `steps + 1` for a chain). Without the
//! key the strategy drafts chains only.

use serde::Serialize;

use super::value::{integer, ConfigValue, Scope};
use crate::error::ConfigError;

/// Largest `max_topk` accepted (SGLang's EAGLE kernels and TensorRT-LLM's dynamic tree go to 8
/// in their flagship configs; 16 leaves room without letting a typo ask for a vocabulary-wide
/// beam).
pub const MAX_TOPK: u32 = 16;
/// Largest `max_num_draft_tokens` accepted (the shared contract's bound on `N`).
pub const MAX_NUM_DRAFT_TOKENS: u32 = 64;

/// Keys of the `tree` object (each has an SGLang-named alias, [`TREE_ALIASES`]).
pub const TREE_KEYS: [&str; 2] = ["max_topk", "max_num_draft_tokens"];
/// SGLang's names of [`TREE_KEYS`], in the same order.
pub const TREE_ALIASES: [&str; 2] = ["speculative_eagle_topk", "speculative_num_draft_tokens"];

/// Upper bounds of the draft trees the `goodput` strategy chooses among.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TreeConfig {
    /// Children kept per expanded node, at most (`1..=MAX_TOPK`; 1: chains only).
    pub max_topk: u32,
    /// Tree nodes verified per request, root excluded, at most (`1..=MAX_NUM_DRAFT_TOKENS`).
    pub max_num_draft_tokens: u32,
}

impl TreeConfig {
    /// Parses the value of the `tree` key: an object with both bounds (either name of each), or
    /// null (chains only). Errors name `tree.<key>` and the allowed values; an unknown key lists
    /// the allowed ones.
    pub(crate) fn parse(v: &ConfigValue) -> Result<Option<TreeConfig>, ConfigError> {
        let ConfigValue::Map(entries) = v else {
            if *v == ConfigValue::Null {
                return Ok(None);
            }
            return Err(ConfigError::new(format!(
                "tree must be an object with keys \"max_topk\" and \"max_num_draft_tokens\", got {v}"
            )));
        };
        let mut found: [Option<u32>; 2] = [None, None];
        for (key, value) in entries {
            let Some(i) = TREE_KEYS
                .iter()
                .position(|k| k == key)
                .or_else(|| TREE_ALIASES.iter().position(|k| k == key))
            else {
                return Err(ConfigError::new(format!(
                    "tree: unknown key \"{key}\"; allowed: {} (or SGLang's {})",
                    TREE_KEYS.join(", "),
                    TREE_ALIASES.join(", ")
                )));
            };
            let name = format!("tree.{key}");
            let n = integer(Scope::Global, &name, value, 1)?;
            let max = [MAX_TOPK, MAX_NUM_DRAFT_TOKENS][i];
            if n > max {
                return Err(ConfigError::new(format!(
                    "{name} must be an integer in 1..={max}, got {n}"
                )));
            }
            if found[i].replace(n).is_some() {
                return Err(ConfigError::new(format!(
                    "tree: {} is given twice (as {} and {})",
                    TREE_KEYS[i], TREE_KEYS[i], TREE_ALIASES[i]
                )));
            }
        }
        match found {
            [Some(max_topk), Some(max_num_draft_tokens)] => Ok(Some(TreeConfig { max_topk, max_num_draft_tokens })),
            _ => Err(ConfigError::new(
                "tree needs both max_topk and max_num_draft_tokens (integers >= 1)".to_string(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AdaptiveConfig, Strategy};

    fn tree_of(json: &str) -> Result<Option<TreeConfig>, String> {
        let c = AdaptiveConfig::from_json(json).map_err(|e| e.to_string())?;
        match c.strategy {
            Strategy::Goodput(g) => Ok(g.tree),
            _ => Err("not goodput".into()),
        }
    }

    #[test]
    fn both_names_parse_and_the_default_is_chains_only() {
        let base = r#"{"strategy": "goodput", "candidate_steps": [0, 1, 2, 3]"#;
        assert_eq!(tree_of(&format!("{base}}}")).unwrap(), None);
        let t = tree_of(&format!(
            r#"{base}, "tree": {{"max_topk": 4, "max_num_draft_tokens": 16}}}}"#
        ))
        .unwrap();
        assert_eq!(
            t,
            Some(TreeConfig {
                max_topk: 4,
                max_num_draft_tokens: 16
            })
        );
        let t = tree_of(&format!(r#"{base}, "tree": {{"speculative_eagle_topk": 8, "speculative_num_draft_tokens": 64}}}}"#)).unwrap();
        assert_eq!(
            t,
            Some(TreeConfig {
                max_topk: 8,
                max_num_draft_tokens: 64
            })
        );
    }

    #[test]
    fn bad_values_are_errors_that_name_the_key() {
        let base = r#"{"strategy": "goodput", "candidate_steps": [0, 1, 2, 3], "tree": "#;
        let err = |t: &str| tree_of(&format!("{base}{t}}}")).unwrap_err();
        assert!(err(r#"{"max_topk": 0, "max_num_draft_tokens": 8}"#)
            .contains("tree.max_topk must be an integer >= 1"));
        assert!(err(r#"{"max_topk": 17, "max_num_draft_tokens": 8}"#)
            .contains("tree.max_topk must be an integer in 1..=16"));
        assert!(
            err(r#"{"max_topk": 2, "speculative_num_draft_tokens": 65}"#)
                .contains("tree.speculative_num_draft_tokens must be an integer in 1..=64")
        );
        assert!(err(r#"{"max_topk": 2.5, "max_num_draft_tokens": 8}"#).contains("tree.max_topk"));
        assert!(err(r#"{"max_topk": 2}"#).contains("needs both"));
        assert!(
            err(r#"{"max_topk": 2, "max_num_draft_tokens": 8, "topk": 1}"#)
                .contains("unknown key \"topk\"")
        );
        assert!(
            err(r#"{"max_topk": 2, "speculative_eagle_topk": 2, "max_num_draft_tokens": 8}"#)
                .contains("twice")
        );
        assert!(err("4").contains("tree must be an object"));
    }
}
