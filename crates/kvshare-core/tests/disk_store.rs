//! Functional tests of the disk store: round trip, dedup / parent entries, TTL, LRU budget,
//! minimum tokens, fingerprint, path safety, startup sweep, corruption, stats, queue drops,
//! concurrency, lock and close.

mod disk_common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use disk_common::*;
use kvshare_core::disk::{
    checked_join, hex32, Clock, DiskConfig, DiskStore, NewCheckpoint, NewEntry, WriteOutcome,
};
use kvshare_core::CoreError;

fn cfg(dir: &Path) -> DiskConfig {
    let mut c = DiskConfig::new(dir, FP);
    c.ttl = None;
    c
}

fn open(dir: &Path) -> DiskStore {
    DiskStore::open(cfg(dir)).unwrap()
}

fn written(o: WriteOutcome) -> [u8; 32] {
    match o {
        WriteOutcome::Written { key, .. } => key,
        other => panic!("expected a write, got {other:?}"),
    }
}

fn file(store: &DiskStore, key: &[u8; 32], ext: &str) -> PathBuf {
    store.dir().join(format!("{}.{ext}", hex32(key)))
}

fn flip(path: &Path, at: u64) {
    let mut b = fs::read(path).unwrap();
    let i = (at as usize) % b.len();
    b[i] ^= 0x40;
    fs::write(path, b).unwrap();
}

#[test]
fn round_trip_blocks_and_checkpoints() {
    let d = tempfile::tempdir().unwrap();
    let store = open(d.path());
    let e = make_entry(1, 6, 0, &[2, 5]);
    let key = written(store.write_now(&e).unwrap());
    assert_eq!(key, entry_key_of(&e));
    for ext in ["kv", "ckpt", "idx"] {
        assert!(file(&store, &key, ext).is_file(), "{ext}");
    }
    let keys = chain_keys(1, 10);
    let m = store.lookup(&keys).unwrap();
    assert_eq!(m.n_blocks, 6);
    assert_eq!(
        m.block_lens,
        keys[..6]
            .iter()
            .map(|k| block_len(k) as u64)
            .collect::<Vec<_>>()
    );
    assert_eq!(m.n_bytes, m.block_lens.iter().sum::<u64>());
    let ck = m.checkpoint.clone().unwrap();
    assert_eq!((ck.key, ck.position), (keys[5], 96));
    // Into a caller buffer, whole blocks only.
    let mut out = vec![0u8; m.n_bytes as usize];
    assert_eq!(store.read_blocks(&keys, &mut out).unwrap(), 6);
    assert_eq!(out, expected_blocks(&keys[..6]));
    let three: usize = keys[..3].iter().map(block_len).sum();
    let mut small = vec![0u8; three + 10];
    assert_eq!(store.read_blocks(&keys, &mut small).unwrap(), 3);
    assert_eq!(&small[..three], &expected_blocks(&keys[..3])[..]);
    // A different prompt shares nothing.
    assert_eq!(store.lookup(&chain_keys(2, 4)).unwrap().n_blocks, 0);
    let c = store.read_checkpoint(&keys[2]).unwrap().unwrap();
    assert_eq!(
        (c.position, c.data.clone(), c.layout.clone()),
        (48, ckpt_data(&keys[2]), ckpt_layout(&keys[2]))
    );
    assert!(store.read_checkpoint(&keys[3]).unwrap().is_none());
    // Deepest checkpoint at or before a position, among candidates.
    let cands: Vec<(u64, [u8; 32])> = (0..10).map(|i| ((i as u64 + 1) * 16, keys[i])).collect();
    assert_eq!(
        store
            .lookup_checkpoint(&cands, 1000)
            .unwrap()
            .unwrap()
            .position,
        96
    );
    assert_eq!(
        store
            .lookup_checkpoint(&cands, 95)
            .unwrap()
            .unwrap()
            .position,
        48
    );
    assert!(store.lookup_checkpoint(&cands, 47).unwrap().is_none());
    let s = store.stats();
    assert_eq!((s.entries, s.blocks, s.checkpoints, s.writes), (1, 6, 2, 1));
    assert_eq!(
        (s.hits, s.misses, s.checkpoint_hits, s.checkpoint_misses),
        (1, 1, 2, 1)
    );
    let files: u64 = ["kv", "ckpt", "idx"]
        .iter()
        .map(|x| fs::metadata(file(&store, &key, x)).unwrap().len())
        .sum();
    assert_eq!(s.bytes_on_disk, files);
    assert_eq!(s.bytes_written, files);
    assert_eq!(s.bytes_read, m.n_bytes + three as u64 + c.data.len() as u64);
    drop(store);
    // Survives a reopen.
    let store = open(d.path());
    assert_eq!(
        store.read_blocks_vec(&keys).unwrap(),
        expected_blocks(&keys[..6])
    );
    assert_eq!(store.stats().swept_files, 0);
    verify_store(&store, &[1, 2], 10).unwrap();
}

