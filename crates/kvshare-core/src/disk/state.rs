//! The in-memory side of the disk store: the committed entries, the block and checkpoint
//! indexes built from them, eviction, lookup, and the startup sweep that rebuilds it all from
//! the directory. Everything here runs under the store's state lock.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use super::format::{self, classify, decode_idx, entry_path, Ext, FileName, IdxFile, IdxRegion};
use super::fsops;
use super::{CheckpointInfo, Clock, DiskConfig, DiskStats, EntryInfo, Key, Match};
use crate::error::{CoreError, Result};

/// Where one payload region is: in entry `file`'s `.kv` or `.ckpt`, committed as generation
/// `gen` (a re-written entry of the same key gets a new generation, so a stale location read
/// outside the lock is never blamed on the new one).
#[derive(Clone, Debug)]
pub(crate) struct Loc {
    pub file: Key,
    pub gen: u64,
    pub offset: u64,
    pub len: u64,
    pub hash: Key,
}

#[derive(Clone, Debug)]
pub(crate) struct CkLoc {
    pub loc: Loc,
    pub position: u64,
    pub layout: String,
}

#[derive(Debug)]
pub(crate) struct Rec {
    pub gen: u64,
    pub tokens: u64,
    pub created_ms: u64,
    pub last_access_ms: u64,
    /// Last access time written to the `.idx` mtime.
    pub persisted_ms: u64,
    pub kv_len: u64,
    pub ckpt_len: u64,
    pub idx_len: u64,
    pub deps: Vec<Key>,
    pub dependents: HashSet<Key>,
    pub block_keys: Vec<Key>,
    pub ckpt_keys: Vec<Key>,
    pub own_blocks: Vec<Key>,
    pub own_ckpts: Vec<Key>,
}

impl Rec {
    pub fn bytes(&self) -> u64 {
        self.kv_len + self.ckpt_len + self.idx_len
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    Ttl,
    Budget,
    Corrupt,
}

pub(crate) struct State {
    pub dir: PathBuf,
    pub fingerprint: Vec<u8>,
    pub budget: u64,
    pub ttl_ms: Option<u64>,
    pub min_tokens: u64,
    pub clock: Clock,
    pub closed: bool,
    pub entries: HashMap<Key, Rec>,
    pub blocks: HashMap<Key, Loc>,
    pub ckpts: HashMap<Key, CkLoc>,
    pub bytes: u64,
    pub next_gen: u64,
    pub stats: DiskStats,
}

fn ms_of(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl State {
    pub fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    pub fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(CoreError::InvalidArgument(
                "the disk store is closed".into(),
            ));
        }
        Ok(())
    }

    pub fn path(&self, key: &Key, ext: Ext) -> Result<PathBuf> {
        entry_path(&self.dir, key, ext, false)
    }

