//! The `Attention` Python class: what a manager's (or a group's) queries attend to.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pagedkv as core;

use crate::conversions::integer;

/// What the queries of a manager or group attend to (see `pagedkv.Attention`).
#[pyclass(frozen, eq, hash, module = "pagedkv._core")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Attention {
    pub(crate) inner: core::Attention,
}

impl Attention {
    fn positive(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u32> {
        let value = integer::<u32>(value, name)?;
        if value == 0 {
            return Err(PyValueError::new_err(format!("{name} must be at least 1")));
        }
        Ok(value)
    }
}

#[pymethods]
impl Attention {
    /// Every earlier token.
    #[staticmethod]
    fn full() -> Attention {
        Attention {
            inner: core::Attention::Full,
        }
    }

    /// The last `window` tokens, the query's own included.
    #[staticmethod]
    fn sliding_window(window: &Bound<'_, PyAny>) -> PyResult<Attention> {
        Ok(Attention {
            inner: core::Attention::SlidingWindow(Attention::positive(window, "window")?),
        })
    }

    /// The tokens of the query's own chunk of `chunk` tokens.
    #[staticmethod]
    fn chunked_local(chunk: &Bound<'_, PyAny>) -> PyResult<Attention> {
        Ok(Attention {
            inner: core::Attention::ChunkedLocal(Attention::positive(chunk, "chunk")?),
        })
    }

    /// "full", "sliding_window" or "chunked_local".
    #[getter]
    fn kind(&self) -> &'static str {
        match self.inner {
            core::Attention::Full => "full",
            core::Attention::SlidingWindow(_) => "sliding_window",
            core::Attention::ChunkedLocal(_) => "chunked_local",
        }
    }

    /// The window in tokens (sliding window only).
    #[getter]
    fn window(&self) -> Option<u32> {
        match self.inner {
            core::Attention::SlidingWindow(window) => Some(window),
            _ => None,
        }
    }

    /// The chunk in tokens (chunked local only).
    #[getter]
    fn chunk(&self) -> Option<u32> {
        match self.inner {
            core::Attention::ChunkedLocal(chunk) => Some(chunk),
            _ => None,
        }
    }

    /// FlashInfer's `window_left`: `window - 1` for a sliding window, else -1.
    #[getter]
    fn window_left(&self) -> i64 {
        match self.inner {
            core::Attention::SlidingWindow(window) => i64::from(window) - 1,
            _ => -1,
        }
    }

    /// The first token a query at `position` reads.
    fn first_key(&self, position: &Bound<'_, PyAny>) -> PyResult<usize> {
        let position = integer::<u64>(position, "position")? as usize;
        Ok(self.inner.first_key(position))
    }

    fn __repr__(&self) -> String {
        match self.inner {
            core::Attention::Full => "Attention.full()".into(),
            core::Attention::SlidingWindow(w) => format!("Attention.sliding_window({w})"),
            core::Attention::ChunkedLocal(c) => format!("Attention.chunked_local({c})"),
        }
    }
}
