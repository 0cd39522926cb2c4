//! Python surface of `specdial_core::config`: `AdaptiveConfig` and the Python-object reader.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use specdial_core::config::{AdaptiveConfig as CoreConfig, ConfigValue, SlotConfig};

use crate::{guard, ConfigError};

/// Maps a Python object (dict / list / int / float / str / bool / None) onto a config tree.
/// Integer dict keys are taken as their decimal text, so `{1: {...}, 8: {...}}` works.
pub(crate) fn to_value(obj: &Bound<'_, PyAny>) -> ConfigValue {
    if obj.is_none() {
        ConfigValue::Null
    } else if obj.is_instance_of::<PyBool>() {
        ConfigValue::Bool(obj.is_truthy().unwrap_or(false))
    } else if obj.is_instance_of::<PyInt>() {
        match obj.extract::<i64>() {
            Ok(i) => ConfigValue::Int(i),
            Err(_) => ConfigValue::Other(format!("integer {obj} (too large)")),
        }
    } else if obj.is_instance_of::<PyFloat>() {
        ConfigValue::Float(obj.extract::<f64>().unwrap_or(f64::NAN))
    } else if let Ok(s) = obj.cast::<PyString>() {
        ConfigValue::Str(s.to_string())
    } else if let Ok(d) = obj.cast::<PyDict>() {
        ConfigValue::Map(
            d.iter()
                .map(|(k, v)| {
                    let key = if k.is_instance_of::<PyInt>() && !k.is_instance_of::<PyBool>() {
                        k.to_string()
                    } else if let Ok(s) = k.cast::<PyString>() {
                        s.to_string()
                    } else {
                        // Non-string keys become an unknown-key error naming their repr.
                        k.repr().map(|r| r.to_string()).unwrap_or_else(|_| "<key>".into())
                    };
                    (key, to_value(&v))
                })
                .collect(),
        )
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        ConfigValue::List(obj.try_iter().map(|it| it.filter_map(Result::ok).map(|x| to_value(&x)).collect()).unwrap_or_default())
    } else {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into());
        ConfigValue::Other(format!("a {ty}"))
    }
}

pub(crate) fn config_err(e: specdial_core::ConfigError) -> PyErr {
    ConfigError::new_err(e.0)
}

/// Validated adaptive speculative-decoding config (SGLang `--speculative-adaptive-config` format).
///
/// Build with `from_json`, `from_file`, `from_dict` or `default`. Invalid input raises
/// `specdial.ConfigError` naming the key and the bad value.
#[pyclass(name = "AdaptiveConfig", module = "specdial._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyAdaptiveConfig {
    pub(crate) inner: CoreConfig,
}

#[pymethods]
impl PyAdaptiveConfig {
    /// Parses JSON text. Raises ConfigError.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        guard(|| CoreConfig::from_json(text).map(|inner| Self { inner }).map_err(config_err))
    }

    /// Reads and parses a JSON file. Raises ConfigError (bad content) or OSError (unreadable file).
    #[staticmethod]
    fn from_file(path: std::path::PathBuf) -> PyResult<Self> {
        guard(|| {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                pyo3::exceptions::PyOSError::new_err(format!("cannot read adaptive config {}: {e}", path.display()))
            })?;
            CoreConfig::from_json(&text)
                .map(|inner| Self { inner })
                .map_err(|e| ConfigError::new_err(format!("{}: {}", path.display(), e.0)))
        })
    }

    /// Validates a dict (same format as the JSON object). Raises ConfigError.
    #[staticmethod]
    fn from_dict(d: &Bound<'_, PyAny>) -> PyResult<Self> {
        guard(|| CoreConfig::from_value(&to_value(d)).map(|inner| Self { inner }).map_err(config_err))
    }

    /// specdial's default: the `goodput` strategy over slot 1 `0..=7`, slot 64 `0..=4`, slot 256
    /// `0..=3` (the candidates bound which CUDA graphs exist; goodput picks among them).
    #[staticmethod]
    fn default() -> Self {
        Self { inner: CoreConfig::default_config() }
    }

    /// SGLang's default EMA config: slot 1 [1,3,5,7] (down -0.25), 8 [0,1,3], 32 [0,1], 64 [0].
    #[staticmethod]
    fn ema_default() -> Self {
        Self { inner: CoreConfig::ema_default() }
    }

    /// Canonical JSON: `strategy` plus one fully merged object per slot.
    fn to_json(&self) -> String {
        self.inner.to_json()
    }

    /// Strategy name: `"ema"`, `"goodput"` or `"throughput_aware"`.
    #[getter]
    fn strategy(&self) -> &'static str {
        self.inner.strategy.name()
    }

    /// The startup profiling run this config asks for, as a dict of SGLang's `profile_run_*`
    /// keys (`throughput_aware` always; `goodput` when a `profile_run_*` key was given), else None.
    #[getter]
    fn profile<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(p) = self.inner.profile() else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("profile_run_batch_sizes", p.profile_run_batch_sizes.clone())?;
        d.set_item("max_profile_run_batch_size", p.max_profile_run_batch_size)?;
        d.set_item("profile_run_n_warmup", p.profile_run_n_warmup)?;
        d.set_item("profile_run_n_measure", p.profile_run_n_measure)?;
        d.set_item("profile_run_seq_len", p.profile_run_seq_len)?;
        Ok(Some(d))
    }

    /// Batch-size lower bounds of the slots, ascending.
    #[getter]
    fn slot_lower_bounds(&self) -> Vec<u32> {
        self.inner.slots.iter().map(|(b, _)| *b).collect()
    }

    /// Sorted union of every slot's candidate steps.
    #[getter]
    fn candidate_steps(&self) -> Vec<u32> {
        self.inner.candidate_union()
    }

    fn __repr__(&self) -> String {
        format!("AdaptiveConfig.from_json('{}')", self.inner.to_json())
    }
}

/// An `AdaptiveConfig`, a dict, or None (the default) as a core config.
pub(crate) fn config_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<CoreConfig> {
    match obj {
        None => Ok(CoreConfig::default_config()),
        Some(o) if o.is_none() => Ok(CoreConfig::default_config()),
        Some(o) => {
            if let Ok(c) = o.cast::<PyAdaptiveConfig>() {
                Ok(c.get().inner.clone())
            } else if o.is_instance_of::<PyDict>() {
                CoreConfig::from_value(&to_value(o)).map_err(config_err)
            } else {
                let ty = o.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                Err(PyTypeError::new_err(format!("config must be an AdaptiveConfig, a dict or None, got {ty}")))
            }
        }
    }
}

/// One slot's settings from a dict (the slot keys; `candidate_steps` required).
pub(crate) fn slot_config_arg(obj: &Bound<'_, PyAny>) -> PyResult<SlotConfig> {
    SlotConfig::from_value(&to_value(obj)).map_err(config_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAdaptiveConfig>()
}