    /// Opens the (canonical) cache dir: removes `.tmp` files, damaged or incomplete entries
    /// (idx first), and data files without a committed `.idx`; indexes what is left. Entries
    /// of another model fingerprint are left on disk untouched and never indexed.
    pub fn open(dir: &Path, cfg: &DiskConfig) -> Result<State> {
        let mut st = State {
            dir: dir.to_path_buf(),
            fingerprint: cfg.fingerprint.clone(),
            budget: cfg.budget_bytes,
            ttl_ms: cfg.ttl.map(|d: Duration| d.as_millis() as u64),
            min_tokens: cfg.min_tokens,
            clock: cfg.clock.clone(),
            closed: false,
            entries: HashMap::new(),
            blocks: HashMap::new(),
            ckpts: HashMap::new(),
            bytes: 0,
            next_gen: 1,
            stats: DiskStats::default(),
        };
        let mut idx_keys = Vec::new();
        let mut data_files: Vec<(Key, Ext)> = Vec::new();
        let mut swept = 0u64;
        for de in std::fs::read_dir(dir)? {
            let de = de?;
            let Some(name) = de.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let class = classify(&name);
            if class == FileName::Other {
                continue;
            }
            let path = format::checked_join(dir, &name)?;
            let ft = de.file_type()?;
            if class == FileName::Tmp || !ft.is_file() {
                // In-progress writes of a dead process, or a link/dir wearing one of our names.
                if ft.is_dir() {
                    continue;
                }
                fsops::remove(&path)?;
                swept += 1;
                continue;
            }
            if let FileName::Final(key, ext) = class {
                match ext {
                    Ext::Idx => idx_keys.push(key),
                    _ => data_files.push((key, ext)),
                }
            }
        }

        // Decode every index; check own file sizes and region bounds.
        let mut cands: HashMap<Key, (IdxFile, u64, u64)> = HashMap::new(); // idx, idx_len, mtime
        let mut foreign: HashSet<Key> = HashSet::new();
        let mut bad: Vec<Key> = Vec::new();
        for key in idx_keys {
            let path = st.path(&key, Ext::Idx)?;
            let read = (|| -> std::io::Result<(Vec<u8>, u64)> {
                let f = fsops::open_read(&path)?;
                let md = f.metadata()?;
                let mut buf = vec![0u8; md.len() as usize];
                fsops::read_at(&f, &mut buf, 0)?;
                Ok((buf, md.modified().map(ms_of).unwrap_or(0)))
            })();
            let (bytes, mtime) = match read {
                Ok(x) => x,
                Err(_) => {
                    bad.push(key);
                    continue;
                }
            };
            match decode_idx(&bytes, &st.fingerprint) {
                Ok(idx) if idx.key.0 == key && st.own_files_ok(&idx) => {
                    cands.insert(key, (idx, bytes.len() as u64, mtime));
                }
                Err(CoreError::FingerprintMismatch(_)) => {
                    foreign.insert(key);
                }
                _ => bad.push(key),
            }
        }
        // References into other entries must match those entries' own regions exactly; drop
        // entries whose parents are gone or changed, until nothing changes.
        let own = own_regions(&cands);
        loop {
            let mut drop_now = Vec::new();
            for (key, (idx, _, _)) in &cands {
                if !refs_ok(key, idx, &cands, &own) {
                    drop_now.push(*key);
                }
            }
            if drop_now.is_empty() {
                break;
            }
            for k in drop_now {
                cands.remove(&k);
                bad.push(k);
            }
        }
        // Remove damaged indexes first (they are the commit markers), then orphaned data.
        for k in &bad {
            fsops::remove(&st.path(k, Ext::Idx)?)?;
            swept += 1;
        }
        if !bad.is_empty() {
            fsops::fsync_dir(dir)?;
        }
        let mut removed_data = false;
        for (k, ext) in data_files {
            let keep = foreign.contains(&k)
                || cands.get(&k).is_some_and(|(idx, _, _)| match ext {
                    Ext::Kv => idx.kv_len > 0,
                    Ext::Ckpt => idx.ckpt_len > 0,
                    Ext::Idx => true,
                });
            if !keep {
                fsops::remove(&st.path(&k, ext)?)?;
                swept += 1;
                removed_data = true;
            }
        }
        if removed_data {
            fsops::fsync_dir(dir)?;
        }
        st.stats.swept_files = swept;

        // Index what survived.
        for (key, (idx, idx_len, mtime)) in cands {
            st.insert_committed(key, &idx, idx_len, mtime);
        }
        Ok(st)
    }

    /// An index's own `.kv`/`.ckpt` exist with exactly the recorded sizes and hold its regions.
    fn own_files_ok(&self, idx: &IdxFile) -> bool {
        let key = idx.key.0;
        for (ext, len) in [(Ext::Kv, idx.kv_len), (Ext::Ckpt, idx.ckpt_len)] {
            if len == 0 {
                continue;
            }
            let Ok(path) = self.path(&key, ext) else {
                return false;
            };
            match std::fs::symlink_metadata(&path) {
                Ok(md) if md.is_file() && md.len() == len => {}
                _ => return false,
            }
        }
        let in_bounds = |r: &IdxRegion, len: u64| {
            r.file.0 != key || r.offset.checked_add(r.len).is_some_and(|e| e <= len)
        };
        idx.blocks.iter().all(|r| in_bounds(r, idx.kv_len))
            && idx
                .checkpoints
                .iter()
                .all(|c| in_bounds(&c.region, idx.ckpt_len))
    }

