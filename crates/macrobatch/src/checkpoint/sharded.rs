//! Sharded checkpoints (`train.checkpoint_sharded`): every rank writes its
//! own share of the parameters and of every optimizer slot — in parallel,
//! nothing gathered — as pieces of whole tensors into `rank-RRRRR.bin`,
//! with `rank-RRRRR.json` listing them. Rank 0 then merges the lists into
//! the manifest (each piece's tensor, strided place, file, offset and
//! SHA-256) and publishes the folder by the same atomic rename as a whole
//! checkpoint. A resume at any (data, tensor, pipeline, ZeRO) layout reads
//! only the pieces holding what the rank keeps, one piece in memory at a
//! time, checking each against its checksum.
//!
//! Invariant: the pieces of a buffer tile every element of every tensor it
//! covers exactly once (one writer per value: [`engine::PieceMap`]).

use anyhow::{bail, Context, Result};
use engine::{ParamLayout, Run};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The buffer name of the parameters (optimizer slots go by their own).
pub const PARAMS: &str = "params";

/// A rank's data file.
pub fn data_file(rank: usize) -> String {
    format!("rank-{rank:05}.bin")
}

fn list_file(rank: usize) -> String {
    format!("rank-{rank:05}.json")
}

/// Elements of one whole tensor — `count` rows of `len`, `stride` apart
/// from `start` — stored back to back as f32 (little-endian) at `offset`
/// of `file`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Piece {
    /// `params` or the optimizer slot.
    pub buffer: String,
    /// The whole tensor's name.
    pub tensor: String,
    /// First element (row-major, flattened).
    pub start: usize,
    /// Elements per row.
    pub len: usize,
    /// Elements between row starts.
    pub stride: usize,
    /// Rows.
    pub count: usize,
    /// The data file.
    pub file: String,
    /// Byte offset in it.
    pub offset: u64,
    /// SHA-256 (hex) of its bytes.
    pub sha256: String,
}

impl Piece {
    fn numel(&self) -> usize {
        self.len * self.count
    }
}

/// What the manifest of a sharded checkpoint says besides its files'
/// checksums.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Index {
    /// The whole model's tensors: name and shape, in layout order.
    pub tensors: Vec<(String, Vec<usize>)>,
    /// The optimizer's slots, in storage order.
    pub slots: Vec<String>,
    /// Ranks that wrote it.
    pub ranks: usize,
    /// Every data file and its length in bytes (its pieces carry the checksums).
    pub data_files: BTreeMap<String, u64>,
    /// Every piece.
    pub pieces: Vec<Piece>,
}

/// One rank's pieces as it writes them.
pub struct RankWriter {
    file: std::io::BufWriter<File>,
    path: PathBuf,
    dir: PathBuf,
    rank: usize,
    offset: u64,
    pieces: Vec<Piece>,
}

