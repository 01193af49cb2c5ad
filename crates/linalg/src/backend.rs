//! The f32 GEMM backends and the choice between them, per shape.
//!
//! Backends for a GEMM that may use the whole rayon pool:
//! - [`Backend::Crate`]: the `gemm` crate with its own threading.
//! - [`Backend::Split`]: the `gemm` crate single-threaded on each of
//!   `threads` blocks of `dst` rows (or columns, when `dst` is wide), run by
//!   rayon. The `gemm` crate blocks `k` by a function of `k` and the cache
//!   sizes only, so this gives bit-identical results to `Crate` (tested).
//! - [`Backend::OpenBlas`] (cargo feature `openblas`): `cblas_sgemm` from the
//!   system's OpenBLAS (Debian `libopenblas-dev`). Its summation order is its
//!   own, so a run's losses depend on whether it was chosen; see below.
//!
//! The choice is made per shape key ([`Key`]: m, n, k, the operand layouts,
//! threads) by timing the first calls of the key on each candidate in turn
//! (the probe: real calls, no extra work), and is
//! cached per machine (CPU model and thread count) in a JSON file under the
//! cache directory ([`cache_path`]). One probe can be fooled — a trial
//! taken while the machine was busy — so a cached choice is provisional
//! until [`FINAL_AGREEMENTS`] processes agree on it: the next process
//! probes the key again, keeps the cached backend when it is within
//! [`MARGIN`] of the fastest candidate (one more agreement), and replaces
//! it otherwise (agreement 1: checked again). A final choice is used
//! without probing, so later runs on the machine make the same choices.
//! (Only OpenBLAS sums in another order: with the `openblas` feature a
//! run's bits may depend on a provisional choice.) `MACROBATCH_GEMM=crate|split|openblas` forces one
//! backend for every shape (`auto`, the default, probes). Calls from inside a
//! parallel loop (one thread each) always use `Crate` single-threaded.

use crate::{Call, SendCall, Strided};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// A way to run an f32 GEMM on the rayon pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The `gemm` crate, its own threading.
    Crate,
    /// The `gemm` crate single-threaded per block of `dst`, blocks on rayon.
    Split,
    /// OpenBLAS `cblas_sgemm` (feature `openblas`).
    #[serde(rename = "openblas")]
    OpenBlas,
    /// The bf16-operand kernel ([`crate::bf16`]); never probed against the
    /// f32 backends, reported by [`stats`].
    Bf16,
}

impl Backend {
    /// The name used in the cache file, `MACROBATCH_GEMM` and reports.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Crate => "crate",
            Backend::Split => "split",
            Backend::OpenBlas => "openblas",
            Backend::Bf16 => "bf16",
        }
    }

    /// The f32 backends this build has.
    pub fn f32_candidates() -> Vec<Backend> {
        let mut v = vec![Backend::Crate, Backend::Split];
        if cfg!(feature = "openblas") {
            v.push(Backend::OpenBlas);
        }
        v
    }

    fn parse(s: &str) -> Option<Backend> {
        Backend::f32_candidates().into_iter().find(|b| b.name() == s)
    }
}

/// What a backend choice depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Rows of `dst`.
    pub m: usize,
    /// Columns of `dst`.
    pub n: usize,
    /// The summed dimension.
    pub k: usize,
    /// `lhs` is column-major (a transposed row-major matrix).
    pub lhs_t: bool,
    /// `rhs` is column-major.
    pub rhs_t: bool,
    /// Threads in the pool.
    pub threads: usize,
    /// bf16 operands (the bf16 kernel's calls: recorded, never probed).
    pub bf16: bool,
}

impl Key {
    pub(crate) fn new(c: &Call<'_>, bf16: bool) -> Key {
        let (m, n, k) = (c.m, c.n, c.k);
        Key { m, n, k, lhs_t: c.lhs.cs != 1, rhs_t: c.rhs.cs != 1, threads: rayon::current_num_threads(), bf16 }
    }