    /// Adds a committed entry (from the sweep or a fresh commit) to the indexes.
    pub fn insert_committed(
        &mut self,
        key: Key,
        idx: &IdxFile,
        idx_len: u64,
        mtime_ms: u64,
    ) -> u64 {
        let gen = self.next_gen;
        self.next_gen += 1;
        let mut rec = Rec {
            gen,
            tokens: idx.tokens,
            created_ms: idx.created_ms,
            last_access_ms: idx.last_access_ms.max(mtime_ms),
            persisted_ms: idx.last_access_ms.max(mtime_ms),
            kv_len: idx.kv_len,
            ckpt_len: idx.ckpt_len,
            idx_len,
            deps: idx.deps.iter().map(|k| k.0).collect(),
            dependents: HashSet::new(),
            block_keys: idx.blocks.iter().map(|r| r.key.0).collect(),
            ckpt_keys: idx.checkpoints.iter().map(|c| c.region.key.0).collect(),
            own_blocks: Vec::new(),
            own_ckpts: Vec::new(),
        };
        for r in &idx.blocks {
            if r.file.0 == key {
                rec.own_blocks.push(r.key.0);
                self.blocks.entry(r.key.0).or_insert(Loc {
                    file: key,
                    gen,
                    offset: r.offset,
                    len: r.len,
                    hash: r.hash.0,
                });
            }
        }
        for c in &idx.checkpoints {
            let r = &c.region;
            if r.file.0 == key {
                rec.own_ckpts.push(r.key.0);
                self.ckpts.entry(r.key.0).or_insert(CkLoc {
                    loc: Loc {
                        file: key,
                        gen,
                        offset: r.offset,
                        len: r.len,
                        hash: r.hash.0,
                    },
                    position: c.position,
                    layout: c.layout.clone(),
                });
            }
        }
        // Dependents links: ours onto our parents (which are present: checked by the caller),
        // and, during the sweep, children inserted before us onto us.
        for d in &rec.deps {
            if let Some(p) = self.entries.get_mut(d) {
                p.dependents.insert(key);
            }
        }
        for (ck, c) in &self.entries {
            if c.deps.contains(&key) {
                rec.dependents.insert(*ck);
            }
        }
        self.bytes += rec.bytes();
        self.entries.insert(key, rec);
        gen
    }

    /// Takes `root` and every entry that (transitively) references it out of the indexes and
    /// appends them to `doomed` (parents before children). Files are deleted by `delete_files`.
    pub fn detach_closure(&mut self, root: Key, reason: Reason, doomed: &mut Vec<Key>) {
        let mut queue = VecDeque::from([root]);
        while let Some(k) = queue.pop_front() {
            let Some(rec) = self.entries.remove(&k) else {
                continue;
            };
            for b in &rec.own_blocks {
                if self.blocks.get(b).is_some_and(|l| l.file == k) {
                    self.blocks.remove(b);
                }
            }
            for c in &rec.own_ckpts {
                if self.ckpts.get(c).is_some_and(|l| l.loc.file == k) {
                    self.ckpts.remove(c);
                }
            }
            for d in &rec.deps {
                if let Some(p) = self.entries.get_mut(d) {
                    p.dependents.remove(&k);
                }
            }
            self.bytes -= rec.bytes();
            match reason {
                Reason::Ttl => self.stats.evictions_ttl += 1,
                Reason::Budget => self.stats.evictions_budget += 1,
                Reason::Corrupt => self.stats.evictions_corrupt += 1,
            }
            queue.extend(rec.dependents.iter().copied());
            doomed.push(k);
        }
    }

    /// Deletes detached entries' files: every `.idx` first (children first), a directory
    /// fsync, then the data files. A crash in between leaves data without an index, which the
    /// next sweep removes.
    pub fn delete_files(&mut self, doomed: &[Key]) {
        if doomed.is_empty() {
            return;
        }
        let mut errors = 0u64;
        for k in doomed.iter().rev() {
            if self
                .path(k, Ext::Idx)
                .and_then(|p| Ok(fsops::remove(&p)?))
                .is_err()
            {
                errors += 1;
            }
        }
        if fsops::fsync_dir(&self.dir).is_err() {
            errors += 1;
        }
        for k in doomed.iter().rev() {
            for ext in [Ext::Kv, Ext::Ckpt] {
                if self
                    .path(k, ext)
                    .and_then(|p| Ok(fsops::remove(&p)?))
                    .is_err()
                {
                    errors += 1;
                }
            }
        }
        self.stats.io_errors += errors;
    }

