//! Helper process for the crash-safety test of the disk store (`tests/disk_crash.rs`); not
//! part of the server. It writes entries through a real `DiskStore` and is killed mid-way:
//!
//! - `disk_crash_writer script DIR CRASH_AT`: a fixed, deterministic sequence of writes
//!   (new entries, entries extending others, payload_from, checkpoints), then a reopen with a
//!   small budget (evictions at open and after commits). With `CRASH_AT` > 0 the process aborts
//!   right after its `CRASH_AT`th file operation (see `disk::fault`). Prints `C <key>` once an
//!   entry is committed and flushed, `P2` when the eviction phase starts, and finally
//!   `DONE ops=<file operations>`.
//! - `disk_crash_writer loop DIR SEED`: writes random entries forever (submit + flush, small
//!   budget) until the test kills it with SIGKILL.

#[path = "../../tests/disk_common/mod.rs"]
mod common;

use std::io::Write;
use std::time::Duration;

use common::*;
use kvshare_core::disk::{fault, hex32, DiskConfig, DiskStore, NewEntry};

fn open(dir: &str, budget: u64, queue: usize) -> DiskStore {
    let mut cfg = DiskConfig::new(dir, FP);
    cfg.budget_bytes = budget;
    cfg.ttl = None;
    cfg.queue_depth = queue;
    DiskStore::open(cfg).expect("open store")
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Writes one entry (alternating the background writer and `write_now`) and reports it if
/// it is committed.
fn put(store: &DiskStore, e: NewEntry, background: bool) {
    let key = entry_key_of(&e);
    if background {
        store.submit(e).expect("valid entry");
        store.flush();
    } else {
        let _ = store.write_now(&e);
    }
    if store.entries().iter().any(|i| i.key == key) {
        say(format!("C {}", hex32(&key)));
    }
}

/// (chain, blocks, payload_from, checkpoint block indexes)
const PHASE1: &[(u64, usize, usize, &[usize])] = &[
    (1, 4, 0, &[1, 3]),
    (1, 8, 0, &[7]),
    (2, 3, 0, &[]),
    (1, 12, 8, &[11]),
    (3, 6, 0, &[2, 5]),
    (2, 7, 3, &[6]),
    (4, 2, 0, &[1]),
    (1, 14, 12, &[]),
    (5, 5, 0, &[4]),
    (3, 9, 6, &[8]),
    (6, 10, 0, &[9]),
    (4, 6, 2, &[5]),
    (7, 3, 0, &[0, 1, 2]),
    (2, 9, 7, &[]),
];
const PHASE2: &[(u64, usize, usize, &[usize])] = &[
    (8, 6, 0, &[5]),
    (1, 16, 14, &[15]),
    (5, 8, 5, &[7]),
    (9, 4, 0, &[3]),
];

fn script(dir: &str) {
    {
        let store = open(dir, 1 << 30, 64);
        for (i, &(chain, n, from, ck)) in PHASE1.iter().enumerate() {
            put(&store, make_entry(chain, n, from, ck), i % 2 == 0);
        }
    }
    say("P2".into());
    let store = open(dir, 9_000, 64);
    for (i, &(chain, n, from, ck)) in PHASE2.iter().enumerate() {
        let from = from.min(store.stored_prefix(&chain_keys(chain, n)).unwrap());
        put(&store, make_entry(chain, n, from, ck), i % 2 == 1);
    }
    for chain in 1..=9 {
        let _ = store.lookup(&chain_keys(chain, 16));
    }
    drop(store);
    say(format!("DONE ops={}", fault::ops()));
}

fn forever(dir: &str, seed: u64) {
    let store = open(dir, 24_000, 4);
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        | 1;
    let mut rnd = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    loop {
        let chain = 1 + rnd(20);
        let n = 1 + rnd(16) as usize;
        let keys = chain_keys(chain, n);
        let from = store
            .stored_prefix(&keys)
            .unwrap()
            .min(rnd(n as u64 + 1) as usize);
        let ck: Vec<usize> = (0..n).filter(|_| rnd(4) == 0).collect();
        let _ = store.submit(make_entry(chain, n, from, &ck));
        if rnd(3) == 0 {
            store.flush();
        }
        let _ = store.lookup(&chain_keys(1 + rnd(20), 16));
        if rnd(50) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: disk_crash_writer script DIR CRASH_AT | loop DIR SEED";
    if args.len() != 4 {
        eprintln!("{usage}");
        std::process::exit(2);
    }
    let n: u64 = args[3].parse().expect(usage);
    match args[1].as_str() {
        "script" => {
            fault::arm(n);
            script(&args[2]);
        }
        "loop" => forever(&args[2], n),
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    }
}
