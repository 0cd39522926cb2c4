//! Python surface of `specdial_core::kv`: `KvPagePool` and `specdial.KvError`.
//!
//! Index arrays (slot indices, page tables) come back as [`Int64Array`], which numpy and torch
//! view without copying. Integer arguments that are out of range (negative, or too large for
//! the pool's types) raise `KvError` naming the argument; non-integers raise `TypeError`.

use pyo3::exceptions::{PyOverflowError, PyValueError};
use pyo3::prelude::*;

use specdial_core::kv::{KvError as CoreKvError, PagePool};

use crate::buffer::Int64Array;
use crate::guard;

pyo3::create_exception!(
    specdial,
    KvError,
    PyValueError,
    "A rejected KV page operation: unknown or duplicate request id, not enough free pages, an \
     invalid token range or truncate length, or an out-of-range argument. The message names the \
     request and the numbers; the pool is unchanged."
);

fn kv_err(e: CoreKvError) -> PyErr {
    KvError::new_err(e.to_string())
}

/// Extracts a non-negative int `<= max`; out-of-range ints raise `KvError` naming `name`.
fn int_arg(obj: &Bound<'_, PyAny>, name: &str, max: u64) -> PyResult<u64> {
    let out_of_range =
        || KvError::new_err(format!("{name} must be an integer in 0..={max}, got {obj}"));
    match obj.extract::<u64>() {
        Ok(v) if v <= max => Ok(v),
        Ok(_) => Err(out_of_range()),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(out_of_range()),
        Err(e) => Err(e),
    }
}

fn request_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int_arg(obj, "request_id", u64::MAX)
}
fn n_tokens_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int_arg(obj, "n_tokens", u64::MAX)
}
fn start_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int_arg(obj, "start", u64::MAX)
}
fn end_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int_arg(obj, "end", u64::MAX)
}
fn new_len_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int_arg(obj, "new_len", u64::MAX)
}
fn num_pages_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    int_arg(obj, "num_pages", u64::from(u32::MAX)).map(|v| v as u32)
}
fn page_size_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    int_arg(obj, "page_size", u64::from(u32::MAX)).map(|v| v as u32)
}

/// Fixed pool of KV pages with per-request page tables (the KV cache's allocator).
///
/// ``KvPagePool(num_pages, page_size)``: ``num_pages`` pages of ``page_size`` tokens each.
/// Token position ``t`` of a request lives in KV slot
/// ``page_table[t // page_size] * page_size + t % page_size``; slots index the first
/// dimension (``num_slots``) of the KV buffers.
///
/// Check/act pairs: ``can_reserve`` says whether ``reserve`` would succeed. Every failing
/// method raises ``specdial.KvError`` (a ``ValueError``) and leaves the pool unchanged.
/// Slot and page arrays are returned as ``Int64Array`` (zero-copy into numpy/torch).
#[pyclass(name = "KvPagePool", module = "specdial._core")]
pub struct PyKvPagePool {
    inner: PagePool,
}

#[pymethods]
impl PyKvPagePool {
    /// Creates a pool with all ``num_pages`` pages (of ``page_size`` tokens each) free.
    ///
    /// Raises KvError if either is < 1, > 2**32 - 1, or ``num_pages * page_size`` exceeds the
    /// largest int64 slot index.
    #[new]
    fn new(
        #[pyo3(from_py_with = num_pages_arg)] num_pages: u32,
        #[pyo3(from_py_with = page_size_arg)] page_size: u32,
    ) -> PyResult<Self> {
        guard(|| {
            PagePool::new(num_pages, page_size)
                .map(|inner| Self { inner })
                .map_err(kv_err)
        })
    }

    /// Total pages in the pool.
    #[getter]
    fn num_pages(&self) -> u32 {
        self.inner.num_pages()
    }

