//! Binding of kvshare-constrain: `ConstraintVocab`, `Grammar`, `Matcher`, `fill_masks` and
//! `GrammarError`. Vocabulary building, compiling and mask computation run with the GIL
//! released; masks are written in place into NumPy uint32 arrays.

use crate::convert::{invalid, typed_array};
use kvshare_constrain::{
    fill_masks_parallel, fill_masks_with, mask_scores, masked_argmax, ConstrainError, Grammar,
    Matcher, Vocab,
};
use parking_lot::Mutex;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use std::sync::Arc;

create_exception!(
    _core,
    GrammarError,
    PyValueError,
    "A grammar that does not compile, or a token it does not allow."
);

fn to_py(err: ConstrainError) -> PyErr {
    match err {
        ConstrainError::Vocab(_) | ConstrainError::MaskSize { .. } => invalid(err.to_string()),
        _ => GrammarError::new_err(err.to_string()),
    }
}

/// One model's token strings for constrained decoding (built once per model).
#[pyclass(frozen, name = "ConstraintVocab", module = "kvshare._core")]
pub struct PyConstraintVocab {
    inner: Vocab,
}

#[pymethods]
impl PyConstraintVocab {
    /// `tokens[i]`: token i's bytes; `special[i]`: a control token (named `<|...|>` in Lark,
    /// never spelled by text); `eos`: the end token id, or a list of them (the first is the
    /// main one); `vocab_size`: the logits row length (>= len(tokens)).
    #[new]
    fn new(
        py: Python<'_>,
        tokens: &Bound<'_, PyList>,
        special: Vec<bool>,
        eos: &Bound<'_, PyAny>,
        vocab_size: usize,
    ) -> PyResult<Self> {
        let mut words = Vec::with_capacity(tokens.len());
        for t in tokens.iter() {
            let b = t
                .cast::<PyBytes>()
                .map_err(|_| invalid("tokens must be a list of bytes"))?;
            words.push(b.as_bytes().to_vec());
        }
        let eos: Vec<u32> = match eos.extract::<u32>() {
            Ok(e) => vec![e],
            Err(_) => eos
                .extract()
                .map_err(|_| invalid("eos must be a token id or a list of token ids"))?,
        };
        let inner = py
            .detach(|| Vocab::new(words, special, &eos, vocab_size))
            .map_err(to_py)?;
        Ok(PyConstraintVocab { inner })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// uint32 words of one mask: ceil(vocab_size / 32).
    #[getter]
    fn mask_words(&self) -> usize {
        self.inner.mask_words()
    }

    #[getter]
    fn eos(&self) -> Vec<u32> {
        self.inner.eos().to_vec()
    }
}

/// A compiled constraint; `matcher()` gives each sequence its own state.
#[pyclass(frozen, name = "Grammar", module = "kvshare._core")]
pub struct PyGrammar {
    inner: Arc<Grammar>,
    kind: String,
}

#[pymethods]
impl PyGrammar {
    /// Compile `source` of `kind` ("json_schema", "json_object", "lark", "regex").
    #[new]
    fn new(py: Python<'_>, vocab: &PyConstraintVocab, kind: &str, source: &str) -> PyResult<Self> {
        let k = kind.parse().map_err(to_py)?;
        let g = py
            .detach(|| Grammar::compile(&vocab.inner, k, source))
            .map_err(to_py)?;
        Ok(PyGrammar {
            inner: Arc::new(g),
            kind: kind.to_string(),
        })
    }

    fn matcher(&self, py: Python<'_>) -> PyMatcher {
        let m = py.detach(|| self.inner.matcher());
        PyMatcher {
            words: m.vocab().mask_words(),
            inner: Mutex::new(m),
        }
    }

    #[getter]
    fn kind(&self) -> &str {
        &self.kind
    }

    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.inner.warnings().to_vec()
    }
}

/// One sequence's position in a grammar.
#[pyclass(frozen, name = "Matcher", module = "kvshare._core")]
pub struct PyMatcher {
    // Locked only with the GIL released or for short calls, and each guard is dropped before
    // the GIL is taken back, so a thread waiting here while holding the GIL cannot deadlock.
    inner: Mutex<Matcher>,
    words: usize,
}

#[pymethods]
impl PyMatcher {
    /// Write the allowed-token bitmask into `out` (writable 1-D uint32, `mask_words` long),
    /// GIL released. Raises GrammarError if the matcher fails (`out` then allows only EOS).
    fn fill_mask(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let oa = typed_array(out, b'u', 4, true, "out")?;
        if oa.shape != [self.words] {
            return Err(invalid(format!("out must have shape ({},)", self.words)));
        }
        // SAFETY: dtype checked by typed_array; `out` stays referenced for this call and no
        // other slice of it is alive.
        let row = unsafe { oa.as_mut_slice::<u32>() };
        py.detach(|| self.inner.lock().fill_mask(row))
            .map_err(to_py)
    }

    /// Advance by `token`; GrammarError (matcher unchanged) if the grammar does not allow it.
    fn consume(&self, token: i64) -> PyResult<()> {
        let t = u32::try_from(token)
            .map_err(|_| GrammarError::new_err(format!("token id {token} out of range")))?;
        self.inner.lock().consume(t).map_err(to_py)
    }