#[test]
fn dedup_and_parent_entries() {
    let d = tempfile::tempdir().unwrap();
    let store = open(d.path());
    let parent = written(store.write_now(&make_entry(1, 8, 0, &[7])).unwrap());
    let before = store.stats().bytes_written;
    // Full payload given, but only the 4 new blocks are written.
    let child_e = make_entry(1, 12, 0, &[7, 11]);
    let child = written(store.write_now(&child_e).unwrap());
    let new_bytes: u64 = chain_keys(1, 12)[8..]
        .iter()
        .map(|k| block_len(k) as u64)
        .sum();
    assert_eq!(
        fs::metadata(file(&store, &child, "kv")).unwrap().len(),
        new_bytes
    );
    assert_eq!(
        fs::metadata(file(&store, &child, "ckpt")).unwrap().len(),
        ckpt_data(&chain_keys(1, 12)[11]).len() as u64
    );
    assert_eq!(
        store.stats().bytes_written - before,
        store_entry_bytes(store.dir(), &child)
    );
    let info = store
        .entries()
        .into_iter()
        .find(|e| e.key == child)
        .unwrap();
    assert_eq!(info.deps, vec![parent]);
    assert_eq!(info.n_blocks, 12);
    // The same entry again: nothing written.
    assert_eq!(
        store.write_now(&child_e).unwrap(),
        WriteOutcome::AlreadyStored
    );
    // A subset of what is stored: nothing written either.
    assert_eq!(
        store.write_now(&make_entry(1, 5, 0, &[])).unwrap(),
        WriteOutcome::AlreadyStored
    );
    assert_eq!(store.stats().skipped_existing, 2);
    // payload_from: the caller only gathers the tail.
    let from = store.stored_prefix(&chain_keys(1, 14)).unwrap();
    assert_eq!(from, 12);
    let grand = written(store.write_now(&make_entry(1, 14, from, &[])).unwrap());
    let keys = chain_keys(1, 14);
    assert_eq!(
        store.read_blocks_vec(&keys).unwrap(),
        expected_blocks(&keys)
    );
    // A payload_from over blocks that are not stored is refused.
    let err = store.write_now(&make_entry(2, 4, 2, &[])).unwrap_err();
    assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
    // Reopen keeps the references.
    drop(store);
    let store = open(d.path());
    assert_eq!(store.entries().len(), 3);
    verify_store(&store, &[1], 16).unwrap();
    // Corrupting the parent's data removes the parent and everything that extends it.
    flip(&file(&store, &parent, "kv"), 5);
    let err = store.read_blocks_vec(&keys).unwrap_err();
    assert!(matches!(err, CoreError::CorruptEntry(_)), "{err}");
    assert!(
        store.entries().is_empty(),
        "dependents of a removed parent must go too"
    );
    assert_eq!(store.stats().evictions_corrupt, 3);
    for k in [parent, child, grand] {
        for ext in ["kv", "ckpt", "idx"] {
            assert!(!file(&store, &k, ext).exists());
        }
    }
    verify_store(&store, &[1], 16).unwrap();
}