    /// Tokens (slots) per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.page_size()
    }

    /// Total slots, ``num_pages * page_size``: the first dimension of the KV buffers.
    #[getter]
    fn num_slots(&self) -> u64 {
        self.inner.num_kv_slots()
    }

    /// Pages not owned by any request.
    fn num_free_pages(&self) -> u32 {
        self.inner.num_free_pages()
    }

    /// Pages owned by some request (``num_free_pages() + num_used_pages() == num_pages``).
    fn num_used_pages(&self) -> u32 {
        self.inner.num_used_pages()
    }

    /// Registered requests (added and not yet freed).
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }

    /// Registers ``request_id`` with an empty page table (0 tokens, 0 pages).
    ///
    /// Raises KvError if it is already registered.
    fn add_request(
        &mut self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
    ) -> PyResult<()> {
        guard(|| self.inner.add_request(request_id).map_err(kv_err))
    }

    /// Whether ``request_id`` is registered (also ``request_id in pool``).
    fn has_request(&self, #[pyo3(from_py_with = request_id_arg)] request_id: u64) -> bool {
        self.inner.has_request(request_id)
    }

    fn __contains__(&self, #[pyo3(from_py_with = request_id_arg)] request_id: u64) -> bool {
        self.inner.has_request(request_id)
    }

    /// Length of ``request_id`` in tokens. Raises KvError for an unknown request.
    fn len_of(&self, #[pyo3(from_py_with = request_id_arg)] request_id: u64) -> PyResult<u64> {
        guard(|| self.inner.len(request_id).map_err(kv_err))
    }

    /// Pages that extending ``request_id`` by ``n_tokens`` tokens would allocate (0 while the
    /// tokens fit in its last page). Raises KvError for an unknown request.
    fn pages_needed(
        &self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
        #[pyo3(from_py_with = n_tokens_arg)] n_tokens: u64,
    ) -> PyResult<u64> {
        guard(|| {
            self.inner
                .pages_needed(request_id, n_tokens)
                .map_err(kv_err)
        })
    }

    /// Whether ``reserve(request_id, n_tokens)`` would succeed: the request is registered and
    /// enough pages are free. Never raises for a valid ``n_tokens``.
    fn can_reserve(
        &self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
        #[pyo3(from_py_with = n_tokens_arg)] n_tokens: u64,
    ) -> bool {
        self.inner.can_reserve(request_id, n_tokens)
    }

    /// Extends ``request_id`` by ``n_tokens`` tokens, allocating pages as needed, and returns
    /// the slot indices of the new token positions ``len .. len + n_tokens`` (Int64Array).
    ///
    /// Raises KvError (pool unchanged) for an unknown request or when not enough pages are
    /// free.
    fn reserve(
        &mut self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
        #[pyo3(from_py_with = n_tokens_arg)] n_tokens: u64,
    ) -> PyResult<Int64Array> {
        guard(|| {
            self.inner
                .reserve(request_id, n_tokens)
                .map(Int64Array::from_vec)
                .map_err(kv_err)
        })
    }

    /// Slot indices of token positions ``start .. end`` of ``request_id`` (Int64Array).
    ///
    /// Raises KvError for an unknown request or unless ``0 <= start <= end <= len_of(request_id)``.
    fn slots(
        &self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
        #[pyo3(from_py_with = start_arg)] start: u64,
        #[pyo3(from_py_with = end_arg)] end: u64,
    ) -> PyResult<Int64Array> {
        guard(|| {
            self.inner
                .kv_indices(request_id, start, end)
                .map(Int64Array::from_vec)
                .map_err(kv_err)
        })
    }

    /// The page table of ``request_id``: its page ids in token order (Int64Array).
    ///
    /// Raises KvError for an unknown request.
    fn page_table(
        &self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
    ) -> PyResult<Int64Array> {
        guard(|| {
            let pages = self.inner.pages(request_id).map_err(kv_err)?;
            Ok(Int64Array::from_vec(
                pages.iter().map(|&p| i64::from(p)).collect(),
            ))
        })
    }

    /// Shortens ``request_id`` to ``new_len`` tokens (e.g. dropping rejected draft tokens) and
    /// returns the number of pages freed (those holding no token below ``new_len``).
    ///
    /// Raises KvError (pool unchanged) for an unknown request or ``new_len > len_of(request_id)``.
    fn truncate(
        &mut self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
        #[pyo3(from_py_with = new_len_arg)] new_len: u64,
    ) -> PyResult<u32> {
        guard(|| self.inner.truncate(request_id, new_len).map_err(kv_err))
    }

    /// Unregisters ``request_id`` and returns all its pages to the pool; returns how many.
    ///
    /// Raises KvError for an unknown request (never added, or already freed).
    fn free_request(
        &mut self,
        #[pyo3(from_py_with = request_id_arg)] request_id: u64,
    ) -> PyResult<u32> {
        guard(|| self.inner.free_request(request_id).map_err(kv_err))
    }

    fn __repr__(&self) -> String {
        format!(
            "KvPagePool(num_pages={}, page_size={}, free_pages={}, requests={})",
            self.inner.num_pages(),
            self.inner.page_size(),
            self.inner.num_free_pages(),
            self.inner.num_requests()
        )
    }
}

/// Adds `KvPagePool`, `Int64Array` and `KvError` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvPagePool>()?;
    m.add_class::<Int64Array>()?;
    m.add("KvError", m.py().get_type::<KvError>())?;
    Ok(())
}
