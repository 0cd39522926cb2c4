//! Python surface of `specdial_core::{slot, policy}`: `AdaptiveStepSlot`,
//! `AdaptiveSpeculativeParams`, `StepDecision`, `validate_initial_steps`.
//!
//! `accepted` arguments are read without per-element Python work when they export the buffer
//! protocol (numpy integer arrays, `torch_tensor.numpy()`); a list of ints also works.

use std::any::TypeId;

use pyo3::buffer::{Element, PyBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use specdial_core::{AdaptiveSpeculativeParams, AdaptiveStepSlot, Observation, PolicyError, StepDecision, VerifyShape};

use crate::config::{config_arg, config_err, slot_config_arg, PyAdaptiveConfig};
use crate::guard;

fn policy_err(e: PolicyError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Runs `f` over the elements of a 1-D buffer of `T` as i64, if `obj` is one: the exporter's
/// memory itself when it is contiguous `i64` (numpy's default integer array), else a converted
/// copy.
fn with_buffer<T, R>(obj: &Bound<'_, PyAny>, f: &mut Option<impl FnOnce(&[i64]) -> R>) -> Option<PyResult<R>>
where
    T: Element + Copy + TryInto<i64> + 'static,
{
    let buf = PyBuffer::<T>::get(obj).ok()?;
    if buf.dimensions() > 1 {
        return Some(Err(PyValueError::new_err(format!(
            "accepted must be 1-D (one count per request), got {} dimensions",
            buf.dimensions()
        ))));
    }
    let f = f.take().expect("with_buffer calls f at most once");
    let py = obj.py();
    // Values that do not fit i64 (u64 > i64::MAX) become -1, which the core rejects by index.
    let conv = |x: T| x.try_into().unwrap_or(-1);
    Some(match buf.as_slice_ptr() {
        Some(ptr) => {
            // SAFETY: `buf` holds the exporter's buffer (it cannot be released or resized) for
            // the whole read, `f` runs no Python code, so nothing can write to the memory while we
            // read it, and every bit pattern is a valid integer `T`.
            let values: &[T] = unsafe { ptr.as_ref() };
            if TypeId::of::<T>() == TypeId::of::<i64>() {
                // SAFETY: `T` is `i64` (same type id), so the slice is reinterpreted as itself.
                let same: &[i64] = unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), values.len()) };
                Ok(f(same))
            } else {
                Ok(f(&values.iter().map(|&x| conv(x)).collect::<Vec<i64>>()))
            }
        }
        None => buf.to_vec(py).map(|v| f(&v.into_iter().map(conv).collect::<Vec<i64>>())),
    })
}

/// Calls `f` with the accepted drafts per request as i64 values. A 1-D integer buffer (numpy,
/// `torch_tensor.numpy()`) is read without per-element Python work and, when contiguous int64,
/// without a copy; the core then iterates a plain slice (statically dispatched, where a
/// `dyn Iterator` cost an indirect call per element: issue 25's `benches/policy_py.py`
/// regression). A list or tuple of ints is extracted directly, without trying the buffer
/// protocol eight times first (each failed try raised and dropped a TypeError).
fn with_accepted<R>(obj: &Bound<'_, PyAny>, f: impl FnOnce(&[i64]) -> R) -> PyResult<R> {
    let mut f = Some(f);
    if !(obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()) {
        macro_rules! try_types {
            ($($t:ty),*) => {$(
                if let Some(r) = with_buffer::<$t, R>(obj, &mut f) { return r; }
            )*};
        }
        try_types!(i64, i32, i16, i8, u8, u16, u32, u64);
    }
    match obj.extract::<Vec<i64>>() {
        Ok(v) => Ok(f.take().expect("f is called once")(&v)),
        Err(_) => {
            let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            Err(PyTypeError::new_err(format!(
                "accepted must be a list of ints or a 1-D integer array (buffer protocol), got {ty}"
            )))
        }
    }
}

/// One batch-size slot's EMA + hysteresis state machine (SGLang's `AdaptiveStepSlot`).
///
/// `initial_steps`: starting steps (the middle candidate if it is not one). `slot_config`: a dict
/// of slot settings (`candidate_steps` required; `ema_alpha`, `update_interval`,
/// `warmup_batches`, `down_hysteresis`, `up_hysteresis`, `ceiling_coeff` optional). Raises
/// ConfigError on a bad dict.
#[pyclass(name = "AdaptiveStepSlot", module = "specdial._core")]
pub struct PyAdaptiveStepSlot {
    inner: AdaptiveStepSlot,
}

#[pymethods]
impl PyAdaptiveStepSlot {
    #[new]
    fn new(initial_steps: u32, slot_config: &Bound<'_, PyAny>) -> PyResult<Self> {
        guard(|| Ok(Self { inner: AdaptiveStepSlot::new(initial_steps, slot_config_arg(slot_config)?) }))
    }

