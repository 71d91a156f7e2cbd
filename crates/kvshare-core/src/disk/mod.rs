//! Crash-safe on-disk store of KV blocks and recurrent-state checkpoints, written in the
//! background. See `docs/cache_disk.md` for the format and the invariants.
//!
//! Layout: per entry, in one flat cache dir, `<key>.kv` (block payloads, concatenated),
//! `<key>.ckpt` (checkpoint payloads) and `<key>.idx` (the commit record: fingerprint, ordered
//! block keys with the file/offset/length/blake3 of each, checkpoints, sizes, times). `<key>` is
//! the 64-hex content key of the entry ([`format::entry_key`]).
//!
//! Protocol: data files are written as `.tmp`, fsynced, renamed, then the directory is fsynced;
//! the `.idx` is written the same way last, and its rename is the commit. Removal deletes the
//! `.idx` first. Opening sweeps `.tmp` files, data without a committed `.idx`, and indexes that
//! are damaged or whose files are missing, of the wrong size, or reference a missing parent.
//!
//! Sharing: a block (or checkpoint) already stored in any committed entry is never written
//! again; a new entry references it in the entry that holds it (its *parent*). Evicting a
//! parent evicts its dependents with it (they could not be read without it); lookups touch the
//! parents of whatever they use, so a parent is never older than its children and LRU picks
//! children first.
//!
//! Fingerprint: entries of another model fingerprint are never indexed, returned, counted or
//! deleted: a lookup of them is a miss. (`FingerprintMismatch` is what decoding such an index
//! returns internally; the store turns it into "not ours".)
//!
//! Reads verify the blake3 checksum of every region. A mismatch (or a short or missing file)
//! removes the entry and its dependents and returns `CorruptEntry`: never the bytes (a caller
//! buffer is zeroed).

mod format;
mod fsops;
mod state;
mod writer;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

pub use format::{checked_join, entry_key, hex32, parse_hex32, FORMAT_VERSION};
#[doc(hidden)]
pub use fsops::fault;

use crate::error::{CoreError, Result};
use format::Ext;
use state::{Loc, State};
use writer::Planned;

/// A block key or checkpoint key (the chain hash; `hash::BlockKey.0`).
pub type Key = [u8; 32];

/// Milliseconds since the Unix epoch; replaceable for tests.
#[derive(Clone, Default)]
pub struct Clock(Option<Arc<dyn Fn() -> u64 + Send + Sync>>);

impl Clock {
    pub fn system() -> Self {
        Clock(None)
    }
    pub fn from_fn(f: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        Clock(Some(Arc::new(f)))
    }
    pub fn now_ms(&self) -> u64 {
        match &self.0 {
            Some(f) => f(),
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        }
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Clock(custom)"
        } else {
            "Clock(system)"
        })
    }
}

#[derive(Clone, Debug)]
pub struct DiskConfig {
    pub dir: PathBuf,
    /// Model fingerprint; entries carry it and only matching ones are used.
    pub fingerprint: Vec<u8>,
    /// Bytes on disk (all three files of every entry) kept after each eviction.
    pub budget_bytes: u64,
    /// Entries idle longer than this are evicted; `None`: no TTL.
    pub ttl: Option<Duration>,
    /// Entries covering fewer tokens are not written.
    pub min_tokens: u64,
    /// Bounded queue of the background writer; a full queue drops submissions.
    pub queue_depth: usize,
    pub clock: Clock,
}

impl DiskConfig {
    /// Defaults: no byte limit, 3-day TTL, no minimum, queue of 16.
    pub fn new(dir: impl Into<PathBuf>, fingerprint: impl Into<Vec<u8>>) -> Self {
        DiskConfig {
            dir: dir.into(),
            fingerprint: fingerprint.into(),
            budget_bytes: u64::MAX,
            ttl: Some(Duration::from_secs(259_200)),
            min_tokens: 0,
            queue_depth: 16,
            clock: Clock::system(),
        }
    }
}

/// A checkpoint to store: recurrent state at token `position`, keyed by the chain key of
/// `tokens[..position]`. The bytes are shared (`Arc`), not copied, until written.
#[derive(Clone, Debug)]
pub struct NewCheckpoint {
    pub position: u64,
    pub key: Key,
    pub layout: String,
    pub data: Arc<[u8]>,
}

