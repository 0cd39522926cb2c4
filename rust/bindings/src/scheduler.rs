//! Python surface of `specdial_core::scheduler`: `SchedulerConfig`, `Scheduler`, the per-iteration
//! `SchedulePlan` and `ReportResult`, `FinishedRequest`, `SchedulerStats`, and the exceptions
//! `SchedulerError`, `QueueFullError`, `InvalidRequestError`.
//!
//! Every index array handed to Python is an [`Int64Array`] (zero-copy into numpy / torch).
//! Arrays taken from Python (`prompt_ids`, report `tokens` / `offsets` / `accepted`) may be any
//! 1-D integer buffer (numpy int64/int32/..., `torch_tensor.numpy()`) or a list of ints.

use pyo3::buffer::{Element, PyBuffer};
use pyo3::exceptions::{PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use specdial_core::scheduler::{
    FinishReason, Finished, Plan, PlanKind, ReportExtras, ReportOutcome, Scheduler, SchedulerConfig,
    SchedulerError as CoreError, SchedulerStats, StepsSource,
};
use specdial_core::AdaptiveSpeculativeParams;

use crate::buffer::Int64Array;
use crate::config::{config_arg, config_err};
use crate::{guard, ConfigError};

pyo3::create_exception!(
    specdial,
    SchedulerError,
    PyRuntimeError,
    "Misuse of the scheduler's plan/report protocol: schedule() while a plan awaits its report, \
     or report() with no plan in flight."
);
pyo3::create_exception!(
    specdial,
    QueueFullError,
    SchedulerError,
    "add_request() refused: max_queued_requests new requests already wait beyond the free running slots (HTTP 503)."
);
pyo3::create_exception!(
    specdial,
    InvalidRequestError,
    PyValueError,
    "add_request() refused a bad argument; the message starts with the field name (HTTP 400)."
);

fn core_err(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::QueueFull { .. } => QueueFullError::new_err(msg),
        CoreError::InvalidRequest { .. } => InvalidRequestError::new_err(msg),
        CoreError::InvalidConfig { .. } => ConfigError::new_err(msg),
        CoreError::PlanInFlight | CoreError::NoPlanInFlight => SchedulerError::new_err(msg),
        CoreError::InvalidReport { .. } => PyValueError::new_err(msg),
    }
}

/// Reads a 1-D buffer of `T` as i64, if `obj` exports one.
fn read_buffer<T>(obj: &Bound<'_, PyAny>, name: &str) -> Option<PyResult<Vec<i64>>>
where
    T: Element + Copy + TryInto<i64>,
{
    let buf = PyBuffer::<T>::get(obj).ok()?;
    if buf.dimensions() > 1 {
        return Some(Err(PyValueError::new_err(format!(
            "{name} must be 1-D, got {} dimensions",
            buf.dimensions()
        ))));
    }
    let py = obj.py();
    let conv = |x: T| {
        x.try_into().map_err(|_| {
            PyValueError::new_err(format!("{name} has a value beyond the int64 range"))
        })
    };
    // One memcpy out of the exporter (these arrays are small: one entry per token or request).
    Some(
        buf.to_vec(py)
            .and_then(|v| v.into_iter().map(conv).collect()),
    )
}

/// A 1-D integer array argument: a buffer of any integer type, or a sequence of ints.
fn int_array(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    macro_rules! try_types {
        ($($t:ty),*) => {$(
            if let Some(r) = read_buffer::<$t>(obj, name) { return r; }
        )*};
    }
    try_types!(i64, i32, i16, i8, u8, u16, u32, u64);
    obj.extract::<Vec<i64>>().map_err(|_| {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        PyTypeError::new_err(format!(
            "{name} must be a sequence of ints or a 1-D integer array (buffer protocol, e.g. numpy), got {ty}"
        ))
    })
}

/// A 1-D float array argument (issue 28's `draft_probs`): a float64 or float32 buffer (numpy,
/// torch via numpy), or a sequence of numbers.
fn float_array(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<f64>> {
    let py = obj.py();
    let one_d = |dims: usize| {
        if dims > 1 {
            Err(PyValueError::new_err(format!("{name} must be 1-D, got {dims} dimensions")))
        } else {
            Ok(())
        }
    };
    if let Ok(buf) = PyBuffer::<f64>::get(obj) {
        one_d(buf.dimensions())?;
        return buf.to_vec(py);
    }
    if let Ok(buf) = PyBuffer::<f32>::get(obj) {
        one_d(buf.dimensions())?;
        return Ok(buf.to_vec(py)?.into_iter().map(f64::from).collect());
    }
    obj.extract::<Vec<f64>>().map_err(|_| {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        PyTypeError::new_err(format!(
            "{name} must be a sequence of floats or a 1-D float32/float64 array (buffer protocol, e.g. numpy), got {ty}"
        ))
    })
}

/// A request id: a non-negative int. Out-of-range ints raise ValueError.
fn request_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    match obj.extract::<u64>() {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(PyValueError::new_err(
            format!("request_id must be an integer >= 0, got {obj}"),
        )),
        Err(e) => Err(e),
    }
}

/// A u32 config field; out of range raises ConfigError naming it.
fn u32_field(name: &str, v: i64) -> PyResult<u32> {
    u32::try_from(v)
        .map_err(|_| ConfigError::new_err(format!("{name}: must be in 0..={}, got {v}", u32::MAX)))
}

fn arr(py: Python<'_>, v: Vec<i64>) -> PyResult<Py<Int64Array>> {
    Py::new(py, Int64Array::from_vec(v))
}

// ------------------------------------------------------------------------------------- config

/// Limits and sizes of a Scheduler (all keyword arguments; units in each name's doc).
///
/// - ``max_running_requests``: requests admitted at once (prefilling + running), >= 1.
/// - ``max_queued_requests``: new requests waiting for first admission beyond the running
///   slots still free for them, >= 1; beyond it ``add_request`` raises QueueFullError (so an
///   idle scheduler takes ``max_running_requests + max_queued_requests`` before an iteration).
///   Preempted requests are not counted.
/// - ``max_prefill_tokens``: prompt tokens per prefill iteration, >= 1 (longer prompts are
///   chunked; SGLang's prefill batch budget).
/// - ``chunked_prefill_size``: most prompt tokens of one request per prefill iteration, >= 1,
///   or None (the budget only); SGLang's meaning.
/// - ``context_length``: longest request in tokens (prompt + output), >= 2.
/// - ``num_pages``, ``page_size``: the KV pool, pages of ``page_size`` tokens;
///   ``num_pages * page_size >= context_length``.
/// - ``eos_token_ids``: tokens that stop a request unless it sets ``ignore_eos``.
/// - ``record_trace``: keep a per-verify trace for ``Scheduler.drain_trace()``.
///
/// Raises ConfigError naming the field.
#[pyclass(name = "SchedulerConfig", module = "specdial._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PySchedulerConfig {
    inner: SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (*, max_running_requests=64, max_queued_requests=1024, max_prefill_tokens=2048,
                        context_length=2048, num_pages=1024, page_size=16, eos_token_ids=Vec::new(),
                        record_trace=false, chunked_prefill_size=None, skip_zero_step_draft_extend=true,
                        enable_prefix_caching=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        max_running_requests: i64,
        max_queued_requests: i64,
        max_prefill_tokens: i64,
        context_length: i64,
        num_pages: i64,
        page_size: i64,
        eos_token_ids: Vec<i64>,
        record_trace: bool,
        chunked_prefill_size: Option<i64>,
        skip_zero_step_draft_extend: bool,
        enable_prefix_caching: bool,
    ) -> PyResult<Self> {
        guard(|| {
            let inner = SchedulerConfig {
                max_running_requests: u32_field("max_running_requests", max_running_requests)?,
                max_queued_requests: u32_field("max_queued_requests", max_queued_requests)?,
                max_prefill_tokens: u32_field("max_prefill_tokens", max_prefill_tokens)?,
                context_length: u32_field("context_length", context_length)?,
                num_pages: u32_field("num_pages", num_pages)?,
                page_size: u32_field("page_size", page_size)?,
                eos_token_ids,
                record_trace,
                chunked_prefill_size: chunked_prefill_size
                    .map(|n| u32_field("chunked_prefill_size", n))
                    .transpose()?,
                skip_zero_step_draft_extend,
                enable_prefix_caching,
            };
            inner.validate().map_err(core_err)?;
            Ok(Self { inner })
        })
    }

    /// Requests admitted at once (prefilling + running).
    #[getter]
    fn max_running_requests(&self) -> u32 {
        self.inner.max_running_requests
    }
    /// Requests waiting for their first admission before add_request raises QueueFullError.
    #[getter]
    fn max_queued_requests(&self) -> u32 {
        self.inner.max_queued_requests
    }
    /// Prompt tokens per prefill iteration.
    #[getter]
    fn max_prefill_tokens(&self) -> u32 {
        self.inner.max_prefill_tokens
    }
    /// Longest request in tokens (prompt + output).
    #[getter]
    fn context_length(&self) -> u32 {
        self.inner.context_length
    }
    /// KV pages in the pool.
    #[getter]
    fn num_pages(&self) -> u32 {
        self.inner.num_pages
    }
    /// Tokens (KV slots) per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.page_size
    }
    /// KV slots, ``num_pages * page_size``: the first dimension of the KV buffers.
    #[getter]
    fn num_slots(&self) -> u64 {
        u64::from(self.inner.num_pages) * u64::from(self.inner.page_size)
    }
    /// Tokens that stop a request unless it sets ignore_eos.
    #[getter]
    fn eos_token_ids(&self) -> Vec<i64> {
        self.inner.eos_token_ids.clone()
    }
    /// Whether decode reports are recorded for drain_trace().
    #[getter]
    fn record_trace(&self) -> bool {
        self.inner.record_trace
    }
    /// Most prompt tokens of one request per prefill iteration (None: the budget only).
    #[getter]
    fn chunked_prefill_size(&self) -> Option<u32> {
        self.inner.chunked_prefill_size
    }
    /// Whether the worker skips the drafter extend at steps 0 (the engine's
    /// ``skip_zero_step_draft_extend``; False without a drafter): prefills are then deferred for
    /// the drafter while decoding runs steps 0 (``SchedulePlan.draft_prefill``) and the policy is
    /// told the catch-up tokens each drafting iteration runs.
    #[getter]
    fn skip_zero_step_draft_extend(&self) -> bool {
        self.inner.skip_zero_step_draft_extend
    }
    /// Whether full KV pages are kept in the prefix cache and shared by later requests with the
    /// same token prefix (SGLang's radix cache, vLLM's ``enable_prefix_caching``; False here,
    /// the engine's ``EngineConfig.enable_prefix_caching`` defaults to True).
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(max_running_requests={}, max_queued_requests={}, max_prefill_tokens={}, \
             context_length={}, num_pages={}, page_size={}, eos_token_ids={:?}, record_trace={})",
            c.max_running_requests,
            c.max_queued_requests,
            c.max_prefill_tokens,
            c.context_length,
            c.num_pages,
            c.page_size,
            c.eos_token_ids,
            if c.record_trace { "True" } else { "False" }
        )
    }
}