    pub fn remove_entries(&mut self, roots: &[Key], reason: Reason) -> usize {
        let mut doomed = Vec::new();
        for r in roots {
            self.detach_closure(*r, reason, &mut doomed);
        }
        self.delete_files(&doomed);
        doomed.len()
    }

    /// TTL first (idle longer than the TTL), then LRU by last access against the byte budget
    /// (a leaf before its parent on ties; evicting a parent evicts its dependents).
    pub fn evict(&mut self, now: u64) -> usize {
        let mut doomed = Vec::new();
        if let Some(ttl) = self.ttl_ms {
            let expired: Vec<Key> = self
                .entries
                .iter()
                .filter(|(_, r)| now.saturating_sub(r.last_access_ms) > ttl)
                .map(|(k, _)| *k)
                .collect();
            for k in expired {
                self.detach_closure(k, Reason::Ttl, &mut doomed);
            }
        }
        if self.bytes > self.budget {
            let mut order: Vec<(u64, usize, Key)> = self
                .entries
                .iter()
                .map(|(k, r)| (r.last_access_ms, r.dependents.len(), *k))
                .collect();
            order.sort_unstable();
            for (_, _, k) in order {
                if self.bytes <= self.budget {
                    break;
                }
                self.detach_closure(k, Reason::Budget, &mut doomed);
            }
        }
        self.delete_files(&doomed);
        doomed.len()
    }

    /// Marks entries used now, and everything they extend; persists it in the `.idx` mtime at
    /// most once a second per entry.
    pub fn touch(&mut self, roots: impl IntoIterator<Item = Key>, now: u64) {
        let mut seen = HashSet::new();
        let mut stack: Vec<Key> = roots.into_iter().collect();
        while let Some(k) = stack.pop() {
            if !seen.insert(k) {
                continue;
            }
            let Some(rec) = self.entries.get_mut(&k) else {
                continue;
            };
            rec.last_access_ms = rec.last_access_ms.max(now);
            stack.extend(rec.deps.iter().copied());
            if now >= rec.persisted_ms + 1000 {
                rec.persisted_ms = now;
                let when = UNIX_EPOCH + Duration::from_millis(now);
                if let Ok(p) = entry_path(&self.dir, &k, Ext::Idx, false) {
                    let _ = fsops::touch(&p, when);
                }
            }
        }
    }

    /// Longest stored prefix of `keys`, without touching or counting anything.
    pub fn prefix_locs(&self, keys: &[Key]) -> Vec<Loc> {
        let mut out = Vec::new();
        for k in keys {
            match self.blocks.get(k) {
                Some(l) => out.push(l.clone()),
                None => break,
            }
        }
        out
    }

    pub fn ck_info(&self, key: &Key) -> Option<CheckpointInfo> {
        self.ckpts.get(key).map(|c| CheckpointInfo {
            position: c.position,
            key: *key,
            layout: c.layout.clone(),
            len: c.loc.len,
        })
    }

