//! `specdial._core`: thin PyO3 wrappers over `specdial-core`, one file per core module.
//!
//! Every method body runs inside [`guard`], so a Rust panic surfaces as
//! `specdial.InternalError` (a `RuntimeError`) instead of PyO3's `PanicException`, which derives
//! from `BaseException` and would slip past `except Exception` in a server loop.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

mod buffer;
mod config;
mod kv;
mod policy;
mod scheduler;
mod sim;

pyo3::create_exception!(
    specdial,
    ConfigError,
    PyValueError,
    "A rejected adaptive config or speculative_num_steps; the message names the key and value."
);
pyo3::create_exception!(
    specdial,
    InternalError,
    PyRuntimeError,
    "A bug inside specdial's Rust core (a caught panic). Please report it with the message."
);

/// Runs `f`, turning a panic into `InternalError`.
pub(crate) fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(InternalError::new_err(format!("internal error in specdial core: {msg}")))
        }
    }
}

/// Test hook: panics inside Rust, to check that callers see `InternalError`.
#[pyfunction]
fn _panic_for_test() -> PyResult<()> {
    guard(|| panic!("deliberate panic for the test suite"))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_TREE_TOPK", specdial_core::config::tree::MAX_TOPK)?;
    m.add("MAX_TREE_NUM_DRAFT_TOKENS", specdial_core::config::tree::MAX_NUM_DRAFT_TOKENS)?;
    m.add("CONFIDENCE_BINS", specdial_core::goodput::confidence::BINS)?;
    m.add("CONFIDENCE_BIN_WIDTH", specdial_core::goodput::confidence::WIDTH)?;
    m.add_function(wrap_pyfunction!(_panic_for_test, m)?)?;
    config::register(m)?;
    policy::register(m)?;
    kv::register(m)?;
    scheduler::register(m)?;
    sim::register(m)?;
    Ok(())
}
