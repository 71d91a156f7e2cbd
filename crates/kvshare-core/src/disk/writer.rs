//! Writing one entry: plan under the state lock (what is new, what is referenced), write the
//! data files without it (`.tmp`, fsync, rename, fsync dir; then the `.idx` as `.tmp` + fsync),
//! and commit under the lock (referenced entries still the same generation? then rename the
//! `.idx` into place: that rename is the commit).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::format::{
    self, entry_path, Blob, Ext, IdxCheckpoint, IdxFile, IdxRegion, FORMAT_VERSION, K32,
};
use super::fsops;
use super::state::{Loc, State};
use super::{Key, NewEntry, WriteOutcome};
use crate::error::{CoreError, Result};
use park::Step;

/// Test hook (fault injection for crash tests of a whole server): with
/// `KVSHARE_DISK_WRITER_PARK=<step>` in the environment, the first entry write of the process
/// that reaches `<step>` stops there, creates the file named by
/// `KVSHARE_DISK_WRITER_PARK_MARKER` (if set; its content is `<step> <pid>`), and waits while
/// that file exists (forever without one). A test waits for the marker, then kills the process:
/// a kill at exactly that point of the write protocol, on any machine load. Deleting the marker
/// lets the write go on. The variables are read once per process, the first time a write
/// reaches a step (so a process forked before any write, e.g. from a test's zygote, reads its
/// own). Unset (the default): one atomic load per step, nothing else. The steps, in order:
///
/// - `start`: the entry is planned, nothing of it is on disk yet;
/// - `data`: its `.kv` / `.ckpt` are written, fsynced and renamed into place (the directory not
///   yet fsynced); no `.idx`;
/// - `data_synced`: the directory is fsynced too;
/// - `idx_tmp`: the `.idx.tmp` is written and fsynced, not yet renamed (not committed);
/// - `committed`: the `.idx` is renamed into place (the commit). This one parks inside the
///   commit, with the store's state lock held: every other call on the store waits.
#[doc(hidden)]
pub mod park {
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::OnceLock;
    use std::time::Duration;

    pub const ENV_STEP: &str = "KVSHARE_DISK_WRITER_PARK";
    pub const ENV_MARKER: &str = "KVSHARE_DISK_WRITER_PARK_MARKER";

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Step {
        Start,
        Data,
        DataSynced,
        IdxTmp,
        Committed,
    }

    impl Step {
        pub const ALL: [Step; 5] = [
            Step::Start,
            Step::Data,
            Step::DataSynced,
            Step::IdxTmp,
            Step::Committed,
        ];

