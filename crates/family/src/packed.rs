//! A frozen base read once per process from the file it is packed from.

use crate::{BoxError, FrozenBytes, Result};
use std::path::Path;
use std::sync::Arc;

/// A frozen base kept packed outside a family's layout: the file it is
/// read from, the bytes it takes, and (once the first model is built) the
/// base itself, shared by every model of the process (thread ranks hold
/// one copy).
#[derive(Debug)]
pub struct PackedSource<B> {
    /// Where the base is read from (`None`: a plan of a shape, never built).
    pub source: Option<std::path::PathBuf>,
    /// Its formats and bytes, as planned before it is read.
    pub planned: FrozenBytes,
    loaded: std::sync::Mutex<Option<Arc<B>>>,
}

/// What reads a frozen base from its file: the base and, when asked
/// (`true`), the layout's other tensors.
pub type ReadBase<'a, B> = &'a dyn Fn(&Path, bool) -> std::result::Result<(B, Option<Vec<f32>>), BoxError>;

impl<B> PackedSource<B> {
    /// A base to be read from `source`, planned as `planned`.
    pub fn new(source: Option<std::path::PathBuf>, planned: FrozenBytes) -> Self {
        Self { source, planned, loaded: std::sync::Mutex::new(None) }
    }

    /// The base, read by `read` on first use; also the layout's other
    /// tensors when `want_rest` (they are read again then: a model built
    /// after the run's start does not need them).
    pub fn get(&self, want_rest: bool, read: ReadBase<'_, B>) -> Result<(Arc<B>, Option<Vec<f32>>)> {
        let mut slot = self.loaded.lock().map_err(|_| "the frozen base's loader panicked on another rank")?;
        if let (Some(b), false) = (slot.as_ref(), want_rest) {
            return Ok((b.clone(), None));
        }
        let Some(source) = &self.source else {
            return Err("a packed frozen base is read from a pretrained model: pass --init-from (a GGUF file or a Hugging Face folder) or set train.frozen_source".into());
        };
        let (base, rest) = read(source, want_rest).map_err(|e| format!("{}: {}", source.display(), chain(&*e)))?;
        let base = slot.get_or_insert_with(|| Arc::new(base)).clone();
        Ok((base, rest))
    }

    /// The layout's other tensors read from `source`, which must be the
    /// base's own file ([`crate::Family::load_unfrozen`]).
    pub fn load_unfrozen(&self, source: &Path, read: ReadBase<'_, B>) -> Result<Vec<f32>> {
        if self.source.as_deref() != Some(source) {
            return Err(format!(
                "the frozen base is read from {}, the other tensors from {}: they must be one model",
                self.source.as_deref().unwrap_or(Path::new("nowhere")).display(),
                source.display()
            )
            .into());
        }
        Ok(self.get(true, read)?.1.unwrap_or_default())
    }
}

/// `e` and every cause below it, joined by `: ` (a file error's cause is
/// what is wrong in the file).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}