fn manual_clock() -> (Arc<AtomicU64>, Clock) {
    let now = Arc::new(AtomicU64::new(1_700_000_000_000));
    let n2 = Arc::clone(&now);
    (now, Clock::from_fn(move || n2.load(Ordering::SeqCst)))
}

#[test]
fn ttl_evicts_idle_entries_before_lookup() {
    let d = tempfile::tempdir().unwrap();
    let (now, clock) = manual_clock();
    let mut c = cfg(d.path());
    c.ttl = Some(Duration::from_secs(10));
    c.clock = clock;
    let store = DiskStore::open(c.clone()).unwrap();
    let a = written(store.write_now(&make_entry(1, 3, 0, &[])).unwrap());
    now.fetch_add(6_000, Ordering::SeqCst);
    let b = written(store.write_now(&make_entry(2, 3, 0, &[])).unwrap());
    now.fetch_add(2_000, Ordering::SeqCst); // t = 8 s: touch a
    assert_eq!(store.lookup(&chain_keys(1, 3)).unwrap().n_blocks, 3);
    now.fetch_add(9_000, Ordering::SeqCst); // t = 17 s: a idle 9 s, b idle 11 s
    assert_eq!(
        store.lookup(&chain_keys(2, 3)).unwrap().n_blocks,
        0,
        "b expired"
    );
    assert_eq!(
        store.lookup(&chain_keys(1, 3)).unwrap().n_blocks,
        3,
        "a was used 9 s ago"
    );
    assert!(!file(&store, &b, "idx").exists());
    assert_eq!(store.stats().evictions_ttl, 1);
    // The last access survives a reopen (idx mtime): at t = 17 s a was touched.
    drop(store);
    now.fetch_add(8_000, Ordering::SeqCst);
    let store = DiskStore::open(c.clone()).unwrap();
    assert_eq!(store.entries().len(), 1, "a used 8 s ago: kept at open");
    now.fetch_add(3_000, Ordering::SeqCst);
    assert_eq!(store.evict().unwrap(), 1);
    assert!(!file(&store, &a, "kv").exists());
    assert_eq!(store.stats().evictions_ttl, 1);
}

#[test]
fn lru_eviction_against_the_byte_budget() {
    let d = tempfile::tempdir().unwrap();
    let (now, clock) = manual_clock();
    let mut c = cfg(d.path());
    c.clock = clock;
    let probe = DiskStore::open(c.clone()).unwrap();
    let one = match probe.write_now(&make_entry(9, 4, 0, &[])).unwrap() {
        WriteOutcome::Written { bytes, .. } => bytes,
        _ => unreachable!(),
    };
    drop(probe);
    fs::remove_dir_all(d.path()).unwrap();
    c.budget_bytes = one * 3 + one / 2; // room for three entries of about this size
    let store = DiskStore::open(c.clone()).unwrap();
    for chain in [1, 2, 3] {
        now.fetch_add(1_000, Ordering::SeqCst);
        store.write_now(&make_entry(chain, 4, 0, &[])).unwrap();
    }
    assert_eq!(store.entries().len(), 3);
    now.fetch_add(1_000, Ordering::SeqCst);
    store.lookup(&chain_keys(1, 4)).unwrap(); // 1 is now the most recent
    now.fetch_add(1_000, Ordering::SeqCst);
    store.write_now(&make_entry(4, 4, 0, &[])).unwrap();
    let s = store.stats();
    assert!(s.bytes_on_disk <= c.budget_bytes);
    assert_eq!(s.evictions_budget, 1);
    let left: Vec<usize> = [1, 2, 3, 4]
        .iter()
        .map(|&ch| store.stored_prefix(&chain_keys(ch, 4)).unwrap())
        .collect();
    assert_eq!(left, vec![4, 0, 4, 4], "the least recently used (2) goes");
    verify_store(&store, &[1, 2, 3, 4], 4).unwrap();
    // An entry larger than the whole budget is refused.
    let big = make_entry(5, 40, 0, &[]);
    assert!(matches!(
        store.write_now(&big),
        Err(CoreError::OverBudget(_))
    ));
    assert_eq!(store.stats().failed_writes, 1);
    // A smaller budget at open evicts down to it, least recently used first.
    drop(store);
    c.budget_bytes = one + one / 2;
    let store = DiskStore::open(c).unwrap();
    assert_eq!(store.entries().len(), 1);
    assert_eq!(store.stored_prefix(&chain_keys(4, 4)).unwrap(), 4);
    verify_store(&store, &[1, 2, 3, 4], 4).unwrap();
}

