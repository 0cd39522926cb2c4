//! `specdial policy simulate`: the strategies against each other and against a clairvoyant oracle,
//! over named regimes ([`workload::Regime`]) and cost curves ([`curve::CostCurve`]), with noisy
//! measured seconds. Seconds to run; the tests of the `goodput` strategy's quality run here
//! (docs/design.md, invariant 6).
//!
//! Contenders per (regime, curve): every fixed steps value `0..=max_steps`, the adaptive configs
//! given (by default `goodput` with specdial's default config, `ema` with SGLang's default config
//! and `throughput_aware` with the config of SGLang's docstring, profiled at start), and the oracle
//! ([`run::run_oracle`]).

pub mod confidence;
pub mod curve;
pub mod oracle;
pub mod run;
pub mod tree;
pub mod tree_report;
pub mod workload;

use serde::Serialize;

use crate::config::AdaptiveConfig;
use curve::CostCurve;
use run::{run_adaptive, run_fixed, run_oracle, Noise, RunOptions, RunResult};
use workload::Regime;

/// SGLang's throughput-aware example config (the docstring of `throughput_aware_controller.py`).
pub const SGLANG_THROUGHPUT_AWARE_EXAMPLE: &str = r#"{"strategy": "throughput_aware", "window_size": 20,
  "update_interval": 10, "1": {"candidate_steps": [1, 3, 5, 7]}, "8": {"candidate_steps": [1, 3, 5]},
  "32": {"candidate_steps": [1, 3]}, "128": {"candidate_steps": [1]}}"#;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimSpec {
    pub regimes: Vec<Regime>,
    /// `(name, curve)`.
    pub curves: Vec<(String, CostCurve)>,
    /// `(name, config)` of the adaptive contenders.
    pub policies: Vec<(String, AdaptiveConfig)>,
    /// Fixed steps `0..=max_steps` run beside, and the oracle's range.
    pub max_steps: u32,
    /// Segments of work per regime (tokens per request, [`workload`]).
    pub segments: u32,
    pub seed: u64,
    pub noise: Noise,
    pub skip_zero_step_draft_extend: bool,
    /// The draft-confidence model ([`confidence`]).
    pub confidence: confidence::DraftConfidence,
}

impl SimSpec {
    /// Every regime and named curve, `goodput` / `ema` / `throughput_aware` with their default
    /// configs, steps up to 7, 16000 segments, seed 0, default noise.
    pub fn standard() -> Self {
        SimSpec {
            regimes: Regime::ALL.to_vec(),
            curves: CostCurve::NAMES.iter().map(|n| (n.to_string(), CostCurve::named(n).expect("named"))).collect(),
            policies: default_policies(),
            max_steps: 7,
            segments: 16000,
            seed: 0,
            noise: Noise::default(),
            skip_zero_step_draft_extend: false,
            confidence: confidence::DraftConfidence::default(),
        }
    }
}

/// `goodput` (specdial's default config), `ema` (SGLang's default), `throughput_aware`
/// (SGLang's example config).
pub fn default_policies() -> Vec<(String, AdaptiveConfig)> {
    vec![
        ("goodput".into(), AdaptiveConfig::default_config()),
        ("ema".into(), AdaptiveConfig::ema_default()),
        (
            "throughput_aware".into(),
            AdaptiveConfig::from_json(SGLANG_THROUGHPUT_AWARE_EXAMPLE).expect("valid example"),
        ),
    ]
}

/// [`default_policies`] with `goodput-per-request` after `goodput` (what `specdial policy
/// simulate` runs by default).
pub fn default_policies_with_per_request() -> Vec<(String, AdaptiveConfig)> {
    let mut p = default_policies();
    p.insert(1, (PER_REQUEST.into(), per_request_config()));
    p
}

/// Name of the per-request contender ([`default_policies_with_per_request`]).
pub const PER_REQUEST: &str = "goodput-per-request";

/// specdial's default `goodput` config with `"verify": "per_request"`.
pub fn per_request_config() -> AdaptiveConfig {
    let mut c = AdaptiveConfig::default_config();
    if let crate::config::Strategy::Goodput(g) = &mut c.strategy {
        g.verify = crate::config::VerifyMode::PerRequest;
        g.min_survival = crate::config::MinSurvival::Auto;
    }
    c
}

/// One (regime, curve) cell of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Case {
    pub regime: String,
    pub steady: bool,
    pub curve: String,
    pub oracle: RunResult,
    /// The per-request oracle ([`oracle`]): true acceptance per request, a verify length each;
    /// run only when a contender decides per request.
    pub oracle_per_request: Option<RunResult>,
    /// The confidence oracle ([`oracle::run_oracle_confidence`]): this iteration's acceptance
    /// probabilities per position; run beside the per-request oracle.
    pub oracle_confidence: Option<RunResult>,
    /// Adaptive contenders, then `fixed-0..fixed-max`.
    pub results: Vec<RunResult>,
}

impl Case {
    /// The contender named `name`.
    pub fn get(&self, name: &str) -> Option<&RunResult> {
        self.results.iter().find(|r| r.name == name)
    }

    /// The best fixed steps value's result.
    pub fn best_fixed(&self) -> &RunResult {
        self.results
            .iter()
            .filter(|r| r.name.starts_with("fixed-"))
            .max_by(|a, b| a.goodput.total_cmp(&b.goodput))
            .expect("fixed contenders")
    }

    /// `name`'s goodput over the oracle's.
    pub fn ratio(&self, name: &str) -> f64 {
        self.get(name).map_or(f64::NAN, |r| r.goodput / self.oracle.goodput)
    }
}

/// Runs one (regime, curve) cell.
pub fn run_case(spec: &SimSpec, regime: Regime, curve_name: &str, curve: &CostCurve) -> Case {
    let w = regime.generate(spec.segments, spec.seed);
    let opts = RunOptions { seed: spec.seed, noise: spec.noise, skip_zero_step_draft_extend: spec.skip_zero_step_draft_extend, confidence: spec.confidence };
    let (oracle, _) = run_oracle(&w, curve, spec.max_steps, &opts);
    let per_request = spec.policies.iter().any(|(_, c)| {
        matches!(&c.strategy, crate::config::Strategy::Goodput(g) if g.verify == crate::config::VerifyMode::PerRequest)
    });
    let oracle_per_request = per_request.then(|| oracle::run_oracle_per_request(&w, curve, spec.max_steps, &opts));
    let oracle_confidence = per_request.then(|| oracle::run_oracle_confidence(&w, curve, spec.max_steps, &opts));
    let mut results: Vec<RunResult> =
        spec.policies.iter().map(|(name, cfg)| run_adaptive(&w, curve, name, cfg, &opts)).collect();
    results.extend((0..=spec.max_steps).map(|k| run_fixed(&w, curve, k, &opts)));
    Case { regime: regime.name.into(), steady: regime.steady, curve: curve_name.into(), oracle, oracle_per_request, oracle_confidence, results }
}

/// Every cell of `spec`.
pub fn run_all(spec: &SimSpec) -> Vec<Case> {
    let mut out = Vec::new();
    for regime in &spec.regimes {
        for (name, curve) in &spec.curves {
            out.push(run_case(spec, *regime, name, curve));
        }
    }
    out
}
