//! `Int64Array`: an immutable 1-D `int64` array owned by Rust and exposed to Python through the
//! buffer protocol, so index arrays (slot indices, page tables, ...) cross to numpy and torch
//! without a Python object per element and without a copy.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// Buffer format of one element: native `long long`, i.e. `int64` (`numpy.int64`, `torch.int64`).
const FORMAT_Q: &std::ffi::CStr = c"q";

/// Read-only 1-D array of `int64` (e.g. KV slot indices), owned by Rust.
///
/// Supports `len()` and the buffer protocol (format `"q"`, read-only, C-contiguous), so
/// `numpy.asarray(a)`, `memoryview(a)` and `torch.frombuffer(a, dtype=torch.int64)` view the
/// same memory without copying; the array stays alive while any view exists. Writable
/// buffer requests raise `BufferError`. `tolist()` copies into a Python list (for debugging).
#[pyclass(name = "Int64Array", module = "specdial._core", frozen)]
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Int64Array {
    data: Vec<i64>,
}

impl Int64Array {
    /// Wraps `v` without copying.
    pub fn from_vec(v: Vec<i64>) -> Self {
        Self { data: v }
    }

    /// The elements.
    pub fn as_slice(&self) -> &[i64] {
        &self.data
    }

    /// Unwraps the vector.
    pub fn into_vec(self) -> Vec<i64> {
        self.data
    }
}

impl From<Vec<i64>> for Int64Array {
    fn from(v: Vec<i64>) -> Self {
        Self::from_vec(v)
    }
}

#[pymethods]
impl Int64Array {
    /// Number of elements.
    fn __len__(&self) -> usize {
        self.data.len()
    }

    /// The elements as a Python list of int (a copy; not for hot paths).
    fn tolist(&self) -> Vec<i64> {
        self.data.clone()
    }

    fn __repr__(&self) -> String {
        const SHOWN: usize = 8;
        let head: Vec<String> = self.data.iter().take(SHOWN).map(i64::to_string).collect();
        let more = if self.data.len() > SHOWN { ", ..." } else { "" };
        format!(
            "Int64Array(len={}, [{}{}])",
            self.data.len(),
            head.join(", "),
            more
        )
    }

    /// Buffer protocol: fills `view` with a read-only, 1-D, C-contiguous view of the elements.
    ///
    /// # Safety
    /// Called by the interpreter with a valid `view`; the shape and stride storage it points to
    /// is boxed in `view.internal` and freed in `__releasebuffer__`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("Int64Array: buffer view is NULL"));
        }
        if (flags & ffi::PyBUF_WRITABLE) == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "Int64Array is read-only: request a read-only buffer (e.g. numpy.asarray)",
            ));
        }
        let this = slf.get();
        let n = this.data.len() as isize;
        let itemsize = std::mem::size_of::<i64>() as isize;
        // [shape[0], strides[0]]: must outlive the view, so it lives in view.internal.
        let dims = Box::into_raw(Box::new([n, itemsize])) as *mut isize;
        // SAFETY: `view` is non-null and points to a Py_buffer the interpreter owns for this call.
        // The data pointer stays valid while `view.obj` holds a reference: the class is frozen,
        // so the Vec is never mutated or reallocated while the object lives.
        unsafe {
            (*view).buf = this.data.as_ptr() as *mut c_void;
            (*view).len = n * itemsize;
            (*view).readonly = 1;
            (*view).itemsize = itemsize;
            (*view).format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
                FORMAT_Q.as_ptr() as *mut c_char
            } else {
                ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND {
                dims
            } else {
                ptr::null_mut()
            };
            (*view).strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
                dims.add(1)
            } else {
                ptr::null_mut()
            };
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = dims as *mut c_void;
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    /// Buffer protocol: frees the shape/stride storage of a view made by `__getbuffer__`.
    ///
    /// # Safety
    /// `view` is a view filled by `__getbuffer__` above, released once.
    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        // SAFETY: `internal` is the Box made in `__getbuffer__` (or NULL), released exactly once.
        unsafe {
            if !view.is_null() && !(*view).internal.is_null() {
                drop(Box::from_raw((*view).internal as *mut [isize; 2]));
                (*view).internal = ptr::null_mut();
            }
        }
    }
}
