//! Conversions between Python and the core: ids, token arrays, salts and counts in; block pairs
//! and errors out.

use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyError, PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyInt, PyMemoryView, PySequence, PyString};

use pagedkv as core;

create_exception!(
    _core,
    OutOfBlocks,
    PyRuntimeError,
    "The pool has fewer free or evictable blocks than the operation needs; nothing changed."
);

/// Maps a core error to the Python exception users expect.
pub(crate) fn to_py(err: core::Error) -> PyErr {
    let msg = err.to_string();
    match err {
        core::Error::UnknownSequence(_) => PyKeyError::new_err(msg),
        core::Error::OutOfBlocks { .. } | core::Error::OutOfStateSlots { .. } => {
            OutOfBlocks::new_err(msg)
        }
        core::Error::InvariantViolated(_) => PyRuntimeError::new_err(msg),
        core::Error::TooLarge { .. } => PyMemoryError::new_err(msg),
        core::Error::DuplicateSequence(_)
        | core::Error::SwappedOut(_)
        | core::Error::NotSwappedOut(_)
        | core::Error::InvalidArgument(_) => PyValueError::new_err(msg),
    }
}

/// The integer types ids convert to.
pub(crate) trait Id: Copy {
    const MAX: u64;
    /// The accepted range, as error messages write it.
    const RANGE: &'static str;
    /// `value` is known to be at most `MAX`.
    fn narrow(value: u64) -> Self;
}

impl Id for u32 {
    const MAX: u64 = u32::MAX as u64;
    const RANGE: &'static str = "[0, 2**32)";
    fn narrow(value: u64) -> Self {
        value as u32
    }
}

impl Id for u64 {
    const MAX: u64 = u64::MAX;
    const RANGE: &'static str = "[0, 2**64)";
    fn narrow(value: u64) -> Self {
        value
    }
}

/// `operator.index`, looked up once.
static OPERATOR_INDEX: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A ValueError saying `message`, caused by `err`, the exception a conversion raised. A
/// BaseException that is not an Exception (KeyboardInterrupt, SystemExit) propagates unchanged.
pub(crate) fn invalid_because(py: Python<'_>, err: PyErr, message: String) -> PyErr {
    if !err.is_instance_of::<PyException>(py) {
        return err;
    }
    let wrapped = PyValueError::new_err(message);
    wrapped.set_cause(py, Some(err));
    wrapped
}

/// The name of `obj`'s type, for error messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |name| name.to_string())
}

/// One integer in `[0, T::MAX]`: a Python int or any object with `__index__`. Errors name
/// `what` and the bad value.
pub(crate) fn integer<T: Id>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    let py = obj.py();
    let int = match obj.downcast::<PyInt>() {
        Ok(int) => int.clone(),
        Err(_) => OPERATOR_INDEX
            .import(py, "operator", "index")?
            .call1((obj,))
            .and_then(|value| Ok(value.downcast_into::<PyInt>()?))
            .map_err(|err| {
                let message = format!("{what} must be an int, got {}", type_name(obj));
                invalid_because(py, err, message)
            })?,
    };
    match int.extract::<u64>() {
        Ok(value) if value <= T::MAX => Ok(T::narrow(value)),
        _ => Err(PyValueError::new_err(format!(
            "{what} must be in {}, got {int}",
            T::RANGE
        ))),
    }
}

