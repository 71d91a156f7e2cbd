//! A small thread pool whose workers spin for a while before they sleep.
//!
//! A decode step calls the kernels ~70 times with a few hundred microseconds of NumPy work in
//! between. Rayon's workers fall asleep in those gaps, and waking one costs ~0.1-0.2 ms on
//! this project's 2-vCPU virtual machines (measured: a 4M-weight product took 0.58 ms on two
//! rayon threads, 0.40 ms on one), so the kernels could only use one core for everything but
//! the output head. Here a worker that finished a part keeps polling for the next one for
//! `SPIN` before it parks, so handing work over inside a step costs about a cache-line
//! transfer. The spinning uses a core that would otherwise idle while the caller runs NumPy.
//!
//! `run(parts, f)` calls `f(0)` on the calling thread and `f(1..parts)` on workers, and
//! returns when all have finished (so `f` may borrow from the caller's stack). One caller at
//! a time uses the workers; a second concurrent caller (or a forked child, which has no
//! workers) runs all its parts itself.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// How long an idle worker polls before parking, unless `KVSHARE_KERNEL_SPIN_US` (read once)
/// says otherwise (0: park at once, as a plain pool would).
const SPIN: Duration = Duration::from_millis(2);

fn spin_window() -> Duration {
    std::env::var("KVSHARE_KERNEL_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(SPIN, Duration::from_micros)
}

type Job = *const (dyn Fn(usize) + Sync);

struct Slot {
    /// Bumped by the caller for each part it posts.
    posted: AtomicU64,
    /// Set to `posted` by the worker when the part is finished.
    done: AtomicU64,
    /// The posted part: the job and its index (valid while posted != done).
    task: UnsafeCell<(Option<Job>, usize)>,
    /// A panic of the part, handed to the caller.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    sleeping: Mutex<bool>,
    wake: Condvar,
}

// SAFETY: `task` is written by the caller only while the worker is idle (done == posted) and
// read by the worker only after it saw the new `posted` (Acquire after the caller's Release).
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
                    posted: AtomicU64::new(0),
                    done: AtomicU64::new(0),
                    task: UnsafeCell::new((None, 0)),
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
    let mut seen = 0u64;
    loop {
        // poll, then park
        let start = Instant::now();
        let mut polls = 0u32;
        while slot.posted.load(Ordering::Acquire) == seen {
            std::hint::spin_loop();
            polls += 1;
            if polls.is_multiple_of(256) && start.elapsed() >= spin {
                let mut sleeping = slot.sleeping.lock().unwrap_or_else(|e| e.into_inner());
                *sleeping = true;
                while slot.posted.load(Ordering::Acquire) == seen {
                    sleeping = slot.wake.wait(sleeping).unwrap_or_else(|e| e.into_inner());
                }
                *sleeping = false;
                break;
            }
        }
        seen = slot.posted.load(Ordering::Acquire);
        // SAFETY: the caller wrote the task before publishing `posted` and waits for `done`.
        let (job, part) = unsafe { *slot.task.get() };
        if let Some(job) = job {
            // SAFETY: the job outlives this call: the caller does not return before `done`.
            let f = unsafe { &*job };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(part))) {
                *slot.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
            }
        }
        slot.done.store(seen, Ordering::Release);
    }
}

/// The number of threads `run` can use (workers + the caller).
pub fn max_parts() -> usize {
    pool().slots.len() + 1
}

/// Run `f(0)` here and `f(1)..f(parts - 1)` on the workers (parts beyond the workers run
/// here too); return when every part has finished. A panic in a part is resumed here.
pub fn run(parts: usize, f: &(dyn Fn(usize) + Sync)) {
    let p = pool();
    let extra = parts.saturating_sub(1).min(p.slots.len());
    if extra == 0 || p.pid != std::process::id() || p.busy.swap(true, Ordering::Acquire) {
        (0..parts).for_each(f);
        return;
    }
    // SAFETY (lifetime): the job is only used until the workers report `done`, which this
    // function waits for before returning.
    let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
    let mut tickets = Vec::with_capacity(extra);
    for (i, slot) in p.slots[..extra].iter().enumerate() {
        // SAFETY: this worker is idle (its previous part is done) and only reads the task
        // after the Release below.
        unsafe { *slot.task.get() = (Some(job), i + 1) };
        let ticket = slot.posted.fetch_add(1, Ordering::AcqRel) + 1;
        let sleeping = slot.sleeping.lock().unwrap_or_else(|e| e.into_inner());
        if *sleeping {
            slot.wake.notify_one();
        }
        drop(sleeping);
        tickets.push(ticket);
    }
    let mine = catch_unwind(AssertUnwindSafe(|| {
        f(0);
        for part in extra + 1..parts {
            f(part);
        }
    }));
    for (slot, &ticket) in p.slots[..extra].iter().zip(&tickets) {
        while slot.done.load(Ordering::Acquire) != ticket {
            std::hint::spin_loop();
        }
    }
    let theirs: Vec<_> = p.slots[..extra]
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