#[test]
fn lru_evicts_children_before_parents() {
    let d = tempfile::tempdir().unwrap();
    let (now, clock) = manual_clock();
    let mut c = cfg(d.path());
    c.clock = clock;
    let store = DiskStore::open(c.clone()).unwrap();
    store.write_now(&make_entry(1, 4, 0, &[])).unwrap();
    now.fetch_add(1_000, Ordering::SeqCst);
    let child = written(store.write_now(&make_entry(1, 8, 4, &[])).unwrap());
    now.fetch_add(1_000, Ordering::SeqCst);
    // Using the child touches the parent too; using only the parent leaves the child older.
    store.lookup(&chain_keys(1, 2)).unwrap();
    let s = store.stats();
    drop(store);
    let child_bytes = store_entry_bytes(d.path(), &child);
    c.budget_bytes = s.bytes_on_disk - 1;
    let store = DiskStore::open(c).unwrap();
    assert_eq!(store.entries().len(), 1);
    assert_eq!(
        store.stored_prefix(&chain_keys(1, 8)).unwrap(),
        4,
        "child evicted, parent kept"
    );
    assert_eq!(store.stats().bytes_on_disk, s.bytes_on_disk - child_bytes);
}

fn store_entry_bytes(dir: &Path, key: &[u8; 32]) -> u64 {
    ["kv", "ckpt", "idx"]
        .iter()
        .filter_map(|x| fs::metadata(dir.join(format!("{}.{x}", hex32(key)))).ok())
        .map(|m| m.len())
        .sum()
}

#[test]
fn entries_below_min_tokens_are_not_written() {
    let d = tempfile::tempdir().unwrap();
    let mut c = cfg(d.path());
    c.min_tokens = 64;
    let store = DiskStore::open(c).unwrap();
    assert_eq!(
        store.write_now(&make_entry(1, 3, 0, &[])).unwrap(),
        WriteOutcome::TooFewTokens
    ); // 48 tokens
    assert!(store.submit(make_entry(2, 2, 0, &[])).unwrap());
    store.flush();
    assert!(matches!(
        store.write_now(&make_entry(1, 4, 0, &[])).unwrap(),
        WriteOutcome::Written { .. }
    ));
    let s = store.stats();
    assert_eq!((s.skipped_small, s.entries, s.writes), (2, 1, 1));
    assert_eq!(fs::read_dir(store.dir()).unwrap().count(), 1 + 2); // .lock + kv + idx
}

#[test]
fn another_models_entries_are_never_returned() {
    let d = tempfile::tempdir().unwrap();
    let store = open(d.path());
    let key = written(store.write_now(&make_entry(1, 4, 0, &[0])).unwrap());
    drop(store);
    let mut other = cfg(d.path());
    other.fingerprint = b"another model".to_vec();
    let store = DiskStore::open(other.clone()).unwrap();
    assert_eq!(store.lookup(&chain_keys(1, 4)).unwrap().n_blocks, 0);
    assert!(store
        .read_checkpoint(&chain_keys(1, 1)[0])
        .unwrap()
        .is_none());
    assert_eq!(store.stats().entries, 0);
    // Its own entries coexist; the foreign files are left alone (not swept, not counted).
    store.write_now(&make_entry(1, 2, 0, &[])).unwrap();
    assert_eq!(store.stats().swept_files, 0);
    assert!(file(&store, &key, "kv").exists() && file(&store, &key, "idx").exists());
    drop(store);
    let store = open(d.path());
    assert_eq!(store.lookup(&chain_keys(1, 4)).unwrap().n_blocks, 4);
    assert_eq!(store.entries().len(), 1);
}

