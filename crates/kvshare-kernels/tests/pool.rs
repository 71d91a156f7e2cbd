//! The kernels' worker pool: every part runs exactly once, borrowed data is safe to use,
//! concurrent callers each get all their parts done, and a panicking part reaches the caller.

use kvshare_kernels::pool::{max_parts, run};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[test]
fn every_part_runs_once() {
    for parts in [1, 2, 3, 7] {
        let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
        run(parts, &|i| {
            hits[i].fetch_add(1, Ordering::SeqCst);
        });
        assert!(
            hits.iter().all(|h| h.load(Ordering::SeqCst) == 1),
            "parts = {parts}"
        );
    }
    assert!(max_parts() >= 1);
}

#[test]
fn parts_after_the_workers_park_still_run() {
    // the workers spin 2 ms, then park: a call after that has to wake them
    let total = AtomicUsize::new(0);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(5));
        run(2, &|i| {
            total.fetch_add(i + 1, Ordering::SeqCst);
        });
    }
    assert_eq!(total.load(Ordering::SeqCst), 9);
}

#[test]
fn concurrent_callers_each_finish() {
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || {
                for round in 0..200 {
                    let sum = AtomicUsize::new(0);
                    run(3, &|i| {
                        sum.fetch_add(i + t + round, Ordering::SeqCst);
                    });
                    assert_eq!(sum.load(Ordering::SeqCst), 3 * (t + round) + 3);
                }
            });
        }
    });
}

#[test]
fn a_panicking_part_reaches_the_caller() {
    let r = std::panic::catch_unwind(|| {
        run(2, &|i| {
            if i == max_parts().min(2) - 1 {
                panic!("part {i} fails");
            }
        })
    });
    assert!(r.is_err());
    // and the pool still works afterwards
    let n = AtomicUsize::new(0);
    run(2, &|_| {
        n.fetch_add(1, Ordering::SeqCst);
    });
    assert_eq!(n.load(Ordering::SeqCst), 2);
}

#[test]
fn more_parts_than_threads_each_run_once_on_at_most_threads() {
    use std::collections::HashSet;
    use std::sync::Mutex;
    for (threads, parts) in [(1, 5), (2, 9), (3, 4), (8, 40)] {
        let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
        let ids = Mutex::new(HashSet::new());
        kvshare_kernels::pool::run_on(threads, parts, &|i| {
            hits[i].fetch_add(1, Ordering::SeqCst);
            ids.lock().unwrap().insert(std::thread::current().id());
        });
        assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1));
        let used = ids.lock().unwrap().len();
        assert!(
            used <= threads.min(max_parts()),
            "{used} threads for {threads}"
        );
    }
    // one thread: all parts here
    let here = std::thread::current().id();
    kvshare_kernels::pool::run_on(1, 6, &|_| assert_eq!(std::thread::current().id(), here));
}

#[test]
fn many_short_calls_never_lose_or_repeat_a_part() {
    // most of these calls end before a worker picks its posting up: the caller takes it back
    // (and must not return while a worker that did pick it up is still running a part)
    for round in 0..20_000 {
        let parts = 1 + round % 5;
        let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
        run(parts, &|i| {
            hits[i].fetch_add(1, Ordering::SeqCst);
        });
        assert!(
            hits.iter().all(|h| h.load(Ordering::SeqCst) == 1),
            "round {round}"
        );
    }
}

#[test]
fn run_ranges_covers_every_unit_once_in_whole_ranges() {
    use std::sync::Mutex;
    // regions of unequal sizes (one empty), chunk sizes that do and do not divide them, and
    // a slow first region, so that the other threads steal from its back
    for (regions, own, steal) in [
        (vec![0, 10], 3, 1),
        (vec![0, 50, 100], 2, 1),
        (vec![0, 0, 7, 40], 4, 3),
        (vec![5, 6, 90, 91], 1, 2),
    ] {
        let (lo, hi) = (regions[0], *regions.last().unwrap());
        let hits: Vec<AtomicUsize> = (0..hi).map(|_| AtomicUsize::new(0)).collect();
        let ranges = Mutex::new(Vec::new());
        kvshare_kernels::pool::run_ranges(&regions, own, steal, &|a, b| {
            assert!(a < b && b <= hi, "range {a}..{b}");
            if a < regions[1] {
                std::thread::sleep(Duration::from_micros(200));
            }
            for h in &hits[a..b] {
                h.fetch_add(1, Ordering::SeqCst);
            }
            ranges.lock().unwrap().push((a, b));
        });
        for (u, h) in hits.iter().enumerate() {
            let want = usize::from(u >= lo);
            assert_eq!(h.load(Ordering::SeqCst), want, "unit {u} of {regions:?}");
        }
        // no range crosses a region's bound, and none is longer than `own` or `steal` allows
        for &(a, b) in ranges.lock().unwrap().iter() {
            assert!(
                regions.iter().all(|&r| r <= a || r >= b),
                "{a}..{b} in {regions:?}"
            );
            assert!(b - a <= own.max(steal), "{a}..{b}");
        }
    }
}