        pub fn name(self) -> &'static str {
            match self {
                Step::Start => "start",
                Step::Data => "data",
                Step::DataSynced => "data_synced",
                Step::IdxTmp => "idx_tmp",
                Step::Committed => "committed",
            }
        }
    }

    struct Config {
        step: Step,
        marker: Option<PathBuf>,
    }

    static CONFIG: OnceLock<Option<Config>> = OnceLock::new();
    static PARKED: AtomicBool = AtomicBool::new(false);

    fn from_env() -> Option<Config> {
        let name = std::env::var(ENV_STEP).ok().filter(|v| !v.is_empty())?;
        let Some(step) = Step::ALL.into_iter().find(|s| s.name() == name) else {
            let names: Vec<&str> = Step::ALL.iter().map(|s| s.name()).collect();
            eprintln!("kvshare-disk-writer: ignoring {ENV_STEP}={name:?} (steps: {names:?})");
            return None;
        };
        let marker = std::env::var_os(ENV_MARKER)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        Some(Config { step, marker })
    }

    /// Called by the writer at each step; parks there if the environment asks for it.
    pub(crate) fn at(step: Step) {
        let Some(cfg) = CONFIG.get_or_init(from_env) else {
            return;
        };
        if cfg.step != step || PARKED.swap(true, Ordering::SeqCst) {
            return;
        }
        eprintln!(
            "kvshare-disk-writer: parked at {} ({ENV_STEP})",
            step.name()
        );
        let Some(marker) = &cfg.marker else {
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        };
        if let Err(e) = std::fs::write(marker, format!("{} {}\n", step.name(), std::process::id()))
        {
            eprintln!(
                "kvshare-disk-writer: cannot create {}: {e}",
                marker.display()
            );
        }
        while marker.exists() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum Region {
    /// Already stored in a committed entry (possibly another one): referenced, not written.
    Existing(Loc),
    /// Stored in this entry's own file at `file_off`; `src` is where its bytes come from
    /// (payload offset for blocks, checkpoint index for checkpoints), `None` for a repeat of a
    /// region earlier in the same entry.
    New {
        src: Option<usize>,
        file_off: u64,
        len: u64,
    },
}

pub(crate) struct Plan {
    pub key: Key,
    pub created_ms: u64,
    pub tokens: u64,
    pub blocks: Vec<(Key, Region)>,
    pub ckpts: Vec<(Key, u64, String, Region)>,
    pub deps: BTreeMap<Key, u64>,
    pub kv_len: u64,
    pub ckpt_len: u64,
}

pub(crate) enum Planned {
    Skip(WriteOutcome),
    Write(Plan),
}

pub(crate) fn plan(st: &State, e: &NewEntry, now: u64) -> Result<Planned> {
    if e.tokens < st.min_tokens {
        return Ok(Planned::Skip(WriteOutcome::TooFewTokens));
    }
    let ck_keys: Vec<Key> = e.checkpoints.iter().map(|c| c.key).collect();
    let key = format::entry_key(&st.fingerprint, e.tokens, &e.block_keys, &ck_keys);
    if st.entries.contains_key(&key) {
        return Ok(Planned::Skip(WriteOutcome::AlreadyStored));
    }
    let mut deps = BTreeMap::new();
    let mut own: HashMap<Key, (u64, u64)> = HashMap::new();
    let mut blocks = Vec::with_capacity(e.block_keys.len());
    let mut kv_len = 0u64;
    let mut src = 0usize;
    for (i, k) in e.block_keys.iter().enumerate() {
        let len = if i >= e.payload_from {
            e.block_lens[i - e.payload_from]
        } else {
            0
        };
        if let Some(l) = st.blocks.get(k) {
            deps.insert(l.file, l.gen);
            blocks.push((*k, Region::Existing(l.clone())));
        } else if let Some(&(file_off, l)) = own.get(k) {
            blocks.push((
                *k,
                Region::New {
                    src: None,
                    file_off,
                    len: l,
                },
            ));
        } else if i < e.payload_from {
            return Err(CoreError::InvalidArgument(format!(
                "block {i} is before payload_from and is not stored (evicted since?)"
            )));
        } else {
            own.insert(*k, (kv_len, len));
            blocks.push((
                *k,
                Region::New {
                    src: Some(src),
                    file_off: kv_len,
                    len,
                },
            ));
            kv_len += len;
        }
        if i >= e.payload_from {
            src += len as usize;
        }
    }
    let mut ckpts = Vec::with_capacity(e.checkpoints.len());
    let mut own_ck: HashMap<Key, (u64, u64)> = HashMap::new();
    let mut ckpt_len = 0u64;
    for (i, c) in e.checkpoints.iter().enumerate() {
        let region = if let Some(l) = st.ckpts.get(&c.key) {
            deps.insert(l.loc.file, l.loc.gen);
            Region::Existing(l.loc.clone())
        } else if let Some(&(file_off, len)) = own_ck.get(&c.key) {
            Region::New {
                src: None,
                file_off,
                len,
            }
        } else {
            let len = c.data.len() as u64;
            own_ck.insert(c.key, (ckpt_len, len));
            let r = Region::New {
                src: Some(i),
                file_off: ckpt_len,
                len,
            };
            ckpt_len += len;
            r
        };
        ckpts.push((c.key, c.position, c.layout.clone(), region));
    }
    if kv_len == 0 && ckpt_len == 0 {
        return Ok(Planned::Skip(WriteOutcome::AlreadyStored));
    }
    if kv_len + ckpt_len > st.budget {
        return Err(CoreError::OverBudget(format!(
            "entry of {} bytes exceeds the disk budget of {} bytes",
            kv_len + ckpt_len,
            st.budget
        )));
    }
    Ok(Planned::Write(Plan {
        key,
        created_ms: now,
        tokens: e.tokens,
        blocks,
        ckpts,
        deps,
        kv_len,
        ckpt_len,
    }))
}

pub(crate) struct Prepared {
    pub plan: Plan,
    pub idx: IdxFile,
    pub idx_len: u64,
}

/// Writes the data files and the uncommitted `.idx.tmp`. No lock held.
pub(crate) fn write_files(
    dir: &Path,
    plan: Plan,
    e: &NewEntry,
    fingerprint: &[u8],
) -> Result<Prepared> {
    let key = plan.key;
    park::at(Step::Start);
    // Own block bytes, in file order, with adjacent payload slices coalesced into one write.
    let mut hashes: HashMap<u64, Key> = HashMap::new(); // file_off -> hash (kv)
    let mut parts: Vec<(usize, usize)> = Vec::new();
    for (_, r) in &plan.blocks {
        if let Region::New {
            src: Some(s),
            file_off,
            len,
        } = r
        {
            let (s, len) = (*s, *len as usize);
            hashes.insert(*file_off, *blake3::hash(&e.payload[s..s + len]).as_bytes());
            match parts.last_mut() {
                Some((ps, pl)) if *ps + *pl == s => *pl += len,
                _ => parts.push((s, len)),
            }
        }
    }
    let mut wrote_data = false;
    if plan.kv_len > 0 {
        let slices: Vec<&[u8]> = parts.iter().map(|&(s, l)| &e.payload[s..s + l]).collect();
        let tmp = entry_path(dir, &key, Ext::Kv, true)?;
        fsops::write_then_rename(&tmp, &entry_path(dir, &key, Ext::Kv, false)?, &slices)?;
        wrote_data = true;
    }
    let mut ck_hashes: HashMap<u64, Key> = HashMap::new();
    if plan.ckpt_len > 0 {
        let mut slices: Vec<&[u8]> = Vec::new();
        for (_, _, _, r) in &plan.ckpts {
            if let Region::New {
                src: Some(i),
                file_off,
                ..
            } = r
            {
                let data: &[u8] = &e.checkpoints[*i].data;
                ck_hashes.insert(*file_off, *blake3::hash(data).as_bytes());
                slices.push(data);
            }
        }
        let tmp = entry_path(dir, &key, Ext::Ckpt, true)?;
        fsops::write_then_rename(&tmp, &entry_path(dir, &key, Ext::Ckpt, false)?, &slices)?;
        wrote_data = true;
    }
    park::at(Step::Data);
    if wrote_data {
        fsops::fsync_dir(dir)?;
    }
    park::at(Step::DataSynced);
    let region = |k: &Key, r: &Region, hs: &HashMap<u64, Key>| match r {
        Region::Existing(l) => IdxRegion {
            key: K32(*k),
            file: K32(l.file),
            offset: l.offset,
            len: l.len,
            hash: K32(l.hash),
        },
        Region::New { file_off, len, .. } => IdxRegion {
            key: K32(*k),
            file: K32(key),
            offset: *file_off,
            len: *len,
            hash: K32(hs[file_off]),
        },
    };
    let idx = IdxFile {
        version: FORMAT_VERSION,
        fingerprint: Blob(fingerprint.to_vec()),
        key: K32(key),
        tokens: plan.tokens,
        created_ms: plan.created_ms,
        last_access_ms: plan.created_ms,
        kv_len: plan.kv_len,
        ckpt_len: plan.ckpt_len,
        deps: plan.deps.keys().map(|k| K32(*k)).collect(),
        blocks: plan
            .blocks
            .iter()
            .map(|(k, r)| region(k, r, &hashes))
            .collect(),
        checkpoints: plan
            .ckpts
            .iter()
            .map(|(k, pos, layout, r)| IdxCheckpoint {
                position: *pos,
                layout: layout.clone(),
                region: region(k, r, &ck_hashes),
            })
            .collect(),
    };
    let bytes = format::encode_idx(&idx);
    fsops::write_synced(&entry_path(dir, &key, Ext::Idx, true)?, &bytes)?;
    park::at(Step::IdxTmp);
    Ok(Prepared {
        plan,
        idx,
        idx_len: bytes.len() as u64,
    })
}

/// Under the lock: commits if every referenced entry is still the generation the plan saw.
/// Returns false (nothing committed) otherwise.
pub(crate) fn commit(st: &mut State, prep: &Prepared, now: u64) -> Result<bool> {
    for (d, gen) in &prep.plan.deps {
        if st.entries.get(d).map(|r| r.gen) != Some(*gen) {
            return Ok(false);
        }
    }
    let key = prep.plan.key;
    fsops::rename(
        &entry_path(&st.dir, &key, Ext::Idx, true)?,
        &entry_path(&st.dir, &key, Ext::Idx, false)?,
    )?;
    park::at(Step::Committed);
    // The index's mtime is its last access (see `State::touch`): start it at the store's clock.
    let when = std::time::UNIX_EPOCH + std::time::Duration::from_millis(prep.plan.created_ms);
    let _ = fsops::touch(&entry_path(&st.dir, &key, Ext::Idx, false)?, when);
    st.insert_committed(key, &prep.idx, prep.idx_len, prep.plan.created_ms);
    let deps: Vec<Key> = prep.plan.deps.keys().copied().collect();
    st.touch(deps, now);
    st.stats.writes += 1;
    st.stats.bytes_written += prep.plan.kv_len + prep.plan.ckpt_len + prep.idx_len;
    Ok(true)
}

/// Removes every file an uncommitted write of `key` may have left (the key is not committed:
/// the caller holds the write lock and planned it as new).
pub(crate) fn cleanup(dir: &Path, key: &Key) {
    for ext in [Ext::Idx, Ext::Kv, Ext::Ckpt] {
        for tmp in [true, false] {
            if let Ok(p) = entry_path(dir, key, ext, tmp) {
                let _ = fsops::remove(&p);
            }
        }
    }
}