    /// The key whose probe decides this one's backend: `m`, `n` and `k`
    /// rounded up to a quarter octave ([`bucket_dim`]). Micro-batches of
    /// varying length (one chat each) make a new exact key for nearly every
    /// length; the rates of two backends change slowly with the sizes, so
    /// one probe per bucket serves them all: about four keys per doubling
    /// of a side instead of one per length.
    pub fn bucket(&self) -> Key {
        Key { m: bucket_dim(self.m), n: bucket_dim(self.n), k: bucket_dim(self.k), ..*self }
    }

    /// `m×k×n` plus `ᵀ` marks for transposed operands, e.g. `4096×768ᵀ×2304`.
    pub fn label(&self) -> String {
        let t = |b: bool| if b { "ᵀ" } else { "" };
        format!("{}{}×{}{}×{}", self.m, t(self.lhs_t), self.k, t(self.rhs_t), self.n)
    }

    fn cache_name(&self) -> String {
        format!(
            "{}x{}x{}{}{}",
            self.m,
            self.k,
            self.n,
            if self.lhs_t { "t" } else { "n" },
            if self.rhs_t { "t" } else { "n" }
        )
    }

    /// Floating-point operations of one call.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// `x` rounded up to a multiple of a quarter of its power of two (up to 16:
/// `x` itself): 17 → 20, 65 → 80, 1000 → 1024, 1025 → 1280.
pub fn bucket_dim(x: usize) -> usize {
    if x <= 16 {
        return x;
    }
    let step = 1usize << (usize::BITS - 1 - x.leading_zeros() - 2);
    x.div_ceil(step) * step
}

/// What is known of one shape key: the backend used, the probe's rates and
/// what the calls of this process measured.
#[derive(Debug, Clone, Default)]
pub struct ShapeStats {
    /// The backend calls of this key use (`None` before the first call).
    pub backend: Option<Backend>,
    /// GFLOP/s of each candidate in the probe (empty when the choice came
    /// from the cache or was forced).
    pub probe: Vec<(Backend, f64)>,
    /// Processes (this one included, when it probed) that agreed on the
    /// backend; the choice is final at [`FINAL_AGREEMENTS`]. 0: forced.
    pub agreed: u32,
    /// The backend a provisional cache entry named when this process
    /// re-checked it (`None`: nothing cached, or final).
    pub rechecked: Option<Backend>,
    /// The backend came from a probe this process made on another key of
    /// the same bucket ([`Key::bucket`]).
    pub shared: bool,
    /// Calls made.
    pub calls: u64,
    /// Seconds spent in them.
    pub seconds: f64,
}

impl ShapeStats {
    /// Achieved GFLOP/s over this process's calls of `key`.
    pub fn gflops(&self, key: &Key) -> f64 {
        if self.seconds > 0.0 {
            key.flops() * self.calls as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

/// The probe of one bucket ([`Key::bucket`]): trial calls of any of its
/// exact keys count, rated in GFLOP/s so that sizes can differ.
#[derive(Debug, Clone, Default)]
struct Probe {
    /// (candidate, trial calls, best GFLOP/s).
    trials: Vec<(Backend, u32, f64)>,
    /// The provisional cache entry being re-checked.
    rechecked: Option<Cached>,
    /// The choice, once made (or read final from the cache).
    decided: Option<Cached>,
    /// The choice was made by this process's trials.
    probed_here: bool,
}

#[derive(Default)]
struct Registry {
    shapes: BTreeMap<Key, ShapeStats>,
    /// Probes by bucket.
    probes: BTreeMap<Key, Probe>,
    /// The cache file of each thread count, once read (keys of
    /// [`Key::cache_name`] leave the threads out: the file name has them).
    cache: BTreeMap<usize, BTreeMap<String, Cached>>,
}

/// Processes that must agree on a shape's backend before the choice is
/// final and no longer probed.
pub const FINAL_AGREEMENTS: u32 = 2;

/// How much slower than the fastest candidate a provisional choice may be
/// in a re-check and still count as agreeing (timing noise between two
/// backends that are in fact equal is a few %).
pub const MARGIN: f64 = 0.10;

/// A cache entry: the backend and how many processes agreed on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cached {
    /// The backend chosen.
    pub backend: Backend,
    /// Processes that agreed.
    pub agreed: u32,
}

/// An entry as stored: `{"backend": "split", "agreed": 2}`, or a bare name
/// (files of earlier versions: one probe, so provisional).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum Stored {
    Full { backend: String, agreed: u32 },
    Name(String),
}

impl Stored {
    fn parse(self) -> Option<Cached> {
        match self {
            Stored::Full { backend, agreed } => Some(Cached { backend: Backend::parse(&backend)?, agreed }),
            Stored::Name(name) => Some(Cached { backend: Backend::parse(&name)?, agreed: 1 }),
        }
    }
}

/// The entry a finished probe leaves: `trials` holds each candidate's best
/// seconds. Without a cached entry the fastest wins (agreement 1). A cached
/// backend within [`MARGIN`] of the fastest is kept, one more agreement;
/// else the fastest replaces it (agreement 1).
pub fn decide(cached: Option<Cached>, trials: &[(Backend, f64)]) -> Cached {
    let fastest = trials.iter().min_by(|x, y| x.1.total_cmp(&y.1)).copied().unwrap_or((Backend::Crate, 0.0));
    let fresh = Cached { backend: fastest.0, agreed: 1 };
    let Some(c) = cached else { return fresh };
    match trials.iter().find(|t| t.0 == c.backend) {
        Some(&(_, secs)) if secs <= fastest.1 * (1.0 + MARGIN) => Cached { backend: c.backend, agreed: c.agreed + 1 },
        _ => fresh,
    }
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, Registry> {
    // A panic while holding the lock leaves only statistics half-written.
    registry().lock().unwrap_or_else(|e| e.into_inner())
}

/// `MACROBATCH_GEMM` read: `Ok(None)` when unset, empty or `auto`.
fn forced_from_env() -> Result<Option<Backend>, String> {
    let Ok(v) = std::env::var("MACROBATCH_GEMM") else { return Ok(None) };
    if v.is_empty() || v == "auto" {
        return Ok(None);
    }
    Backend::parse(&v).map(Some).ok_or_else(|| {
        let names: Vec<_> = Backend::f32_candidates().iter().map(|b| b.name()).collect();
        format!(
            "MACROBATCH_GEMM={v} is not a GEMM backend of this build; set it to one of {}|auto (or unset it)",
            names.join("|")
        )
    })
}

/// Checks `MACROBATCH_GEMM` up front, so a program can refuse a misspelt
/// backend before any work instead of running with another one.
pub fn check_env() -> Result<(), String> {
    forced_from_env().map(|_| ())
}

/// The forced backend from `MACROBATCH_GEMM`, if any (read once). An unknown
/// name is reported once on stderr and ignored (the binary refuses it first
/// through [`check_env`]).
fn forced() -> Option<Backend> {
    static F: OnceLock<Option<Backend>> = OnceLock::new();
    *F.get_or_init(|| {
        forced_from_env().unwrap_or_else(|e| {
            eprintln!("warning: {e}; probing instead");
            None
        })
    })
}

/// The CPU model name, the vector ISA in force ([`crate::vector_isa`]: a
/// VM or emulator may hide AVX-512 from the same model name) and the thread
/// count, as the cache file's identity (`/proc/cpuinfo` is read once per
/// process).
fn machine_id(threads: usize) -> String {
    static SLUG: OnceLock<String> = OnceLock::new();
    let slug = SLUG.get_or_init(|| {
        let model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|s| s.trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let slug: String =
            model.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
        slug.trim_matches('-').to_string()
    });
    format!("{slug}-{}-t{threads}", crate::vector_isa().to_ascii_lowercase())
}

/// The probe cache of this machine: `$MACROBATCH_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/macrobatch`, else `$HOME/.cache/macrobatch`, then
/// `gemm-<cpu model>-<vector isa>-t<threads>.json`. `None` when no directory is known.
pub fn cache_path() -> Option<PathBuf> {
    cache_path_for(rayon::current_num_threads())
}

/// [`cache_path`] for a pool of `threads` threads.
fn cache_path_for(threads: usize) -> Option<PathBuf> {
    // An empty variable counts as unset (else a relative path: the cwd).
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let dir = var("MACROBATCH_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("macrobatch")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/macrobatch")))?;
    Some(dir.join(format!("gemm-{}.json", machine_id(threads))))
}

fn load_cache(reg: &mut Registry, threads: usize) {
    if reg.cache.contains_key(&threads) {
        return;
    }
    reg.cache.insert(threads, BTreeMap::new());
    let Some(path) = cache_path_for(threads) else { return };
    let Ok(text) = std::fs::read_to_string(&path) else { return };
    match serde_json::from_str::<BTreeMap<String, Stored>>(&text) {
        Ok(map) => {
            // Entries naming a backend this build lacks are probed again.
            reg.cache.insert(threads, map.into_iter().filter_map(|(k, v)| Some((k, v.parse()?))).collect());
        }
        Err(e) => eprintln!("warning: ignoring unreadable GEMM probe cache {}: {e}", path.display()),
    }
}

/// Writes the cache atomically (temporary file + rename); failures only warn:
/// the next run probes again. Entries another process saved since this one
/// read the file are kept (this process's choices win where both have one).
fn save_cache(reg: &Registry, threads: usize) {
    let Some(path) = cache_path_for(threads) else { return };
    let mut map: BTreeMap<String, Stored> =
        std::fs::read_to_string(&path).ok().and_then(|text| serde_json::from_str(&text).ok()).unwrap_or_default();
    map.extend(
        reg.cache
            .get(&threads)
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), Stored::Full { backend: v.backend.name().to_string(), agreed: v.agreed })),
    );
    let result = (|| -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_string_pretty(&map).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, &path)
    })();
    if let Err(e) = result {
        eprintln!("warning: could not save the GEMM probe cache {}: {e}", path.display());
    }
}