// ------------------------------------------------------------------------------------- plan

/// One iteration's work (frozen). ``B = batch_size``; every array is an Int64Array, in
/// ``request_ids`` order, concatenated arrays request after request.
///
/// **Prefill** (``kind == "prefill"``): request ``b`` computes KV positions
/// ``kv_lens[b] - qo_lens[b] .. kv_lens[b]``. ``input_ids``, ``positions`` and ``out_loc`` have
/// ``num_tokens = sum(qo_lens)`` entries (token, position, KV slot to write). ``prefill_done[b]``
/// is 1 when the chunk ends the request's prefill; ``sample_first[b]`` is 1 when it then samples
/// its first token from the logits at ``logits_indices`` (indices into ``input_ids``), which
/// ``report`` must carry. A request resuming after preemption re-prefills ``prompt + output[:-1]``
/// and samples nothing.
///
/// **Decode** (``kind == "decode"``): request ``b`` has ``L = positions[b]`` KV positions and
/// feeds its last emitted token ``input_ids[b]`` at position ``L``; its
/// ``steps_per_request[b]`` drafts go to positions ``L+1 ..= L+steps_per_request[b]``.
/// ``out_loc`` holds the slots of positions ``L ..= L+steps_per_request[b]``
/// (``qo_lens[b] = steps_per_request[b] + 1``), already reserved. ``input_ids`` and ``positions``
/// have ``B`` entries. ``steps`` and ``graph_bs`` (padded CUDA-graph batch size or None) form the
/// ``graph_key``. A draft-tree iteration (issue 29; ``tree_topk > 1``, ``steps`` = the tree's
/// depth) lays ``out_loc`` out the same way (``steps_per_request[b]`` caps request ``b``'s
/// accepted drafts) and adds ``num_draft_tokens`` (``N``, tree nodes without the root) scratch
/// slots per request in ``scratch_loc`` (``[B * N]``, request-major), freed when its report
/// comes in; its ``graph_key`` is ``(depth, topk, N, graph_bs or batch_size)``.
///
/// Both: ``rows[b]`` = the worker row request ``b`` holds (assigned by the scheduler at
/// admission, unique among admitted requests, freed at finish / abort / preemption; a prefill
/// chunk starting at position 0 starts its row afresh); ``kv_lens[b]`` = KV positions after this
/// iteration. Only with ``plan_kv_layout`` on (empty otherwise): ``kv_indices`` = slots of
/// positions ``0 .. kv_lens[b]`` of each request (the torch backend's ``plan(qo_lens, kv_lens,
/// kv_indices)``); ``page_table`` / ``page_table_offsets`` = each request's page ids
/// (flashinfer's paged_kv_indices / indptr). ``preempted`` = requests preempted while building this plan: drop
/// their state (their KV is already freed); they return in a later prefill from position 0.
#[pyclass(name = "SchedulePlan", module = "specdial._core", frozen)]
pub struct PySchedulePlan {
    kind: PlanKind,
    steps: u32,
    graph_bs: Option<u32>,
    batch_size: usize,
    request_ids: Py<Int64Array>,
    rows: Py<Int64Array>,
    input_ids: Py<Int64Array>,
    positions: Py<Int64Array>,
    out_loc: Py<Int64Array>,
    qo_lens: Py<Int64Array>,
    kv_lens: Py<Int64Array>,
    kv_indices: Py<Int64Array>,
    page_table: Py<Int64Array>,
    page_table_offsets: Py<Int64Array>,
    steps_per_request: Py<Int64Array>,
    prefill_done: Py<Int64Array>,
    sample_first: Py<Int64Array>,
    logits_indices: Py<Int64Array>,
    preempted: Py<Int64Array>,
    draft_prefill: bool,
    skip_extend: Py<Int64Array>,
    min_survival: f32,
    cached_lens: Py<Int64Array>,
    cached_draft_lens: Py<Int64Array>,
    cached_kv_indices: Py<Int64Array>,
    cached_ids: Py<Int64Array>,
    tree_topk: u32,
    num_draft_tokens: u32,
    scratch_loc: Py<Int64Array>,
}