impl RankWriter {
    /// Starts rank `rank`'s data file in the checkpoint folder `dir`.
    pub fn create(dir: &Path, rank: usize) -> Result<Self> {
        let path = dir.join(data_file(rank));
        let file = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self {
            file: std::io::BufWriter::with_capacity(1 << 20, file),
            path,
            dir: dir.to_path_buf(),
            rank,
            offset: 0,
            pieces: Vec::new(),
        })
    }

    /// Whether no piece was written yet.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Appends the values of `run` (of tensor `tensor`) of `buffer`.
    pub fn put(&mut self, buffer: &str, tensor: &str, run: &Run, values: &[f32]) -> Result<()> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        nn::io::write_all_budgeted(&mut self.file, &bytes)
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        self.pieces.push(Piece {
            buffer: buffer.to_string(),
            tensor: tensor.to_string(),
            start: run.start,
            len: run.len,
            stride: run.stride,
            count: run.count,
            file: data_file(self.rank),
            offset: self.offset,
            sha256: hex(&Sha256::digest(&bytes)),
        });
        self.offset += bytes.len() as u64;
        Ok(())
    }

    /// Flushes and syncs the data file, then writes the list of its pieces.
    pub fn finish(self) -> Result<()> {
        let file = self.file.into_inner().map_err(|e| e.into_error()).context("cannot flush a checkpoint piece")?;
        file.sync_all().with_context(|| format!("cannot sync {}", self.path.display()))?;
        let list = self.dir.join(list_file(self.rank));
        nn::io::write_atomic(&list, serde_json::to_string(&self.pieces)?.as_bytes())?;
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Rank 0, once every rank finished: the index of the `ranks` ranks'
/// pieces in `dir` (their lists removed: the manifest holds them).
pub fn merge(dir: &Path, ranks: usize, layout: &ParamLayout, slots: &[&str]) -> Result<Index> {
    let mut pieces = Vec::new();
    let mut data_files = BTreeMap::new();
    for r in 0..ranks {
        let list = dir.join(list_file(r));
        let text = std::fs::read_to_string(&list)
            .with_context(|| format!("rank {r} wrote no list of its pieces ({})", list.display()))?;
        let mine: Vec<Piece> = serde_json::from_str(&text).with_context(|| format!("{} is corrupt", list.display()))?;
        let data = dir.join(data_file(r));
        let bytes = std::fs::metadata(&data).with_context(|| format!("cannot read {}", data.display()))?.len();
        if mine.iter().map(|p| p.numel() as u64 * 4).sum::<u64>() != bytes {
            bail!("{} holds {bytes} bytes, not what its {} pieces list", data.display(), mine.len());
        }
        pieces.extend(mine);
        data_files.insert(data_file(r), bytes);
        std::fs::remove_file(&list).with_context(|| format!("cannot remove {}", list.display()))?;
    }
    let tensors = layout.tensors().iter().map(|t| (t.name.clone(), t.shape.clone())).collect();
    Ok(Index { tensors, slots: slots.iter().map(|s| s.to_string()).collect(), ranks, data_files, pieces })
}

/// Checks the data files' lengths (their contents are checked piece by
/// piece as they are read).
pub fn validate(dir: &Path, index: &Index) -> Result<()> {
    for (name, &want) in &index.data_files {
        let got = std::fs::metadata(dir.join(name)).map(|m| m.len()).with_context(|| format!("{name} is missing"))?;
        if got != want {
            bail!("{name} holds {got} bytes, expected {want}: the file is truncated or corrupt");
        }
    }
    Ok(())
}

/// Reads pieces of a sharded checkpoint.
pub struct Reader {
    dir: PathBuf,
    index: Index,
    /// Piece indices by (buffer, tensor index).
    by: HashMap<(String, usize), Vec<usize>>,
    files: Mutex<HashMap<String, std::sync::Arc<File>>>,
}

impl Reader {
    /// The reader of the checkpoint in `dir` described by `index`.
    pub fn new(dir: &Path, index: Index) -> Result<Self> {
        let names: HashMap<&str, usize> = index.tensors.iter().enumerate().map(|(i, t)| (t.0.as_str(), i)).collect();
        let mut by: HashMap<(String, usize), Vec<usize>> = HashMap::new();
        for (i, p) in index.pieces.iter().enumerate() {
            let Some(&t) = names.get(p.tensor.as_str()) else {
                bail!("{}: a piece of tensor `{}`, which the checkpoint does not list", dir.display(), p.tensor);
            };
            by.entry((p.buffer.clone(), t)).or_default().push(i);
        }
        Ok(Self { dir: dir.to_path_buf(), index, by, files: Mutex::new(HashMap::new()) })
    }

    /// The index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Errors unless the checkpoint's tensors are `layout`'s (names and
    /// shapes, in order).
    pub fn check_layout(&self, layout: &ParamLayout) -> Result<()> {
        let ts = layout.tensors();
        let same = ts.len() == self.index.tensors.len()
            && ts.iter().zip(&self.index.tensors).all(|(t, (n, s))| &t.name == n && &t.shape == s);
        if !same {
            let first = ts
                .iter()
                .zip(&self.index.tensors)
                .find(|(t, (n, s))| &t.name != n || &t.shape != s)
                .map_or(String::new(), |(t, (n, s))| {
                    format!(": `{n}` {s:?} where the model has `{}` {:?}", t.name, t.shape)
                });
            bail!(
                "{} holds {} tensors, the model {}{first}; it was written for another model",
                self.dir.display(),
                self.index.tensors.len(),
                ts.len()
            );
        }
        Ok(())
    }

    /// Reads the elements `wants` name of `buffer` (runs of the whole
    /// tensors, by index in the checkpoint's list): for each piece holding
    /// some of them — read whole, once, and checked — calls `place(want,
    /// row, column, values)` per overlap. Errors unless every wanted
    /// element was found.
    pub fn read(&self, buffer: &str, wants: &[Run], mut place: impl FnMut(&Run, usize, usize, &[f32])) -> Result<()> {
        let mut by_tensor: BTreeMap<usize, Vec<&Run>> = BTreeMap::new();
        for w in wants.iter().filter(|w| w.numel() > 0) {
            by_tensor.entry(w.tensor).or_default().push(w);
        }
        for (t, ws) in by_tensor {
            let want: usize = ws.iter().map(|w| w.numel()).sum();
            let name = self.index.tensors.get(t).map_or("?", |x| x.0.as_str());
            let mut found = 0;
            for &pi in self.by.get(&(buffer.to_string(), t)).map_or(&[][..], |v| &v[..]) {
                let p = &self.index.pieces[pi];
                // (want, row, column, position in the piece, length)
                let mut overlaps = Vec::new();
                for (wi, w) in ws.iter().enumerate() {
                    for k in 0..w.count {
                        let (a, b) = (w.start + k * w.stride, w.start + k * w.stride + w.len);
                        for kp in rows_overlapping(p, a, b) {
                            let ps = p.start + kp * p.stride;
                            let (s, e) = (a.max(ps), b.min(ps + p.len));
                            if s < e {
                                overlaps.push((wi, k, s - a, kp * p.len + (s - ps), e - s));
                            }
                        }
                    }
                }
                if overlaps.is_empty() {
                    continue;
                }
                let data = self.piece_data(p)?;
                for (wi, k, col, at, n) in overlaps {
                    place(ws[wi], k, col, &data[at..at + n]);
                    found += n;
                }
            }
            if found != want {
                bail!(
                    "{}: the pieces of `{name}` ({buffer}) hold {found} of the {want} elements this rank needs; the checkpoint is incomplete",
                    self.dir.display()
                );
            }
        }
        Ok(())
    }

    /// A piece's values, checked against its checksum.
    fn piece_data(&self, p: &Piece) -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; p.numel() * 4];
        // The table is held only to find the file: ranks read at once.
        let f = {
            let mut files = self.files.lock().map_err(|_| anyhow::anyhow!("checkpoint file table poisoned"))?;
            match files.get(&p.file) {
                Some(f) => f.clone(),
                None => {
                    let path = self.dir.join(&p.file);
                    let f = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
                    files.entry(p.file.clone()).or_insert(std::sync::Arc::new(f)).clone()
                }
            }
        };
        f.read_exact_at(&mut bytes, p.offset)
            .with_context(|| format!("cannot read {} bytes at {} of {}", bytes.len(), p.offset, p.file))?;
        let sha = hex(&Sha256::digest(&bytes));
        if sha != p.sha256 {
            bail!(
                "{}: the piece of `{}` ({}) at byte {} of {} does not match its checksum: the file is corrupt",
                self.dir.display(),
                p.tensor,
                p.buffer,
                p.offset,
                p.file
            );
        }
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

/// The rows of `p` that may meet elements `a..b`.
fn rows_overlapping(p: &Piece, a: usize, b: usize) -> std::ops::Range<usize> {
    if p.count == 0 || b <= p.start {
        return 0..0;
    }
    let stride = p.stride.max(1);
    let lo = match a + 1 > p.start + p.len {
        true => (a + 1 - p.start - p.len).div_ceil(stride),
        false => 0,
    };
    let hi = ((b - 1 - p.start) / stride).min(p.count - 1);
    lo..hi + 1
}