#[test]
fn paths_stay_inside_the_cache_dir() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("a").join("..").join("cache");
    let store = DiskStore::open(cfg(&dir)).unwrap();
    assert_eq!(
        store.dir(),
        fs::canonicalize(root.path().join("cache")).unwrap()
    );
    for bad in ["../outside.kv", "..", "/etc/passwd", "x/y.kv", "A.KV", ""] {
        assert!(
            matches!(
                checked_join(store.dir(), bad),
                Err(CoreError::PathEscape(_))
            ),
            "{bad:?}"
        );
    }
    assert_eq!(
        checked_join(store.dir(), "ab.kv").unwrap(),
        store.dir().join("ab.kv")
    );
    drop(store);
    // A symlink wearing an entry's name is not followed: the sweep removes the link only.
    let outside = root.path().join("secret");
    fs::write(&outside, b"do not touch").unwrap();
    let e = make_entry(1, 2, 0, &[]);
    let key = entry_key_of(&e);
    let link = root
        .path()
        .join("cache")
        .join(format!("{}.kv", hex32(&key)));
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    let store = DiskStore::open(cfg(&dir)).unwrap();
    assert!(!link.exists() && fs::symlink_metadata(&link).is_err());
    assert_eq!(fs::read(&outside).unwrap(), b"do not touch");
    // A link planted at a .tmp name while we write is refused, not followed.
    std::os::unix::fs::symlink(
        &outside,
        root.path()
            .join("cache")
            .join(format!("{}.kv.tmp", hex32(&key))),
    )
    .unwrap();
    assert!(store.write_now(&e).is_err());
    assert_eq!(fs::read(&outside).unwrap(), b"do not touch");
    assert_eq!(store.stats().entries, 0);
}

#[test]
fn startup_sweep_removes_incomplete_and_damaged_entries() {
    let d = tempfile::tempdir().unwrap();
    let store = open(d.path());
    let good = written(store.write_now(&make_entry(1, 4, 0, &[3])).unwrap());
    let no_kv = written(store.write_now(&make_entry(2, 4, 0, &[])).unwrap());
    let short = written(store.write_now(&make_entry(3, 4, 0, &[])).unwrap());
    let bad_idx = written(store.write_now(&make_entry(4, 4, 0, &[])).unwrap());
    let child = written(store.write_now(&make_entry(2, 6, 4, &[])).unwrap()); // extends no_kv
    let dir = store.dir().to_path_buf();
    drop(store);
    let orphan = [7u8; 32];
    fs::write(dir.join(format!("{}.kv", hex32(&orphan))), b"orphan data").unwrap();
    fs::write(dir.join(format!("{}.ckpt", hex32(&orphan))), b"orphan ckpt").unwrap();
    fs::write(dir.join(format!("{}.kv.tmp", hex32(&orphan))), b"half").unwrap();
    fs::write(dir.join(format!("{}.idx.tmp", hex32(&good))), b"half").unwrap();
    fs::write(dir.join("notes.txt"), b"not ours").unwrap();
    fs::remove_file(dir.join(format!("{}.kv", hex32(&no_kv)))).unwrap();
    let p = dir.join(format!("{}.kv", hex32(&short)));
    let len = fs::metadata(&p).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    flip(&dir.join(format!("{}.idx", hex32(&bad_idx))), 77);
    let store = open(&dir);
    let keys: Vec<_> = store.entries().iter().map(|e| e.key).collect();
    assert_eq!(
        keys,
        vec![good],
        "only the intact entry survives (the child of a broken parent goes)"
    );
    // 2 orphan data + 2 tmp + idx of no_kv, short, bad_idx, child + data of short, bad_idx, child
    assert_eq!(store.stats().swept_files, 2 + 2 + 4 + 3);
    assert!(dir.join("notes.txt").exists());
    let _ = child;
    verify_store(&store, &[1, 2, 3, 4], 8).unwrap();
}