impl PySchedulePlan {
    fn new(py: Python<'_>, p: Plan) -> PyResult<Self> {
        Ok(Self {
            kind: p.kind,
            steps: p.steps,
            graph_bs: p.graph_bs,
            batch_size: p.request_ids.len(),
            request_ids: arr(py, p.request_ids)?,
            rows: arr(py, p.rows)?,
            input_ids: arr(py, p.input_ids)?,
            positions: arr(py, p.positions)?,
            out_loc: arr(py, p.out_loc)?,
            qo_lens: arr(py, p.qo_lens)?,
            kv_lens: arr(py, p.kv_lens)?,
            kv_indices: arr(py, p.kv_indices)?,
            page_table: arr(py, p.page_table)?,
            page_table_offsets: arr(py, p.page_table_offsets)?,
            steps_per_request: arr(py, p.steps_per_request)?,
            prefill_done: arr(py, p.prefill_done)?,
            sample_first: arr(py, p.sample_first)?,
            logits_indices: arr(py, p.logits_indices)?,
            preempted: arr(py, p.preempted)?,
            draft_prefill: p.draft_prefill,
            skip_extend: arr(py, p.skip_extend)?,
            min_survival: p.min_survival,
            cached_lens: arr(py, p.cached_lens)?,
            cached_draft_lens: arr(py, p.cached_draft_lens)?,
            cached_kv_indices: arr(py, p.cached_kv_indices)?,
            cached_ids: arr(py, p.cached_ids)?,
            tree_topk: p.tree_topk,
            num_draft_tokens: p.num_draft_tokens,
            scratch_loc: arr(py, p.scratch_loc)?,
        })
    }
}

#[pymethods]
impl PySchedulePlan {
    /// Prefill [B]: KV positions request b takes from the prefix cache at its admission in this
    /// plan (its chunk starts there), 0 for a chunk continuing an earlier admission. A chunk whose
    /// first position ``kv_lens[b] - qo_lens[b]`` equals ``cached_lens[b]`` is an admission: the
    /// worker (re)starts the row and fills positions ``0 .. cached_lens[b]`` from
    /// ``cached_kv_indices`` / ``cached_ids``, the first ``cached_draft_lens[b]`` of them
    /// drafter-covered. Decode: empty.
    #[getter]
    fn cached_lens(&self, py: Python<'_>) -> Py<Int64Array> {
        self.cached_lens.clone_ref(py)
    }
    /// Prefill [B]: of the ``cached_lens[b]`` positions, the leading ones whose pages carry the
    /// drafter's KV (every cached page carries the EAGLE features); the drafter runs over the
    /// rest with the drafter prefill or the next catch-up. Decode: empty.
    #[getter]
    fn cached_draft_lens(&self, py: Python<'_>) -> Py<Int64Array> {
        self.cached_draft_lens.clone_ref(py)
    }
    /// Prefill [sum(cached_lens)]: KV indices of the cached positions, request after request.
    #[getter]
    fn cached_kv_indices(&self, py: Python<'_>) -> Py<Int64Array> {
        self.cached_kv_indices.clone_ref(py)
    }
    /// Prefill [sum(cached_lens)]: token ids of the cached positions, request after request.
    #[getter]
    fn cached_ids(&self, py: Python<'_>) -> Py<Int64Array> {
        self.cached_ids.clone_ref(py)
    }
    /// Prefill: whether the drafter runs over these chunks now (False: the worker leaves them to
    /// the next drafting iteration's catch-up, because decoding runs steps 0 with the zero-step
    /// extend skipped). Decode: True.
    #[getter]
    fn draft_prefill(&self) -> bool {
        self.draft_prefill
    }
    /// Decode [B] (issue 28): 1 where the request skips the draft extend after this verify
    /// (verify budget 0 with ``skip_zero_step_draft_extend``; the drafter catches it up before it
    /// next drafts), else 0; a request at budget 0 is also left out of the catch-up before
    /// drafting. Prefill: empty.
    #[getter]
    fn skip_extend(&self, py: Python<'_>) -> Py<Int64Array> {
        self.skip_extend.clone_ref(py)
    }
    /// Decode (issue 28's confidence stop): the worker stops each request's verify at the first
    /// draft position whose cumulative draft probability is below this and reports the lengths
    /// it verified (``report(..., verified=)``); 0.0 = no rule (always for prefill and steps 0).
    #[getter]
    fn min_survival(&self) -> f32 {
        self.min_survival
    }

