//! Hashing keys from Python: a salt, a LoRA adapter name and `(start, end, key)` extra keys.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PySequence, PyString};

use pagedkv as core;

use crate::conversions::{integer, salt_bytes};

/// The keys one call hashes besides the tokens, owned until the core borrows them.
pub(crate) struct Keys {
    salt: Option<Vec<u8>>,
    lora_name: Option<String>,
    extra_keys: Vec<core::ExtraKey>,
}

impl Keys {
    /// Converts the `salt`, `lora_name` and `extra_keys` arguments.
    pub(crate) fn new(
        salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Keys> {
        let lora_name = match lora_name {
            None => None,
            Some(name) => Some(
                name.downcast::<PyString>()
                    .map_err(|_| PyValueError::new_err("lora_name must be a str or None"))?
                    .to_str()?
                    .to_owned(),
            ),
        };
        Ok(Keys {
            salt: salt_bytes(salt)?,
            lora_name,
            extra_keys: extra_keys_of(extra_keys)?,
        })
    }

    /// The core's view.
    pub(crate) fn get(&self) -> core::HashKeys<'_> {
        core::HashKeys {
            salt: self.salt.as_deref(),
            lora_name: self.lora_name.as_deref(),
            extra_keys: &self.extra_keys,
        }
    }
}

/// `extra_keys`: a sequence of `(start, end, key)` with token positions and a str key.
pub(crate) fn extra_keys_of(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<core::ExtraKey>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    let bad = || PyValueError::new_err("extra_keys must be a sequence of (start, end, key: str)");
    let spans = obj.downcast::<PySequence>().map_err(|_| bad())?;
    let mut out = Vec::with_capacity(spans.len()?);
    for span in spans.try_iter()? {
        let span = span?;
        let fields = span.downcast::<PySequence>().map_err(|_| bad())?;
        if fields.len()? != 3 || span.is_instance_of::<PyString>() {
            return Err(bad());
        }
        let key = fields.get_item(2)?;
        let key = key.downcast::<PyString>().map_err(|_| bad())?;
        out.push(core::ExtraKey {
            start: integer::<u64>(&fields.get_item(0)?, "an extra key's start")? as usize,
            end: integer::<u64>(&fields.get_item(1)?, "an extra key's end")? as usize,
            key: key.to_str()?.to_owned(),
        });
    }
    Ok(out)
}
