//! Real models run through attnkit, for issue #19: a BERT sentence encoder
//! (all-MiniLM-L6-v2, [`bert`]) and a Llama-architecture decoder with a KV cache ([`llama`]).
//!
//! Demonstrations and tests, not library API: the model code is kept small and plain so that
//! the attention call is the obvious line of each layer. The tests compare against
//! transformers' outputs stored in `tests/data` (written by `scripts/minilm_reference.py` and
//! `scripts/llama_reference.py`); no Python is needed to run them.

pub mod bert;
pub mod cache;
pub mod llama;
pub mod ops;

pub use ops::{Error, Profile, Result};

use std::path::Path;

/// `dir/config.json` as JSON.
pub(crate) fn read_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| Error::Io(path.display().to_string(), e))?;
    serde_json::from_str(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
}