#[test]
fn corrupt_payloads_are_detected_removed_and_never_returned() {
    let d = tempfile::tempdir().unwrap();
    let store = open(d.path());
    let keys = chain_keys(1, 6);
    let key = written(store.write_now(&make_entry(1, 6, 0, &[5])).unwrap());
    flip(&file(&store, &key, "kv"), 300);
    let m = store.lookup(&keys).unwrap();
    assert_eq!(m.n_blocks, 6, "lookup reads no payload");
    let mut out = vec![0xEEu8; m.n_bytes as usize];
    let err = store.read_blocks(&keys, &mut out).unwrap_err();
    assert!(matches!(err, CoreError::CorruptEntry(_)), "{err}");
    assert!(
        out.iter().all(|&b| b == 0),
        "no bytes of a corrupt entry reach the caller"
    );
    assert_eq!(store.lookup(&keys).unwrap().n_blocks, 0);
    assert!(!file(&store, &key, "idx").exists() && !file(&store, &key, "kv").exists());
    let s = store.stats();
    assert_eq!((s.evictions_corrupt, s.entries, s.bytes_on_disk), (1, 0, 0));

    // Checkpoint bit flip.
    let key = written(store.write_now(&make_entry(2, 3, 0, &[2])).unwrap());
    flip(&file(&store, &key, "ckpt"), 10);
    let err = store.read_checkpoint(&chain_keys(2, 3)[2]).unwrap_err();
    assert!(matches!(err, CoreError::CorruptEntry(_)));
    assert_eq!(store.stats().entries, 0);

    // Truncated while open: the read comes up short.
    let key = written(store.write_now(&make_entry(3, 3, 0, &[])).unwrap());
    let p = file(&store, &key, "kv");
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(5)
        .unwrap();
    assert!(matches!(
        store.read_blocks_vec(&chain_keys(3, 3)),
        Err(CoreError::CorruptEntry(_))
    ));
    // Deleted while open.
    let key = written(store.write_now(&make_entry(4, 3, 0, &[])).unwrap());
    fs::remove_file(file(&store, &key, "kv")).unwrap();
    assert!(matches!(
        store.read_blocks_vec(&chain_keys(4, 3)),
        Err(CoreError::CorruptEntry(_))
    ));
    assert_eq!(store.stats().evictions_corrupt, 4);
    verify_store(&store, &[1, 2, 3, 4], 6).unwrap();

    // Every single-byte flip anywhere in an entry's files is caught (at open or at read).
    let e = make_entry(5, 3, 0, &[1]);
    drop(store);
    for ext in ["kv", "ckpt", "idx"] {
        let len = {
            let store = open(d.path());
            let k = written(store.write_now(&e).unwrap());
            fs::metadata(file(&store, &k, ext)).unwrap().len()
        };
        for at in (0..len).step_by(7) {
            let store = open(d.path());
            let k = match store.write_now(&e).unwrap() {
                WriteOutcome::Written { key, .. } => key,
                WriteOutcome::AlreadyStored => entry_key_of(&e),
                o => panic!("{o:?}"),
            };
            flip(&file(&store, &k, ext), at);
            drop(store);
            let store = open(d.path());
            let keys = chain_keys(5, 3);
            let blocks = store.read_blocks_vec(&keys);
            let ck = store.read_checkpoint(&keys[1]);
            match (&blocks, &ck) {
                (Ok(b), Ok(Some(c))) if b.len() == expected_blocks(&keys).len() => {
                    panic!(
                        "flip of {ext} byte {at} undetected (ckpt {} bytes)",
                        c.data.len()
                    )
                }
                _ => {}
            }
            if let Ok(b) = &blocks {
                assert_eq!(b[..], expected_blocks(&keys)[..b.len()]);
            }
            assert!(
                store.entries().is_empty(),
                "damaged entry still listed ({ext} byte {at})"
            );
            verify_store(&store, &[5], 3).unwrap();
        }
    }
}

