//! A small thread pool whose workers spin for a while before they sleep, and whose parts go to
//! whichever thread is running.
//!
//! A decode step calls the kernels ~70 times with a few hundred microseconds of NumPy work in
//! between. Rayon's workers fall asleep in those gaps, and waking one costs ~0.1-0.2 ms on
//! this project's 2-vCPU virtual machines (measured: a 4M-weight product took 0.58 ms on two
//! rayon threads, 0.40 ms on one), so the kernels could only use one core for everything but
//! the output head. Here a worker that finished a call keeps polling for the next one for
//! `SPIN` before it parks, so handing work over inside a step costs about a cache-line
//! transfer. The spinning uses a core that would otherwise idle while the caller runs NumPy.
//!
//! Parts are not bound to threads: the caller and the workers it posts claim part indices
//! from one counter until none are left. A worker the OS has not scheduled (the machine is
//! shared: another process holds the core) is not waited for: when the caller has run out of
//! parts it takes back a posting no worker has picked up and returns. With parts bound to
//! threads, each such call waited for the worker's next time slice (~4 ms measured for a
//! 0.7 MB product that takes 0.05 ms); now it costs only the absent worker's share of the
//! work, done by the caller.
//!
//! `run(parts, f)` calls `f(i)` once for each `i < parts`, on the calling thread and on up to
//! `parts - 1` workers, and returns when all have finished (so `f` may borrow from the
//! caller's stack); `run_on(threads, parts, f)` uses at most `threads` threads;
//! `run_ranges(regions, own, steal, f)` walks one region of units per thread and lets a
//! thread that is done take the others' last units (the decode products). `f` must not
//! depend on which thread runs a part. One caller at a time uses the workers; a second
//! concurrent caller (or a forked child, which has no workers) runs all its parts itself.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// How long an idle worker polls before parking, unless `KVSHARE_KERNEL_SPIN_US` (read once)
/// says otherwise (0: park at once, as a plain pool would).
const SPIN: Duration = Duration::from_millis(2);

/// How long the caller spins on a worker that is still in a part before it yields its core
/// (the worker may be waiting for that very core).
const WAIT_SPIN: Duration = Duration::from_micros(50);

fn spin_window() -> Duration {
    std::env::var("KVSHARE_KERNEL_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(SPIN, Duration::from_micros)
}

type Job = *const (dyn Fn() + Sync);

/// A slot's states: no work for it, work posted (not yet picked up), work being run.
const IDLE: u8 = 0;
const POSTED: u8 = 1;
const RUNNING: u8 = 2;

struct Slot {
    /// IDLE -> POSTED (the caller), POSTED -> RUNNING (the worker picks it up) or POSTED ->
    /// IDLE (the caller takes it back), RUNNING -> IDLE (the worker is done with the job).
    state: AtomicU8,
    /// The posted job (valid while the state is POSTED or RUNNING).
    task: UnsafeCell<Option<Job>>,
    /// A panic of the job, handed to the caller.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    sleeping: Mutex<bool>,
    wake: Condvar,
}

// SAFETY: `task` is written by the caller only while the state is IDLE, and read by the
// worker only after its POSTED -> RUNNING exchange (Acquire after the caller's Release).
unsafe impl Sync for Slot {}
unsafe impl Send for Slot {}

struct Pool {
    slots: Vec<Arc<Slot>>,
    busy: AtomicBool,
    /// The process that started the workers: a forked child has none of them and runs every
    /// part itself instead of waiting for threads that do not exist there.
    pid: u32,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = thread::available_parallelism()
            .map_or(1, |n| n.get())
            .saturating_sub(1);
        let slots = (0..n)
            .map(|i| {
                let slot = Arc::new(Slot {
                    state: AtomicU8::new(IDLE),
                    task: UnsafeCell::new(None),
                    panic: Mutex::new(None),
                    sleeping: Mutex::new(false),
                    wake: Condvar::new(),
                });
                let s = Arc::clone(&slot);
                let spin = spin_window();
                thread::Builder::new()
                    .name(format!("kvshare-kernel-{}", i + 1))
                    .spawn(move || worker(&s, spin))
                    .expect("spawn a kernel worker");
                slot
            })
            .collect();
        Pool {
            slots,
            busy: AtomicBool::new(false),
            pid: std::process::id(),
        }
    })
}