/// Times `backend` on `key`'s shape and layouts with fresh operands: the
/// best of `reps` calls after one warm-up, in GFLOP/s. For reports
/// (`macrobatch bench`); allocates the three matrices. `None` for a shape
/// whose matrices do not fit in memory (their sizes overflow `usize`).
pub fn measure(key: &Key, backend: Backend, reps: usize) -> Option<f64> {
    let (m, n, k) = (key.m, key.n, key.k);
    // Checked: `run` trusts these sizes.
    let (mk, kn, mn) = (m.checked_mul(k)?, k.checked_mul(n)?, m.checked_mul(n)?);
    mk.checked_add(kn)?.checked_add(mn)?.checked_mul(4)?;
    let a: Vec<f32> = (0..mk).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
    let b: Vec<f32> = (0..kn).map(|i| ((i * 104729) % 1000) as f32 * 1e-3 - 0.5).collect();
    let mut c = vec![0.0f32; mn];
    let lhs = if key.lhs_t { Strided::transposed(&a, m) } else { Strided::rows(&a, k) };
    let rhs = if key.rhs_t { Strided::transposed(&b, k) } else { Strided::rows(&b, n) };
    let mut best = f64::INFINITY;
    for i in 0..=reps.max(1) {
        let t = Instant::now();
        // SAFETY: the views and `c` are exactly the shapes the call reads and writes.
        unsafe {
            run(backend, &Call { m, n, k, dst: c.as_mut_ptr(), dst_rs: n, accumulate: false, lhs, rhs, alpha: 1.0 })
        };
        if i > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Some(key.flops() / best / 1e9)
}

/// A snapshot of every pool-wide GEMM shape this process ran.
pub fn stats() -> Vec<(Key, ShapeStats)> {
    lock().shapes.iter().map(|(k, s)| (*k, s.clone())).collect()
}

/// Forgets the call counts (not the choices), e.g. after warm-up.
pub fn reset_counts() {
    for s in lock().shapes.values_mut() {
        s.calls = 0;
        s.seconds = 0.0;
    }
}

/// Records one call of `key` taking `seconds` on `backend` (the bf16
/// kernel's calls too, which have no trials). A trial call (`on_trial`)
/// also counts towards the probe: when every candidate has had [`TRIALS`]
/// calls, the fastest is kept and the cache saved.
pub(crate) fn record(key: Key, backend: Backend, seconds: f64, on_trial: bool) {
    let mut guard = lock();
    let reg = &mut *guard;
    let s = reg.shapes.entry(key).or_default();
    if backend == Backend::Bf16 {
        s.backend = Some(backend);
    }
    s.calls += 1;
    s.seconds += seconds;
    if !on_trial {
        return;
    }
    let bucket = key.bucket();
    let Some(p) = reg.probes.get_mut(&bucket).filter(|p| p.decided.is_none()) else { return };
    let rate = key.flops() / seconds.max(1e-12) / 1e9;
    if let Some(t) = p.trials.iter_mut().find(|t| t.0 == backend) {
        t.1 += 1;
        t.2 = t.2.max(rate);
    }
    if p.trials.iter().all(|t| t.1 >= TRIALS) {
        // `decide` compares times: seconds per GFLOP.
        let times: Vec<(Backend, f64)> = p.trials.iter().map(|t| (t.0, 1.0 / t.2)).collect();
        let chosen = decide(p.rechecked, &times);
        (p.decided, p.probed_here) = (Some(chosen), true);
        s.backend = Some(chosen.backend);
        s.agreed = chosen.agreed;
        s.rechecked = p.rechecked.map(|c| c.backend);
        s.probe = p.trials.iter().map(|t| (t.0, t.2)).collect();
        reg.cache.entry(key.threads).or_default().insert(bucket.cache_name(), chosen);
        save_cache(reg, key.threads);
    }
}

/// Timed calls each candidate gets before a shape's backend is chosen.
const TRIALS: u32 = 3;

/// A pool-wide f32 GEMM: runs the backend of its key and records the time.
/// While a key is on trial its calls go round the candidates (which give
/// the same bits, except OpenBLAS), and after [`TRIALS`] calls each the
/// fastest (best time) is kept and cached: the probe costs no extra work
/// and no scratch memory.
///
/// # Safety
/// As [`crate::gemm_raw`]; the views have been bounds-checked.
pub(crate) unsafe fn pool_f32(call: &Call<'_>) {
    let key = Key::new(call, false);
    let (backend, on_trial) = choose(key);
    let t = Instant::now();
    run(backend, call);
    record(key, backend, t.elapsed().as_secs_f64(), on_trial);
}

/// The backend for the next call of `key`, and whether the call is a trial:
/// the key's own once known, else its bucket's choice (made, or cached as
/// final), else the bucket's next trial candidate.
fn choose(key: Key) -> (Backend, bool) {
    if let Some(b) = forced() {
        return (b, false);
    }
    let mut guard = lock();
    let reg = &mut *guard;
    if let Some(b) = reg.shapes.get(&key).and_then(|s| s.backend) {
        return (b, false);
    }
    let bucket = key.bucket();
    load_cache(reg, key.threads);
    let p = reg.probes.entry(bucket).or_default();
    if p.decided.is_none() && p.trials.is_empty() {
        match reg.cache.get(&key.threads).and_then(|c| c.get(&bucket.cache_name())).copied() {
            Some(c) if c.agreed >= FINAL_AGREEMENTS => p.decided = Some(c),
            // Provisional: probed again, and `record` decides against it.
            cached => p.rechecked = cached,
        }
        p.trials = Backend::f32_candidates().into_iter().map(|b| (b, 0, 0.0)).collect();
    }
    let s = reg.shapes.entry(key).or_default();
    if let Some(c) = p.decided {
        (s.backend, s.agreed, s.shared) = (Some(c.backend), c.agreed, p.probed_here);
        return (c.backend, false);
    }
    (s.rechecked, s.agreed) = (p.rechecked.map(|c| c.backend), p.rechecked.map_or(0, |c| c.agreed));
    // The candidate with the fewest trials so far (first in order on ties).
    let next = p.trials.iter().min_by_key(|t| t.1).map_or(Backend::Crate, |t| t.0);
    (next, true)
}

/// Runs `backend` on the pool (`Bf16` without AVX512-BF16 runs `Crate`).
///
/// # Safety
/// `call.dst` must be valid for writes of the `m × n` block with row stride
/// `dst_rs` (`m == 1` or `dst_rs ≥ n`), no other thread may touch that block
/// meanwhile, and `call.lhs` / `call.rhs` must hold the `m × k` and `k × n`
/// views (this function does not check them: [`crate::gemm_raw`] does).
pub unsafe fn run(backend: Backend, call: &Call<'_>) {
    let threads = rayon::current_num_threads();
    match backend {
        Backend::Bf16 if crate::bf16::supported() => crate::bf16::gemm(call, true),
        Backend::Crate | Backend::Bf16 => crate::crate_gemm(call, gemm::Parallelism::Rayon(threads)),
        Backend::Split => split(call, threads),
        Backend::OpenBlas => openblas::sgemm(call, threads),
    }
}

/// Smallest block of rows or columns given a task of its own. Above 64 so
/// that no block falls into the `gemm` crate's small-matrix path (m ≤ 64
/// and n ≤ 64), which blocks `k` differently (by 512 instead of by its
/// cache-derived `kc`): every block then sums in the unsplit call's order.
const MIN_SPLIT: usize = 128;

/// `dst`, each a single-threaded `gemm` call.
unsafe fn split(call: &Call<'_>, threads: usize) {
    let by_rows = call.m >= call.n;
    let (len, other) = if by_rows { (call.m, call.n) } else { (call.n, call.m) };
    // Its vector paths (a side of 1, k ≤ 2) are left whole as well.
    let tasks = if other <= 1 || call.k <= 2 { 1 } else { threads.min(len / MIN_SPLIT).max(1) };
    if tasks == 1 {
        crate::crate_gemm(call, gemm::Parallelism::None);
        return;
    }
    // Blocks of whole 16-element multiples, so every block starts aligned to
    // the microkernel's tiles as the unsplit call's would; the 16-element
    // units are shared out evenly and the last block takes the rest, so that
    // every block has at least len / tasks ≥ MIN_SPLIT (rounded down to 16)
    // rows or columns (rounding the block size up instead could leave a last
    // block of a single row, or of ≤ 64, on the crate's other paths).
    let units = len / 16;
    let (per, extra) = (units / tasks, units % tasks);
    let mut start = 0;
    let parts: Vec<SendCall<'_>> = (0..tasks)
        .map(|t| {
            let size = if t + 1 == tasks { len - start } else { (per + usize::from(t < extra)) * 16 };
            let part = SendCall(if by_rows { call.rows(start, size) } else { call.cols(start, size) });
            start += size;
            part
        })
        .collect();
    rayon::scope(|s| {
        for part in parts {
            // SAFETY: each part is a disjoint block of rows (or columns) of
            // `dst`, belonging to this task alone; its sub-views of `lhs` and
            // `rhs` lie inside the checked views.
            s.spawn(move |_| unsafe { crate::crate_gemm(&{ part }.0, gemm::Parallelism::None) });
        }
    });
}

#[cfg(feature = "openblas")]
mod openblas {
    use crate::{Call, Strided};

    #[link(name = "openblas")]
    extern "C" {
        fn cblas_sgemm(
            order: i32,
            trans_a: i32,
            trans_b: i32,
            m: i32,
            n: i32,
            k: i32,
            alpha: f32,
            a: *const f32,
            lda: i32,
            b: *const f32,
            ldb: i32,
            beta: f32,
            c: *mut f32,
            ldc: i32,
        );
        fn openblas_set_num_threads(n: i32);
    }
    const ROW_MAJOR: i32 = 101;
    const NO_TRANS: i32 = 111;
    const TRANS: i32 = 112;

    /// (trans flag, leading dimension) of a view, if BLAS can take it.
    fn layout(v: &Strided<'_>) -> Option<(i32, i32)> {
        let ld = |x: usize| i32::try_from(x.max(1)).ok();
        if v.cs == 1 {
            Some((NO_TRANS, ld(v.rs)?))
        } else if v.rs == 1 {
            Some((TRANS, ld(v.cs)?))
        } else {
            None
        }
    }

    /// `cblas_sgemm` with OpenBLAS's own `threads` threads; views it cannot
    /// express (neither stride 1, or sizes past `i32`) go to the `gemm` crate.
    pub(super) unsafe fn sgemm(c: &Call<'_>, threads: usize) {
        let dims = (i32::try_from(c.m), i32::try_from(c.n), i32::try_from(c.k), i32::try_from(c.dst_rs.max(1)));
        match (layout(&c.lhs), layout(&c.rhs), dims) {
            (Some((ta, lda)), Some((tb, ldb)), (Ok(m), Ok(n), Ok(k), Ok(ldc))) => {
                openblas_set_num_threads(threads as i32);
                let beta = if c.accumulate { 1.0 } else { 0.0 };
                cblas_sgemm(ROW_MAJOR, ta, tb, m, n, k, c.alpha, c.lhs.ptr(), lda, c.rhs.ptr(), ldb, beta, c.dst, ldc);
            }
            _ => crate::crate_gemm(c, gemm::Parallelism::Rayon(threads)),
        }
    }
}

#[cfg(not(feature = "openblas"))]
mod openblas {
    /// Not built: never a candidate (see [`super::Backend::f32_candidates`]);
    /// runs the `gemm` crate if named anyway.
    pub(super) unsafe fn sgemm(c: &crate::Call<'_>, threads: usize) {
        crate::crate_gemm(c, gemm::Parallelism::Rayon(threads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A provisional choice within the margin of the fastest is kept (one
    /// more agreement); one clearly slower (a probe fooled by a busy
    /// machine) is replaced and must be confirmed again.
    #[test]
    fn a_provisional_choice_is_kept_within_the_margin_and_replaced_beyond_it() {
        let (crate_, split) = (Backend::Crate, Backend::Split);
        let fresh = decide(None, &[(crate_, 2.0), (split, 1.0)]);
        assert_eq!(fresh, Cached { backend: split, agreed: 1 });
        // Cached `crate`, 5% slower than `split` in this re-check: agreed.
        let kept = decide(Some(Cached { backend: crate_, agreed: 1 }), &[(crate_, 1.05), (split, 1.0)]);
        assert_eq!(kept, Cached { backend: crate_, agreed: 2 });
        assert!(kept.agreed >= FINAL_AGREEMENTS);
        // Cached `crate`, 50% slower: replaced, provisional again.
        let replaced = decide(Some(Cached { backend: crate_, agreed: 1 }), &[(crate_, 1.5), (split, 1.0)]);
        assert_eq!(replaced, Cached { backend: split, agreed: 1 });
        // A cached backend this probe did not run (another build's) is replaced.
        let gone = decide(Some(Cached { backend: Backend::OpenBlas, agreed: 1 }), &[(crate_, 1.0), (split, 1.2)]);
        assert_eq!(gone, Cached { backend: crate_, agreed: 1 });
    }

    #[test]
    fn stored_entries_of_both_forms_parse() {
        let map: BTreeMap<String, Stored> =
            serde_json::from_str(r#"{"a": "split", "b": {"backend": "crate", "agreed": 3}, "c": "nonesuch"}"#)
                .unwrap_or_default();
        let parsed: BTreeMap<String, Option<Cached>> = map.into_iter().map(|(k, v)| (k, v.parse())).collect();
        assert_eq!(parsed["a"], Some(Cached { backend: Backend::Split, agreed: 1 }), "a bare name is one probe");
        assert_eq!(parsed["b"], Some(Cached { backend: Backend::Crate, agreed: 3 }));
        assert_eq!(parsed["c"], None);
    }
}