    /// ``"prefill"`` or ``"decode"``.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind.as_str()
    }
    /// ``kind == "prefill"``.
    #[getter]
    fn is_prefill(&self) -> bool {
        self.kind == PlanKind::Prefill
    }
    /// Requests in this iteration (B).
    #[getter]
    fn batch_size(&self) -> usize {
        self.batch_size
    }
    /// Query tokens in this iteration: ``sum(qo_lens) == len(out_loc)``.
    #[getter]
    fn num_tokens(&self, py: Python<'_>) -> usize {
        self.out_loc.bind(py).get().as_slice().len()
    }
    /// Decode: drafts per request chosen for the batch (0 = plain decoding). Prefill: 0.
    #[getter]
    fn steps(&self) -> u32 {
        self.steps
    }
    /// Decode: padded CUDA-graph batch size, or None (no graph fits: eager). Prefill: None.
    #[getter]
    fn graph_bs(&self) -> Option<u32> {
        self.graph_bs
    }
    /// Which runtime state / CUDA graph serves it: ``(steps, graph_bs or batch_size)`` for a
    /// chain, ``(depth, tree_topk, num_draft_tokens, graph_bs or batch_size)`` for a draft tree.
    #[getter]
    fn graph_key<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let bs = self.graph_bs.unwrap_or(self.batch_size as u32);
        if self.tree_topk > 1 {
            PyTuple::new(py, [self.steps, self.tree_topk, self.num_draft_tokens, bs])
        } else {
            PyTuple::new(py, [self.steps, bs])
        }
    }
    /// Decode: children per frontier node of the draft tree (``speculative_eagle_topk``), 1 for
    /// a chain. Prefill: 1.
    #[getter]
    fn tree_topk(&self) -> u32 {
        self.tree_topk
    }
    /// Decode: draft tokens per request without the root: the tree's nodes ``N`` (SGLang's
    /// ``speculative_num_draft_tokens - 1``), ``steps`` for a chain. Prefill: 0.
    #[getter]
    fn num_draft_tokens(&self) -> u32 {
        self.num_draft_tokens
    }
    /// Decode tree [B * N] int64: KV slots of the tree nodes, request ``b`` at
    /// ``b*N .. (b+1)*N``; the core frees them when this plan's report comes in (or it is
    /// abandoned). Chain and prefill: empty.
    #[getter]
    fn scratch_loc(&self, py: Python<'_>) -> Py<Int64Array> {
        self.scratch_loc.clone_ref(py)
    }
    /// [B] request ids.
    #[getter]
    fn request_ids(&self, py: Python<'_>) -> Py<Int64Array> {
        self.request_ids.clone_ref(py)
    }
    /// Prefill [num_tokens] chunk tokens; decode [B] last emitted token per request.
    /// [B] worker rows, unique (0 .. max_running_requests).
    #[getter]
    fn rows(&self, py: Python<'_>) -> Py<Int64Array> {
        self.rows.clone_ref(py)
    }

    #[getter]
    fn input_ids(&self, py: Python<'_>) -> Py<Int64Array> {
        self.input_ids.clone_ref(py)
    }
    /// Prefill [num_tokens] token positions; decode [B] position L of each input token.
    #[getter]
    fn positions(&self, py: Python<'_>) -> Py<Int64Array> {
        self.positions.clone_ref(py)
    }
    /// [num_tokens] KV slots written this iteration (reserved).
    #[getter]
    fn out_loc(&self, py: Python<'_>) -> Py<Int64Array> {
        self.out_loc.clone_ref(py)
    }
    /// [B] query tokens per request.
    #[getter]
    fn qo_lens(&self, py: Python<'_>) -> Py<Int64Array> {
        self.qo_lens.clone_ref(py)
    }
    /// [B] KV positions per request after this iteration's writes.
    #[getter]
    fn kv_lens(&self, py: Python<'_>) -> Py<Int64Array> {
        self.kv_lens.clone_ref(py)
    }
    /// [sum(kv_lens)] slots of positions 0 .. kv_lens[b] of every request.
    #[getter]
    fn kv_indices(&self, py: Python<'_>) -> Py<Int64Array> {
        self.kv_indices.clone_ref(py)
    }
    /// Page ids of every request in token order, concatenated.
    #[getter]
    fn page_table(&self, py: Python<'_>) -> Py<Int64Array> {
        self.page_table.clone_ref(py)
    }
    /// [B + 1] offsets into page_table.
    #[getter]
    fn page_table_offsets(&self, py: Python<'_>) -> Py<Int64Array> {
        self.page_table_offsets.clone_ref(py)
    }
    /// Decode [B]: drafts per request, ``min(steps, remaining - 1)``. Prefill: empty.
    #[getter]
    fn steps_per_request(&self, py: Python<'_>) -> Py<Int64Array> {
        self.steps_per_request.clone_ref(py)
    }
    /// Prefill [B]: 1 where this chunk ends the request's prefill. Decode: empty.
    #[getter]
    fn prefill_done(&self, py: Python<'_>) -> Py<Int64Array> {
        self.prefill_done.clone_ref(py)
    }
    /// Prefill [B]: 1 where the request samples its first token now. Decode: empty.
    #[getter]
    fn sample_first(&self, py: Python<'_>) -> Py<Int64Array> {
        self.sample_first.clone_ref(py)
    }
    /// Prefill [sum(sample_first)]: indices into input_ids whose logits are sampled. Decode: empty.
    #[getter]
    fn logits_indices(&self, py: Python<'_>) -> Py<Int64Array> {
        self.logits_indices.clone_ref(py)
    }
    /// Requests preempted while building this plan (KV freed; they will be re-prefilled).
    #[getter]
    fn preempted(&self, py: Python<'_>) -> Py<Int64Array> {
        self.preempted.clone_ref(py)
    }

    /// Decode: out_loc as [B * (steps + 1)] (row-major [B, steps + 1]) with ``pad_slot`` in the
    /// positions beyond each request's steps_per_request, for fixed-shape graphs. Prefill: a copy
    /// of out_loc.
    fn out_loc_padded(&self, py: Python<'_>, pad_slot: i64) -> Int64Array {
        let out_loc = self.out_loc.bind(py).get().as_slice();
        if self.kind == PlanKind::Prefill {
            return Int64Array::from_vec(out_loc.to_vec());
        }
        let n = self.steps as usize + 1;
        let mut out = Vec::with_capacity(self.batch_size * n);
        let mut start = 0;
        for &q in self.qo_lens.bind(py).get().as_slice() {
            let q = q as usize;
            out.extend_from_slice(&out_loc[start..start + q]);
            out.extend(std::iter::repeat(pad_slot).take(n - q));
            start += q;
        }
        Int64Array::from_vec(out)
    }

    fn __len__(&self) -> usize {
        self.batch_size
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "SchedulePlan(kind={:?}, batch_size={}, num_tokens={}, steps={}, graph_bs={}, preempted={})",
            self.kind.as_str(),
            self.batch_size,
            self.num_tokens(py),
            self.steps,
            self.graph_bs.map_or("None".into(), |g| g.to_string()),
            self.preempted.bind(py).get().as_slice().len()
        )
    }
}

// ------------------------------------------------------------------------------------- report

/// A request that left the scheduler: ``request_id``, ``reason`` (``"length"``, ``"stop"`` or
/// ``"abort"``), ``stop_token_id`` (the EOS / stop token that ended it, else None),
/// ``output_len`` (output tokens in all, the finishing one included) and ``cached_tokens``
/// (prompt tokens served from the prefix cache at its latest admission; OpenAI's
/// ``usage.prompt_tokens_details.cached_tokens``).
#[pyclass(name = "FinishedRequest", module = "specdial._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyFinishedRequest {
    inner: Finished,
}

#[pymethods]
impl PyFinishedRequest {
    #[getter]
    fn request_id(&self) -> u64 {
        self.inner.request_id
    }
    #[getter]
    fn reason(&self) -> &'static str {
        self.inner.reason.as_str()
    }
    #[getter]
    fn stop_token_id(&self) -> Option<i64> {
        self.inner.reason.stop_token_id()
    }
    #[getter]
    fn output_len(&self) -> u64 {
        self.inner.output_len
    }
    #[getter]
    fn cached_tokens(&self) -> u64 {
        self.inner.cached_tokens
    }
    fn __repr__(&self) -> String {
        let stop = self
            .inner
            .reason
            .stop_token_id()
            .map_or("None".into(), |t| t.to_string());
        format!(
            "FinishedRequest(request_id={}, reason={:?}, stop_token_id={stop}, output_len={}, \
             cached_tokens={})",
            self.inner.request_id,
            self.inner.reason.as_str(),
            self.inner.output_len,
            self.inner.cached_tokens
        )
    }
}

/// What one ``report`` changed (frozen), in the plan's request order: ``request_ids`` [B],
/// ``new_tokens`` (tokens appended to each request's output, after stop truncation, request after
/// request), ``new_offsets`` [B + 1] (request ``b`` got ``new_tokens[new_offsets[b]:new_offsets[b+1]]``;
/// none for requests aborted while the plan was in flight), ``finished`` (FinishedRequest list:
/// their KV pages and rows are already free); and the state after the report, so a serving loop
/// need not ask again: ``stats`` (a SchedulerStats) and ``slot_states`` (as ``slot_states()``).
#[pyclass(name = "ReportResult", module = "specdial._core", frozen)]
pub struct PyReportResult {
    request_ids: Py<Int64Array>,
    new_tokens: Py<Int64Array>,
    new_offsets: Py<Int64Array>,
    finished: Vec<Finished>,
    stats: Py<PySchedulerStats>,
    slot_states: Vec<(u32, u32, f64, u64)>,
}

#[pymethods]
impl PyReportResult {
    /// [B] the plan's request ids.
    #[getter]
    fn request_ids(&self, py: Python<'_>) -> Py<Int64Array> {
        self.request_ids.clone_ref(py)
    }
    /// Tokens appended per request, concatenated.
    #[getter]
    fn new_tokens(&self, py: Python<'_>) -> Py<Int64Array> {
        self.new_tokens.clone_ref(py)
    }
    /// [B + 1] offsets into new_tokens.
    #[getter]
    fn new_offsets(&self, py: Python<'_>) -> Py<Int64Array> {
        self.new_offsets.clone_ref(py)
    }
    /// Requests finished by this report (a new list each access).
    #[getter]
    fn finished(&self) -> Vec<PyFinishedRequest> {
        self.finished
            .iter()
            .map(|&inner| PyFinishedRequest { inner })
            .collect()
    }
    /// The scheduler's stats after this report (a SchedulerStats).
    #[getter]
    fn stats(&self, py: Python<'_>) -> Py<PySchedulerStats> {
        self.stats.clone_ref(py)
    }
    /// The scheduler's slot states after this report (as ``Scheduler.slot_states()``).
    #[getter]
    fn slot_states(&self) -> Vec<(u32, u32, f64, u64)> {
        self.slot_states.clone()
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ReportResult(batch_size={}, new_tokens={}, finished={})",
            self.request_ids.bind(py).get().as_slice().len(),
            self.new_tokens.bind(py).get().as_slice().len(),
            self.finished.len()
        )
    }
}