    /// Feeds one verify's accepted drafts per request (bonus excluded; ints in 0..=current_steps,
    /// a list or a 1-D integer array). Returns the new steps if they changed, else None. Raises
    /// ValueError on a value out of range (the slot is then unchanged).
    fn update(&mut self, accepted: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        guard(|| with_accepted(accepted, |v| self.inner.update(v.iter().copied()))?.map_err(policy_err))
    }

    /// Steps this slot chooses now.
    #[getter]
    fn current_steps(&self) -> u32 {
        self.inner.current_steps()
    }

    /// EMA of accepted drafts per request (bonus token excluded, as in SGLang).
    #[getter]
    fn ema_accept_len(&self) -> f64 {
        self.inner.ema_accept_len()
    }

    /// Candidate steps, ascending.
    #[getter]
    fn candidate_steps(&self) -> Vec<u32> {
        self.inner.config().candidate_steps.clone()
    }

    /// Non-empty verifies observed.
    #[getter]
    fn verify_count(&self) -> u64 {
        self.inner.verify_count()
    }

    fn __repr__(&self) -> String {
        format!(
            "AdaptiveStepSlot(current_steps={}, ema_accept_len={:.4}, candidate_steps={:?})",
            self.inner.current_steps(),
            self.inner.ema_accept_len(),
            self.inner.config().candidate_steps
        )
    }
}

/// What one decode iteration runs: `steps`, `num_draft_tokens` (steps + 1 for a chain, 1 + the tree's nodes for a tree), `graph_bs` (the
/// padded CUDA-graph batch size, or None for eager), `slot` (index of the deciding slot),
/// `verify_lengths` (per-request verify lengths, or None when every request runs `steps`: what
/// every strategy decides today) and `tree_shape` (`(depth, topk, num_draft_tokens)` of a draft
/// tree, or None for a chain: always None today).
#[pyclass(name = "StepDecision", module = "specdial._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyStepDecision {
    inner: StepDecision,
}

#[pymethods]
impl PyStepDecision {
    #[getter]
    fn steps(&self) -> u32 {
        self.inner.steps
    }
    #[getter]
    fn num_draft_tokens(&self) -> u32 {
        self.inner.num_draft_tokens
    }
    #[getter]
    fn graph_bs(&self) -> Option<u32> {
        self.inner.graph_bs
    }
    #[getter]
    fn slot(&self) -> usize {
        self.inner.slot
    }
    #[getter]
    fn verify_lengths(&self) -> Option<Vec<u32>> {
        match &self.inner.verify {
            VerifyShape::Uniform => None,
            VerifyShape::PerRequest(lengths) => Some(lengths.clone()),
        }
    }
    #[getter]
    fn tree_shape(&self) -> Option<(u32, u32, u32)> {
        self.inner.tree.map(|t| (t.depth, t.topk, t.num_draft_tokens))
    }
    fn __repr__(&self) -> String {
        let g = self.inner.graph_bs.map_or("None".to_string(), |g| g.to_string());
        format!(
            "StepDecision(steps={}, num_draft_tokens={}, graph_bs={g}, slot={})",
            self.inner.steps, self.inner.num_draft_tokens, self.inner.slot
        )
    }
}

/// The adaptive policy: per-batch-size slots plus routing (SGLang's `AdaptiveSpeculativeParams`).
///
/// `initial_steps`: every slot starts there (or at its middle candidate). `config`: an
/// AdaptiveConfig, a dict, or None for the default. Raises ConfigError.
#[pyclass(name = "AdaptiveSpeculativeParams", module = "specdial._core")]
pub struct PyAdaptiveSpeculativeParams {
    inner: AdaptiveSpeculativeParams,
}

#[pymethods]
impl PyAdaptiveSpeculativeParams {
    #[new]
    #[pyo3(signature = (initial_steps, config=None))]
    fn new(initial_steps: u32, config: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        guard(|| Ok(Self { inner: AdaptiveSpeculativeParams::new(initial_steps, config_arg(config)?) }))
    }

    /// Sorted union of every slot's candidate steps.
    #[getter]
    fn candidate_steps(&self) -> Vec<u32> {
        self.inner.candidate_steps().to_vec()
    }

    /// The config in force.
    #[getter]
    fn config(&self) -> PyAdaptiveConfig {
        PyAdaptiveConfig { inner: self.inner.config().clone() }
    }

    /// Sets (a list of ints >= 1) or clears (None) the captured CUDA-graph batch sizes.
    /// Raises ValueError on a size < 1.
    #[pyo3(signature = (sizes))]
    fn set_cuda_graph_bs(&mut self, sizes: Option<Vec<i64>>) -> PyResult<()> {
        guard(|| self.inner.set_cuda_graph_bs(sizes.as_deref()).map_err(policy_err))
    }