/// An entry to store: consecutive blocks of one prompt (from its first block) and checkpoints.
#[derive(Clone, Debug, Default)]
pub struct NewEntry {
    pub block_keys: Vec<Key>,
    /// Blocks before this index carry no payload: they must already be stored (see
    /// [`DiskStore::stored_prefix`]), so a caller need not gather what the disk already has.
    pub payload_from: usize,
    /// Payloads of `block_keys[payload_from..]`, concatenated.
    pub payload: Vec<u8>,
    /// Length of each payload block (`block_keys.len() - payload_from` values).
    pub block_lens: Vec<u64>,
    /// Tokens this entry covers (compared with the minimum).
    pub tokens: u64,
    pub checkpoints: Vec<NewCheckpoint>,
}

impl NewEntry {
    /// An entry whose blocks all have `block_bytes` bytes, all with payload.
    pub fn uniform(block_keys: Vec<Key>, payload: Vec<u8>, block_bytes: u64, tokens: u64) -> Self {
        let block_lens = vec![block_bytes; block_keys.len()];
        NewEntry {
            block_keys,
            payload_from: 0,
            payload,
            block_lens,
            tokens,
            checkpoints: Vec::new(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(CoreError::InvalidArgument(m));
        if self.payload_from > self.block_keys.len() {
            return bad(format!(
                "payload_from {} > {} blocks",
                self.payload_from,
                self.block_keys.len()
            ));
        }
        if self.block_lens.len() != self.block_keys.len() - self.payload_from {
            return bad(format!(
                "{} block lengths for {} payload blocks",
                self.block_lens.len(),
                self.block_keys.len() - self.payload_from
            ));
        }
        let total: u64 = self.block_lens.iter().sum();
        if total != self.payload.len() as u64 {
            return bad(format!(
                "block lengths add up to {total}, payload has {} bytes",
                self.payload.len()
            ));
        }
        if self.block_keys.is_empty() && self.checkpoints.is_empty() {
            return bad("an entry needs blocks or checkpoints".into());
        }
        if self.checkpoints.iter().any(|c| c.layout.len() > 4096) {
            return bad("checkpoint layout longer than 4096 bytes".into());
        }
        Ok(())
    }
}

/// What a synchronous write did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Committed as entry `key`; `bytes` new bytes on disk (data + index).
    Written { key: Key, bytes: u64 },
    /// Everything in it is already stored.
    AlreadyStored,
    /// Fewer tokens than the store's minimum: not written.
    TooFewTokens,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub position: u64,
    pub key: Key,
    pub layout: String,
    pub len: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub position: u64,
    pub key: Key,
    pub layout: String,
    pub data: Vec<u8>,
}

/// Result of a prefix lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Match {
    /// Leading keys found (a longest prefix: chain keys make any later key imply the earlier).
    pub n_blocks: usize,
    /// Total payload bytes of those blocks.
    pub n_bytes: u64,
    pub block_lens: Vec<u64>,
    /// The deepest stored checkpoint keyed by one of the matched block keys.
    pub checkpoint: Option<CheckpointInfo>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryInfo {
    pub key: Key,
    pub n_blocks: usize,
    pub n_checkpoints: usize,
    pub tokens: u64,
    /// Own bytes on disk (data files + index).
    pub bytes: u64,
    pub created_ms: u64,
    pub last_access_ms: u64,
    /// Entries it extends (references blocks or checkpoints of).
    pub deps: Vec<Key>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskStats {
    pub entries: u64,
    pub bytes_on_disk: u64,
    pub blocks: u64,
    pub checkpoints: u64,
    /// Block lookups that matched at least one block / none.
    pub hits: u64,
    pub misses: u64,
    pub checkpoint_hits: u64,
    pub checkpoint_misses: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Entries committed.
    pub writes: u64,
    /// Submissions dropped because the queue was full.
    pub dropped_writes: u64,
    pub skipped_small: u64,
    pub skipped_existing: u64,
    /// Writes that failed (I/O error, over budget, missing parent): nothing was committed.
    pub failed_writes: u64,
    pub evictions_ttl: u64,
    pub evictions_budget: u64,
    pub evictions_corrupt: u64,
    /// Files removed by the startup sweep.
    pub swept_files: u64,
    pub io_errors: u64,
    /// Submissions waiting for the writer.
    pub queued: u64,
}

struct Inner {
    dir: PathBuf,
    fingerprint: Vec<u8>,
    state: Mutex<State>,
    /// Serialises writers (background thread and `write_now`), so plans never race.
    write_lock: Mutex<()>,
    pending: Mutex<u64>,
    drained: Condvar,
    lock_file: Mutex<Option<File>>,
}

/// The disk store. `Send + Sync`: every method takes `&self`.
pub struct DiskStore {
    inner: Arc<Inner>,
    tx: Mutex<Option<SyncSender<NewEntry>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl DiskStore {
    /// Opens (creating) the cache dir, takes its lock file, sweeps it, indexes it, applies the
    /// TTL and budget, and starts the writer thread.
    pub fn open(cfg: DiskConfig) -> Result<DiskStore> {
        std::fs::create_dir_all(&cfg.dir)?;
        let dir = std::fs::canonicalize(&cfg.dir)?;
        let lock = fsops::lock_dir(&dir)?;
        let mut st = State::open(&dir, &cfg)?;
        let now = st.now();
        st.evict(now);
        let inner = Arc::new(Inner {
            dir,
            fingerprint: cfg.fingerprint.clone(),
            state: Mutex::new(st),
            write_lock: Mutex::new(()),
            pending: Mutex::new(0),
            drained: Condvar::new(),
            lock_file: Mutex::new(Some(lock)),
        });
        let (tx, rx) = sync_channel(cfg.queue_depth.max(1));
        let w = Arc::clone(&inner);
        let worker = std::thread::Builder::new()
            .name("kvshare-disk-writer".into())
            .spawn(move || writer_loop(w, rx))?;
        Ok(DiskStore {
            inner,
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
        })
    }

    /// The canonical cache dir.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Queues an entry for the background writer and returns at once: `Ok(true)` queued,
    /// `Ok(false)` dropped (queue full, counted in `dropped_writes`, or store closed).
    /// A malformed entry is `InvalidArgument`.
    pub fn submit(&self, e: NewEntry) -> Result<bool> {
        e.validate()?;
        let tx = self.tx.lock();
        let Some(tx) = tx.as_ref() else {
            return Ok(false);
        };
        *self.inner.pending.lock() += 1;
        match tx.try_send(e) {
            Ok(()) => Ok(true),
            Err(err) => {
                self.inner.done_one();
                if matches!(err, TrySendError::Full(_)) {
                    self.inner.state.lock().stats.dropped_writes += 1;
                }
                Ok(false)
            }
        }
    }

    /// Writes an entry now, on the caller's thread (tests, tools).
    pub fn write_now(&self, e: &NewEntry) -> Result<WriteOutcome> {
        e.validate()?;
        self.inner.write(e)
    }

    /// Waits until every queued submission has been written (or has failed).
    pub fn flush(&self) {
        let mut p = self.inner.pending.lock();
        while *p > 0 {
            self.inner.drained.wait(&mut p);
        }
    }

    /// Finishes queued writes, stops the writer and releases the cache dir. Later calls fail
    /// with `InvalidArgument` (submit returns `Ok(false)`). Idempotent; `drop` calls it.
    pub fn close(&self) {
        drop(self.tx.lock().take());
        if let Some(w) = self.worker.lock().take() {
            let _ = w.join();
        }
        self.inner.state.lock().closed = true;
        drop(self.inner.lock_file.lock().take());
    }

    /// Runs eviction (TTL, then LRU against the budget); returns the entries removed.
    pub fn evict(&self) -> Result<usize> {
        let mut st = self.inner.state.lock();
        st.check_open()?;
        let now = st.now();
        Ok(st.evict(now))
    }

    /// Longest prefix of `keys` stored, across all entries. Evicts first; counts a hit or
    /// miss; touches the entries used (and those they extend).
    pub fn lookup(&self, keys: &[Key]) -> Result<Match> {
        let mut st = self.inner.state.lock();
        st.check_open()?;
        Ok(st.lookup(keys))
    }

    /// Number of leading `keys` stored, without evicting, touching or counting.
    pub fn stored_prefix(&self, keys: &[Key]) -> Result<usize> {
        let st = self.inner.state.lock();
        st.check_open()?;
        Ok(st.prefix_locs(keys).len())
    }

    /// Deepest checkpoint among `candidates` (position, key) at or before `max_position`.
    /// Evicts first; counts a checkpoint hit or miss.
    pub fn lookup_checkpoint(
        &self,
        candidates: &[(u64, Key)],
        max_position: u64,
    ) -> Result<Option<CheckpointInfo>> {
        let mut st = self.inner.state.lock();
        st.check_open()?;
        Ok(st.lookup_checkpoint(candidates, max_position))
    }

    /// Reads the payloads of the longest stored prefix of `keys` into `out`, back to back, as
    /// many whole blocks as fit; returns the number of blocks read (fewer than a previous
    /// `lookup` said if they were evicted since). Every block is checksum-verified; on a
    /// mismatch the entry is removed, `out` is zeroed and `CorruptEntry` returned.
    pub fn read_blocks(&self, keys: &[Key], out: &mut [u8]) -> Result<usize> {
        let (locs, files) = {
            let mut st = self.inner.state.lock();
            st.check_open()?;
            let mut locs = st.prefix_locs(keys);
            let mut total = 0u64;
            let fit = locs
                .iter()
                .take_while(|l| {
                    total += l.len;
                    total <= out.len() as u64
                })
                .count();
            locs.truncate(fit);
            let files = st.open_files(&locs, Ext::Kv)?;
            (locs, files)
        };
        let total: u64 = locs.iter().map(|l| l.len).sum();
        match read_verify(&locs, &files, out) {
            Ok(()) => {
                self.inner.state.lock().stats.bytes_read += total;
                Ok(locs.len())
            }
            Err(failure) => {
                let (bad, err) = *failure;
                out[..total as usize].fill(0);
                if let Some(l) = bad {
                    self.inner.state.lock().blame(&l);
                }
                Err(err)
            }
        }
    }

    /// Like [`read_blocks`](Self::read_blocks), into a new buffer (the whole stored prefix).
    pub fn read_blocks_vec(&self, keys: &[Key]) -> Result<Vec<u8>> {
        let total: u64 = {
            let st = self.inner.state.lock();
            st.check_open()?;
            st.prefix_locs(keys).iter().map(|l| l.len).sum()
        };
        let mut out = vec![0u8; total as usize];
        let n = self.read_blocks(keys, &mut out)?;
        let got: u64 = {
            let st = self.inner.state.lock();
            st.prefix_locs(&keys[..n]).iter().map(|l| l.len).sum()
        };
        out.truncate(got.min(total) as usize);
        Ok(out)
    }

    /// Reads and verifies one checkpoint; `None` if not stored.
    pub fn read_checkpoint(&self, key: &Key) -> Result<Option<Checkpoint>> {
        let (ck, files) = {
            let mut st = self.inner.state.lock();
            st.check_open()?;
            let Some(ck) = st.ckpts.get(key).cloned() else {
                return Ok(None);
            };
            let files = st.open_files(std::slice::from_ref(&ck.loc), Ext::Ckpt)?;
            (ck, files)
        };
        let mut data = vec![0u8; ck.loc.len as usize];
        match read_verify(std::slice::from_ref(&ck.loc), &files, &mut data) {
            Ok(()) => {
                self.inner.state.lock().stats.bytes_read += ck.loc.len;
                Ok(Some(Checkpoint {
                    position: ck.position,
                    key: *key,
                    layout: ck.layout,
                    data,
                }))
            }
            Err(failure) => {
                let (bad, err) = *failure;
                if let Some(l) = bad {
                    self.inner.state.lock().blame(&l);
                }
                Err(err)
            }
        }
    }

    pub fn stats(&self) -> DiskStats {
        let mut s = self.inner.state.lock().stats();
        s.queued = *self.inner.pending.lock();
        s
    }

    /// Committed entries, oldest first.
    pub fn entries(&self) -> Vec<EntryInfo> {
        self.inner.state.lock().entry_infos()
    }

    /// Ordered block keys of a committed entry.
    pub fn entry_block_keys(&self, key: &Key) -> Option<Vec<Key>> {
        self.inner
            .state
            .lock()
            .entries
            .get(key)
            .map(|r| r.block_keys.clone())
    }

    /// Checkpoint keys of a committed entry.
    pub fn entry_checkpoint_keys(&self, key: &Key) -> Option<Vec<Key>> {
        self.inner
            .state
            .lock()
            .entries
            .get(key)
            .map(|r| r.ckpt_keys.clone())
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        self.close();
    }
}

fn writer_loop(inner: Arc<Inner>, rx: Receiver<NewEntry>) {
    while let Ok(e) = rx.recv() {
        // A bug must not wedge `flush` (pending would never drain): count it as a failure.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.write(&e)));
        if r.is_err() {
            inner.state.lock().stats.failed_writes += 1;
        }
        inner.done_one();
    }
}

impl Inner {
    fn done_one(&self) {
        let mut p = self.pending.lock();
        *p -= 1;
        if *p == 0 {
            self.drained.notify_all();
        }
    }

    fn write(&self, e: &NewEntry) -> Result<WriteOutcome> {
        let r = self.write_inner(e);
        let mut st = self.state.lock();
        match &r {
            Ok(WriteOutcome::TooFewTokens) => st.stats.skipped_small += 1,
            Ok(WriteOutcome::AlreadyStored) => st.stats.skipped_existing += 1,
            Ok(WriteOutcome::Written { .. }) => {}
            Err(_) => st.stats.failed_writes += 1,
        }
        r
    }

    fn write_inner(&self, e: &NewEntry) -> Result<WriteOutcome> {
        let _w = self.write_lock.lock();
        // A parent evicted between plan and commit makes the commit refuse; plan again.
        for _attempt in 0..3 {
            let plan = {
                let st = self.state.lock();
                st.check_open()?;
                let now = st.now();
                match writer::plan(&st, e, now)? {
                    Planned::Skip(o) => return Ok(o),
                    Planned::Write(p) => p,
                }
            };
            let key = plan.key;
            let prep = match writer::write_files(&self.dir, plan, e, &self.fingerprint) {
                Ok(p) => p,
                Err(err) => {
                    writer::cleanup(&self.dir, &key);
                    return Err(err);
                }
            };
            let committed = {
                let mut st = self.state.lock();
                let now = st.now();
                writer::commit(&mut st, &prep, now)
            };
            match committed {
                Ok(true) => {
                    let bytes = prep.plan.kv_len + prep.plan.ckpt_len + prep.idx_len;
                    let synced = fsops::fsync_dir(&self.dir);
                    let mut st = self.state.lock();
                    let now = st.now();
                    st.evict(now);
                    synced?;
                    return Ok(WriteOutcome::Written { key, bytes });
                }
                Ok(false) => writer::cleanup(&self.dir, &key),
                Err(err) => {
                    writer::cleanup(&self.dir, &key);
                    return Err(err);
                }
            }
        }
        Err(CoreError::InvalidArgument(
            "entry's parents kept being evicted while writing it".into(),
        ))
    }
}

/// A failed read: the region to blame (a damaged entry), if any, and the error.
type ReadFailure = Box<(Option<Loc>, CoreError)>;

/// Reads `locs` (coalescing adjacent regions of one file into one read) into `out` back to back
/// and verifies each region's checksum. On failure, returns the region to blame (a damaged
/// entry) if any, and the error.
fn read_verify(
    locs: &[Loc],
    files: &HashMap<Key, File>,
    out: &mut [u8],
) -> std::result::Result<(), ReadFailure> {
    let mut pos = 0usize;
    let mut i = 0;
    while i < locs.len() {
        let first = &locs[i];
        let mut j = i + 1;
        let mut len = first.len;
        while j < locs.len() && locs[j].file == first.file && locs[j].offset == first.offset + len {
            len += locs[j].len;
            j += 1;
        }
        let buf = &mut out[pos..pos + len as usize];
        if let Err(e) = fsops::read_at(&files[&first.file], buf, first.offset) {
            // Truncated or unreadable: either way the entry is blamed (removed) and the
            // caller recomputes; a read error must not be met again on every lookup.
            let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "is truncated".to_string()
            } else {
                format!("is unreadable ({e})")
            };
            return Err(Box::new((
                Some(first.clone()),
                CoreError::CorruptEntry(format!("{} {why}", hex32(&first.file))),
            )));
        }
        let mut p = pos;
        for l in &locs[i..j] {
            if blake3::hash(&out[p..p + l.len as usize]).as_bytes() != &l.hash {
                return Err(Box::new((
                    Some(l.clone()),
                    CoreError::CorruptEntry(format!("checksum mismatch in {}", hex32(&l.file))),
                )));
            }
            p += l.len as usize;
        }
        pos += len as usize;
        i = j;
    }
    Ok(())
}