impl PyReportResult {
    fn new(py: Python<'_>, o: ReportOutcome) -> PyResult<Self> {
        Ok(Self {
            request_ids: arr(py, o.request_ids)?,
            new_tokens: arr(py, o.new_tokens)?,
            new_offsets: arr(py, o.new_offsets)?,
            finished: o.finished,
            stats: Py::new(py, PySchedulerStats::from(o.stats))?,
            slot_states: o.slot_states,
        })
    }
}

// ------------------------------------------------------------------------------------- stats

/// Scheduler gauges (now) and counters (since creation), frozen. ``as_dict()`` for logging.
#[pyclass(name = "SchedulerStats", module = "specdial._core", frozen, get_all)]
pub struct PySchedulerStats {
    /// Requests in decode iterations.
    running: usize,
    /// Requests admitted and prefilling.
    prefilling: usize,
    /// Requests waiting (new and preempted).
    queued: usize,
    /// Of queued, preempted requests waiting to resume.
    queued_preempted: usize,
    /// Pages held by admitted requests (shared pages once).
    kv_pages_used: u32,
    kv_pages_total: u32,
    /// Pages the prefix cache holds now, shared with requests or not.
    cached_pages: u32,
    requests_added: u64,
    /// Finished with reason length or stop.
    requests_finished: u64,
    requests_aborted: u64,
    preemptions: u64,
    /// Times the adaptive policy changed a slot's steps.
    step_switches: u64,
    /// Output tokens appended.
    tokens_generated: u64,
    /// Tokens prefilled (cached prefixes excluded).
    prefill_tokens: u64,
    /// Prompt tokens of requests at their first admission (vLLM's prompt_tokens_total).
    prompt_tokens: u64,
    /// Of prompt_tokens, those served from the prefix cache (hit rate = cached / prompt).
    cached_tokens: u64,
    /// Cached pages evicted to make room (least recently used first).
    evicted_pages: u64,
    prefill_iterations: u64,
    decode_iterations: u64,
    /// {steps: decode iterations at those steps}.
    decode_iterations_by_steps: std::collections::BTreeMap<u32, u64>,
    /// Requests verified with drafts (vLLM spec_decode_num_drafts).
    spec_num_drafts: u64,
    /// Draft tokens verified (vLLM spec_decode_num_draft_tokens).
    spec_num_draft_tokens: u64,
    /// Drafts accepted (vLLM spec_decode_num_accepted_tokens).
    spec_num_accepted_tokens: u64,
    /// Entry i: requests that accepted more than i drafts (vLLM ..._per_pos).
    spec_accepted_per_pos: Vec<u64>,
}

impl From<SchedulerStats> for PySchedulerStats {
    fn from(s: SchedulerStats) -> Self {
        PySchedulerStats {
            running: s.running,
            prefilling: s.prefilling,
            queued: s.queued,
            queued_preempted: s.queued_preempted,
            kv_pages_used: s.kv_pages_used,
            kv_pages_total: s.kv_pages_total,
            cached_pages: s.cached_pages,
            requests_added: s.requests_added,
            requests_finished: s.requests_finished,
            requests_aborted: s.requests_aborted,
            preemptions: s.preemptions,
            step_switches: s.step_switches,
            tokens_generated: s.tokens_generated,
            prefill_tokens: s.prefill_tokens,
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
            evicted_pages: s.evicted_pages,
            prefill_iterations: s.prefill_iterations,
            decode_iterations: s.decode_iterations,
            decode_iterations_by_steps: s.decode_iterations_by_steps.into_iter().collect(),
            spec_num_drafts: s.spec_num_drafts,
            spec_num_draft_tokens: s.spec_num_draft_tokens,
            spec_num_accepted_tokens: s.spec_num_accepted_tokens,
            spec_accepted_per_pos: s.spec_accepted_per_pos,
        }
    }
}

#[pymethods]
impl PySchedulerStats {
    /// Every field as a dict (a fresh copy).
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("running", self.running)?;
        d.set_item("prefilling", self.prefilling)?;
        d.set_item("queued", self.queued)?;
        d.set_item("queued_preempted", self.queued_preempted)?;
        d.set_item("kv_pages_used", self.kv_pages_used)?;
        d.set_item("kv_pages_total", self.kv_pages_total)?;
        d.set_item("cached_pages", self.cached_pages)?;
        d.set_item("requests_added", self.requests_added)?;
        d.set_item("requests_finished", self.requests_finished)?;
        d.set_item("requests_aborted", self.requests_aborted)?;
        d.set_item("preemptions", self.preemptions)?;
        d.set_item("step_switches", self.step_switches)?;
        d.set_item("tokens_generated", self.tokens_generated)?;
        d.set_item("prefill_tokens", self.prefill_tokens)?;
        d.set_item("prompt_tokens", self.prompt_tokens)?;
        d.set_item("cached_tokens", self.cached_tokens)?;
        d.set_item("evicted_pages", self.evicted_pages)?;
        d.set_item("prefill_iterations", self.prefill_iterations)?;
        d.set_item("decode_iterations", self.decode_iterations)?;
        d.set_item(
            "decode_iterations_by_steps",
            self.decode_iterations_by_steps.clone(),
        )?;
        d.set_item("spec_num_drafts", self.spec_num_drafts)?;
        d.set_item("spec_num_draft_tokens", self.spec_num_draft_tokens)?;
        d.set_item("spec_num_accepted_tokens", self.spec_num_accepted_tokens)?;
        d.set_item("spec_accepted_per_pos", self.spec_accepted_per_pos.clone())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerStats(running={}, prefilling={}, queued={}, kv_pages_used={}/{}, preemptions={}, \
             step_switches={}, tokens_generated={})",
            self.running,
            self.prefilling,
            self.queued,
            self.kv_pages_used,
            self.kv_pages_total,
            self.preemptions,
            self.step_switches,
            self.tokens_generated
        )
    }
}

// ------------------------------------------------------------------------------------- scheduler