    /// Steps the slot of a batch of `batch_size` requests (>= 1, else ValueError) runs now. A
    /// pure read: nothing is recorded.
    fn get_steps_for_batch(&self, batch_size: i64) -> PyResult<u32> {
        guard(|| self.inner.get_steps_for_batch(batch_size).map_err(policy_err))
    }

    /// Reports one verify to the slot of `batch_size`: `accepted` drafts per request (bonus
    /// excluded; a list or a 1-D integer array), each in `0..=steps` where `steps` is the keyword
    /// if given, else the slot's pending decision (the last `decide`), else its current steps.
    /// `seconds`: the decode iteration's wall time (a float > 0); `context_tokens`: the batch's KV
    /// tokens before it. `ema` ignores both; `goodput` learns its cost model from them (without
    /// seconds it keeps its prior cost shape, +10 % per draft step). Returns the slot's new steps
    /// if they changed, else None. Raises ValueError naming the bad argument (nothing changes).
    #[pyo3(signature = (accepted, batch_size, *, seconds=None, context_tokens=None, steps=None))]
    fn on_verify_complete(
        &mut self,
        accepted: &Bound<'_, PyAny>,
        batch_size: i64,
        seconds: Option<&Bound<'_, PyAny>>,
        context_tokens: Option<i64>,
        steps: Option<i64>,
    ) -> PyResult<Option<u32>> {
        guard(|| {
            let obs = observation(seconds, context_tokens, steps)?;
            with_accepted(accepted, |v| self.inner.on_verify_complete_with(v.iter().copied(), batch_size, obs))?.map_err(policy_err)
        })
    }

    /// Graph batch sizes whose slot can choose `steps` (capture only those), or None if unset.
    fn cuda_graph_bs_for_step(&self, steps: u32) -> Option<Vec<u32>> {
        self.inner.cuda_graph_bs_for_step(steps)
    }

    /// The decision for the next decode iteration at `batch_size` (>= 1, else ValueError) with
    /// `context_tokens` tokens of context (the sum of the batch's KV lengths before it; None:
    /// unknown). Records its steps as the slot's pending decision (a repeated `decide` before the
    /// report replaces it).
    #[pyo3(signature = (batch_size, context_tokens=None))]
    fn decide(&mut self, batch_size: i64, context_tokens: Option<i64>) -> PyResult<PyStepDecision> {
        guard(|| {
            let ctx = non_negative("context_tokens", context_tokens)?;
            self.inner.decide(batch_size, ctx).map(|inner| PyStepDecision { inner }).map_err(policy_err)
        })
    }

    /// Per-slot state, ascending by lower bound: a list of
    /// `(lower_bound, current_steps, accepted_estimate, verify_count)`; `accepted_estimate` is the
    /// EMA of accepted drafts under `ema` (SGLang's `ema_accept_len`), the expected accepted drafts
    /// at the current steps under the other strategies.
    fn slot_states(&self) -> Vec<(u32, u32, f64, u64)> {
        self.inner
            .slot_states()
            .into_iter()
            .map(|s| (s.lower_bound, s.current_steps, s.accepted_estimate, s.verify_count))
            .collect()
    }

    /// Steps switches so far (`goodput`, `throughput_aware`; 0 under `ema`, whose switches are the
    /// non-None returns of `on_verify_complete`). `goodput` probes are not switches.
    #[getter]
    fn switches(&self) -> u64 {
        self.inner.switches()
    }

    /// The `goodput` strategy's state, or None under another strategy: a dict with
    /// `acceptance` (conditional acceptance per draft position), `probes`, `switches`,
    /// `off_pace_skipped` (iterations whose seconds the cost model left out because the machine
    /// ran off its usual pace), and `last_decision` (None before the first: `slot`, `batch_size`, `context_tokens`, `steps`,
    /// `probe`, `predicted_seconds` {steps: seconds}, `expected_tokens` {steps: tokens per
    /// request}).
    fn goodput_state<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        guard(|| self.inner.goodput().map(|g| goodput_dict(py, g)).transpose())
    }

    /// What the `goodput` strategy learned (its cost model and long-run acceptance counts) as
    /// versioned JSON text, or None under another strategy. `import_policy_state` reads it.
    fn export_policy_state(&self) -> Option<String> {
        self.inner.goodput().map(|g| g.export_state())
    }

    /// Seeds the `goodput` strategy with a state `export_policy_state` wrote (on the same
    /// machine and models). Returns False (nothing done) under another strategy. Raises
    /// ValueError, with nothing changed, on text that does not parse, another version or values
    /// out of range.
    fn import_policy_state(&mut self, state: &str) -> PyResult<bool> {
        guard(|| match self.inner.goodput_mut() {
            None => Ok(false),
            Some(g) => g
                .import_state(state)
                .map(|()| true)
                .map_err(|e| PyValueError::new_err(format!("policy state: {e}"))),
        })
    }

    /// Feeds one profiled measurement: under `throughput_aware` a cost-table entry (SGLang's
    /// startup profiling), under `goodput` a seed of its cost model; ignored under `ema`.
    /// `seconds` > 0 (per decode iteration), `batch_size` >= 1. Raises ValueError.
    #[pyo3(signature = (batch_size, steps, seconds, context_tokens=0))]
    fn set_profiled_cost(&mut self, batch_size: u32, steps: u32, seconds: f64, context_tokens: u64) -> PyResult<()> {
        guard(|| self.inner.set_profiled_cost(batch_size, steps, seconds, context_tokens).map_err(policy_err))
    }

    /// The `throughput_aware` cost table as `[(batch_size, steps, seconds)]` (empty otherwise).
    fn cost_table(&self) -> Vec<(u32, u32, f64)> {
        self.inner.throughput_aware().map(|t| t.cost_table()).unwrap_or_default()
    }
}