#[test]
fn a_full_queue_drops_writes_and_counts_them() {
    let d = tempfile::tempdir().unwrap();
    let mut c = cfg(d.path());
    c.queue_depth = 1;
    let store = DiskStore::open(c).unwrap();
    let mut accepted = 0u64;
    let mut dropped = 0u64;
    for chain in 0..200u64 {
        // Large-ish entries so the writer cannot keep up.
        let mut e = make_entry(chain, 1, 0, &[]);
        e.payload = vec![chain as u8; 1 << 20];
        e.block_lens = vec![1 << 20];
        if store.submit(e).unwrap() {
            accepted += 1;
        } else {
            dropped += 1;
        }
    }
    store.flush();
    let s = store.stats();
    assert!(dropped > 0, "queue of 1 never filled");
    assert_eq!(s.dropped_writes, dropped);
    assert_eq!(s.writes, accepted);
    assert_eq!(s.entries, accepted);
    assert_eq!(s.queued, 0);
    // A malformed entry is an error, not a drop.
    let mut bad = make_entry(1, 2, 0, &[]);
    bad.block_lens.pop();
    assert!(matches!(
        store.submit(bad),
        Err(CoreError::InvalidArgument(_))
    ));
}

#[test]
fn background_writes_and_concurrent_readers() {
    let d = tempfile::tempdir().unwrap();
    let mut c = cfg(d.path());
    c.queue_depth = 64;
    c.budget_bytes = 60_000; // evictions happen while readers read
    let store = Arc::new(DiskStore::open(c).unwrap());
    let writer = {
        let s = Arc::clone(&store);
        std::thread::spawn(move || {
            for i in 0..120u64 {
                let chain = i % 12;
                let n = 1 + (i as usize * 7) % 16;
                let from = s.stored_prefix(&chain_keys(chain, n)).unwrap();
                let _ = s.submit(make_entry(chain, n, from, &[n - 1]));
                if i % 10 == 0 {
                    s.flush();
                }
            }
            s.flush();
        })
    };
    let readers: Vec<_> = (0..3)
        .map(|t| {
            let s = Arc::clone(&store);
            std::thread::spawn(move || {
                for i in 0..300u64 {
                    let keys = chain_keys((i + t) % 12, 16);
                    let m = s.lookup(&keys).unwrap();
                    // Whatever comes back is exact (it may be shorter if evicted meanwhile).
                    let b = s.read_blocks_vec(&keys[..m.n_blocks]).unwrap();
                    let n = s.stored_prefix(&keys).unwrap().max(m.n_blocks);
                    let exp = expected_blocks(&keys[..n]);
                    assert_eq!(&exp[..b.len()], &b[..]);
                }
            })
        })
        .collect();
    writer.join().unwrap();
    for r in readers {
        r.join().unwrap();
    }
    let s = store.stats();
    assert!(s.writes > 0 && s.bytes_on_disk <= 60_000);
    assert_eq!(s.evictions_corrupt, 0);
    verify_store(&store, &(0..12).collect::<Vec<_>>(), 16).unwrap();
}