/// Continuous-batching scheduler: queues, admission, chunked prefill, KV pages, steps per decode
/// iteration, preemption. Python runs the passes; the loop is::
///
///     plan = sched.schedule()          # None: nothing to run
///     ...run plan...                   # prefill chunk, or draft + verify
///     res = sched.report(tokens, offsets, accepted)   # stream res.new_tokens, res.finished
///
/// ``Scheduler(config, *, speculative_num_steps, adaptive=True, adaptive_config=None,
/// cuda_graph_bs=None)``: ``adaptive=True`` chooses steps per decode iteration with the adaptive
/// policy (``adaptive_config``: an AdaptiveConfig, a dict or None for the default; every slot
/// starts at ``speculative_num_steps``, which must be one of its candidates); ``adaptive=False``
/// uses ``speculative_num_steps`` (0..=32) every iteration. ``cuda_graph_bs``: captured graph batch
/// sizes (decode plans carry the padded size; the policy routes by it). Raises ConfigError.
///
/// KV convention: a running request with T tokens holds KV positions 0..T-1; its last token is
/// the input of its next decode. The target and the drafter share the slot indices.
#[pyclass(name = "Scheduler", module = "specdial._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (config, *, speculative_num_steps, adaptive=true, adaptive_config=None, cuda_graph_bs=None, plan_kv_layout=false, speculative_eagle_topk=1, speculative_num_draft_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        config: PyRef<'_, PySchedulerConfig>,
        speculative_num_steps: i64,
        adaptive: bool,
        adaptive_config: Option<&Bound<'_, PyAny>>,
        cuda_graph_bs: Option<Vec<i64>>,
        plan_kv_layout: bool,
        speculative_eagle_topk: i64,
        speculative_num_draft_tokens: Option<i64>,
    ) -> PyResult<Self> {
        guard(|| {
            let steps = u32::try_from(speculative_num_steps).map_err(|_| {
                ConfigError::new_err(format!(
                    "speculative_num_steps: must be in 0..=32, got {speculative_num_steps}"
                ))
            })?;
            let source = if adaptive {
                let cfg = config_arg(adaptive_config)?;
                cfg.validate_initial_steps(speculative_num_steps)
                    .map_err(config_err)?;
                StepsSource::Adaptive(AdaptiveSpeculativeParams::new(steps, cfg))
            } else {
                if adaptive_config.is_some_and(|c| !c.is_none()) {
                    return Err(ConfigError::new_err(
                        "adaptive_config: given with adaptive=False; pass adaptive=True or drop it",
                    ));
                }
                StepsSource::Fixed(steps)
            };
            let mut inner = Scheduler::new(config.inner.clone(), source).map_err(core_err)?;
            inner
                .set_cuda_graph_bs(cuda_graph_bs.as_deref())
                .map_err(core_err)?;
            inner.set_plan_kv_layout(plan_kv_layout);
            let (topk, m) = tree_args(speculative_eagle_topk, speculative_num_draft_tokens)?;
            inner.set_draft_tree(topk, m).map_err(core_err)?;
            Ok(Self { inner })
        })
    }

    /// Queues a request; returns its id (ints counting up from 0).
    ///
    /// ``prompt_ids``: token ids (a sequence of ints or a 1-D integer array), 1 ..
    /// ``context_length - 1`` of them. ``max_new_tokens`` >= 1 (output tokens; the context end
    /// also stops). ``stop_token_ids``: tokens that stop it (reason "stop"), besides the config's
    /// EOS ids unless ``ignore_eos``. Raises InvalidRequestError (a ValueError) whose message
    /// starts with the field, then QueueFullError (a SchedulerError / RuntimeError).
    ///
    /// ``max_cached_tokens``: at most this many KV positions are taken from the prefix cache at
    /// each admission (None: as many as match; an int >= 0). A request that wants prompt
    /// log-probabilities from position ``p`` passes ``max(p, 1) - 1`` (SGLang caps its prefix
    /// match at ``logprob_start_len`` the same way).
    #[pyo3(signature = (prompt_ids, max_new_tokens, stop_token_ids=Vec::new(), ignore_eos=false,
                        *, max_cached_tokens=None))]
    fn add_request(
        &mut self,
        prompt_ids: &Bound<'_, PyAny>,
        max_new_tokens: i64,
        stop_token_ids: Vec<i64>,
        ignore_eos: bool,
        max_cached_tokens: Option<i64>,
    ) -> PyResult<u64> {
        guard(|| {
            let prompt = int_array(prompt_ids, "prompt_ids")?;
            let limit = match max_cached_tokens {
                Some(n) if n < 0 => {
                    return Err(InvalidRequestError::new_err(format!(
                        "max_cached_tokens: must be >= 0 or None, got {n}"
                    )))
                }
                n => n.map(|n| n as u64),
            };
            self.inner
                .add_request_limited(prompt, max_new_tokens, stop_token_ids, ignore_eos, limit)
                .map_err(core_err)
        })
    }

    /// The next iteration's plan (a SchedulePlan), or None when there is nothing to run. KV slots
    /// of the plan are reserved. Raises SchedulerError while the previous plan awaits its report.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<Option<PySchedulePlan>> {
        guard(|| match self.inner.schedule().map_err(core_err)? {
            Some(plan) => Ok(Some(PySchedulePlan::new(py, plan)?)),
            None => Ok(None),
        })
    }

    /// Applies the results of the plan in flight and returns a ReportResult.
    ///
    /// ``tokens``: emitted token ids, request after request in plan order; request ``b`` emitted
    /// ``tokens[offsets[b]:offsets[b+1]]`` (``offsets``: B + 1 ints from 0). Prefill: exactly one
    /// token (the sampled first token) for requests with ``sample_first``, none for the others.
    /// Decode: ``accepted[b] + 1`` tokens (accepted drafts, then the bonus token),
    /// ``accepted[b] <= steps_per_request[b]``. ``accepted`` (decode only, optional): accepted
    /// drafts per request, checked against ``offsets``. Arrays: 1-D integer buffers (numpy) or
    /// lists. ``seconds`` (decode plans only, optional): the iteration's wall time, a float > 0,
    /// from just before ``schedule()`` to just after the passes returned; the adaptive policy
    /// learns its cost model from it (``goodput``). ``stop_strings``: ``(request_id, keep)``
    /// pairs, one per request of the plan whose stop string matched in the text of the tokens
    /// it emitted now (the caller detokenizes); ``keep`` (1 ..= its emitted tokens) counts its
    /// emitted tokens up to and including the one whose text completed the stop string. The
    /// tokens after it are dropped (not output, not counted, their KV freed) and EOS, stop tokens
    /// and the length then apply to the kept ones; the request finishes here with reason "stop"
    /// and no stop token unless those finish it first; so every finish is decided in the report,
    /// nothing is called back after it, and the output does not depend on how many tokens one
    /// verify emitted. The policy still sees every accepted draft. Results for requests aborted meanwhile are
    /// ignored. ``draft_probs`` (decode plans only, optional; issue 28): the drafter's probability
    /// of each draft token the plan verified, request after request in plan order
    /// (``sum(steps_per_request)`` floats in [0, 1], float32/float64 buffer or list); the
    /// ``goodput`` strategy with ``"verify": "per_request"`` uses them as the next decision's
    /// draft confidence. ``verified`` (decode plans only, optional; issue 28's confidence stop):
    /// the draft tokens each request verified, ``0 <= verified[b] <= steps_per_request[b]`` and
    /// ``accepted[b] <= verified[b]`` (None: ``steps_per_request``); acceptance statistics, the
    /// policy and the trace then count only verified positions. Raises SchedulerError with no
    /// plan in flight, ValueError naming tokens / offsets / accepted / seconds / stop_strings /
    /// draft_probs / verified when they do not match the plan (which then stays in flight,
    /// unchanged).
    #[pyo3(signature = (tokens, offsets, accepted=None, *, seconds=None, stop_strings=Vec::new(), draft_probs=None, verified=None))]
    #[allow(clippy::too_many_arguments)]
    fn report(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        accepted: Option<&Bound<'_, PyAny>>,
        seconds: Option<&Bound<'_, PyAny>>,
        stop_strings: Vec<(u64, i64)>,
        draft_probs: Option<&Bound<'_, PyAny>>,
        verified: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyReportResult> {
        guard(|| {
            let seconds = crate::policy::observation(seconds, None, None)?.seconds;
            let tokens = int_array(tokens, "tokens")?;
            let offsets = int_array(offsets, "offsets")?;
            let accepted = match accepted {
                Some(a) if !a.is_none() => Some(int_array(a, "accepted")?),
                _ => None,
            };
            let draft_probs = match draft_probs {
                Some(q) if !q.is_none() => Some(float_array(q, "draft_probs")?),
                _ => None,
            };
            let verified = match verified {
                Some(v) if !v.is_none() => Some(int_array(v, "verified")?),
                _ => None,
            };
            let stop_strings = stop_strings
                .into_iter()
                .map(|(id, keep)| match usize::try_from(keep) {
                    Ok(keep) => Ok((id, keep)),
                    Err(_) => Err(PyValueError::new_err(format!(
                        "stop_strings: request {id} keeps {keep} tokens; must be >= 1"
                    ))),
                })
                .collect::<PyResult<Vec<_>>>()?;
            let extras = ReportExtras {
                seconds,
                stop_strings: &stop_strings,
                draft_probs: draft_probs.as_deref(),
                verified: verified.as_deref(),
            };
            let out = self
                .inner
                .report_with(&tokens, &offsets, accepted.as_deref(), extras)
                .map_err(core_err)?;
            PyReportResult::new(py, out)
        })
    }

    /// Gives up the plan in flight without results (its passes failed): every request in it
    /// that is still live is aborted (KV pages and row freed); returns their FinishedRequest
    /// records (reason "abort"), in plan order. Raises SchedulerError with no plan in flight.
    fn abandon_plan(&mut self) -> PyResult<Vec<PyFinishedRequest>> {
        guard(|| {
            let finished = self.inner.abandon_plan().map_err(core_err)?;
            Ok(finished
                .into_iter()
                .map(|inner| PyFinishedRequest { inner })
                .collect())
        })
    }

    /// Aborts a request in any state (queued, prefilling, running, in the plan in flight),
    /// freeing its KV pages. Returns its FinishedRequest (reason "abort"), or None if the id is
    /// not live (unknown or already finished: aborting twice is harmless).
    fn abort(
        &mut self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
    ) -> PyResult<Option<PyFinishedRequest>> {
        guard(|| {
            Ok(self
                .inner
                .abort(request_id)
                .map(|inner| PyFinishedRequest { inner }))
        })
    }

    /// Finishes a live request now, e.g. when Python matched a stop string in its text
    /// (``reason="stop"``; also ``"length"`` or ``"abort"``), freeing its KV pages. Returns its
    /// FinishedRequest, or None if the id is not live. Raises ValueError for another reason.
    #[pyo3(signature = (request_id, reason="stop"))]
    fn finish_request(
        &mut self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
        reason: &str,
    ) -> PyResult<Option<PyFinishedRequest>> {
        guard(|| {
            let reason = match reason {
                "stop" => FinishReason::Stop(None),
                "length" => FinishReason::Length,
                "abort" => FinishReason::Abort,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "reason must be \"stop\", \"length\" or \"abort\", got {other:?}"
                    )))
                }
            };
            Ok(self
                .inner
                .finish_request(request_id, reason)
                .map(|inner| PyFinishedRequest { inner }))
        })
    }

    /// Fixes the steps of later decode plans (an int in 0..=32), or returns to the adaptive
    /// policy (None; ConfigError without one). The policy is not fed while steps are fixed.
    fn set_fixed_steps(&mut self, steps: Option<i64>) -> PyResult<()> {
        guard(|| {
            let steps = steps
                .map(|s| {
                    u32::try_from(s).map_err(|_| {
                        ConfigError::new_err(format!(
                            "speculative_num_steps: must be in 0..=32, got {s}"
                        ))
                    })
                })
                .transpose()?;
            self.inner.set_fixed_steps(steps).map_err(core_err)
        })
    }

    /// Drops every cached KV page no request holds (SGLang's ``/flush_cache``); True when done.
    /// False, with nothing changed, while any request is live or a plan is in flight (SGLang's
    /// rule: a flush waits for an idle server).
    fn flush_cache(&mut self) -> bool {
        self.inner.flush_cache()
    }

    /// Sets (ints >= 1) or clears (None) the captured CUDA-graph batch sizes. Raises ConfigError.
    fn set_cuda_graph_bs(&mut self, sizes: Option<Vec<i64>>) -> PyResult<()> {
        guard(|| {
            self.inner
                .set_cuda_graph_bs(sizes.as_deref())
                .map_err(core_err)
        })
    }

    /// Gauges and counters now (a SchedulerStats).
    fn stats(&self) -> PySchedulerStats {
        self.inner.stats().into()
    }

    /// Per adaptive slot, ascending: ``(lower_bound, current_steps, accepted_estimate,
    /// verify_count)`` (``accepted_estimate``: the EMA of accepted drafts under ``ema``, the
    /// expected accepted drafts at the current steps otherwise). Empty without an adaptive policy.
    fn slot_states(&self) -> Vec<(u32, u32, f64, u64)> {
        self.inner.slot_states()
    }

    /// The adaptive policy's strategy name (``"ema"``, ``"goodput"``, ``"throughput_aware"``),
    /// or None without a policy.
    #[getter]
    fn policy_strategy(&self) -> Option<&'static str> {
        self.inner.policy().map(|p| p.config().strategy.name())
    }

    /// The ``goodput`` strategy's state (``AdaptiveSpeculativeParams.goodput_state``), or None.
    fn goodput_state<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        guard(|| {
            self.inner
                .policy()
                .and_then(|p| p.goodput())
                .map(|g| crate::policy::goodput_dict(py, g))
                .transpose()
        })
    }

    /// What the ``goodput`` strategy learned (its cost model and long-run acceptance counts) as
    /// versioned JSON text (``AdaptiveSpeculativeParams.export_policy_state``); None under
    /// another strategy or without an adaptive policy.
    fn export_policy_state(&self) -> Option<String> {
        self.inner.policy().and_then(|p| p.goodput()).map(|g| g.export_state())
    }

    /// Seeds the ``goodput`` strategy with a state ``export_policy_state`` wrote. Returns False
    /// (nothing done) under another strategy or without a policy. Raises ValueError, with
    /// nothing changed, on text that does not parse, another version or values out of range.
    fn import_policy_state(&mut self, state: &str) -> PyResult<bool> {
        guard(|| match self.inner.policy_mut().and_then(|p| p.goodput_mut()) {
            None => Ok(false),
            Some(g) => g
                .import_state(state)
                .map(|()| true)
                .map_err(|e| PyValueError::new_err(format!("policy state: {e}"))),
        })
    }

    /// Predicted seconds of one decode iteration per candidate steps value of the slot serving a
    /// batch of ``batch_size`` requests with ``context_tokens`` tokens (``goodput`` only; {}
    /// otherwise). A pure read.
    #[pyo3(signature = (batch_size, context_tokens=0))]
    fn predicted_seconds(&self, batch_size: i64, context_tokens: u64) -> PyResult<std::collections::BTreeMap<u32, f64>> {
        guard(|| {
            let Some(p) = self.inner.policy() else { return Ok(Default::default()) };
            let Some(g) = p.goodput() else { return Ok(Default::default()) };
            let (slot, graph) = p.route(batch_size).map_err(|e| PyValueError::new_err(e.to_string()))?;
            let b = batch_size as u32;
            let (bucket, b_cost) = match graph {
                Some(gb) => (gb, gb),
                None => (specdial_core::goodput::cost::bucket_of(b), b),
            };
            Ok(p.config().slots[slot]
                .1
                .candidate_steps
                .iter()
                .map(|&k| (k, g.predict_seconds(bucket, b_cost, k, context_tokens)))
                .collect())
        })
    }

    /// The steps the adaptive policy can choose for a decode iteration of ``batch_size``
    /// requests: the candidates of the slot the batch routes to after padding to the CUDA-graph
    /// size that replays (``AdaptiveSpeculativeParams.reachable_steps``; start-up profiling
    /// measures exactly these). [] without an adaptive policy. ValueError for a batch size < 1.
    fn reachable_steps(&self, batch_size: i64) -> PyResult<Vec<u32>> {
        match self.inner.policy() {
            None => Ok(Vec::new()),
            Some(p) => p
                .reachable_steps(batch_size)
                .map(<[u32]>::to_vec)
                .map_err(|e| PyValueError::new_err(format!("batch_size: {e}"))),
        }
    }

    /// Feeds one startup-profiling measurement to the policy (``AdaptiveSpeculativeParams.
    /// set_profiled_cost``). Raises ValueError, or SchedulerError without an adaptive policy.
    #[pyo3(signature = (batch_size, steps, seconds, context_tokens=0))]
    fn set_profiled_cost(&mut self, batch_size: u32, steps: u32, seconds: f64, context_tokens: u64) -> PyResult<()> {
        guard(|| match self.inner.policy_mut() {
            None => Err(SchedulerError::new_err("this scheduler has no adaptive policy")),
            Some(p) => p
                .set_profiled_cost(batch_size, steps, seconds, context_tokens)
                .map_err(|e| PyValueError::new_err(e.to_string())),
        })
    }

    /// The per-verify trace since the last call, as JSON Lines text (each line
    /// ``{"accepted": [...], "batch_size": B, "steps": k}``, plus ``"steps_per_request"`` when
    /// some request was capped below ``steps``; the format ``specdial policy replay`` reads), ""
    /// when empty or when ``record_trace`` is off. Append it to the trace file.
    fn drain_trace(&mut self) -> String {
        let mut out = String::new();
        for record in self.inner.drain_trace() {
            out.push_str(&record.to_json());
            out.push('\n');
        }
        out
    }

    /// Output token ids of a live request so far (Int64Array, a copy), None once finished.
    fn output_ids(
        &self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
    ) -> Option<Int64Array> {
        self.inner
            .output_ids(request_id)
            .map(|o| Int64Array::from_vec(o.to_vec()))
    }

    /// ``"waiting"``, ``"prefilling"`` or ``"running"`` for a live request, None once finished.
    fn request_state(
        &self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
    ) -> Option<&'static str> {
        self.inner.request_state(request_id).map(|s| s.as_str())
    }

    /// Whether any request is live (waiting, prefilling or running).
    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    /// Requests in decode iterations now.
    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    /// Requests waiting now (new and preempted).
    #[getter]
    fn num_queued(&self) -> usize {
        self.inner.num_queued()
    }

    /// Whether a plan awaits its report.
    #[getter]
    fn plan_in_flight(&self) -> bool {
        self.inner.plan_in_flight()
    }

    /// Whether plans carry ``kv_indices``, ``page_table`` and ``page_table_offsets`` (default
    /// False: the worker builds its attention metadata from its own tables; a backend that plans
    /// from the scheduler's page tables sets it). Takes effect at the next plan.
    #[getter]
    fn get_plan_kv_layout(&self) -> bool {
        self.inner.plan_kv_layout()
    }

    #[setter]
    fn set_plan_kv_layout(&mut self, on: bool) {
        self.inner.set_plan_kv_layout(on);
    }

    /// Rows held by admitted (prefilling or running) requests.
    #[getter]
    fn rows_in_use(&self) -> usize {
        self.inner.rows_in_use()
    }

    /// The worker row of an admitted request, None otherwise.
    fn row_of(&self, #[pyo3(from_py_with = request_id_arg)] request_id: u64) -> Option<u32> {
        self.inner.row_of(request_id)
    }

    /// Every steps value a decode plan can carry (build runtime states / graphs for these).
    #[getter]
    fn candidate_steps(&self) -> Vec<u32> {
        self.inner.candidate_steps()
    }

    /// The fixed steps in force, or None when the adaptive policy decides.
    #[getter]
    fn fixed_steps(&self) -> Option<u32> {
        self.inner.fixed_steps()
    }

    /// ``(speculative_eagle_topk, speculative_num_draft_tokens)`` in SGLang's counting (the
    /// root included): ``(1, largest steps + 1)`` for chains.
    #[getter]
    fn draft_tree(&self) -> (u32, u32) {
        self.inner.draft_tree_flags()
    }

    /// Sets the draft tree (SGLang's ``speculative_eagle_topk`` and
    /// ``speculative_num_draft_tokens``, the root included; top-k 1 is chains), checked against
    /// the largest steps; takes effect at the next plan. Raises ConfigError naming the field and
    /// the allowed values (the scheduler is then unchanged).
    #[pyo3(signature = (speculative_eagle_topk, speculative_num_draft_tokens=None))]
    fn set_draft_tree(&mut self, speculative_eagle_topk: i64, speculative_num_draft_tokens: Option<i64>) -> PyResult<()> {
        let (topk, m) = tree_args(speculative_eagle_topk, speculative_num_draft_tokens)?;
        self.inner.set_draft_tree(topk, m).map_err(core_err)
    }

    /// The config (a SchedulerConfig).
    #[getter]
    fn config(&self) -> PySchedulerConfig {
        PySchedulerConfig {
            inner: self.inner.config().clone(),
        }
    }

    /// KV slots, ``num_pages * page_size``: the first dimension of the KV buffers.
    #[getter]
    fn num_slots(&self) -> u64 {
        self.inner.pool().num_kv_slots()
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!(
            "Scheduler(running={}, prefilling={}, queued={}, kv_pages_used={}/{}, steps={})",
            s.running,
            s.prefilling,
            s.queued,
            s.kv_pages_used,
            s.kv_pages_total,
            self.inner
                .fixed_steps()
                .map_or("adaptive".into(), |k| k.to_string())
        )
    }
}