/// Reads a 1-D integer array or sequence into `T`, naming `what` and the bad value in errors.
/// numpy arrays of any integer dtype are read in place, without a Python object per element.
pub(crate) fn integers<T: Id>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>> {
    let out_of_range =
        |v: i128| PyValueError::new_err(format!("{what} must be in {}, got {v}", T::RANGE));
    if let Ok(array) = obj.downcast::<PyUntypedArray>() {
        if array.ndim() != 1 {
            return Err(PyValueError::new_err(format!(
                "{what} must be 1-D, got an array of shape {:?}",
                array.shape()
            )));
        }
        macro_rules! read_as {
            ($($t:ty),*) => {$(
                if array.dtype().is_equiv_to(&numpy::dtype::<$t>(obj.py())) {
                    let typed = array.downcast::<PyArray1<$t>>()?;
                    // A contiguous array (the usual case) is copied out at once, under the GIL
                    // and without numpy's borrow tracking (a lookup and an update of a shared
                    // table, each way), then narrowed in a loop the compiler vectorizes; a
                    // strided view is borrowed and read element by element.
                    return match typed.to_vec() {
                        Ok(values) => narrow_all(&values, |&v: &$t| v as i128),
                        Err(_) => narrow_all(&typed.readonly().as_array(), |&v: &$t| v as i128),
                    }
                    .map_err(out_of_range);
                }
            )*};
        }
        read_as!(i64, i32, u32, u64, i16, u16, i8, u8);
        return Err(PyValueError::new_err(format!(
            "{what} must be an integer array, got dtype {}",
            array.dtype()
        )));
    }
    // Text and raw bytes iterate as characters or byte values, never as token ids.
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyMemoryView>()
    {
        return Err(PyValueError::new_err(format!(
            "{what} must be a sequence of ints, not {}",
            type_name(obj)
        )));
    }
    let not_a_sequence = || {
        PyValueError::new_err(format!(
            "{what} must be a 1-D integer array or a sequence of ints, got {}",
            type_name(obj)
        ))
    };
    let sequence = obj.downcast::<PySequence>().map_err(|_| not_a_sequence())?;
    let mut values = Vec::with_capacity(sequence.len().unwrap_or(0));
    for item in sequence.try_iter()? {
        values.push(integer(&item?, what)?);
    }
    Ok(values)
}

/// Every value of `values` as `T`, or the first one outside `[0, T::MAX]` (widened by `wide`).
/// The range check folds over every value without stopping early, so it vectorizes.
fn narrow_all<'a, S: 'a, T: Id>(
    values: impl IntoIterator<Item = &'a S> + Copy,
    wide: impl Fn(&S) -> i128,
) -> Result<Vec<T>, i128> {
    let outside = |v: &S| !(0..=i128::from(T::MAX)).contains(&wide(v));
    if values.into_iter().fold(false, |any, v| any | outside(v)) {
        if let Some(bad) = values.into_iter().find(|&v| outside(v)) {
            return Err(wide(bad));
        }
    }
    Ok(values
        .into_iter()
        .map(|v| T::narrow(wide(v) as u64))
        .collect())
}

/// Token ids: a 1-D integer array or a sequence of ints.
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    integers(obj, "token ids")
}

/// Sequence ids: a 1-D integer array or a sequence of ints.
pub(crate) fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    integers(obj, "sequence ids")
}

/// One sequence id.
pub(crate) fn seq_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    integer(obj, "a sequence id")
}

/// A count argument of the constructor: the object as given (converted in the body, where the
/// argument's name is known) or its default.
pub(crate) enum Count<'py> {
    Given(Bound<'py, PyAny>),
    Default(u32),
}

impl<'py> FromPyObject<'py> for Count<'py> {
    fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(Count::Given(obj.clone()))
    }
}

impl Count<'_> {
    /// The count, converted as argument `name`.
    pub(crate) fn get(self, name: &str) -> PyResult<u32> {
        match self {
            Count::Given(v) => integer::<u32>(&v, name),
            Count::Default(v) => Ok(v),
        }
    }
}

/// The prefix salt: bytes, str (as UTF-8) or None.
pub(crate) fn salt_bytes(salt: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
    let Some(salt) = salt else { return Ok(None) };
    if let Ok(s) = salt.downcast::<PyString>() {
        return Ok(Some(s.to_str()?.as_bytes().to_vec()));
    }
    if let Ok(b) = salt.downcast::<PyBytes>() {
        return Ok(Some(b.as_bytes().to_vec()));
    }
    Err(PyValueError::new_err("salt must be bytes, str or None"))
}

/// Block ids as an int32 array (a table, or blocks to load).
pub(crate) fn blocks<'py>(py: Python<'py>, blocks: Vec<u32>) -> Bound<'py, PyArray1<i32>> {
    let blocks: Vec<i32> = blocks.into_iter().map(|b| b as i32).collect();
    blocks.into_pyarray(py)
}

/// `[n, 2]` int32 block pairs (a swap's copies).
pub(crate) fn pairs<'py>(py: Python<'py>, pairs: Vec<[u32; 2]>) -> Bound<'py, PyArray2<i32>> {
    let n = pairs.len();
    let flat: Vec<i32> = pairs.into_iter().flatten().map(|b| b as i32).collect();
    Array2::from_shape_vec((n, 2), flat)
        .expect("n * 2 values")
        .into_pyarray(py)
}