fn worker(slot: &Slot, spin: Duration) {
    loop {
        // poll, then park
        let start = Instant::now();
        let mut polls = 0u32;
        while slot.state.load(Ordering::Acquire) != POSTED {
            std::hint::spin_loop();
            polls += 1;
            if polls.is_multiple_of(256) && start.elapsed() >= spin {
                let mut sleeping = slot.sleeping.lock().unwrap_or_else(|e| e.into_inner());
                *sleeping = true;
                while slot.state.load(Ordering::Acquire) != POSTED {
                    sleeping = slot.wake.wait(sleeping).unwrap_or_else(|e| e.into_inner());
                }
                *sleeping = false;
                break;
            }
        }
        // the caller may have taken the posting back in the meantime
        if slot
            .state
            .compare_exchange(POSTED, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        // SAFETY: the caller wrote the task before publishing POSTED and, now that the state
        // is RUNNING, waits for IDLE before it returns.
        if let Some(job) = unsafe { *slot.task.get() } {
            // SAFETY: the job outlives this call (see above).
            let f = unsafe { &*job };
            if let Err(p) = catch_unwind(AssertUnwindSafe(f)) {
                *slot.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
            }
        }
        slot.state.store(IDLE, Ordering::Release);
    }
}

/// The number of threads `run` can use (workers + the caller).
pub fn max_parts() -> usize {
    pool().slots.len() + 1
}

/// `f(0)..f(parts - 1)`, each once, on this thread and up to `parts - 1` workers; returns
/// when every part has finished. A panic in a part is resumed here.
pub fn run(parts: usize, f: &(dyn Fn(usize) + Sync)) {
    run_on(parts, parts, f)
}

/// `f(0)..f(parts - 1)`, each once, on this thread and up to `threads - 1` workers, each
/// thread claiming the next unclaimed part until none is left; returns when every part has
/// finished. A panic in a part is resumed here (the other parts still run).
pub fn run_on(threads: usize, parts: usize, f: &(dyn Fn(usize) + Sync)) {
    let p = pool();
    let extra = threads.min(parts).saturating_sub(1).min(p.slots.len());
    if extra == 0 || p.pid != std::process::id() || p.busy.swap(true, Ordering::Acquire) {
        (0..parts).for_each(f);
        return;
    }
    let next = AtomicUsize::new(0);
    let claim = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= parts {
            break;
        }
        f(i);
    };
    let claim: &(dyn Fn() + Sync) = &claim;
    // SAFETY (lifetime): the job is only used by workers that picked it up (RUNNING), and
    // this function waits for each of them to finish (IDLE) before returning.
    let job: Job = unsafe { std::mem::transmute::<&(dyn Fn() + Sync), Job>(claim) };
    let slots = &p.slots[..extra];
    for slot in slots {
        // SAFETY: the slot is IDLE (its previous job is done or was taken back) and the
        // worker only reads the task after the Release below.
        unsafe { *slot.task.get() = Some(job) };
        slot.state.store(POSTED, Ordering::Release);
        let sleeping = slot.sleeping.lock().unwrap_or_else(|e| e.into_inner());
        if *sleeping {
            slot.wake.notify_one();
        }
    }
    let mine = catch_unwind(AssertUnwindSafe(claim));
    for slot in slots {
        // a worker that has not picked the job up by now gets none: its parts are done
        if slot
            .state
            .compare_exchange(POSTED, IDLE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            continue;
        }
        let start = Instant::now();
        while slot.state.load(Ordering::Acquire) != IDLE {
            if start.elapsed() < WAIT_SPIN {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
    }
    let theirs: Vec<_> = slots
        .iter()
        .filter_map(|s| s.panic.lock().unwrap_or_else(|e| e.into_inner()).take())
        .collect();
    p.busy.store(false, Ordering::Release);
    if let Err(e) = mine {
        resume_unwind(e);
    }
    if let Some(e) = theirs.into_iter().next() {
        resume_unwind(e);
    }
}

/// `f(lo, hi)` over disjoint ranges that cover `regions[0]..regions[last]`, on this thread and
/// up to `regions.len() - 2` workers. The thread that starts `t`-th owns `regions[t]..regions[t
/// + 1]` and walks it from the front, `own` units at a time, so that its reads run through
/// memory as one stream (a row product's prefetching runs on from one range into the next);
/// a thread that has finished its own takes `steal` units at a time from the back of the
/// region with the most left (all of a region whose worker never started). So the threads
/// finish within about one `own` range of each other, where `run_on`'s parts (a quarter of a
/// product each) left one thread idle for ~10-20 us at the end of a decode step's products.
/// `f` must not depend on how the units are cut into ranges.
pub fn run_ranges(regions: &[usize], own: usize, steal: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    let n = regions.len().saturating_sub(1);
    if n == 0 {
        return;
    }
    let (own, steal) = (own.max(1), steal.max(1));
    // per region: front (the next unit its owner takes) << 32 | back (the end of what is left)
    let pack = |front: usize, back: usize| ((front as u64) << 32) | back as u64;
    let unpack = |v: u64| ((v >> 32) as usize, (v & 0xFFFF_FFFF) as usize);
    debug_assert!(regions.windows(2).all(|w| w[0] <= w[1]) && regions[n] < 1 << 32);
    let left: Vec<AtomicU64> = regions
        .windows(2)
        .map(|w| AtomicU64::new(pack(w[0], w[1])))
        .collect();
    let take = |r: usize, front: bool| -> Option<(usize, usize)> {
        let mut cur = left[r].load(Ordering::Acquire);
        loop {
            let (a, b) = unpack(cur);
            if a >= b {
                return None;
            }
            let (range, next) = if front {
                let e = (a + own).min(b);
                ((a, e), pack(e, b))
            } else {
                let s = b.saturating_sub(steal).max(a);
                ((s, b), pack(a, s))
            };
            match left[r].compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(range),
                Err(v) => cur = v,
            }
        }
    };
    let remaining = |i: usize| {
        let (a, b) = unpack(left[i].load(Ordering::Acquire));
        b.saturating_sub(a)
    };
    run(n, &|r| {
        while let Some((a, b)) = take(r, true) {
            f(a, b);
        }
        // then from the back of the region with the most left, until none has any
        loop {
            // each region's remainder read once: what is taken only ever shrinks, so a
            // largest of 0 means every region is done
            let (i, most) = (0..n)
                .map(|i| (i, remaining(i)))
                .max_by_key(|&(_, left)| left)
                .expect("n > 0 regions");
            if most == 0 {
                break;
            }
            if let Some((a, b)) = take(i, false) {
                f(a, b);
            }
        }
    });
}