/// `None` or an int >= 0, as u64; ValueError naming `name` otherwise.
pub(crate) fn non_negative(name: &str, v: Option<i64>) -> PyResult<Option<u64>> {
    match v {
        None => Ok(None),
        Some(x) if x >= 0 => Ok(Some(x as u64)),
        Some(x) => Err(PyValueError::new_err(format!("{name} must be an int >= 0 (tokens), got {x}"))),
    }
}

/// The keyword arguments of a report as an [`Observation`]; ValueError naming a bad one.
pub(crate) fn observation(
    seconds: Option<&Bound<'_, PyAny>>,
    context_tokens: Option<i64>,
    steps: Option<i64>,
) -> PyResult<Observation> {
    let seconds = match seconds {
        None => None,
        Some(s) if s.is_none() => None,
        Some(s) => {
            let is_bool = s.is_instance_of::<pyo3::types::PyBool>();
            let t: Option<f64> = if is_bool { None } else { s.extract::<f64>().ok() };
            match t {
                Some(t) if t.is_finite() && t > 0.0 => Some(t),
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "seconds must be a finite float > 0 (the decode iteration's wall time), got {}",
                        s.repr().map(|r| r.to_string()).unwrap_or_default()
                    )))
                }
            }
        }
    };
    let steps = match steps {
        None => None,
        Some(k) if (0..=i64::from(specdial_core::config::MAX_CANDIDATE_STEPS)).contains(&k) => Some(k as u32),
        Some(k) => return Err(PyValueError::new_err(format!("steps must be an int in 0..=32, got {k}"))),
    };
    Ok(Observation { seconds, context_tokens: non_negative("context_tokens", context_tokens)?, steps, catch_up_tokens: None })
}

/// The `goodput_state` dict (see `AdaptiveSpeculativeParams.goodput_state`).
pub(crate) fn goodput_dict<'py>(py: Python<'py>, g: &specdial_core::goodput::GoodputPolicy) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("acceptance", g.acceptance_rates())?;
    d.set_item("probes", g.probes())?;
    d.set_item("switches", g.switches())?;
    d.set_item("off_pace_skipped", g.off_pace_skipped())?;
    d.set_item("confidence_calibration", g.confidence_calibration())?;
    match g.last_decision() {
        None => d.set_item("last_decision", py.None())?,
        Some(v) => {
            let last = PyDict::new(py);
            last.set_item("slot", v.slot)?;
            last.set_item("batch_size", v.batch_size)?;
            last.set_item("context_tokens", v.context_tokens)?;
            last.set_item("steps", v.steps)?;
            last.set_item("probe", v.probe)?;
            let secs = PyDict::new(py);
            let toks = PyDict::new(py);
            for &(k, t, e) in &v.candidates {
                secs.set_item(k, t)?;
                toks.set_item(k, e)?;
            }
            last.set_item("predicted_seconds", secs)?;
            last.set_item("expected_tokens", toks)?;
            d.set_item("last_decision", last)?;
        }
    }
    Ok(d)
}

/// Raises ConfigError when `steps` is a candidate of no slot of `config` (an AdaptiveConfig, a
/// dict, or None for the default).
#[pyfunction]
#[pyo3(signature = (config, steps))]
fn validate_initial_steps(config: Option<&Bound<'_, PyAny>>, steps: i64) -> PyResult<()> {
    guard(|| config_arg(config)?.validate_initial_steps(steps).map_err(config_err))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAdaptiveStepSlot>()?;
    m.add_class::<PyStepDecision>()?;
    m.add_class::<PyAdaptiveSpeculativeParams>()?;
    m.add_function(wrap_pyfunction!(validate_initial_steps, m)?)?;
    Ok(())
}
