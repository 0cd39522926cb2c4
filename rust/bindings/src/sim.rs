//! Python surface of `specdial_core::sim`: `simulate(spec_json)` and `CostTable`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde::Deserialize;

use specdial_core::config::AdaptiveConfig;
use specdial_core::sim::curve::{CostCurve, CostTable};
use specdial_core::sim::run::Noise;
use specdial_core::sim::tree_report::{run_tree_case_with, tree_bounds, CONCURRENCY};
use specdial_core::sim::workload::Regime;
use specdial_core::sim::{default_policies_with_per_request, run_all, SimSpec};

use crate::guard;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    regimes: Option<Vec<String>>,
    /// Curve names, or `{"name": ..., "table": <cost-table JSON text>}`.
    curves: Option<Vec<serde_json::Value>>,
    /// `[[name, config JSON text], ...]`.
    policies: Option<Vec<(String, String)>>,
    segments: Option<u32>,
    seed: Option<u64>,
    noise_sigma: Option<f64>,
    spike_probability: Option<f64>,
    drift: Option<f64>,
    interference: Option<f64>,
    max_steps: Option<u32>,
    skip_zero_step_draft_extend: Option<bool>,
}

fn bad(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// Curve names, or `{"name": ..., "table": <cost-table JSON text>}`: ValueError naming the bad
/// entry.
fn parse_curves(curves: &[serde_json::Value]) -> PyResult<Vec<(String, CostCurve)>> {
    curves
        .iter()
        .map(|c| match c {
            serde_json::Value::String(n) => CostCurve::named(n)
                .map(|curve| (n.clone(), curve))
                .ok_or_else(|| bad(format!("curve {n:?} is not one of {}", CostCurve::NAMES.join(", ")))),
            serde_json::Value::Object(m) => {
                let name = m.get("name").and_then(|v| v.as_str()).unwrap_or("table").to_string();
                let text = m.get("table").and_then(|v| v.as_str()).ok_or_else(|| bad("a table curve needs \"table\": text"))?;
                let table = CostTable::from_json(text).map_err(|e| bad(format!("{name}: {e}")))?;
                Ok((name, CostCurve::Table(table)))
            }
            other => Err(bad(format!("curves entries are names or tables, got {other}"))),
        })
        .collect()
}

fn build(spec: Spec) -> PyResult<SimSpec> {
    let mut out = SimSpec::standard();
    if let Some(names) = spec.regimes {
        out.regimes = names
            .iter()
            .map(|n| {
                Regime::named(n).ok_or_else(|| {
                    let all: Vec<&str> = Regime::every().map(|r| r.name).collect();
                    bad(format!("regime {n:?} is not one of {}", all.join(", ")))
                })
            })
            .collect::<PyResult<_>>()?;
    }
    if let Some(curves) = spec.curves {
        out.curves = parse_curves(&curves)?;
    }
    if let Some(policies) = spec.policies {
        out.policies = policies
            .into_iter()
            .map(|(name, text)| {
                AdaptiveConfig::from_json(&text)
                    .map(|c| (name.clone(), c))
                    .map_err(|e| crate::ConfigError::new_err(format!("policy {name}: {}", e.0)))
            })
            .collect::<PyResult<_>>()?;
    } else {
        out.policies = default_policies_with_per_request();
    }
    if let Some(n) = spec.segments {
        if n == 0 {
            return Err(bad("segments must be >= 1"));
        }
        out.segments = n;
    }
    out.seed = spec.seed.unwrap_or(0);
    let sigma = spec.noise_sigma.unwrap_or(Noise::default().sigma);
    let spike = spec.spike_probability.unwrap_or(Noise::default().spike_probability);
    if !(sigma.is_finite() && (0.0..=2.0).contains(&sigma)) {
        return Err(bad(format!("noise sigma must be in [0, 2], got {sigma}")));
    }
    if !(0.0..=1.0).contains(&spike) {
        return Err(bad(format!("spike probability must be in [0, 1], got {spike}")));
    }
    let drift = spec.drift.unwrap_or(0.0);
    if !(drift.is_finite() && (0.0..=2.0).contains(&drift)) {
        return Err(bad(format!("drift must be in [0, 2], got {drift}")));
    }
    let interference = spec.interference.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&interference) {
        return Err(bad(format!("interference must be in [0, 1], got {interference}")));
    }
    out.noise = Noise { sigma, spike_probability: spike, drift, interference };
    if let Some(k) = spec.max_steps {
        if k > 8 {
            return Err(bad(format!("max_steps must be in 0..=8, got {k}")));
        }
        out.max_steps = k;
    }
    out.skip_zero_step_draft_extend = spec.skip_zero_step_draft_extend.unwrap_or(false);
    Ok(out)
}