    /// The output so far is complete: EOS is allowed.
    #[getter]
    fn accepting(&self) -> bool {
        self.inner.lock().is_accepting()
    }

    /// Nothing can extend the output: only EOS may follow.
    #[getter]
    fn stopped(&self) -> bool {
        self.inner.lock().is_stopped()
    }

    /// Why the matcher failed (its mask is then EOS only), or None.
    #[getter]
    fn error(&self) -> Option<String> {
        self.inner.lock().error()
    }

    #[getter]
    fn mask_words(&self) -> usize {
        self.words
    }
}

/// Fill row i of `out` (writable 2-D uint32 `[len(matchers), mask_words]`) with matcher i's
/// mask, on up to `threads` threads (default: one per core), GIL released. Returns one entry
/// per matcher: None, or the error message of a failed matcher (its row then allows only EOS).
/// `kernel_pool`: run on the CPU kernels' thread pool instead of new threads (for a call made
/// between forward steps, when that pool's workers are idle; `threads` is then ignored).
#[pyfunction]
#[pyo3(signature = (matchers, out, threads = None, kernel_pool = false))]
fn fill_masks(
    py: Python<'_>,
    matchers: Vec<Bound<'_, PyMatcher>>,
    out: &Bound<'_, PyAny>,
    threads: Option<usize>,
    kernel_pool: bool,
) -> PyResult<Vec<Option<String>>> {
    let oa = typed_array(out, b'u', 4, true, "out")?;
    let refs: Vec<&PyMatcher> = matchers.iter().map(|m| m.get()).collect();
    let words = refs.first().map_or(0, |m| m.words);
    if refs.iter().any(|m| m.words != words) {
        return Err(invalid("matchers of different vocabularies"));
    }
    if oa.shape != [refs.len(), words] && !(refs.is_empty() && oa.shape.len() == 2) {
        return Err(invalid(format!(
            "out must have shape ({}, {words})",
            refs.len()
        )));
    }
    // lock in address order, so that concurrent calls over overlapping lists cannot deadlock
    let mut order: Vec<usize> = (0..refs.len()).collect();
    order.sort_by_key(|&i| refs[i] as *const PyMatcher as usize);
    if order
        .windows(2)
        .any(|w| std::ptr::eq(refs[w[0]], refs[w[1]]))
    {
        return Err(invalid("a matcher is listed twice"));
    }
    let threads = threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    // SAFETY: dtype and shape checked above; `out` stays referenced for this call.
    let rows = unsafe { oa.as_mut_slice::<u32>() };
    let results = py.detach(|| {
        let mut guards: Vec<_> = order.iter().map(|&i| (i, refs[i].inner.lock())).collect();
        guards.sort_by_key(|(i, _)| *i);
        let mut ms: Vec<&mut Matcher> = guards.iter_mut().map(|(_, g)| &mut **g).collect();
        if kernel_pool {
            let parts = kvshare_kernels::pool::max_parts();
            fill_masks_with(&mut ms, rows, parts, &|parts, work| {
                kvshare_kernels::pool::run(parts, &|_| work())
            })
        } else {
            fill_masks_parallel(&mut ms, rows, threads)
        }
    });
    Ok(results
        .into_iter()
        .map(|r| r.err().map(|e| e.to_string()))
        .collect())
}

/// The index of the highest score in `row` (float32) among the tokens `mask` (uint32 words)
/// allows, or None when it allows none of them: greedy constrained decoding in one pass.
#[pyfunction(name = "masked_argmax")]
fn py_masked_argmax(row: &Bound<'_, PyAny>, mask: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    let ra = typed_array(row, b'f', 4, false, "row")?;
    let ma = typed_array(mask, b'u', 4, false, "mask")?;
    if ra.shape.len() != 1 || ma.shape.len() != 1 {
        return Err(invalid("row and mask must be 1-D"));
    }
    // SAFETY: dtypes and contiguity checked; both arrays stay referenced for this call.
    let (r, m) = unsafe { (ra.as_slice::<f32>(), ma.as_slice::<u32>()) };
    Ok(masked_argmax(r, m))
}

/// Set every score of `row` (writable float32) that `mask` does not allow to -inf, in place;
/// returns how many tokens are allowed.
#[pyfunction]
fn mask_logits(row: &Bound<'_, PyAny>, mask: &Bound<'_, PyAny>) -> PyResult<usize> {
    let ra = typed_array(row, b'f', 4, true, "row")?;
    let ma = typed_array(mask, b'u', 4, false, "mask")?;
    if ra.shape.len() != 1 || ma.shape.len() != 1 {
        return Err(invalid("row and mask must be 1-D"));
    }
    // SAFETY: as above, and `row` was checked writable (a distinct array from `mask`: the
    // dtypes differ).
    let (r, m) = unsafe { (ra.as_mut_slice::<f32>(), ma.as_slice::<u32>()) };
    Ok(mask_scores(r, m))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GrammarError", m.py().get_type::<GrammarError>())?;
    m.add_class::<PyConstraintVocab>()?;
    m.add_class::<PyGrammar>()?;
    m.add_class::<PyMatcher>()?;
    m.add_function(wrap_pyfunction!(fill_masks, m)?)?;
    m.add_function(wrap_pyfunction!(py_masked_argmax, m)?)?;
    m.add_function(wrap_pyfunction!(mask_logits, m)?)
}
