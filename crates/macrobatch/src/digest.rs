//! SHA-256 of files, read in 1 MiB pieces (never whole: hashing a
//! checkpoint or a base model costs no memory beside what is in it).

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Total size and SHA-256 (hex) of `paths`' contents, one after another
/// in the order given: one file's is its own `sha256sum`.
pub fn sha256_files(paths: &[&Path]) -> Result<(u64, String)> {
    let (mut hasher, mut buf, mut len) = (Sha256::new(), vec![0u8; 1 << 20], 0u64);
    for path in paths {
        let read_err = || format!("cannot read {}", path.display());
        let mut f = std::fs::File::open(path).with_context(read_err)?;
        loop {
            let n = match f.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => r.with_context(read_err)?,
            };
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            len += n as u64;
        }
    }
    Ok((len, hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()))
}

/// Size and SHA-256 (hex) of one file.
pub fn sha256_file(path: &Path) -> Result<(u64, String)> {
    sha256_files(&[path])
}