#[test]
fn one_store_per_dir_and_close() {
    let d = tempfile::tempdir().unwrap();
    let store = open(d.path());
    assert!(
        matches!(DiskStore::open(cfg(d.path())), Err(CoreError::Io(_))),
        "second store on one dir"
    );
    store.write_now(&make_entry(1, 2, 0, &[])).unwrap();
    assert!(store.submit(make_entry(2, 2, 0, &[])).unwrap());
    store.close(); // drains the queue first
    assert!(matches!(
        store.lookup(&chain_keys(1, 2)),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(!store.submit(make_entry(3, 2, 0, &[])).unwrap());
    let again = open(d.path());
    assert_eq!(again.entries().len(), 2);
}

#[test]
fn checkpoint_only_entries_and_shared_checkpoints() {
    let d = tempfile::tempdir().unwrap();
    let store = open(d.path());
    let keys = chain_keys(1, 4);
    let ck = NewCheckpoint {
        position: 40,
        key: [9; 32],
        layout: "ssm f16[2,8]".into(),
        data: Arc::from(vec![1u8; 300]),
    };
    let e = NewEntry {
        tokens: 40,
        checkpoints: vec![ck.clone()],
        ..Default::default()
    };
    let only = written(store.write_now(&e).unwrap());
    assert!(!file(&store, &only, "kv").exists());
    // Another entry carrying the same checkpoint references it instead of rewriting it.
    let mut e2 = make_entry(1, 4, 0, &[]);
    e2.checkpoints.push(ck.clone());
    let k2 = written(store.write_now(&e2).unwrap());
    assert!(!file(&store, &k2, "ckpt").exists());
    assert_eq!(
        store.entries().iter().find(|i| i.key == k2).unwrap().deps,
        vec![only]
    );
    let got = store.read_checkpoint(&[9; 32]).unwrap().unwrap();
    assert_eq!(
        (got.position, got.layout.as_str(), got.data.len()),
        (40, "ssm f16[2,8]", 300)
    );
    let c = store
        .lookup_checkpoint(&[(40, [9; 32]), (16, keys[0])], 64)
        .unwrap()
        .unwrap();
    assert_eq!(c.position, 40);
    assert!(
        store
            .lookup_checkpoint(&[(41, [9; 32])], 64)
            .unwrap()
            .is_none(),
        "position must match"
    );
    drop(store);
    let store = open(d.path());
    assert_eq!(store.entries().len(), 2);
    assert_eq!(
        store.read_checkpoint(&[9; 32]).unwrap().unwrap().data,
        vec![1u8; 300]
    );
}

/// A directory, a symlink loop or a FIFO where an entry's `.kv` or `.ckpt` should be: the read
/// fails at once with `CorruptEntry` (never blocks: a FIFO's open would wait for a writer),
/// the entry is removed and never offered again, the other entries are untouched.
#[test]
fn unreadable_files_are_a_miss_and_the_entry_is_removed() {
    let d = tempfile::tempdir().unwrap();
    let store = open(d.path());
    let good = written(store.write_now(&make_entry(9, 3, 0, &[])).unwrap());
    let make_fifo = |p: &Path| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    };
    type Replace = Box<dyn Fn(&Path)>;
    let replacements: Vec<(&str, Replace)> = vec![
        ("directory", Box::new(|p: &Path| fs::create_dir(p).unwrap())),
        (
            "symlink loop",
            Box::new(|p: &Path| std::os::unix::fs::symlink(p, p).unwrap()),
        ),
        ("fifo", Box::new(make_fifo)),
    ];
    for (i, (what, replace)) in replacements.iter().enumerate() {
        for ext in ["kv", "ckpt"] {
            let seed = 20 + 2 * i as u64 + u64::from(ext == "ckpt");
            let keys = chain_keys(seed, 3);
            let key = written(store.write_now(&make_entry(seed, 3, 0, &[2])).unwrap());
            let p = file(&store, &key, ext);
            fs::remove_file(&p).unwrap();
            replace(&p);
            let t0 = std::time::Instant::now();
            let err = if ext == "kv" {
                store.read_blocks_vec(&keys).map(|_| ()).unwrap_err()
            } else {
                store.read_checkpoint(&keys[2]).map(|_| ()).unwrap_err()
            };
            assert!(
                matches!(err, CoreError::CorruptEntry(_)),
                "{what} .{ext}: {err}"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{what} .{ext} blocked"
            );
            assert_eq!(store.lookup(&keys).unwrap().n_blocks, 0, "{what} .{ext}");
            assert!(!file(&store, &key, "idx").exists(), "{what} .{ext}");
        }
    }
    assert_eq!(store.stats().evictions_corrupt, 6);
    assert_eq!(store.lookup(&chain_keys(9, 3)).unwrap().n_blocks, 3);
    assert!(file(&store, &good, "kv").is_file());
    drop(store);
    // The damage left on disk does not stop the store from opening again.
    let store = open(d.path());
    assert_eq!(store.lookup(&chain_keys(9, 3)).unwrap().n_blocks, 3);
}
