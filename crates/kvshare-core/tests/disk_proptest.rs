//! Random sequences of writes (background and direct, extending each other), lookups, clock
//! advances (TTL), evictions, reopens and external damage (bit flips, truncation, deleted
//! files). After every step: whatever a read returns is exact, a damaged entry can only
//! produce `CorruptEntry` (and is then gone), bytes on disk stay within the budget, and
//! without pending damage the directory matches the index exactly.

mod disk_common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use disk_common::*;
use kvshare_core::disk::{Clock, DiskConfig, DiskStore};
use kvshare_core::CoreError;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Write {
        chain: u64,
        n: usize,
        ck: bool,
        bg: bool,
    },
    Lookup {
        chain: u64,
    },
    Advance {
        secs: u64,
    },
    Evict,
    Reopen,
    Flip {
        pick: usize,
        at: u64,
    },
    Truncate {
        pick: usize,
        cut: u64,
    },
    Remove {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..5u64, 1..12usize, any::<bool>(), any::<bool>()).prop_map(|(chain, n, ck, bg)| Op::Write { chain, n, ck, bg }),
        3 => (0..5u64).prop_map(|chain| Op::Lookup { chain }),
        1 => (0..25u64).prop_map(|secs| Op::Advance { secs }),
        1 => Just(Op::Evict),
        2 => Just(Op::Reopen),
        1 => (any::<usize>(), any::<u64>()).prop_map(|(pick, at)| Op::Flip { pick, at }),
        1 => (any::<usize>(), any::<u64>()).prop_map(|(pick, cut)| Op::Truncate { pick, cut }),
        1 => any::<usize>().prop_map(|pick| Op::Remove { pick }),
    ]
}

const BUDGET: u64 = 14_000;

fn our_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|d| d.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().len() > 64)
        .collect();
    v.sort();
    v
}

/// Reads everything; a `CorruptEntry` is allowed only while damage is pending.
fn tolerant_pass(store: &DiskStore, damaged: bool) -> Result<(), TestCaseError> {
    let ok_err = |e: CoreError| -> Result<(), TestCaseError> {
        prop_assert!(
            damaged && matches!(e, CoreError::CorruptEntry(_)),
            "unexpected error {e}"
        );
        Ok(())
    };
    for info in store.entries() {
        let Some(keys) = store.entry_block_keys(&info.key) else {
            continue;
        };
        match store.read_blocks_vec(&keys) {
            Ok(b) => prop_assert_eq!(&b[..], &expected_blocks(&keys)[..b.len()]),
            Err(e) => ok_err(e)?,
        }
        for ck in store.entry_checkpoint_keys(&info.key).unwrap_or_default() {
            match store.read_checkpoint(&ck) {
                Ok(Some(c)) => prop_assert_eq!(c.data, ckpt_data(&ck)),
                Ok(None) => {}
                Err(e) => ok_err(e)?,
            }
        }
    }
    for chain in 0..5 {
        let keys = chain_keys(chain, 12);
        let m = store.lookup(&keys).unwrap();
        match store.read_blocks_vec(&keys[..m.n_blocks]) {
            Ok(b) => prop_assert_eq!(&b[..], &expected_blocks(&keys)[..b.len()]),
            Err(e) => ok_err(e)?,
        }
    }
    prop_assert!(store.stats().bytes_on_disk <= BUDGET);
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let d = tempfile::tempdir().unwrap();
    let now = Arc::new(AtomicU64::new(1_700_000_000_000));
    let n2 = Arc::clone(&now);
    let mut cfg = DiskConfig::new(d.path(), FP);
    cfg.budget_bytes = BUDGET;
    cfg.ttl = Some(Duration::from_secs(30));
    cfg.clock = Clock::from_fn(move || n2.load(Ordering::SeqCst));
    let mut store = DiskStore::open(cfg.clone()).unwrap();
    // Damage to data files shows at the next read; damage to an index at the next open.
    let mut damaged = false;
    let mut idx_damage = false;
    for op in ops {
        match op {
            Op::Write { chain, n, ck, bg } => {
                let keys = chain_keys(chain, n);
                let from = store.stored_prefix(&keys).unwrap();
                let cks: Vec<usize> = if ck { vec![n - 1] } else { vec![] };
                let e = make_entry(chain, n, from, &cks);
                if bg {
                    store.submit(e).unwrap();
                    store.flush();
                } else {
                    let _ = store.write_now(&e);
                }
            }
            Op::Lookup { chain } => {
                let keys = chain_keys(chain, 12);
                let m = store.lookup(&keys).unwrap();
                prop_assert!(store.stats().bytes_on_disk <= BUDGET);
                if let Ok(b) = store.read_blocks_vec(&keys[..m.n_blocks]) {
                    prop_assert_eq!(&b[..], &expected_blocks(&keys)[..b.len()]);
                }
            }
            Op::Advance { secs } => {
                now.fetch_add(secs * 1000, Ordering::SeqCst);
            }
            Op::Evict => {
                store.evict().unwrap();
            }
            Op::Reopen => {
                drop(store);
                store = DiskStore::open(cfg.clone()).unwrap();
                idx_damage = false;
            }
            Op::Flip { pick, at } => {
                let files = our_files(store.dir());
                if !files.is_empty() {
                    let p = &files[pick % files.len()];
                    let mut b = fs::read(p).unwrap();
                    if !b.is_empty() {
                        let i = (at % b.len() as u64) as usize;
                        b[i] ^= 1 << (at % 8);
                        fs::write(p, b).unwrap();
                        damaged = true;
                        idx_damage |= p.extension().unwrap() == "idx";
                    }
                }
            }
            Op::Truncate { pick, cut } => {
                let files = our_files(store.dir());
                if !files.is_empty() {
                    let p = &files[pick % files.len()];
                    let len = fs::metadata(p).unwrap().len();
                    fs::OpenOptions::new()
                        .write(true)
                        .open(p)
                        .unwrap()
                        .set_len(cut % len.max(1))
                        .unwrap();
                    damaged = true;
                    idx_damage |= p.extension().unwrap() == "idx";
                }
            }
            Op::Remove { pick } => {
                let files = our_files(store.dir());
                if !files.is_empty() {
                    let p = &files[pick % files.len()];
                    fs::remove_file(p).unwrap();
                    damaged = true;
                    idx_damage |= p.extension().unwrap() == "idx";
                }
            }
        }
        tolerant_pass(&store, damaged)?;
        if damaged && !idx_damage {
            // A full read pass has removed every entry with damaged data: strict from here.
            damaged = false;
        }
        if !damaged {
            if let Err(e) = verify_store(&store, &[0, 1, 2, 3, 4], 12) {
                return Err(TestCaseError::fail(e));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_ops_with_damage_and_reopen(ops in prop::collection::vec(op(), 1..30)) {
        run(ops)?;
    }
}