/// Runs the policy simulator (`specdial policy simulate`). `spec_json`: an object with optional
/// `regimes` (names), `curves` (names, or `{"name", "table": <cost-table JSON text>}`),
/// `policies` (`[[name, config JSON], ...]`; default goodput / ema / throughput_aware),
/// `segments`, `seed`, `noise_sigma`, `spike_probability`, `drift`, `interference`, `max_steps`,
/// `skip_zero_step_draft_extend`. Returns JSON: a list of cases, each with `regime`, `steady`,
/// `curve`, `oracle` and `results` (per contender: `goodput` tokens/s, `tokens`, `seconds`,
/// `steps_changes`, `probes`, `steps_histogram`). Raises ValueError / ConfigError naming the
/// bad field. The GIL is released while it runs.
#[pyfunction]
fn simulate(py: Python<'_>, spec_json: &str) -> PyResult<String> {
    let spec: Spec = serde_json::from_str(spec_json).map_err(|e| bad(format!("simulation spec: {e}")))?;
    let spec = build(spec)?;
    let cases = py.detach(|| run_all(&spec));
    guard(|| serde_json::to_string(&cases).map_err(|e| bad(e.to_string())))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TreeSpec {
    /// Curve names, or `{"name": ..., "table": <cost-table JSON text>}`.
    curves: Option<Vec<serde_json::Value>>,
    concurrency: Option<Vec<u32>>,
    /// `[name, config JSON text]`: a `goodput` config with a `tree` key.
    policy: (String, String),
    segments: Option<u32>,
    seed: Option<u64>,
}

/// Runs the draft-tree simulation (issue 29; `specdial policy simulate` with tree bounds).
/// `spec_json`: an object with `policy` (`[name, config JSON]`, a `goodput` config with a
/// `tree` key), optional `curves` (as [`simulate`]'s; default every named curve),
/// `concurrency` (values among 1, 4, 16, 64, 256; default all), `segments` (default 3000),
/// `seed`. Per (curve, concurrency) on the mixed request classes: the config with its trees
/// (`trees`), the same config drafting chains only (`chains`), the best fixed plan among chains
/// 0..7 and every tree shape within the bounds (`best_fixed`) and the best fixed chain
/// (`best_fixed_chain`), each with `goodput` tokens/s, `tokens`, `seconds`, `iterations`,
/// `tree_iterations`, `most_run` and `plans` (iterations per plan). Returns the cases as JSON.
/// Raises ValueError / ConfigError naming the bad field and the allowed values. The GIL is
/// released while it runs.
#[pyfunction]
fn simulate_trees(py: Python<'_>, spec_json: &str) -> PyResult<String> {
    let spec: TreeSpec = serde_json::from_str(spec_json).map_err(|e| bad(format!("tree simulation spec: {e}")))?;
    let (name, text) = spec.policy;
    let config = AdaptiveConfig::from_json(&text).map_err(|e| crate::ConfigError::new_err(format!("policy {name}: {}", e.0)))?;
    if tree_bounds(&config).is_none() {
        return Err(crate::ConfigError::new_err(format!(
            "policy {name}: the tree simulation needs the goodput strategy with a \"tree\" key \
             ({{\"max_topk\": K, \"max_num_draft_tokens\": N}}), got strategy {:?} without one",
            config.strategy.name()
        )));
    }
    let curves = match spec.curves {
        Some(list) => parse_curves(&list)?,
        None => SimSpec::standard().curves,
    };
    let concurrency = spec.concurrency.unwrap_or_else(|| CONCURRENCY.to_vec());
    if let Some(c) = concurrency.iter().find(|c| !CONCURRENCY.contains(c)) {
        return Err(bad(format!("concurrency {c} is not one of {CONCURRENCY:?}")));
    }
    let segments = spec.segments.unwrap_or(3000);
    if segments == 0 {
        return Err(bad("segments must be >= 1"));
    }
    let seed = spec.seed.unwrap_or(0);
    let cases = py.detach(|| {
        let mut out = Vec::new();
        for (curve_name, curve) in &curves {
            for &c in &concurrency {
                out.push(run_tree_case_with(c, curve_name, curve, segments, seed, &config));
            }
        }
        out
    });
    guard(|| serde_json::to_string(&cases).map_err(|e| bad(e.to_string())))
}

/// Names of the simulator's regimes (with a description each) and cost curves.
#[pyfunction]
fn simulation_catalog() -> (Vec<(String, String, bool)>, Vec<String>) {
    (
        Regime::every().map(|r| (r.name.to_string(), r.description.to_string(), r.steady)).collect(),
        CostCurve::NAMES.iter().map(|n| n.to_string()).collect(),
    )
}

/// A measured cost table (the JSON format of `specdial policy simulate --curve FILE`):
/// `CostTable.from_json(text)`, then `seconds(batch_size, steps, context_tokens)`, interpolated
/// (see `specdial_core::sim::curve::CostTable`).
#[pyclass(name = "CostTable", module = "specdial._core", frozen)]
pub struct PyCostTable {
    inner: CostTable,
}

#[pymethods]
impl PyCostTable {
    /// Parses and checks a table; ValueError naming the bad entry.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        CostTable::from_json(text).map(|inner| Self { inner }).map_err(bad)
    }

    /// Seconds of one decode iteration of `batch_size` requests (padded to the table's graph
    /// sizes when it has them) at `steps` with `context_tokens` tokens of context in all.
    fn seconds(&self, batch_size: u32, steps: u32, context_tokens: f64) -> PyResult<f64> {
        if batch_size < 1 {
            return Err(bad("batch_size must be >= 1"));
        }
        let curve = CostCurve::Table(self.inner.clone());
        let b = curve
            .graph_sizes()
            .and_then(|g| g.iter().copied().find(|&s| s >= batch_size))
            .unwrap_or(batch_size);
        Ok(curve.seconds(b, steps, context_tokens, 0.0))
    }

    /// Steps values the table measured, ascending.
    #[getter]
    fn steps(&self) -> Vec<u32> {
        self.inner.steps()
    }

    /// The CUDA-graph batch sizes of the measurement, or None.
    #[getter]
    fn graph_bs(&self) -> Option<Vec<u32>> {
        self.inner.graph_bs.clone()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(simulate_trees, m)?)?;
    m.add_function(wrap_pyfunction!(simulation_catalog, m)?)?;
    m.add_class::<PyCostTable>()
}
