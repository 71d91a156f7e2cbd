//! Crash safety of the disk store with real processes, real files and real fsync.
//!
//! 1. Fault points: the `disk_crash_writer` helper runs a fixed write script and aborts right
//!    after its Nth file operation (create / write / fsync / rename / dir fsync / unlink), for
//!    every N of the script (~290 points, covering writes, dedup'd extensions, commits, the
//!    startup sweep and evictions). After each crash the store is reopened: every entry is
//!    complete and checksum-valid or absent, nothing else is left in the dir, and every entry
//!    whose commit the helper had reported is still there.
//! 2. SIGKILL at random moments of a random write loop (`Child::kill`), reopening each time.

mod disk_common;

use std::collections::HashSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use disk_common::*;
use kvshare_core::disk::{hex32, DiskConfig, DiskStore};

const BIN: &str = env!("CARGO_BIN_EXE_disk_crash_writer");

fn reopen(dir: &Path) -> DiskStore {
    let mut cfg = DiskConfig::new(dir, FP);
    cfg.ttl = None;
    DiskStore::open(cfg).expect("reopen after crash")
}

struct Run {
    committed: Vec<String>,
    phase2: bool,
    done_ops: Option<u64>,
    crashed: bool,
}

fn run_script(dir: &Path, crash_at: u64) -> Run {
    let out = Command::new(BIN)
        .args(["script", dir.to_str().unwrap(), &crash_at.to_string()])
        .stderr(Stdio::null())
        .output()
        .expect("spawn helper");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut run = Run {
        committed: vec![],
        phase2: false,
        done_ops: None,
        crashed: !out.status.success(),
    };
    for line in text.lines() {
        if let Some(k) = line.strip_prefix("C ") {
            run.committed.push(k.to_string());
        } else if line == "P2" {
            run.phase2 = true;
        } else if let Some(n) = line.strip_prefix("DONE ops=") {
            run.done_ops = Some(n.parse().unwrap());
        }
    }
    run
}

#[test]
fn crash_after_every_file_operation() {
    let t0 = Instant::now();
    let base = tempfile::tempdir().unwrap();
    let full = run_script(&base.path().join("full"), 0);
    let total = full.done_ops.expect("uncrashed script finishes");
    assert!(total >= 200, "only {total} fault points");
    // Crash points are independent (one dir each): a few workers overlap the fsync waits.
    let next = AtomicU64::new(1);
    let with_entries = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| loop {
                let n = next.fetch_add(1, Ordering::SeqCst);
                if n > total {
                    break;
                }
                let dir = base.path().join(format!("c{n}"));
                check_crash_point(&dir, n, &with_entries);
                std::fs::remove_dir_all(&dir).unwrap();
            });
        }
    });
    eprintln!(
        "{total} crash points ({} with entries left) in {:.1?}",
        with_entries.load(Ordering::SeqCst),
        t0.elapsed()
    );
}

fn check_crash_point(dir: &Path, n: u64, with_entries: &AtomicU64) {
    let run = run_script(dir, n);
    assert!(
        run.crashed && run.done_ops.is_none(),
        "crash point {n} did not crash"
    );
    let store = reopen(dir);
    let present: HashSet<String> = store.entries().iter().map(|e| hex32(&e.key)).collect();
    if !run.phase2 {
        // Before the eviction phase nothing is removed: every reported commit survives.
        for k in &run.committed {
            assert!(
                present.contains(k),
                "crash point {n}: committed entry {k} lost"
            );
        }
    }
    if let Err(e) = verify_store(&store, &(1..=9).collect::<Vec<_>>(), 16) {
        panic!("crash point {n}: {e}");
    }
    assert_eq!(store.stats().evictions_corrupt, 0, "crash point {n}");
    if !present.is_empty() {
        with_entries.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn sigkill_at_random_moments() {
    let t0 = Instant::now();
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("cache");
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut entries_seen = 0;
    for i in 0..40u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut child = Command::new(BIN)
            .args(["loop", dir.to_str().unwrap(), &i.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_micros(2_000 + seed % 40_000));
        child.kill().unwrap();
        child.wait().unwrap();
        let store = reopen(&dir);
        if let Err(e) = verify_store(&store, &(1..=20).collect::<Vec<_>>(), 16) {
            panic!("kill {i}: {e}");
        }
        assert_eq!(store.stats().evictions_corrupt, 0, "kill {i}");
        entries_seen += store.entries().len();
    }
    assert!(entries_seen > 0, "the writer never committed anything");
    eprintln!(
        "40 kills, {entries_seen} entries verified, in {:.1?}",
        t0.elapsed()
    );
}
