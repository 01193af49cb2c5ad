//! Optimizer state offloaded to disk: one file per state slot (AdamW's
//! `exp_avg` / `exp_avg_sq`, SGD's `momentum_buffer`), streamed through
//! fixed window buffers during the update (read a window, update, write it back).

use super::CHUNK;
use crate::error::EngineError;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Elements of one slot's window buffer: 1 MiB of f32.
pub const WINDOW_ELEMS: usize = 1 << 18;

/// Where a process's offloaded optimizer state goes.
#[derive(Debug)]
pub struct OffloadedState {
    dir: PathBuf,
    slots: Vec<Slot>,
    /// f32 values per slot (this rank's optimizer state).
    len: usize,
    /// One window buffer per slot, `min(len, WINDOW_ELEMS)` long.
    window: usize,
}

#[derive(Debug)]
struct Slot {
    name: &'static str,
    path: PathBuf,
    file: File,
    buf: Vec<f32>,
}

/// Window buffer elements per slot for `len` state values and a requested
/// window (at least one update piece, [`CHUNK`] elements, so a piece always fits).
pub fn window_len(len: usize, window: usize) -> usize {
    len.min(window.max(CHUNK))
}

fn io_err(path: &Path, op: &'static str, source: std::io::Error) -> EngineError {
    EngineError::Offload { path: path.to_path_buf(), op, source }
}

impl OffloadedState {
    /// Creates `dir` and one file `NAME.f32` per slot holding `init[slot]`
    /// (zeros where `init` has no such slot; `len` values each, written in
    /// full, so a full disk fails here, not mid-run).
    /// `window`: elements per window buffer (see [`window_len`]).
    pub fn create(
        dir: &Path,
        names: &[&'static str],
        len: usize,
        window: usize,
        init: &[&[f32]],
    ) -> Result<Self, EngineError> {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "create the offload folder", e))?;
        let window = window_len(len, window);
        let mut slots = Vec::with_capacity(names.len());
        for (i, &name) in names.iter().enumerate() {
            let path = dir.join(format!("{name}.f32"));
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| io_err(&path, "create", e))?;
            let mut slot = Slot { name, path, file, buf: vec![0.0; window] };
            let values = init.get(i).filter(|v| v.len() == len);
            for start in (0..len).step_by(window.max(1)) {
                let n = window.min(len - start);
                match values {
                    Some(v) => slot.buf[..n].copy_from_slice(&v[start..start + n]),
                    None => slot.buf[..n].fill(0.0),
                }
                slot.write(start, n)?;
            }
            slots.push(slot);
        }
        Ok(Self { dir: dir.to_path_buf(), slots, len, window })
    }

    /// State values per slot.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no state at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0 || self.slots.is_empty()
    }

    /// Elements of one window.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Bytes held in memory (the window buffers).
    pub fn resident_bytes(&self) -> usize {
        4 * self.window * self.slots.len()
    }

    /// Bytes on disk.
    pub fn offloaded_bytes(&self) -> usize {
        4 * self.len * self.slots.len()
    }

    /// Reads state `start..start + n` of every slot into the window buffers.
    pub fn load(&mut self, start: usize, n: usize) -> Result<(), EngineError> {
        self.slots.iter_mut().try_for_each(|s| s.read(start, n))
    }

    /// Writes the window buffers back to state `start..start + n`.
    pub fn store(&mut self, start: usize, n: usize) -> Result<(), EngineError> {
        self.slots.iter_mut().try_for_each(|s| s.write(start, n))
    }

    /// The window buffers, one per slot (valid after [`OffloadedState::load`]).
    pub fn buffers(&mut self) -> Vec<&mut [f32]> {
        self.slots.iter_mut().map(|s| s.buf.as_mut_slice()).collect()
    }

    /// All of slot `name`'s values, read from its file.
    pub fn read_all(&mut self, name: &'static str) -> Result<Vec<f32>, EngineError> {
        let (len, window) = (self.len, self.window);
        let slot = self.slots.iter_mut().find(|s| s.name == name).ok_or(EngineError::MissingState { name })?;
        let mut out = vec![0.0; len];
        for start in (0..len).step_by(window.max(1)) {
            let n = window.min(len - start);
            slot.read(start, n)?;
            out[start..start + n].copy_from_slice(&slot.buf[..n]);
        }
        Ok(out)
    }

    /// Replaces slot `i`'s values (length [`OffloadedState::len`]).
    pub fn write_all(&mut self, i: usize, values: &[f32]) -> Result<(), EngineError> {
        if values.len() != self.len {
            return Err(EngineError::ParamCount { expected: self.len, got: values.len() });
        }
        let window = self.window;
        let Some(slot) = self.slots.get_mut(i) else { return Ok(()) };
        for start in (0..values.len()).step_by(window.max(1)) {
            let n = window.min(values.len() - start);
            slot.buf[..n].copy_from_slice(&values[start..start + n]);
            slot.write(start, n)?;
        }
        Ok(())
    }

    /// The folder holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Slot {
    /// Reads straight into the window buffer (files are little-endian f32).
    fn read(&mut self, start: usize, n: usize) -> Result<(), EngineError> {
        let buf = &mut self.buf[..n];
        self.file.read_exact_at(bytemuck::cast_slice_mut(buf), 4 * start as u64).map_err(|e| {
            let op = if e.kind() == std::io::ErrorKind::UnexpectedEof { "read (file too short)" } else { "read" };
            io_err(&self.path, op, e)
        })?;
        buf.iter_mut().for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
        Ok(())
    }

    fn write(&mut self, start: usize, n: usize) -> Result<(), EngineError> {
        let buf = &mut self.buf[..n];
        buf.iter_mut().for_each(|x| *x = f32::from_bits(x.to_bits().to_le()));
        let r = self.file.write_all_at(bytemuck::cast_slice(buf), 4 * start as u64);
        buf.iter_mut().for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
        r.map_err(|e| io_err(&self.path, "write", e))
    }
}

impl Drop for OffloadedState {
    /// The files are scratch (checkpoints hold the state): removed with the
    /// trainer, and the folder with them when it is left empty.
    fn drop(&mut self) {
        for s in &self.slots {
            let _ = std::fs::remove_file(&s.path);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
