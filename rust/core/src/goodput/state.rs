//! The `goodput` strategy's learned state saved across runs (the policy cache).

use super::acceptance::AcceptanceState;
use super::cost::CostState;
use super::GoodputPolicy;
use serde::{Deserialize, Serialize};

/// Version of the saved learned state ([`GoodputPolicy::export_state`]); a state of another
/// version is refused. Bump it whenever [`CostState`] or [`AcceptanceState`] change meaning.
pub const STATE_VERSION: u32 = 1;

/// What the strategy saves across runs on one machine: the cost model and the long-run
/// acceptance counts (the slots' steps, probe credit and counters start afresh).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct LearnedState {
    version: u32,
    cost: CostState,
    acceptance: AcceptanceState,
}

impl GoodputPolicy {
    /// What the strategy learned, as JSON: `{"version": STATE_VERSION, "cost": ..., "acceptance":
    /// ...}` (the cost model and the long-run acceptance counts; [`Self::import_state`] reads it).
    pub fn export_state(&self) -> String {
        let state = LearnedState { version: STATE_VERSION, cost: self.cost.state(), acceptance: self.acceptance.state() };
        serde_json::to_string(&state).expect("the learned state is plain numbers")
    }

    /// Seeds the cost model and the acceptance prior with a state [`Self::export_state`] wrote
    /// (on the same machine, model and drafter: the caller keys it). Errors, with nothing
    /// changed, on text that does not parse, another `version`, or values out of range.
    pub fn import_state(&mut self, text: &str) -> Result<(), String> {
        let version = serde_json::from_str::<serde_json::Value>(text)
            .map_err(|e| format!("not JSON: {e}"))?
            .get("version")
            .and_then(serde_json::Value::as_u64);
        if version != Some(u64::from(STATE_VERSION)) {
            return Err(format!("version {version:?}, expected {STATE_VERSION}"));
        }
        let state: LearnedState = serde_json::from_str(text).map_err(|e| format!("bad state: {e}"))?;
        let mut cost = self.cost.clone();
        cost.restore(state.cost)?;
        let mut acceptance = self.acceptance.clone();
        acceptance.restore(&state.acceptance)?;
        self.cost = cost;
        self.acceptance = acceptance;
        Ok(())
    }
}