/// SGLang's ``speculative_eagle_topk`` / ``speculative_num_draft_tokens`` as the core's `u32`s
/// (a negative or huge value is out of range: ConfigError naming it, with the allowed values).
fn tree_args(topk: i64, m: Option<i64>) -> PyResult<(u32, Option<u32>)> {
    let topk = u32::try_from(topk).map_err(|_| {
        ConfigError::new_err(format!("speculative_eagle_topk: must be in 1..={}, got {topk}", specdial_core::scheduler::MAX_TREE_NODES))
    })?;
    let m = m
        .map(|m| {
            u32::try_from(m).map_err(|_| {
                ConfigError::new_err(format!("speculative_num_draft_tokens: must be an int >= 1 (the root plus the tree's nodes) or None, got {m}"))
            })
        })
        .transpose()?;
    Ok((topk, m))
}

/// Checks SGLang's ``speculative_eagle_topk`` and ``speculative_num_draft_tokens`` (the root
/// included; None: ``steps + 1`` at top-k 1, required above) against ``speculative_num_steps``
/// (the tree's depth: the fixed steps, or the adaptive policy's largest) and returns the tree's
/// ``(topk, nodes without the root)``, or None for a chain. Rules: top-k in 1..=64; at top-k 1
/// the count must be steps + 1; above, steps >= 1 and steps + 1 <= count <=
/// min(topk + (steps - 1) * topk**2, 64) + 1 (EAGLE-2's candidates, SGLang's tree). Raises
/// ConfigError naming the field and the allowed values.
#[pyfunction]
#[pyo3(signature = (speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens=None))]
pub fn validate_draft_tree(speculative_num_steps: i64, speculative_eagle_topk: i64, speculative_num_draft_tokens: Option<i64>) -> PyResult<Option<(u32, u32)>> {
    let steps = u32::try_from(speculative_num_steps)
        .map_err(|_| ConfigError::new_err(format!("speculative_num_steps: must be in 0..=32, got {speculative_num_steps}")))?;
    let (topk, m) = tree_args(speculative_eagle_topk, speculative_num_draft_tokens)?;
    let tree = specdial_core::scheduler::validate_tree(steps, topk, m).map_err(core_err)?;
    Ok(tree.map(|t| (t.topk, t.num_draft_tokens)))
}

/// Adds the scheduler classes and exceptions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("SchedulerError", py.get_type::<SchedulerError>())?;
    m.add("QueueFullError", py.get_type::<QueueFullError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add_class::<PySchedulerConfig>()?;
    m.add_class::<PySchedulePlan>()?;
    m.add_class::<PyFinishedRequest>()?;
    m.add_class::<PyReportResult>()?;
    m.add_class::<PySchedulerStats>()?;
    m.add_class::<PyScheduler>()?;
    m.add_function(wrap_pyfunction!(validate_draft_tree, m)?)?;
    Ok(())
}