    pub fn lookup(&mut self, keys: &[Key]) -> Match {
        let now = self.now();
        self.evict(now);
        let locs = self.prefix_locs(keys);
        let n = locs.len();
        let checkpoint = keys[..n].iter().rev().find_map(|k| self.ck_info(k));
        let mut touched: Vec<Key> = locs.iter().map(|l| l.file).collect();
        if let Some(c) = &checkpoint {
            touched.push(self.ckpts[&c.key].loc.file);
        }
        touched.sort_unstable();
        touched.dedup();
        self.touch(touched, now);
        if n > 0 {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
        Match {
            n_blocks: n,
            n_bytes: locs.iter().map(|l| l.len).sum(),
            block_lens: locs.iter().map(|l| l.len).collect(),
            checkpoint,
        }
    }

    pub fn lookup_checkpoint(
        &mut self,
        candidates: &[(u64, Key)],
        max_position: u64,
    ) -> Option<CheckpointInfo> {
        let now = self.now();
        self.evict(now);
        let best = candidates
            .iter()
            .filter(|(pos, _)| *pos <= max_position)
            .filter_map(|(pos, k)| {
                self.ckpts
                    .get(k)
                    .filter(|c| c.position == *pos)
                    .map(|_| (*pos, *k))
            })
            .max_by_key(|(pos, _)| *pos);
        match best {
            Some((_, k)) => {
                let file = self.ckpts[&k].loc.file;
                self.touch([file], now);
                self.stats.checkpoint_hits += 1;
                self.ck_info(&k)
            }
            None => {
                self.stats.checkpoint_misses += 1;
                None
            }
        }
    }

    /// Opens the files that `locs` live in, under the lock, so an eviction that follows cannot
    /// pull them away before the read. A missing file means a damaged entry: it is removed.
    pub fn open_files(&mut self, locs: &[Loc], ext: Ext) -> Result<HashMap<Key, File>> {
        let mut files = HashMap::new();
        for l in locs {
            if files.contains_key(&l.file) {
                continue;
            }
            let path = self.path(&l.file, ext)?;
            match fsops::open_read(&path) {
                Ok(f) => {
                    files.insert(l.file, f);
                }
                // Missing, or unreadable (a directory, a symlink or loop, a FIFO, no
                // permission): the entry is removed, as a corrupt one is, and the caller
                // recomputes; it is never offered again.
                Err(e) => {
                    self.remove_entries(&[l.file], Reason::Corrupt);
                    let what = if e.kind() == std::io::ErrorKind::NotFound {
                        "is missing".to_string()
                    } else {
                        format!("is unreadable ({e})")
                    };
                    return Err(CoreError::CorruptEntry(format!(
                        "{} {what}",
                        path.display()
                    )));
                }
            }
        }
        Ok(files)
    }

    /// Removes the entry a bad region came from, if it is still the same generation.
    pub fn blame(&mut self, loc: &Loc) {
        if self
            .entries
            .get(&loc.file)
            .is_some_and(|r| r.gen == loc.gen)
        {
            self.remove_entries(&[loc.file], Reason::Corrupt);
        }
    }

    pub fn stats(&self) -> DiskStats {
        let mut s = self.stats.clone();
        s.entries = self.entries.len() as u64;
        s.bytes_on_disk = self.bytes;
        s.blocks = self.blocks.len() as u64;
        s.checkpoints = self.ckpts.len() as u64;
        s
    }

    pub fn entry_infos(&self) -> Vec<EntryInfo> {
        let mut v: Vec<EntryInfo> = self
            .entries
            .iter()
            .map(|(k, r)| EntryInfo {
                key: *k,
                n_blocks: r.block_keys.len(),
                n_checkpoints: r.ckpt_keys.len(),
                tokens: r.tokens,
                bytes: r.bytes(),
                created_ms: r.created_ms,
                last_access_ms: r.last_access_ms,
                deps: r.deps.clone(),
            })
            .collect();
        v.sort_by_key(|e| (e.created_ms, e.key));
        v
    }
}

type OwnRegions = HashMap<Key, (HashMap<Key, IdxRegion>, HashMap<Key, IdxRegion>)>;

fn own_regions(cands: &HashMap<Key, (IdxFile, u64, u64)>) -> OwnRegions {
    cands
        .iter()
        .map(|(k, (idx, _, _))| {
            let blocks = idx
                .blocks
                .iter()
                .filter(|r| r.file.0 == *k)
                .map(|r| (r.key.0, r.clone()))
                .collect();
            let ckpts = idx
                .checkpoints
                .iter()
                .filter(|c| c.region.file.0 == *k)
                .map(|c| (c.region.key.0, c.region.clone()))
                .collect();
            (*k, (blocks, ckpts))
        })
        .collect()
}

/// Every region an index places in another entry must be one of that entry's own regions,
/// byte for byte (key, offset, length, checksum), and that entry must be a declared dependency.
fn refs_ok(
    key: &Key,
    idx: &IdxFile,
    cands: &HashMap<Key, (IdxFile, u64, u64)>,
    own: &OwnRegions,
) -> bool {
    let check = |r: &IdxRegion, is_ckpt: bool| -> bool {
        if r.file.0 == *key {
            return true;
        }
        if !cands.contains_key(&r.file.0) || !idx.deps.iter().any(|d| d.0 == r.file.0) {
            return false;
        }
        let Some((b, c)) = own.get(&r.file.0) else {
            return false;
        };
        let m = if is_ckpt { c } else { b };
        m.get(&r.key.0) == Some(r)
    };
    idx.blocks.iter().all(|r| check(r, false))
        && idx.checkpoints.iter().all(|c| check(&c.region, true))
        && idx
            .deps
            .iter()
            .all(|d| d.0 != *key && cands.contains_key(&d.0))
}
